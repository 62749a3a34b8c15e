"""Seeded, deterministic still images (JPEG, PNG, WebP) for flashcodec tests and benchmarks.

Encoded in-process with PyAV: a smooth seeded colour gradient with noise, and
at the top the same frame-index code strip as the video frames (see
``frame_code``), carrying ``seed % 2**18``.  Put ``datasets/`` on ``sys.path``
and ``import synthetic_image``.
"""

from __future__ import annotations

import pathlib
from fractions import Fraction

import numpy as np

if __package__:  # imported as ``datasets.synthetic_image`` (``python -m datasets.synthetic_video``)
    from .frame_code import MAX_FRAMES, code_cell_edges, draw_frame_index
else:  # ``datasets/`` on ``sys.path``
    from frame_code import MAX_FRAMES, code_cell_edges, draw_frame_index

__all__ = ["make_image"]

_IMAGE_CODECS = {
    ".jpg": ("mjpeg", "yuvj420p"),
    ".jpeg": ("mjpeg", "yuvj420p"),
    ".png": ("png", "rgb24"),
    ".webp": ("libwebp", "yuv420p"),
}


def _image_rgb(width: int, height: int, seed: int, alpha: bool) -> np.ndarray:
    rng = np.random.default_rng([seed, 0x1346])
    yy = np.linspace(0, 1, height, dtype=np.float32)[:, None]
    xx = np.linspace(0, 1, width, dtype=np.float32)[None, :]
    ph = rng.uniform(0, 2 * np.pi, size=3)
    chans = [
        110 + 70 * np.sin(2 * np.pi * (f1 * xx + f2 * yy) + p)
        for (f1, f2), p in zip(((1.0, 0.3), (0.2, 1.1), (0.7, -0.6)), ph)
    ]
    rgb = np.stack(chans, axis=-1) + rng.normal(0, 10, size=(height, width, 3))
    rgb = np.clip(rgb, 0, 255).astype(np.uint8)
    # code strip carrying index = seed % MAX_FRAMES
    draw_frame_index(rgb, seed % MAX_FRAMES, code_cell_edges(width, height), black=0, white=255)
    if alpha:
        a = np.clip(255 * (0.25 + 0.75 * xx) + 0 * yy, 0, 255).astype(np.uint8)
        rgb = np.concatenate([rgb, a[..., None]], axis=-1)
    return rgb


def make_image(
    path, *, width: int = 97, height: int = 61, seed: int = 0, alpha: bool = False,
    quality: int = 90,
) -> pathlib.Path:
    """Write a seeded still image; format from the suffix (.jpg/.jpeg/.png/.webp).

    The top 3/8 carries the frame-index code of ``seed % 2**18`` (readable with
    :func:`read_frame_index`).  ``alpha=True`` (PNG and WebP only) adds an
    alpha channel ramping from 25% to 100% opacity left to right.
    ``quality``: 1-100 for JPEG/WebP.
    """
    import av

    path = pathlib.Path(path)
    suffix = path.suffix.lower()
    if suffix not in _IMAGE_CODECS:
        raise ValueError(
            f"unsupported image suffix {suffix!r}; choose one of {sorted(_IMAGE_CODECS)}"
        )
    if width <= 0 or height <= 0:
        raise ValueError(f"width/height must be positive, got {width}x{height}")
    codec, pix_fmt = _IMAGE_CODECS[suffix]
    if alpha:
        if suffix == ".png":
            pix_fmt = "rgba"
        elif suffix == ".webp":
            pix_fmt = "yuva420p"
        else:
            raise ValueError(f"{suffix} cannot store alpha; use .png or .webp")
    rgb = _image_rgb(width, height, seed, alpha)
    frame = av.VideoFrame.from_ndarray(rgb, format="rgba" if alpha else "rgb24")
    if frame.format.name != pix_fmt:
        frame = frame.reformat(format=pix_fmt)
    cc = av.CodecContext.create(codec, "w")
    cc.width, cc.height, cc.pix_fmt = width, height, pix_fmt
    cc.time_base = Fraction(1, 25)
    if codec == "mjpeg":
        cc.qscale = True
        q = int(round(2 + (100 - quality) * 29 / 99))  # 100 -> 2 (best) .. 1 -> 31
        cc.global_quality = q * 118
        cc.color_range = 2  # full range (JPEG)
        cc.sample_aspect_ratio = Fraction(1, 1)  # -> standard JFIF APP0 header
        cc.options = {"flags": "+bitexact"}  # no "Lavc..." comment segment
    elif codec == "libwebp":
        cc.options = {"quality": str(quality), "lossless": "0"}
    frame.pts = 0
    data = b"".join(bytes(p) for p in cc.encode(frame)) + b"".join(
        bytes(p) for p in cc.encode(None)
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path

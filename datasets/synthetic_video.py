#!/usr/bin/env python3
"""Seeded, deterministic synthetic media for flashcodec tests and benchmarks.

Everything is encoded in-process with PyAV (no ffmpeg CLI).  Each video
frame is made of

* a smooth gradient + seeded noise texture that pans across the frame,
* a second, finer noise layer moving the other way (so that a single motion
  vector per block cannot predict the frame and the decoder does real work),
* a textured box bouncing around the lower part of the frame,
* a strip at the top of the frame: 3 rows x 8 black/white cells (3/8 of the
  frame height) that encode the display index of the frame (18 bits) plus a
  6-bit check value.

:func:`read_frame_index` recovers the display index from a decoded RGB frame,
also after lossy compression and downscaling to 1/4 of the size (the cells
are then about 4x3 pixels for a 128x96 clip).  A frame whose strip does not
carry a valid code (e.g. decoded from corrupted data) raises
:class:`FrameIndexError`.

This file is standalone: put ``datasets/`` on ``sys.path`` and
``import synthetic_video`` (there is deliberately no ``datasets/__init__.py``,
which would clash with the HuggingFace ``datasets`` package).  It is also a
CLI, see ``python datasets/synthetic_video.py --help``.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import math
import os
import pathlib
import sys
import time
import uuid
from fractions import Fraction
from typing import Any, Iterable

import numpy as np

__all__ = [
    "CODECS",
    "CONTAINERS",
    "GENERATOR_VERSION",
    "FrameIndexError",
    "cached_video",
    "corrupt_middle",
    "frame_times",
    "make_image",
    "make_video",
    "probe_rotation",
    "read_frame_index",
    "try_read_frame_index",
    "truncate_file",
]

#: Bump when the pixel content or encoder settings change: it is part of the
#: cache key used by :func:`cached_video`.
GENERATOR_VERSION = 2

#: codec name -> PyAV/FFmpeg encoder name
CODECS = {
    "h264": "libx264",
    "hevc": "libx265",
    "vp9": "libvpx-vp9",
    "av1": "libsvtav1",
    "mpeg4": "mpeg4",
}

#: file suffix -> (FFmpeg muxer name, codecs it accepts).  Only combinations
#: that were verified to round-trip through PyAV are listed.
CONTAINERS = {
    ".mp4": ("mp4", frozenset({"h264", "hevc", "vp9", "av1", "mpeg4"})),
    ".mov": ("mov", frozenset({"h264", "hevc", "mpeg4"})),
    ".mkv": ("matroska", frozenset({"h264", "hevc", "vp9", "av1", "mpeg4"})),
    ".webm": ("webm", frozenset({"vp9", "av1"})),
    ".avi": ("avi", frozenset({"h264", "mpeg4"})),
}

#: Containers that can carry a display matrix (rotation).
_ROTATION_CONTAINERS = frozenset({".mp4", ".mov", ".mkv", ".webm"})
#: Codecs for which B-frames / open GOP can be requested.
_BFRAME_CODECS = frozenset({"h264", "hevc", "mpeg4"})
_OPEN_GOP_CODECS = frozenset({"h264", "hevc", "mpeg4"})

# ---------------------------------------------------------------------------
# frame-index code: geometry and encoding
# ---------------------------------------------------------------------------

CODE_COLS = 8
CODE_ROWS = 3
#: height of one code row as a fraction of the frame height
CODE_ROW_FRAC = 1.0 / 8.0
INDEX_BITS = 18
CHECK_BITS = 6
MAX_FRAMES = 1 << INDEX_BITS
_CHECK_XOR = 0b101010  # so that all-black / all-white frames are invalid
_Y_BLACK, _Y_WHITE = 16, 235  # limited-range luma of the cells


class FrameIndexError(ValueError):
    """The frame carries no valid frame-index code (corrupt or not ours)."""


def _check_value(index: int) -> int:
    # XOR of the three 6-bit chunks: any single flipped index bit changes
    # exactly one check bit, so single-cell errors are always detected.
    return ((index ^ (index >> 6) ^ (index >> 12)) & 0x3F) ^ _CHECK_XOR


def _code_bits(index: int) -> list[int]:
    if not 0 <= index < MAX_FRAMES:
        raise ValueError(f"frame index {index} out of range [0, {MAX_FRAMES})")
    word = (index << CHECK_BITS) | _check_value(index)
    n = INDEX_BITS + CHECK_BITS
    return [(word >> (n - 1 - k)) & 1 for k in range(n)]  # MSB first, row-major


def _cell_edges(size: int, count: int, step: float) -> list[int]:
    return [int(math.floor(k * step * size + 0.5)) for k in range(count + 1)]


def _to_hwc_uint8(img: Any) -> np.ndarray:
    """Accept av.VideoFrame, numpy arrays and (CPU/CUDA) torch tensors."""
    if hasattr(img, "to_ndarray") and hasattr(img, "planes"):  # av.VideoFrame
        return img.to_ndarray(format="rgb24")
    if hasattr(img, "detach") and hasattr(img, "cpu"):  # torch.Tensor
        img = img.detach().cpu()
        if getattr(img, "dtype", None) is not None and "bfloat16" in str(img.dtype):
            img = img.float()
        img = img.numpy()
    a = np.asarray(img)
    if a.ndim == 2:
        a = a[:, :, None]
    if a.ndim != 3:
        raise ValueError(f"expected an HxWxC, CxHxW or HxW image, got shape {a.shape}")
    if a.shape[2] not in (1, 3, 4) and a.shape[0] in (1, 3, 4):
        a = np.moveaxis(a, 0, 2)  # CHW -> HWC
    if a.dtype.kind == "f":
        scale = 255.0 if float(np.nanmax(a)) <= 1.0 + 1e-6 else 1.0
        a = np.clip(np.nan_to_num(a) * scale, 0, 255)
    elif a.dtype == np.uint16:  # 10-bit samples in uint16, or full 16-bit
        a = a >> (2 if int(a.max()) <= 1023 else 8)
    return a


def _inner_pixels(lo: float, hi: float, size: int) -> tuple[int, int]:
    """Pixels lying entirely inside the middle 60% of the span [lo, hi);
    the pixel holding the centre if there are none."""
    m = 0.2 * (hi - lo)
    a, b = math.ceil(lo + m), math.floor(hi - m)
    if b <= a:
        a = min(size - 1, int(math.floor((lo + hi) / 2)))
        b = a + 1
    return max(0, a), min(size, b)


def try_read_frame_index(img: Any, *, rotation: int = 0, mirror: bool = False) -> int | None:
    """Like :func:`read_frame_index` but returns ``None`` instead of raising."""
    try:
        return read_frame_index(img, rotation=rotation, mirror=mirror)
    except FrameIndexError:
        return None


def read_frame_index(img: Any, *, rotation: int = 0, mirror: bool = False) -> int:
    """Recover the display index encoded in a frame made by :func:`make_video`.

    ``img``: an RGB(A) image as HxWxC (or CxHxW) uint8/float array, a grey or
    luma HxW array, a torch tensor or an ``av.VideoFrame``.  Any size works as
    long as a code cell is at least ~3x2 pixels (a 128x96 clip at 1/4 scale is
    fine).  ``rotation``: if the image was rotated for display by ``rotation``
    degrees clockwise (the ``make_video(rotation=...)`` convention), pass the
    same value and it is undone first; ``mirror``: it was also mirrored
    left-right after the rotation (``make_video(mirror=True)``).

    Raises :class:`FrameIndexError` if the check bits do not match.
    """
    a = _to_hwc_uint8(img)
    if mirror:
        a = a[:, ::-1]  # undo the mirror, which came after the rotation
    if rotation % 360:
        if rotation % 90:
            raise ValueError(f"rotation must be a multiple of 90, got {rotation}")
        a = np.rot90(a, k=(rotation // 90) % 4)  # undo a clockwise rotation
    h, w = a.shape[:2]
    cw, ch = w / CODE_COLS, h * CODE_ROW_FRAC
    if cw < 1.0 or ch < 1.0:
        raise FrameIndexError(f"image {w}x{h} too small to carry a frame-index code")
    bits = []
    for r in range(CODE_ROWS):
        y0, y1 = _inner_pixels(r * ch, (r + 1) * ch, h)
        for c in range(CODE_COLS):
            x0, x1 = _inner_pixels(c * cw, (c + 1) * cw, w)
            patch = a[y0:y1, x0:x1].astype(np.float32)
            if patch.shape[2] >= 3:
                luma = (
                    0.299 * patch[..., 0] + 0.587 * patch[..., 1] + 0.114 * patch[..., 2]
                )
            else:
                luma = patch[..., 0]
            bits.append(1 if float(luma.mean()) >= 128.0 else 0)
    word = 0
    for b in bits:
        word = (word << 1) | b
    index, check = word >> CHECK_BITS, word & ((1 << CHECK_BITS) - 1)
    if check != _check_value(index):
        raise FrameIndexError(f"frame-index check failed (read index {index})")
    return index


# ---------------------------------------------------------------------------
# content generation (numpy, cheap per frame)
# ---------------------------------------------------------------------------


def _even(v: float, lo: int = 2) -> int:
    return max(lo, 2 * int(round(v / 2.0)))


class _FrameSynth:
    """Precomputes textures once; :meth:`render` fills a yuv420p buffer."""

    def __init__(self, width: int, height: int, seed: int):
        if width % 2 or height % 2:
            raise ValueError(f"video width/height must be even, got {width}x{height}")
        self.w, self.h = width, height
        rng = np.random.default_rng([seed, 0x5EED])
        w, h = width, height
        self.amp = amp = _even(max(8, min(w, h) // 8))
        cw, chh = w + 2 * amp, h + 2 * amp
        yy = np.linspace(0.0, 1.0, chh, dtype=np.float32)[:, None]
        xx = np.linspace(0.0, 1.0, cw, dtype=np.float32)[None, :]
        ph = rng.uniform(0, 2 * np.pi, size=4).astype(np.float32)
        grad = (
            110
            + 45 * np.sin(2 * np.pi * (1.3 * xx + 0.7 * yy) + ph[0])
            + 25 * np.cos(2 * np.pi * (0.4 * xx - 1.1 * yy) + ph[1])
        )
        # coarse blotches (blocky noise upsampled 8x) + fine per-pixel noise
        cb = 8
        coarse = rng.normal(0, 14, size=(chh // cb + 1, cw // cb + 1)).astype(np.float32)
        coarse = np.repeat(np.repeat(coarse, cb, 0), cb, 1)[:chh, :cw]
        fine = rng.normal(0, 6, size=(chh, cw)).astype(np.float32)
        self.layer1 = np.clip(grad + coarse + fine, 20, 200).astype(np.uint8)
        # second layer moving the other way: low-amplitude grain (adds 0..40;
        # sigma 3 gives ~3.5 Mbit/s for 720p30 x264 crf 23, like real footage)
        self.layer2 = np.clip(rng.normal(20, 3, size=(chh, cw)), 0, 40).astype(np.uint8)
        # chroma canvases at half resolution, kept inside [48, 208] so the
        # per-frame drift (|d| <= 24) never wraps around
        hc, wc = chh // 2, cw // 2
        yyc = np.linspace(0.0, 1.0, hc, dtype=np.float32)[:, None]
        xxc = np.linspace(0.0, 1.0, wc, dtype=np.float32)[None, :]
        noise_c = rng.normal(0, 6, size=(2, hc, wc)).astype(np.float32)
        u = 128 + 45 * np.sin(2 * np.pi * (0.9 * xxc + 0.2 * yyc) + ph[2]) + noise_c[0]
        v = 128 + 45 * np.cos(2 * np.pi * (0.3 * xxc + 0.8 * yyc) + ph[3]) + noise_c[1]
        self.canv_u = np.clip(u, 48, 208).astype(np.uint8)
        self.canv_v = np.clip(v, 48, 208).astype(np.uint8)
        # code strip geometry (luma only: the strip's chroma is neutral)
        self.col_edges = _cell_edges(w, CODE_COLS, 1.0 / CODE_COLS)
        self.row_edges = _cell_edges(h, CODE_ROWS, CODE_ROW_FRAC)
        self.strip_h = self.row_edges[-1] + self.row_edges[-1] % 2  # even
        # bouncing box below the strip
        self.box_h = min(_even(h * 0.25), _even(max(2, h - self.strip_h - 2)))
        self.box_w = _even(w * 0.2)
        bh, bw = self.box_h, self.box_w
        chk = ((np.arange(bh)[:, None] // 4 + np.arange(bw)[None, :] // 4) % 2) * 90
        self.box_y = np.clip(
            80 + chk + rng.normal(0, 10, size=(bh, bw)), 16, 235
        ).astype(np.uint8)
        self.box_uv = (int(rng.integers(60, 100)), int(rng.integers(160, 200)))
        self.speed = (_even(max(2, w / 48)), _even(max(2, h / 40)))
        self.n_pix = w * h

    @staticmethod
    def _tri(pos: int, span: int) -> int:
        if span <= 0:
            return 0
        p = pos % (2 * span)
        return p if p <= span else 2 * span - p

    def render(self, index: int, out: np.ndarray) -> np.ndarray:
        """Write frame ``index`` into ``out`` (flat uint8, yuv420p layout)."""
        w, h, amp = self.w, self.h, self.amp
        n = self.n_pix
        Y = out[:n].reshape(h, w)
        U = out[n : n + n // 4].reshape(h // 2, w // 2)
        V = out[n + n // 4 :].reshape(h // 2, w // 2)
        # pan layer 1 along a Lissajous path, layer 2 the opposite way
        t = float(index)
        ox = _even(amp + amp * math.sin(2 * math.pi * t / 97.0), 0)
        oy = _even(amp + amp * math.sin(2 * math.pi * t / 131.0 + 1.0), 0)
        ox2 = _even(amp - amp * math.sin(2 * math.pi * t / 61.0 + 0.5), 0)
        oy2 = _even(amp - amp * math.cos(2 * math.pi * t / 83.0), 0)
        np.add(self.layer1[oy : oy + h, ox : ox + w], self.layer2[oy2 : oy2 + h, ox2 : ox2 + w], out=Y)
        d = int(round(24 * math.sin(2 * math.pi * t / 150.0)))
        for plane, canv in ((U, self.canv_u), (V, self.canv_v)):
            src = canv[oy // 2 : oy // 2 + h // 2, ox // 2 : ox // 2 + w // 2]
            if d >= 0:
                np.add(src, np.uint8(d), out=plane)
            else:
                np.subtract(src, np.uint8(-d), out=plane)
        # bouncing box
        bh, bw = self.box_h, self.box_w
        if bh > 0 and bw > 0 and self.strip_h + bh <= h:
            bx = 2 * (self._tri(index * self.speed[0], w - bw) // 2)
            by = self.strip_h + 2 * (
                self._tri(index * self.speed[1], h - self.strip_h - bh) // 2
            )
            Y[by : by + bh, bx : bx + bw] = self.box_y
            U[by // 2 : (by + bh) // 2, bx // 2 : (bx + bw) // 2] = self.box_uv[0]
            V[by // 2 : (by + bh) // 2, bx // 2 : (bx + bw) // 2] = self.box_uv[1]
        # frame-index code strip
        bits = _code_bits(index)
        ce, re = self.col_edges, self.row_edges
        U[: self.strip_h // 2] = 128
        V[: self.strip_h // 2] = 128
        k = 0
        for r in range(CODE_ROWS):
            for c in range(CODE_COLS):
                Y[re[r] : re[r + 1], ce[c] : ce[c + 1]] = _Y_WHITE if bits[k] else _Y_BLACK
                k += 1
        return out


# ---------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------


def _as_fraction(x: float | Fraction | str) -> Fraction:
    if isinstance(x, Fraction):
        return x
    f = Fraction(str(x)) if not isinstance(x, int) else Fraction(x)
    # recognise the NTSC family (29.97 -> 30000/1001 etc.)
    for base in (24, 30, 48, 60, 120):
        ntsc = Fraction(base * 1000, 1001)
        if f != ntsc and abs(float(f) - float(ntsc)) < 5e-3:
            return ntsc
    return f


_VFR_TICKS = 4  # ticks per nominal frame duration in VFR mode


def _vfr_multipliers(n_max: int, seed: int) -> list[int]:
    rng = np.random.default_rng([seed, 0xF4A])
    m = rng.integers(1, 3, size=n_max).tolist()  # 1x or 2x the nominal duration
    # guarantee both durations occur early on
    if n_max >= 2:
        m[0], m[1] = 1, 2
    return m


def frame_times(
    *, duration_s: float = 1.0, fps: float = 24.0, vfr: bool = False, seed: int = 0
) -> list[Fraction]:
    """Presentation times (seconds, exact) of the frames :func:`make_video` writes.

    ``len(frame_times(...))`` is the number of frames; frame ``i`` in display
    order carries index ``i`` in its code strip.  CFR: ``round(duration*fps)``
    frames at ``i/fps``.  VFR: each frame lasts 1x or 2x the nominal ``1/fps``
    (seeded pattern) and frames are emitted while ``t < duration_s``.
    """
    rate = _as_fraction(fps)
    if rate <= 0:
        raise ValueError(f"fps must be > 0, got {fps}")
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    dur = Fraction(str(duration_s))
    if not vfr:
        n = max(1, int(round(dur * rate)))
        return [Fraction(i) / rate for i in range(n)]
    nominal = 1 / rate
    mults = _vfr_multipliers(int(math.ceil(dur * rate)) + 2, seed)
    times, t = [], Fraction(0)
    for m in mults:
        if t >= dur and times:
            break
        times.append(t)
        t += m * nominal
    return times


# ---------------------------------------------------------------------------
# video
# ---------------------------------------------------------------------------


def _codec_options(
    codec: str, *, gop: int, bframes: int, open_gop: bool, preset: str | int | None
) -> dict[str, str]:
    opts: dict[str, str] = {}
    if codec == "h264":
        if preset is not None:
            opts["preset"] = str(preset)
        opts["x264-params"] = (
            f"keyint={gop}:min-keyint={gop}:scenecut=0:bframes={bframes}"
            f":open-gop={int(open_gop)}:b-adapt=0"
        )
    elif codec == "hevc":
        if preset is not None:
            opts["preset"] = str(preset)
        opts["x265-params"] = (
            f"keyint={gop}:min-keyint={gop}:scenecut=0:bframes={bframes}"
            f":open-gop={int(open_gop)}:b-adapt=0:log-level=error"
        )
    elif codec == "vp9":
        opts.update({"crf": "32", "b": "0", "keyint_min": str(gop)})
        if preset is not None:
            p = str(preset)
            if p in ("realtime", "good", "best"):
                opts["deadline"] = p
            else:
                opts["cpu-used"] = p
        opts["row-mt"] = "1"
    elif codec == "av1":
        if preset is not None:
            opts["preset"] = str(preset)
        opts["svtav1-params"] = f"keyint={gop}:scd=0"
    elif codec == "mpeg4":
        opts["sc_threshold"] = "1000000000"  # no scene-cut keyframes
        if not open_gop:
            opts["flags"] = "+cgop"
    return opts


def _check_args(codec, suffix, width, height, gop, bframes, vfr, rotation, open_gop, mirror=False):
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}; choose one of {sorted(CODECS)}")
    if suffix not in CONTAINERS:
        raise ValueError(
            f"unsupported container suffix {suffix!r}; choose one of {sorted(CONTAINERS)}"
        )
    if codec not in CONTAINERS[suffix][1]:
        ok = sorted(s for s, (_, cs) in CONTAINERS.items() if codec in cs)
        raise ValueError(f"codec {codec!r} cannot be stored in {suffix!r}; use one of {ok}")
    if width <= 0 or height <= 0 or width % 2 or height % 2:
        raise ValueError(f"width/height must be positive and even, got {width}x{height}")
    if width < 16 or height < 16:  # (libx265 rejects 8x8; the code cells need room)
        raise ValueError(f"width/height must be at least 16, got {width}x{height}")
    if gop < 1:
        raise ValueError(f"gop must be >= 1, got {gop}")
    if bframes < 0:
        raise ValueError(f"bframes must be >= 0, got {bframes}")
    if bframes and codec not in _BFRAME_CODECS:
        raise ValueError(f"{codec} has no B-frames; use bframes=0")
    if bframes and bframes >= gop:
        raise ValueError(f"bframes ({bframes}) must be smaller than gop ({gop})")
    if open_gop and codec not in _OPEN_GOP_CODECS:
        raise ValueError(f"open_gop is only supported for {sorted(_OPEN_GOP_CODECS)}")
    if rotation not in (0, 90, 180, 270):
        raise ValueError(f"rotation must be 0, 90, 180 or 270, got {rotation}")
    if (rotation or mirror) and suffix not in _ROTATION_CONTAINERS:
        raise ValueError(f"{suffix} cannot store rotation metadata")
    if vfr and suffix == ".avi":
        raise ValueError("AVI cannot store variable frame rate; use .mp4/.mkv/.mov/.webm")


class _EnvVar:
    """Set an environment variable for the duration of a block if unset."""

    def __init__(self, name: str, value: str):
        self.name, self.value, self.set = name, value, False

    def __enter__(self):
        if self.name not in os.environ:
            os.environ[self.name] = self.value
            self.set = True

    def __exit__(self, *exc):
        if self.set:
            os.environ.pop(self.name, None)


def make_video(
    path,
    *,
    codec: str = "h264",
    width: int = 128,
    height: int = 96,
    duration_s: float = 1.0,
    fps: float = 24.0,
    gop: int = 12,
    bframes: int = 0,
    vfr: bool = False,
    rotation: int = 0,
    mirror: bool = False,
    pix_fmt: str = "yuv420p",
    seed: int = 0,
    preset: str | int | None = None,
    open_gop: bool = False,
    faststart: bool = False,
    threads: int = 0,
) -> pathlib.Path:
    """Encode a synthetic clip to ``path`` (container from the suffix).

    codec: h264 (libx264), hevc (libx265), vp9 (libvpx-vp9), av1 (libsvtav1),
    mpeg4.  gop: keyframe interval in frames (regular, no scene cuts).
    bframes: consecutive B-frames (h264/hevc/mpeg4 only).  open_gop:
    h264/hevc/mpeg4.  vfr: frame durations alternate between 1x and 2x
    ``1/fps`` (seeded, see :func:`frame_times`).  rotation: clockwise degrees
    a player must rotate the stored picture for display (the legacy ``rotate``
    tag convention), written as a display matrix; PyAV reports it back as
    ``frame.rotation == -rotation`` (counter-clockwise, in [-180, 180]).
    mirror: the display matrix also mirrors the picture left-right after
    the rotation (PyAV then reports ``frame.rotation`` as ``180 + rotation``,
    mod 360).
    preset: encoder speed preset (x264/x265 names, SVT-AV1 0-13, VP9
    cpu-used or deadline); None = encoder default.  faststart: mp4/mov with
    the index at the front.  threads: 0 = auto.
    """
    import av

    path = pathlib.Path(path)
    suffix = path.suffix.lower()
    _check_args(codec, suffix, width, height, gop, bframes, vfr, rotation, open_gop, mirror)
    times = frame_times(duration_s=duration_s, fps=fps, vfr=vfr, seed=seed)
    if len(times) > MAX_FRAMES:
        raise ValueError(f"{len(times)} frames exceed the frame-index code ({MAX_FRAMES})")
    rate = _as_fraction(fps)
    tb = 1 / (rate * _VFR_TICKS) if vfr else 1 / rate
    muxer = CONTAINERS[suffix][0]
    container_opts = {"fflags": "+bitexact"}
    if faststart and suffix in (".mp4", ".mov"):
        container_opts["movflags"] = "+faststart"
    synth = _FrameSynth(width, height, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with _EnvVar("SVT_LOG", "1"):
            with av.open(str(path), "w", format=muxer, options=container_opts) as out:
                stream = out.add_stream(
                    CODECS[codec],
                    rate=rate,
                    options=_codec_options(
                        codec, gop=gop, bframes=bframes, open_gop=open_gop, preset=preset
                    ),
                )
                stream.width, stream.height, stream.pix_fmt = width, height, pix_fmt
                cc = stream.codec_context
                # mpeg4 (ffmpeg's mpegvideo) shortens closed GOPs that end in a
                # B-run, so give it an endless GOP and force the I-frames instead
                force_keys = codec == "mpeg4"
                cc.gop_size = 1 << 20 if force_keys else gop
                if codec in _BFRAME_CODECS:
                    cc.max_b_frames = bframes
                cc.thread_count = threads
                cc.time_base = tb
                stream.time_base = tb
                if codec == "mpeg4":
                    cc.qscale = True
                    cc.global_quality = 4 * 118  # FF_QP2LAMBDA * q
                if rotation or mirror:
                    # PyAV takes counter-clockwise degrees, and mirrors after the turn
                    stream.set_display_rotation(-rotation, hflip=mirror)
                if vfr:
                    # no nominal rate, or the muxer advertises a constant one
                    # (e.g. Matroska's DefaultDuration is taken from it)
                    cc.framerate = Fraction(0, 1)
                # encoders do not reliably carry frame durations over to packets
                # (libx264 leaves them 0, and then the mp4 edit list cuts off the
                # last frame): set them from the pts
                durations: dict[int, int] = {}

                def _mux(packets):
                    for pkt in packets:
                        if pkt.pts is not None and pkt.pts in durations:
                            pkt.duration = durations.pop(pkt.pts)
                        out.mux_one(pkt)

                buf = np.empty(width * height * 3 // 2, dtype=np.uint8)
                for i, t in enumerate(times):
                    synth.render(i, buf)
                    frame = av.VideoFrame.from_ndarray(
                        buf.reshape(height * 3 // 2, width), format="yuv420p"
                    )
                    if pix_fmt != "yuv420p":
                        frame = frame.reformat(format=pix_fmt)
                    frame.pts = int(t / tb)
                    if force_keys and i % gop == 0:
                        frame.pict_type = av.video.frame.PictureType.I
                    frame.time_base = tb
                    nxt = times[i + 1] if i + 1 < len(times) else t + 1 / rate
                    frame.duration = durations[frame.pts] = int((nxt - t) / tb)
                    _mux(stream.encode(frame))
                _mux(stream.encode(None))
    except BaseException:
        path.unlink(missing_ok=True)  # no half-written clip left behind
        raise
    return path


def probe_rotation(path) -> int:
    """Display rotation of the first video stream of ``path``, in clockwise
    degrees (0/90/180/270, the ``make_video(rotation=...)`` convention), read
    with PyAV from the decoded frame's display-matrix side data."""
    import av

    with av.open(str(path)) as c:
        for frame in c.decode(video=0):
            return int(round(-frame.rotation)) % 360
    raise ValueError(f"{path}: no decodable video frame")


# ---------------------------------------------------------------------------
# images
# ---------------------------------------------------------------------------

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
    bits = _code_bits(seed % MAX_FRAMES)
    ce = _cell_edges(width, CODE_COLS, 1.0 / CODE_COLS)
    re = _cell_edges(height, CODE_ROWS, CODE_ROW_FRAC)
    k = 0
    for r in range(CODE_ROWS):
        for c in range(CODE_COLS):
            rgb[re[r] : re[r + 1], ce[c] : ce[c + 1]] = 255 if bits[k] else 0
            k += 1
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


# ---------------------------------------------------------------------------
# damaged files
# ---------------------------------------------------------------------------


def truncate_file(src, dst, keep_fraction: float = 0.5) -> pathlib.Path:
    """Copy the first ``keep_fraction`` of ``src``'s bytes to ``dst``.

    Note that a plain mp4 keeps its index (moov) at the end, so a truncated
    one cannot be opened at all; use ``make_video(..., faststart=True)`` or
    .mkv for a truncated file that still opens and has its tail missing.
    """
    if not 0.0 < keep_fraction <= 1.0:
        raise ValueError(f"keep_fraction must be in (0, 1], got {keep_fraction}")
    data = pathlib.Path(src).read_bytes()
    dst = pathlib.Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes(data[: int(len(data) * keep_fraction)])
    return dst


def _packet_spans(path) -> list[tuple[int, int, bool]]:
    """(file offset, size, keyframe) of each video packet's payload, in decode order."""
    import av

    raw = pathlib.Path(path).read_bytes()
    spans = []
    with av.open(str(path)) as c:
        for pkt in c.demux(video=0):
            if pkt.size == 0:
                continue
            data = bytes(pkt)
            pos = pkt.pos if pkt.pos is not None and pkt.pos >= 0 else 0
            # pkt.pos may point at a container block header: find the payload
            probe = data[: min(64, len(data))]
            off = raw.find(probe, max(0, pos - 16))
            if off < 0 or raw[off : off + len(data)] != data:
                continue  # payload not stored contiguously; leave it alone
            spans.append((off, len(data), bool(pkt.is_keyframe)))
    return spans


def corrupt_middle(src, dst, *, seed: int = 0) -> pathlib.Path:
    """Copy ``src`` to ``dst`` with the packets of the middle GOP damaged.

    Container structure (headers, index, block headers) is untouched, so the
    file still opens and demuxes to the same packets, but decoding the middle
    GOP yields errors and/or garbage frames (frame-index codes that fail the
    check or disagree with the expected display index).  The keyframe packet
    gets everything after its first few bytes overwritten with seeded random
    bytes; the other packets of the GOP get their second half overwritten.
    With a single GOP the middle third of the packets is damaged instead.
    """
    spans = _packet_spans(src)
    if not spans:
        raise ValueError(f"{src}: no video packets found")
    keys = [i for i, s in enumerate(spans) if s[2]]
    if len(keys) >= 2:
        g = len(keys) // 2
        lo, hi = keys[g], keys[g + 1] if g + 1 < len(keys) else len(spans)
    else:
        lo, hi = len(spans) // 3, max(len(spans) // 3 + 1, 2 * len(spans) // 3)
    data = bytearray(pathlib.Path(src).read_bytes())
    rng = np.random.default_rng([seed, 0xC0AA])
    for j in range(lo, hi):
        off, size, _ = spans[j]
        start = min(8, size // 4) if j == lo else size // 2
        n = size - start
        if n > 0:
            data[off + start : off + size] = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
    dst = pathlib.Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes(bytes(data))
    return dst


# ---------------------------------------------------------------------------
# cache
# ---------------------------------------------------------------------------

_MAKE_VIDEO_PARAMS = {
    name: p.default
    for name, p in inspect.signature(make_video).parameters.items()
    if p.kind is inspect.Parameter.KEYWORD_ONLY
}


def default_cache_dir() -> pathlib.Path:
    """``$FLASHCODEC_CACHE/videos`` or ``~/.cache/flashcodec/videos``."""
    root = os.environ.get("FLASHCODEC_CACHE")
    base = pathlib.Path(root).expanduser() if root else pathlib.Path.home() / ".cache" / "flashcodec"
    return base / "videos"


def _spec_name(spec: dict) -> tuple[str, dict]:
    spec = dict(spec)
    suffix = str(spec.pop("suffix", ".mp4")).lower()
    if not suffix.startswith("."):
        suffix = "." + suffix
    unknown = set(spec) - set(_MAKE_VIDEO_PARAMS)
    if unknown:
        raise ValueError(f"unknown make_video arguments in spec: {sorted(unknown)}")
    full = {**_MAKE_VIDEO_PARAMS, **spec}
    if isinstance(full["fps"], Fraction):
        full["fps"] = str(full["fps"])
    key = json.dumps({"v": GENERATOR_VERSION, "suffix": suffix, **full}, sort_keys=True, default=str)
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    fps = str(full["fps"]).replace("/", "_")
    name = (
        f"{full['codec']}_{full['width']}x{full['height']}_{full['duration_s']}s_{fps}fps"
        f"_g{full['gop']}_b{full['bframes']}"
        + ("_vfr" if full["vfr"] else "")
        + (f"_rot{full['rotation']}" if full["rotation"] else "")
        + f"_s{full['seed']}_{digest}{suffix}"
    )
    return name, spec


def cached_video(spec: dict, cache_dir=None) -> pathlib.Path:
    """Return a clip for ``spec`` (make_video keyword arguments, plus optional
    ``"suffix"``, default ``".mp4"``), generating it only if it is missing.

    The file name is derived from the full spec (defaults filled in) and
    :data:`GENERATOR_VERSION`; files are written to a temporary name and
    renamed into place, so concurrent callers never see partial files.
    """
    name, kwargs = _spec_name(spec)
    cache = pathlib.Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = cache / name
    if final.exists():
        return final
    cache.mkdir(parents=True, exist_ok=True)
    tmp = cache / f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}-{name}"
    try:
        make_video(tmp, **kwargs)
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            tmp.unlink()
    return final


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of usage + message
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="synthetic_video.py",
        description=(
            "Encode a seeded synthetic test clip with PyAV. The container comes from "
            "OUT's suffix (.mp4 .mov .mkv .webm .avi). Every frame carries its display "
            "index as a black/white cell code (see read_frame_index)."
        ),
        epilog=(
            "example: python datasets/synthetic_video.py bench_720p.mp4 --codec h264 "
            "--width 1280 --height 720 --duration 300 --fps 30 --gop 250 --bframes 3 "
            "--preset veryfast"
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("out", metavar="OUT", help="output file")
    p.add_argument("--codec", default="h264", choices=sorted(CODECS))
    p.add_argument("--width", type=int, default=128, help="even")
    p.add_argument("--height", type=int, default=96, help="even")
    p.add_argument("--duration", type=float, default=1.0, help="seconds")
    p.add_argument("--fps", type=str, default="24", help="frame rate, e.g. 30 or 30000/1001")
    p.add_argument("--gop", type=int, default=12, help="keyframe interval in frames")
    p.add_argument("--bframes", type=int, default=0, help="B-frames (h264/hevc/mpeg4)")
    p.add_argument("--open-gop", action="store_true", help="open GOPs (h264/hevc/mpeg4)")
    p.add_argument("--vfr", action="store_true", help="variable frame rate (1x/2x durations)")
    p.add_argument("--rotation", type=int, default=0, choices=(0, 90, 180, 270),
                   help="display rotation, clockwise degrees (metadata only)")
    p.add_argument("--pix-fmt", default="yuv420p", help="pixel format stored in the stream")
    p.add_argument("--preset", default=None,
                   help="encoder preset (x264/x265: ultrafast..veryslow; svtav1: 0-13; "
                        "vp9: cpu-used 0-8 or realtime/good/best); unset: the encoder's default")
    p.add_argument("--seed", type=int, default=0, help="texture / VFR pattern seed")
    p.add_argument("--threads", type=int, default=0, help="encoder threads, 0 = auto")
    p.add_argument("--faststart", action="store_true", help="mp4/mov: index at the front")
    return p


def main(argv: Iterable[str] | None = None) -> int:
    parser = _build_parser()
    a = parser.parse_args(argv)
    try:
        fps = _as_fraction(Fraction(a.fps) if "/" in a.fps else float(a.fps))
    except (ValueError, ZeroDivisionError):
        parser.error(f"invalid --fps {a.fps!r}")
    t0 = time.perf_counter()
    try:
        out = make_video(
            a.out, codec=a.codec, width=a.width, height=a.height, duration_s=a.duration,
            fps=fps, gop=a.gop, bframes=a.bframes, vfr=a.vfr, rotation=a.rotation,
            pix_fmt=a.pix_fmt, seed=a.seed, preset=a.preset, open_gop=a.open_gop,
            faststart=a.faststart, threads=a.threads,
        )
    except Exception as e:  # one line, not a traceback
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 1
    n = len(frame_times(duration_s=a.duration, fps=fps, vfr=a.vfr, seed=a.seed))
    dt = time.perf_counter() - t0
    size = out.stat().st_size
    print(f"wrote {out}: {n} frames {a.width}x{a.height} {a.codec}, "
          f"{size / 1e6:.2f} MB, {dt:.1f} s ({n / dt:.0f} fps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Fidelity of flashcodec's resize modes against Qwen2.5-VL's reference preprocessing.

For seeded clips from 240p to 720p, decodes the sampled frames in each resize mode and compares
them with the reference: a sequential PyAV decode to full-resolution RGB (the stream's colour
tags) resized by :func:`flashcodec.resize.resize_frames` (float32 bicubic + antialias, rounded,
as torchvision's ``resize`` in qwen-vl-utils' ``fetch_video``). Prints mean / p99 / max |diff| in
levels of 255 and each mode's conversion cost per frame (decoded frame -> RGB at the output size,
one thread, decode excluded), as a Markdown table. Then the same for images: ``resize="fast"``
against ``"exact"`` (PIL bicubic, qwen-vl-utils' image resize) on a seeded 4032x3024 JPEG.
With ``--filters``, instead: the candidate filters for ``"exact"`` on 720p -> 728x392 frames.

    python bench/decode/fidelity.py                 # about a minute on 2 cores
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import av
import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "datasets"))

import synthetic_image  # noqa: E402
import synthetic_video  # noqa: E402

import flashcodec  # noqa: E402
from flashcodec.decode.pyav import convert_frame  # noqa: E402
from flashcodec.resize import RESIZE_MODES, resize_frames  # noqa: E402

#: (width, height, output (height, width) or None for the Qwen default video size)
CASES = [
    (426, 240, None), (426, 240, (168, 280)), (640, 360, None), (854, 480, None),
    (854, 480, (224, 392)), (1280, 720, None), (1280, 720, (392, 728)),
]


def decoded_frames(path: Path, indices: list[int]) -> list[av.VideoFrame]:
    wanted = set(indices)
    with av.open(str(path)) as container:
        return [frame for i, frame in enumerate(container.decode(video=0)) if i in wanted]


def reference(frames: list[av.VideoFrame], height: int, width: int) -> torch.Tensor:
    """uint8 [N, 3, height, width]: full-resolution RGB (the frames' colour tags), then the float reference resize."""
    full = torch.from_numpy(np.stack([f.to_ndarray(format="rgb24") for f in frames])).permute(0, 3, 1, 2)
    return resize_frames(full, height, width)  # full: [N, 3, H0, W0]


def convert_ms(frames: list[av.VideoFrame], height: int, width: int, mode: str, rounds: int = 5) -> float:
    """Best of ``rounds`` passes over ``frames`` (the machine may be shared), ms per frame."""
    convert_frame(frames[0], height, width, mode)  # warmup
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for frame in frames:
            convert_frame(frame, height, width, mode)
        best = min(best, time.perf_counter() - started)
    return best * 1e3 / len(frames)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--frames", type=int, default=16, help="frames sampled per clip (default 16)")
    p.add_argument("--cache", type=Path, default=None, help="clip cache (default ~/.cache/flashcodec/videos)")
    p.add_argument("--filters", action="store_true", help="compare the candidate filters for exact instead")
    args = p.parse_args(argv)
    if args.filters:
        filter_candidates(args.cache, args.frames)
        return 0
    torch.set_num_threads(1)
    print("| clip | output | mode | mean | p99 | max | convert ms / frame |")
    print("|---|---|---|---|---|---|---|")
    with flashcodec.DecodeEngine("pyav", num_threads=2) as engine:
        for width, height, size in CASES:
            spec = dict(codec="h264", width=width, height=height, duration_s=4.0, fps=30.0, gop=30, bframes=3,
                        suffix=".mp4", preset="veryfast", seed=width)
            path = synthetic_video.cached_video(spec, cache_dir=args.cache)
            kwargs = {} if size is None else {"height": size[0], "width": size[1]}
            frames = ref = None
            for mode in RESIZE_MODES:
                out = engine.decode_video(path, num_frames=args.frames, resize=mode, **kwargs)
                n, (h, w) = len(out.frame_indices), out.frames.shape[2:]
                if ref is None:
                    frames = decoded_frames(path, out.frame_indices)
                    ref = reference(frames, h, w)
                diff = (out.frames[:n].to(torch.int16) - ref.to(torch.int16)).abs().numpy()
                print(f"| {width}x{height} | {w}x{h} | {mode} | {diff.mean():.3f} | {np.percentile(diff, 99):.0f} | "
                      f"{diff.max()} | {convert_ms(frames, h, w, mode):.2f} |")
    image_fidelity(args.cache)
    return 0


def _sws(frame: av.VideoFrame, height: int, width: int, flags) -> np.ndarray:
    return frame.to_ndarray(width=width, height=height, format="rgb24", interpolation=flags)


def _full_then(resize_rgb):
    """A candidate that converts at full resolution, then resizes the [H0, W0, 3] RGB array."""
    return lambda frame, height, width: resize_rgb(frame.to_ndarray(format="rgb24"), height, width)


def _torch_uint8(rgb, height, width):
    x = torch.from_numpy(rgb).permute(2, 0, 1)[None]  # [1, 3, H0, W0] channels-last
    return torch.nn.functional.interpolate(x, size=(height, width), mode="bicubic", antialias=True)[0].permute(1, 2, 0)


def _sws_rgb(rgb, height, width):
    return av.VideoFrame.from_ndarray(rgb, format="rgb24").to_ndarray(width=width, height=height,
                                                                      interpolation="BICUBIC")


def _pil(rgb, height, width):
    from PIL import Image

    return np.asarray(Image.fromarray(rgb).resize((width, height), Image.Resampling.BICUBIC))


def _float_reference(rgb, height, width):
    return resize_frames(torch.from_numpy(rgb).permute(2, 0, 1)[None], height, width)[0].permute(1, 2, 0)


def filter_candidates(cache: Path | None, num_frames: int) -> None:
    from av.video.reformatter import Interpolation as I

    full_chroma = I.BICUBIC | I.FULL_CHR_H_INT | I.FULL_CHR_H_INP | I.ACCURATE_RND
    candidates = {
        "one swscale call, AREA (fast)": lambda f, h, w: _sws(f, h, w, "AREA"),
        "one swscale call, BICUBIC": lambda f, h, w: _sws(f, h, w, "BICUBIC"),
        "one swscale call, BICUBIC + full chroma + accurate rounding": lambda f, h, w: _sws(f, h, w, full_chroma),
        "full-res RGB + torch uint8 antialiased bicubic (exact)": _full_then(_torch_uint8),
        "full-res RGB + swscale BICUBIC": _full_then(_sws_rgb),
        "full-res RGB + PIL bicubic": _full_then(_pil),
        "full-res RGB + float32 reference": _full_then(_float_reference),
    }
    torch.set_num_threads(1)
    spec = dict(codec="h264", width=1280, height=720, duration_s=4.0, fps=30.0, gop=30, bframes=3,
                suffix=".mp4", preset="veryfast", seed=1280)
    path = synthetic_video.cached_video(spec, cache_dir=cache)
    frames = decoded_frames(path, np.linspace(0, 119, num_frames).round().astype(int).tolist())
    h, w = 392, 728
    ref = reference(frames, h, w)
    print("| filter | mean | p99 | max | ms / frame |")
    print("|---|---|---|---|---|")
    for name, fn in candidates.items():
        out = torch.from_numpy(np.stack([np.asarray(fn(f, h, w)) for f in frames])).permute(0, 3, 1, 2)
        diff = (out.to(torch.int16) - ref.to(torch.int16)).abs().numpy()
        best = float("inf")
        for _ in range(3):
            started = time.perf_counter()
            for frame in frames:
                fn(frame, h, w)
            best = min(best, time.perf_counter() - started)
        print(f"| {name} | {diff.mean():.3f} | {np.percentile(diff, 99):.0f} | {diff.max()} | "
              f"{best * 1e3 / len(frames):.2f} |")


def image_fidelity(cache: Path | None) -> None:
    folder = Path(cache) if cache else synthetic_video.default_cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "fidelity_4032x3024_s0.jpg"
    if not path.exists():
        synthetic_image.make_image(path, width=4032, height=3024, seed=0)
    print("\n| image | output | mode | ms (best of 5) | mean / p99 / max vs exact |")
    print("|---|---|---|---|---|")
    exact = None
    for mode in RESIZE_MODES:
        best = float("inf")
        for _ in range(5):
            started = time.perf_counter()
            image = flashcodec.decode_image(path, max_pixels=1000 * 750, resize=mode)
            best = min(best, time.perf_counter() - started)
        exact = image.pixels if exact is None else exact
        diff = (image.pixels.to(torch.int16) - exact.to(torch.int16)).abs().numpy()
        h, w = image.size
        print(f"| 4032x3024 JPEG | {w}x{h} | {mode} | {best * 1e3:.0f} | "
              f"{diff.mean():.3f} / {np.percentile(diff, 99):.0f} / {diff.max()} |")


if __name__ == "__main__":
    sys.exit(main())

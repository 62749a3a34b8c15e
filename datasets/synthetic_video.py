#!/usr/bin/env python3
"""Seeded, deterministic synthetic video clips for flashcodec tests and benchmarks.

Everything is encoded in-process with PyAV (no ffmpeg CLI).  The frames come
from ``video_frames``: panning noise textures, a bouncing box, and at the top a
black/white cell code holding the frame's display index, which
``frame_code.read_frame_index`` recovers from a decoded RGB frame, also after
lossy compression and downscaling to 1/4 of the size.  :func:`cached_video`
keeps clips on disk, keyed by their arguments.

Beside this file: ``frame_code`` (the frame-index code), ``video_frames`` (the
frames' times and pixels), ``video_codecs`` (encoders, containers and their
options), ``synthetic_image`` (still images) and ``damaged_media`` (truncated
and corrupted copies).  Put ``datasets/`` on ``sys.path`` and ``import
synthetic_video`` (there is deliberately no ``datasets/__init__.py``, which
would clash with the HuggingFace ``datasets`` package).  It is also a CLI, see
``python datasets/synthetic_video.py --help``.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import os
import pathlib
import sys
import time
import uuid
from fractions import Fraction
from typing import Iterable

import numpy as np

if __package__:  # ``python -m datasets.synthetic_video``
    from .damaged_media import corrupt_middle, truncate_file
    from .frame_code import MAX_FRAMES, read_frame_index
    from .synthetic_image import make_image
    from .video_codecs import BFRAME_CODECS, CODECS, CONTAINERS, check_video_args, codec_options
    from .video_frames import VFR_TICKS, FrameSynth, as_fraction, frame_times
else:  # ``datasets/`` on ``sys.path``, or ``python datasets/synthetic_video.py``
    from damaged_media import corrupt_middle, truncate_file
    from frame_code import MAX_FRAMES, read_frame_index
    from synthetic_image import make_image
    from video_codecs import BFRAME_CODECS, CODECS, CONTAINERS, check_video_args, codec_options
    from video_frames import VFR_TICKS, FrameSynth, as_fraction, frame_times

__all__ = [
    "CODECS",
    "CONTAINERS",
    "GENERATOR_VERSION",
    "cached_video",
    "frame_times",
    "make_video",
    "probe_rotation",
    # re-exported: tests/flashcodec and tests/unifiedserve import them from here
    "corrupt_middle",
    "make_image",
    "read_frame_index",
    "truncate_file",
]

#: Bump when the pixel content or encoder settings change: it is part of the
#: cache key used by :func:`cached_video`.
GENERATOR_VERSION = 2


# ---------------------------------------------------------------------------
# video
# ---------------------------------------------------------------------------


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
    check_video_args(codec, suffix, width, height, gop, bframes, vfr, rotation, open_gop, mirror)
    times = frame_times(duration_s=duration_s, fps=fps, vfr=vfr, seed=seed)
    if len(times) > MAX_FRAMES:
        raise ValueError(f"{len(times)} frames exceed the frame-index code ({MAX_FRAMES})")
    rate = as_fraction(fps)
    tb = 1 / (rate * VFR_TICKS) if vfr else 1 / rate
    muxer = CONTAINERS[suffix][0]
    container_opts = {"fflags": "+bitexact"}
    if faststart and suffix in (".mp4", ".mov"):
        container_opts["movflags"] = "+faststart"
    synth = FrameSynth(width, height, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with _EnvVar("SVT_LOG", "1"):
            with av.open(str(path), "w", format=muxer, options=container_opts) as out:
                stream = out.add_stream(
                    CODECS[codec],
                    rate=rate,
                    options=codec_options(
                        codec, gop=gop, bframes=bframes, open_gop=open_gop, preset=preset
                    ),
                )
                stream.width, stream.height, stream.pix_fmt = width, height, pix_fmt
                cc = stream.codec_context
                # mpeg4 (ffmpeg's mpegvideo) shortens closed GOPs that end in a
                # B-run, so give it an endless GOP and force the I-frames instead
                force_keys = codec == "mpeg4"
                cc.gop_size = 1 << 20 if force_keys else gop
                if codec in BFRAME_CODECS:
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
        fps = as_fraction(Fraction(a.fps) if "/" in a.fps else float(a.fps))
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

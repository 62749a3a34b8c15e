#!/usr/bin/env python3
"""What one decoder's open costs, and what that costs a request: FFmpeg's H.264 stream-info decode, same run.

Every segment decoder opens the video (each NVDEC session, each CPU thread). For H.264, FFmpeg's stream-info
pass decodes the first pictures in software at each open. This times, on one clip:

- an open through PyAV and through torchcodec (CPU, or ``--device cuda:N`` for an NVDEC session), each full and
  without that decode (PyAV: ``pyav.FAST_OPEN_OPTIONS``; torchcodec: ``flashcodec/decode/fast_open.py``);
- flashcodec's ``decode_video`` of 32 sparse frames and of the dense plan on that device (the torchcodec backend on
  the CPU, NVDEC on a GPU), with fast opens and with every open full (``fast_open.full_opens``).

    python bench/decode/bench_open.py                       # 1080p H.264, 20 s, CPU (~1 minute with the clip)
    python bench/decode/bench_open.py --device cuda:0       # NVDEC sessions
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "decode"))

from bench_decode import make_clip  # noqa: E402  (bench_decode's clips: x264, GOPs of 250, 3 B-frames)

from flashcodec import FlashCodecError  # noqa: E402
from flashcodec.benchmark import best_time, sampling_indices  # noqa: E402
from flashcodec.decode import fast_open  # noqa: E402


def positive_int(text: str) -> int:
    """An integer >= 1, for argparse."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def size_arg(text: str) -> tuple[int, int]:
    """``WxH`` -> ``(width, height)``, for argparse."""
    try:
        width, height = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected WxH, e.g. 1920x1080, got {text!r}") from None
    if width < 16 or height < 16 or width % 2 or height % 2:
        raise argparse.ArgumentTypeError(f"width and height must be even and >= 16, got {text!r}")
    return width, height


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu (torchcodec's CPU decoder) or cuda:N (NVDEC); default cpu")
    p.add_argument("--clip", type=Path, help="an H.264 file to use instead of the generated clip")
    p.add_argument("--size", type=size_arg, default=(1920, 1080), help="clip size WxH (default 1920x1080)")
    p.add_argument("--duration", type=float, default=20.0, help="clip length in seconds (default 20)")
    p.add_argument("--opens", type=int, default=7, help="opens timed per front end, median kept (default 7)")
    p.add_argument("--repeat", type=int, default=3, help="timed decodes per mode, best kept (default 3)")
    p.add_argument("--threads", type=int, default=2, help="CPU decoder threads on --device cpu (default 2)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results", help="where the JSON goes")
    p.add_argument("--cache", type=Path, default=None, help="clip cache (default ~/.cache/flashcodec/videos)")
    return p.parse_args(argv)


def median_seconds(fn, n: int) -> float:
    times = []
    for _ in range(n):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main(argv=None) -> int:
    args = parse_args(argv)
    installed = fast_open.install()  # before torchcodec is imported
    import av
    import flashcodec
    from flashcodec.decode import backends, pyav
    from torchcodec.decoders import VideoDecoder

    path = str(args.clip or make_clip("h264", *args.size, args.duration, 30.0, args.cache))
    try:
        info = flashcodec.probe(path)
    except FlashCodecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if info.codec != "h264":
        print(f"error: {path} is {info.codec}; only H.264's open decodes pictures", file=sys.stderr)
        return 2
    width, height = info.width, info.height
    depth = backends.reorder_depth(info)
    device = args.device

    def torchcodec_open():
        with fast_open.opening(info, depth):
            VideoDecoder(path, stream_index=info.stream_index, device=device, seek_mode="approximate")

    def pyav_open(options):
        def run():
            with av.open(path, options=options) as container:
                container.streams.video[0].codec_context  # noqa: B018  (opened as a segment decoder opens)
        return run

    opens = {"pyav_full": median_seconds(pyav_open(None), args.opens),
             "pyav_fast": median_seconds(pyav_open(pyav.FAST_OPEN_OPTIONS["h264"]), args.opens)}
    torchcodec_open()  # warm: torchcodec's libraries and, on a GPU, its decoder cache
    opens["torchcodec_fast"] = median_seconds(torchcodec_open, args.opens)
    with fast_open.full_opens():
        opens["torchcodec_full"] = median_seconds(torchcodec_open, args.opens)

    if device.startswith("cuda"):
        engine = flashcodec.DecodeEngine(devices=[device], cpu_threads=0)
    else:
        engine = flashcodec.DecodeEngine("torchcodec", num_threads=args.threads)
    plan = flashcodec.plan_video(info)
    samplings = {"sparse": sampling_indices(info, "sparse"), "dense": list(plan.frame_indices)}
    decodes: dict = {}
    with engine:
        for name, indices in samplings.items():
            def decode():
                return engine.decode_video(path, frame_indices=indices)

            decode()  # warm
            before = fast_open.fast_opens()
            fast, _ = best_time(decode, args.repeat)
            fast_count = (fast_open.fast_opens() - before) / args.repeat
            with fast_open.full_opens():
                full, _ = best_time(decode, args.repeat)
            decodes[name] = {"frames": len(indices), "fast_s": fast, "full_s": full, "fast_opens_per_run": fast_count}

    print(f"{Path(path).name}: H.264 {width}x{height}, {info.num_frames} frames, reorder depth {depth} "
          f"(an open without the decode gives {info.open_reorder_depth}); device {device}; fast opens "
          f"{'on' if installed else 'off: ' + str(fast_open.reason())}")
    print(f"{'one open':<22} {'full':>9} {'fast':>9} {'ratio':>7}")
    for front in ("pyav", "torchcodec"):
        full, fast = opens[front + "_full"], opens[front + "_fast"]
        print(f"{front:<22} {full * 1e3:8.1f}ms {fast * 1e3:8.1f}ms {full / fast:6.1f}x")
    print(f"{'decode_video':<22} {'full':>9} {'fast':>9} {'ratio':>7}  opens without the decode")
    for name, d in decodes.items():
        print(f"{name + ' (' + str(d['frames']) + ' frames)':<22} {d['full_s']:8.3f}s {d['fast_s']:8.3f}s "
              f"{d['full_s'] / d['fast_s']:6.2f}x  {d['fast_opens_per_run']:.0f} per run")
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"bench_open_{device.replace(':', '')}.json"
    out.write_text(json.dumps({"command": "python bench/decode/bench_open.py " + " ".join(argv or sys.argv[1:]),
                               "clip": path, "fast_open_installed": installed, "reason": fast_open.reason(),
                               "opens_s": opens, "decode_video": decodes}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

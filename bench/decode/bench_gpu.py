#!/usr/bin/env python3
"""GPU decode benchmark: issue 12's targets, measured in one run, as ratios.

Makes its clips where it runs (bench/decode/gpu_media.py: 1080p with motion and noise, 10
Mbit/s, 2-s GOPs, H.264 and HEVC, NVENC when it opens), then per codec, for Qwen2.5-VL's dense
sampling of the same frames at the same output size:

- one NVDEC session: one torchcodec CUDA ``VideoDecoder`` decoding the sampled frames, resized
  on the GPU with the fused resize kernel, as flashcodec's NVDEC sessions do (flashcodec's timed
  runs open their decoders inside the timer, the baselines' outside it);
- the 7-engine ceiling: ``--sessions`` independent sessions (threads, decoders made beforehand),
  each decoding all of them at once (one file, one decoder each);
- the naive split: the video's GOPs cut into ``--sessions`` static contiguous runs, one session each
  (the target's baseline opens them before its timer; ``naive_split_opened`` opens them inside it, as
  flashcodec's slots open theirs within a request);
- flashcodec on the GPU alone, on the CPU alone (``--cpu-threads``), and on both (ranks given the
  speeds just measured), and NVML/GPM engine use during flashcodec's GPU decode and the ceiling;
- sparse sampling (32 frames): flashcodec on the GPU against one session;

then a batch of ``--jpegs`` JPEGs: nvJPEG (flashcodec.decode_images on the GPU, and torchvision's
bare call) against the CPU path. Outputs are checked before anything is timed (flashcodec GPU
against flashcodec CPU, the session baseline against flashcodec GPU); every timing excludes a
warm-up run; a measurement that cannot run here (no GPU, a missing package) is recorded as
skipped with its reason. Writes ``gpu-decode.json`` and ``gpu-decode.md`` into ``--out``.

    python bench/decode/bench_gpu.py --out /tmp/gpu --short   # <= 4 minutes on the H100 machine
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import platform
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import flashcodec  # noqa: E402
from flashcodec.benchmark import best_time, machine_info, sampling_indices  # noqa: E402
from flashcodec.decode import fast_open  # noqa: E402
from flashcodec.decode.frame_mappings import frame_mappings  # noqa: E402
from flashcodec.decode.trace import trace_summary  # noqa: E402
from flashcodec.devices import (DEFAULT_NVDEC_SESSIONS, NVDEC_HOST_CORES, default_cpu_threads,  # noqa: E402
                               nvdec_unavailable_reason)
from flashcodec.image_batch import ImageBatchDecoder, nvjpeg_unavailable_reason  # noqa: E402
from flashcodec.plan.video import floor_cost  # noqa: E402
from flashcodec.resize import resize_frames_on_device  # noqa: E402
from flashcodec.telemetry import TelemetrySampler, TelemetryUnavailable, nvml_index, open_nvml  # noqa: E402
from gpu_media import ClipSpec, make_clip, make_jpegs  # noqa: E402
from gpu_report import check_targets, markdown, ratios  # noqa: E402

#: Chunk of frames one session asks torchcodec for at a time (as flashcodec's NVDEC sessions do).
CHUNK = 8
#: Correctness guard: a mean |diff| above this is a wrong decode, not a rounding difference.
MAX_SANE_DIFF = 3.0


class Skip(Exception):
    """A measurement that cannot run here; the message is the reason."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for gpu-decode.json and gpu-decode.md")
    p.add_argument("--short", action="store_true", help="60-s clips instead of 150-s ones (<= 4 minutes on an H100)")
    p.add_argument("--codecs", default="h264,hevc", help="comma-separated: h264, hevc (default both)")
    p.add_argument("--duration", type=float, help="clip seconds (default 150, or 60 with --short)")
    p.add_argument("--size", default="1920x1080", help="clip size WxH (default 1920x1080)")
    p.add_argument("--fps", type=int, default=30, help="clip frame rate (default 30)")
    p.add_argument("--bitrate", type=float, default=10.0, help="clip bit rate in Mbit/s (default 10)")
    p.add_argument("--gop", type=int, default=None,
                   help="clip GOP length in frames (default 2 s of frames, the GOPs of the issue's naive-split "
                        "measurement; a 60-s clip then has 30 GOPs for 14 sessions)")
    p.add_argument("--gpu", type=int, default=0, help="CUDA ordinal to decode on (default 0)")
    p.add_argument("--sessions", type=int, default=DEFAULT_NVDEC_SESSIONS,
                   help="NVDEC sessions of flashcodec, the ceiling and the naive split "
                        f"(default {DEFAULT_NVDEC_SESSIONS})")
    p.add_argument("--cpu-threads", type=int, default=os.cpu_count() or 1,
                   help="CPU decoder threads (default: all cores)")
    p.add_argument("--mixed-cpu-threads", type=int, default=None,
                   help="CPU decoder threads beside the GPU in the GPU+CPU run (default: the engine's own, "
                        f"--cpu-threads less the {NVDEC_HOST_CORES} host cores an NVDEC rank keeps busy)")
    p.add_argument("--jpegs", type=int, default=256, help="JPEGs in the image batch (default 256)")
    p.add_argument("--jpeg-size", default="1280x720", help="JPEG size WxH (default 1280x720)")
    p.add_argument("--repeat", type=int, default=1, help="timed runs per measurement, best kept (default 1)")
    p.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "flashcodec" / "gpu-bench",
                   help="clip cache folder")
    args = p.parse_args(argv)
    if args.fps >= 1 and args.gop is None:
        args.gop = 2 * args.fps
    for name in ("sessions", "cpu_threads", "mixed_cpu_threads", "jpegs", "repeat", "gop", "fps"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    try:
        args.width, args.height = (int(v) for v in args.size.lower().split("x"))
        args.jpeg_width, args.jpeg_height = (int(v) for v in args.jpeg_size.lower().split("x"))
    except ValueError:
        p.error("--size and --jpeg-size take WxH, e.g. 1920x1080")
    if args.width % 2 or args.height % 4:
        p.error("--size: the width must be even and the height a multiple of 4")
    args.duration = args.duration or (60.0 if args.short else 150.0)
    return args


def _sync(gpu: int) -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize(gpu)


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.cpu().to(torch.int16) - b.cpu().to(torch.int16)).abs().float().mean())


def _measure(results: dict, name: str, fn) -> dict:
    try:
        results[name] = fn()
    except Skip as s:
        results[name] = {"skipped": str(s)}
    except Exception as e:  # one failed measurement is reported; the others still run
        results[name] = {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"}
    r = results[name]
    print(f"  {name:<28} " + (f"{r['seconds']:.3f} s" if "seconds" in r else
                              f"skipped: {r['skipped']}" if "skipped" in r else f"ERROR {r['error']}"), flush=True)
    return r


# ---- one NVDEC session, the ceiling and the naive split (torchcodec CUDA decoders) ----

def _session(path: str, gpu: int, mappings: str | None = None):
    """A torchcodec CUDA decoder: with ``mappings`` (frame_mappings) opened as flashcodec's slots open theirs,
    without a file scan; else in exact mode (a scan of the file, for decoders made before a timer)."""
    from torchcodec.decoders import VideoDecoder

    if mappings is not None:
        return VideoDecoder(path, device=f"cuda:{gpu}", dimension_order="NCHW", custom_frame_mappings=mappings)
    return VideoDecoder(path, device=f"cuda:{gpu}", dimension_order="NCHW", seek_mode="exact")


def _session_decode(decoder, indices, h: int, w: int, keep: bool = False):
    kept = []
    for start in range(0, len(indices), CHUNK):
        frames = decoder.get_frames_at(indices[start:start + CHUNK]).data  # uint8 [n, 3, H0, W0] on the GPU
        small = resize_frames_on_device(frames, h, w)  # [n, 3, h, w]: the fused kernel, as flashcodec's sessions
        if keep:
            kept.append(small)
    return torch.cat(kept) if keep else None


def _in_threads(decoders, jobs, h, w, gpu):
    with ThreadPoolExecutor(len(decoders)) as pool:
        list(pool.map(lambda dj: _session_decode(dj[0], dj[1], h, w), zip(decoders, jobs)))
    _sync(gpu)


def gop_split(info, indices, parts: int) -> list[list[int]]:
    """The naive baseline's static plan: GOPs in ``parts`` contiguous runs of equal GOP count, each
    run's sampled indices (runs without a sampled frame are dropped)."""
    keys = [g.keyframe_index for g in info.gops]
    per_gop: list[list[int]] = [[] for _ in keys]
    for i in indices:
        per_gop[max(0, bisect.bisect_right(keys, i) - 1)].append(i)
    bounds = [k * len(keys) // parts for k in range(parts + 1)]
    runs = [[i for g in per_gop[a:b] for i in g] for a, b in zip(bounds, bounds[1:])]
    return [r for r in runs if r]


# ---- flashcodec ----

def _fc_decode(engine, path: str, indices, gpu: int):
    analysis = engine.analyse_bitstream(path, frame_indices=indices)  # probe + plan: not timed
    started = time.perf_counter()
    engine.add_decoding_request(analysis.key_id)
    out = engine.get_decoding_output(analysis.key_id)
    _sync(gpu)
    return time.perf_counter() - started, out


def _fc_traced(engine, path: str, indices, gpu: int, slots: dict[str, int]) -> dict:
    """One more run, traced: which slot opened and decoded what, and when (flashcodec.decode.trace.trace_summary)."""
    analysis = engine.analyse_bitstream(path, frame_indices=indices)
    started = time.perf_counter()
    engine.add_decoding_request(analysis.key_id, trace=True)
    out = engine.get_decoding_output(analysis.key_id)
    _sync(gpu)
    return trace_summary(out.trace, time.perf_counter() - started, slots)


def _fc_timed(engine, path, indices, gpu, repeat):
    _, warm = _fc_decode(engine, path, indices, gpu)
    best = min(_fc_decode(engine, path, indices, gpu)[0] for _ in range(repeat))
    return best, warm


def _engine(gpu, sessions, cpu_threads, *, use_gpu: bool, use_cpu: bool, speeds=None):
    devices = ([f"cuda:{gpu}"] if use_gpu else []) + (["cpu"] if use_cpu else [])
    return flashcodec.DecodeEngine(devices=devices, cpu_threads=cpu_threads if use_cpu else 0,
                                   nvdec_sessions=sessions, rank_speeds=speeds)


def _sampler(gpu: int, codec: str) -> TelemetrySampler:
    """An NVML sampler of CUDA device ``gpu`` (NVML's own index of it, matched by UUID), its NVDEC count from
    the driver."""
    try:
        from flashcodec.nvcuvid import decoder_caps

        engines = decoder_caps(codec, "420", 8, gpu).num_engines or None
    except Exception:  # engine count unknown: NVML's own list is used
        engines = None
    try:
        index = nvml_index(gpu)
    except TelemetryUnavailable:  # the sampler reports NVML's absence itself
        index = gpu
    # 0.2 s between GPM samples: NVML's metrics are computed over the interval of two samples
    return TelemetrySampler(0.2, lambda: open_nvml([index], num_nvdec_engines=engines))


def _telemetry(sampler: TelemetrySampler, seconds: float) -> dict:
    if sampler.unavailable:
        return {"skipped": sampler.unavailable}
    (summary,) = sampler.summary()
    return {"seconds": seconds, **summary.as_dict()}


def bench_codec(clip, args, checkpoint=None) -> dict:
    """Every video measurement of one clip; returns its results, ratios and target checks. ``checkpoint(partial)``
    is called after each measurement with what is measured so far (a run cut short by a time limit keeps it)."""
    path, gpu, S, C = str(clip.path), args.gpu, args.sessions, args.cpu_threads
    info = flashcodec.probe(path)
    plan = flashcodec.plan_video(info)
    dense = list(plan.frame_indices)
    sparse = sampling_indices(info, "sparse")
    h, w = plan.height, plan.width
    must_decode = floor_cost(info, dense)
    print(f"{info.codec} {info.width}x{info.height} {info.num_frames} frames ({clip.encoder}, "
          f"{clip.measured_bitrate / 1e6:.1f} Mbit/s): dense {len(dense)} frames at {h}x{w}, "
          f"{must_decode} must be decoded", flush=True)
    nvdec_reason = nvdec_unavailable_reason(gpu)
    m: dict = {}
    state: dict = {}

    def need_gpu():
        if nvdec_reason:
            raise Skip(nvdec_reason)

    def cpu_alone():
        with _engine(gpu, S, C, use_gpu=False, use_cpu=True) as engine:
            seconds, out = _fc_timed(engine, path, dense, gpu, args.repeat)
        state["cpu_frames"] = out.frames[:len(dense)]
        return {"seconds": seconds, "fps": must_decode / seconds, "threads": C}

    def gpu_alone():
        need_gpu()
        engine = state["gpu_engine"] = _engine(gpu, S, C, use_gpu=True, use_cpu=False)
        _, warm = _fc_decode(engine, path, dense, gpu)
        frames = state["gpu_frames"] = warm.frames[:len(dense)]
        if "cpu_frames" in state:
            diff = state["gpu_vs_cpu"] = _diff(frames, state["cpu_frames"])
            if diff > MAX_SANE_DIFF:
                raise AssertionError(f"GPU output differs from CPU output by mean {diff:.2f}; refusing to time")
        opens_before = fast_open.fast_opens()
        seconds = min(_fc_decode(engine, path, dense, gpu)[0] for _ in range(args.repeat))
        fast_opens = (fast_open.fast_opens() - opens_before) / args.repeat
        with fast_open.full_opens():  # the same runs with FFmpeg's stream-info decode at every session's open
            full_opens = min(_fc_decode(engine, path, dense, gpu)[0] for _ in range(args.repeat))
        cpu_before = time.process_time()  # one more run: how many of the host's cores NVDEC's threads keep busy
        wall = _fc_decode(engine, path, dense, gpu)[0]
        host_cores = (time.process_time() - cpu_before) / wall
        trace = _fc_traced(engine, path, dense, gpu, {f"cuda:{gpu}": S})
        return {"seconds": seconds, "fps": must_decode / seconds, "sessions": S, "host_cores_busy": host_cores,
                "trace": trace, "fast_opens_per_run": fast_opens, "seconds_full_opens": full_opens,
                "full_opens_because": fast_open.reason()}

    def one_session():
        need_gpu()
        decoder = _session(path, gpu)
        frames = _session_decode(decoder, dense, h, w, keep=True)  # warm-up and the check
        _sync(gpu)
        diff = _diff(frames, state["gpu_frames"]) if "gpu_frames" in state else None
        if diff is not None and diff > MAX_SANE_DIFF:
            raise AssertionError(f"one-session frames differ from flashcodec's by mean {diff:.2f}; refusing to time")
        seconds, _ = best_time(lambda: (_session_decode(decoder, dense, h, w), _sync(gpu)), args.repeat)
        return {"seconds": seconds, "fps": must_decode / seconds, "vs_flashcodec_mean_abs_diff": diff}

    def ceiling():
        need_gpu()
        decoders = [_session(path, gpu) for _ in range(S)]
        _in_threads(decoders, [dense[:CHUNK]] * S, h, w, gpu)  # warm-up: every decoder made and used
        with _sampler(gpu, info.codec) as sampler:  # NVML reads in a thread: no cost to the decode
            seconds, _ = best_time(lambda: _in_threads(decoders, [dense] * S, h, w, gpu), args.repeat)
        state["ceiling_telemetry"] = _telemetry(sampler, seconds)
        return {"seconds": seconds, "sessions": S, "fps": S * must_decode / seconds}

    def naive_split():
        need_gpu()
        runs = gop_split(info, dense, S)
        decoders = [_session(path, gpu) for _ in runs]
        _in_threads(decoders, [r[:CHUNK] for r in runs], h, w, gpu)
        seconds, _ = best_time(lambda: _in_threads(decoders, runs, h, w, gpu), args.repeat)
        return {"seconds": seconds, "fps": must_decode / seconds, "sessions": len(runs)}

    def naive_split_opened():
        """The same static split with each thread opening its session inside the timer, as flashcodec's slots do
        within a request (the same open: the probe's frame mappings). Reported beside the target's baseline,
        which opens before its timer, to tell the cost of opening from the cost of scheduling."""
        need_gpu()
        runs = gop_split(info, dense, S)
        mappings = frame_mappings(info)

        def decode_runs():
            with ThreadPoolExecutor(len(runs)) as pool:
                list(pool.map(lambda run: _session_decode(_session(path, gpu, mappings), run, h, w), runs))
            _sync(gpu)

        decode_runs()  # warm-up: torchcodec's cache of hardware decoders filled, as flashcodec's warm runs find it
        seconds, _ = best_time(decode_runs, args.repeat)
        return {"seconds": seconds, "fps": must_decode / seconds, "sessions": len(runs)}

    def mixed(threads: int) -> dict:
        """flashcodec on the GPU and ``threads`` CPU decoder threads at once, the planner told each rank's speed
        alone (the CPU's scaled from its ``C`` threads)."""
        need_gpu()
        g, c = m.get("gpu_alone", {}), m.get("cpu_alone", {})
        if "fps" not in g or "fps" not in c:
            raise Skip("needs both GPU-alone and CPU-alone timings")
        speeds = {f"cuda:{gpu}": g["fps"], "cpu": c["fps"] * threads / C}  # the planner splits in these proportions
        with _engine(gpu, S, threads, use_gpu=True, use_cpu=True, speeds=speeds) as engine:
            plan = engine.analyse_bitstream(path, frame_indices=dense).plan  # the split the timed runs get
            seconds, _ = _fc_timed(engine, path, dense, gpu, args.repeat)
            trace = _fc_traced(engine, path, dense, gpu, {f"cuda:{gpu}": S, "cpu": threads})
        split = {name: len(rank.segments) for name, rank in zip(speeds, plan.ranks)}
        return {"seconds": seconds, "fps": must_decode / seconds, "cpu_threads": threads, "rank_speeds": speeds,
                "segments_per_rank": split, "trace": trace}

    def gpu_and_cpu():
        # the engine's own CPU thread count beside a GPU rank (devices.default_cpu_threads: the cores CPU-alone
        # used, less the host cores the NVDEC rank keeps busy); the target's measurement
        return mixed(args.mixed_cpu_threads or default_cpu_threads(1, cores=C))

    def gpu_and_cpu_all_threads():
        return mixed(C)  # a CPU decoder thread on every core CPU-alone used, beside the GPU rank: not a target

    def engines_busy():
        need_gpu()
        engine = state.get("gpu_engine")
        if engine is None:
            raise Skip("flashcodec's GPU decode did not run")
        sampler = _sampler(gpu, info.codec)
        if sampler.unavailable:
            raise Skip(sampler.unavailable)
        with sampler:  # flashcodec's dense decode, repeated for >= 1.5 s of samples
            started = time.perf_counter()
            while time.perf_counter() - started < 1.5:
                _fc_decode(engine, path, dense, gpu)
        return _telemetry(sampler, time.perf_counter() - started)

    def sparse_gpu():
        need_gpu()
        if "gpu_engine" not in state:
            raise Skip("flashcodec's GPU engine did not start")
        seconds, _ = _fc_timed(state["gpu_engine"], path, sparse, gpu, args.repeat)
        return {"seconds": seconds, "num_frames": len(sparse)}

    def sparse_one_session():
        need_gpu()
        decoder = _session(path, gpu)
        _session_decode(decoder, sparse[:2], h, w)
        seconds, _ = best_time(lambda: (_session_decode(decoder, sparse, h, w), _sync(gpu)), args.repeat)
        return {"seconds": seconds, "num_frames": len(sparse)}

    for name, fn in (("cpu_alone", cpu_alone), ("gpu_alone", gpu_alone), ("one_session", one_session),
                     ("ceiling", ceiling), ("naive_split", naive_split),
                     ("naive_split_opened", naive_split_opened), ("gpu_and_cpu", gpu_and_cpu),
                     ("gpu_and_cpu_all_threads", gpu_and_cpu_all_threads),
                     ("engines_busy", engines_busy), ("sparse_gpu", sparse_gpu),
                     ("sparse_one_session", sparse_one_session)):
        _measure(m, name, fn)
        if checkpoint is not None:
            checkpoint({"partial": f"cut short after {name}", "measurements": m})
    if "ceiling_telemetry" in state:
        m["ceiling_engines_busy"] = state["ceiling_telemetry"]
    if "gpu_engine" in state:
        state["gpu_engine"].close()
    return {"clip": {"path": path, "encoder": clip.encoder, "codec": info.codec, "size": [info.width, info.height],
                     "frames": info.num_frames, "duration_s": info.duration_s, "gops": len(info.gops),
                     "measured_mbit_s": clip.measured_bitrate / 1e6, "encode_s": clip.encode_s},
            "dense_frames": len(dense), "sparse_frames": len(sparse), "out_size": [h, w],
            "frames_must_decode": must_decode, "measurements": m,
            "ratios": ratios(m, state.get("gpu_vs_cpu"), S)}


def bench_jpegs(args) -> dict:
    """``--jpegs`` JPEGs: flashcodec's nvJPEG batch vs its CPU path (and torchvision's bare nvJPEG call)."""
    jpegs = make_jpegs(args.jpegs, args.jpeg_width, args.jpeg_height)
    out: dict = {"count": len(jpegs), "size": [args.jpeg_width, args.jpeg_height]}
    state: dict = {}
    reason = nvjpeg_unavailable_reason(args.gpu)

    def cpu():
        with ImageBatchDecoder("cpu", cpu_threads=args.cpu_threads) as d:
            state["cpu"] = d.decode(jpegs)
            seconds, _ = best_time(lambda: d.decode(jpegs), args.repeat)
        return {"seconds": seconds, "threads": args.cpu_threads}

    def nvjpeg():
        if reason:
            raise Skip(reason)
        with ImageBatchDecoder(f"cuda:{args.gpu}", batch_size=len(jpegs)) as d:
            warm = d.decode(jpegs)
            diff = max(_diff(a.pixels, b.pixels) for a, b in zip(warm, state["cpu"])) if "cpu" in state else None
            if diff is not None and diff > MAX_SANE_DIFF:
                raise AssertionError(f"nvJPEG output differs from the CPU's by mean {diff:.2f}; refusing to time")
            seconds, _ = best_time(lambda: (d.decode(jpegs), _sync(args.gpu)), args.repeat)
        return {"seconds": seconds, "max_mean_abs_diff_vs_cpu": diff}

    def nvjpeg_bare():
        if reason:
            raise Skip(reason)
        from torchvision.io import ImageReadMode, decode_jpeg

        encoded = [torch.frombuffer(bytearray(j), dtype=torch.uint8) for j in jpegs]
        call = lambda: (decode_jpeg(encoded, mode=ImageReadMode.RGB, device=f"cuda:{args.gpu}"),  # noqa: E731
                        _sync(args.gpu))
        call()
        seconds, _ = best_time(call, args.repeat)
        return {"seconds": seconds, "note": "decode only, full size, no resize"}

    for name, fn in (("cpu", cpu), ("nvjpeg", nvjpeg), ("nvjpeg_bare", nvjpeg_bare)):
        _measure(out, name, fn)
    if "seconds" in out["cpu"] and "seconds" in out["nvjpeg"]:
        out["nvjpeg_speedup_vs_cpu"] = out["cpu"]["seconds"] / out["nvjpeg"]["seconds"]
    return out


def versions(gpu: int) -> dict:
    info = machine_info()
    for name in ("torchcodec", "torchvision", "pynvml"):
        try:
            module = __import__(name)
            info[name] = getattr(module, "__version__", "present")
        except Exception as e:  # absent or broken: say which
            info[name] = f"unavailable ({type(e).__name__})"
    info["cuda"] = torch.version.cuda
    info["gpu"] = torch.cuda.get_device_name(gpu) if torch.cuda.is_available() else None
    info["node"] = platform.node()
    return info


def save(report: dict, out: Path) -> None:
    (out / "gpu-decode.json").write_text(json.dumps(report, indent=2, default=str))


def main(argv=None) -> int:
    args = parse_args(argv)
    fast_open.install()  # before anything imports torchcodec: flashcodec's sessions open without the H.264 decode
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"started": time.time(), "command": "python bench/decode/bench_gpu.py " + " ".join(argv or sys.argv[1:]),
              "machine": versions(args.gpu), "notes": [], "codecs": {}}
    if args.duration < 120:
        report["notes"].append(f"clips are {args.duration:.0f} s long (the issue's target clip is >= 2 minutes)")
    for codec in [c.strip() for c in args.codecs.split(",") if c.strip()]:
        spec = ClipSpec(codec, args.width, args.height, args.duration, args.fps, int(args.bitrate * 1e6), args.gop)
        try:
            clip = make_clip(spec, args.cache)
        except Exception as e:  # e.g. no encoder for that codec here
            report["codecs"][codec] = {"error": f"clip not made: {e}"}
            continue

        def checkpoint(partial, codec=codec):  # a run cut short by a time limit keeps each measurement done
            report["codecs"][codec] = partial
            save(report, args.out)

        result = bench_codec(clip, args, checkpoint)
        result["targets"] = check_targets(result["ratios"])
        report["codecs"][codec] = result
        save(report, args.out)
    print(f"{args.jpegs} JPEGs", flush=True)
    report["jpeg"] = bench_jpegs(args)
    report["seconds"] = time.time() - report["started"]
    save(report, args.out)
    md = markdown(report)
    (args.out / "gpu-decode.md").write_text(md)
    print(md)
    print(f"wrote {args.out / 'gpu-decode.json'} and {args.out / 'gpu-decode.md'} ({report['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

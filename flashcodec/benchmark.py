"""Decode benchmark: flashcodec against other decoders on the same frames, same run.

Each peer is used the way its documentation recommends for "give me these frame indices at this
size", with all cores allowed. flashcodec is timed in each resize mode (``exact``, the default,
and ``fast``). Correctness is checked before anything is timed: in each mode flashcodec must
equal a sequential PyAV decode converted the same way (bit for bit); other peers use their own
scalers and colour conversion, so their mean difference to the ``exact`` frames (Qwen2.5-VL's
reference preprocessing) is reported, not required to be 0.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Callable

import numpy as np

import flashcodec
from flashcodec._probe import open_input
from flashcodec._provenance import source_commit
from flashcodec.decode import fast_open
from flashcodec.decode.pyav import DEFAULT_INTERPOLATION, PyAVSegmentDecoder, convert_frame
from flashcodec.plan.video import VideoPlan, floor_cost
from flashcodec.resize import DEFAULT_RESIZE_MODE, RESIZE_MODES
from flashcodec.source import Source

SPARSE_FRAMES = 32

PeerFn = Callable[[str, list[int], int, int, int], np.ndarray]  # -> uint8 [N, 3, H, W]


def peer_pyav(path, indices, height, width, threads):
    wanted, frames = set(indices), {}
    last = max(indices)
    with open_input(path) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        for i, frame in enumerate(container.decode(stream)):
            if i in wanted:
                frames[i] = frame.to_ndarray(width=width, height=height, format="rgb24",
                                             interpolation=DEFAULT_INTERPOLATION)
            if i >= last:
                break
    return np.stack([frames[i] for i in indices]).transpose(0, 3, 1, 2)


def sequential_reference(path: str, indices: list[int], height: int, width: int) -> dict[str, np.ndarray]:
    """One sequential PyAV decode, the targets converted in every resize mode: mode -> uint8 [N, 3, H, W]."""
    wanted, frames = set(indices), {mode: {} for mode in RESIZE_MODES}
    last = max(indices)
    with open_input(path) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        for i, frame in enumerate(container.decode(stream)):
            if i in wanted:
                for mode in RESIZE_MODES:
                    frames[mode][i] = convert_frame(frame, height, width, mode)
            if i >= last:
                break
    return {mode: np.stack([got[i] for i in indices]).transpose(0, 3, 1, 2) for mode, got in frames.items()}


def peer_torchcodec(path, indices, height, width, threads):
    fast_open.install()  # loaded for flashcodec's decoders later in this process; the peer's opens stay full
    from torchcodec.decoders import VideoDecoder
    from torchcodec.transforms import Resize

    decoder = VideoDecoder(path, seek_mode="exact", num_ffmpeg_threads=0, transforms=[Resize((height, width))])
    return decoder.get_frames_at(indices).data.numpy()


def peer_decord(path, indices, height, width, threads):
    import decord

    reader = decord.VideoReader(path, ctx=decord.cpu(0), width=width, height=height, num_threads=0)
    return reader.get_batch(indices).asnumpy().transpose(0, 3, 1, 2)


def peer_deepcodec(path, indices, height, width, threads):
    import sys

    from deepcodec import VideoReader

    # DeepCodec runs its workers as a `deepcodec` executable installed next to the interpreter.
    bindir = os.path.dirname(sys.executable)
    if bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    return VideoReader(path, height=height, width=width, num_threads=threads).get_batch(indices)


def peer_opencv(path, indices, height, width, threads):
    import cv2

    cap = cv2.VideoCapture(path)
    wanted, frames = set(indices), {}
    last = max(indices)
    for i in range(last + 1):
        if not cap.grab():  # grab() demuxes+decodes without converting; retrieve() only targets
            break
        if i in wanted:
            ok, bgr = cap.retrieve()
            rgb = cv2.cvtColor(cv2.resize(bgr, (width, height), interpolation=cv2.INTER_CUBIC), cv2.COLOR_BGR2RGB)
            frames[i] = rgb
    cap.release()
    return np.stack([frames[i] for i in indices]).transpose(0, 3, 1, 2)


PEERS: dict[str, PeerFn] = {
    "pyav": peer_pyav, "torchcodec": peer_torchcodec, "decord": peer_decord,
    "deepcodec": peer_deepcodec, "opencv": peer_opencv,
}
PEER_MODULES = {"pyav": "av", "torchcodec": "torchcodec.decoders", "decord": "decord",
                "deepcodec": "deepcodec", "opencv": "cv2"}


def installed_peers() -> list[str]:
    import importlib

    fast_open.install()  # before the imports below load torchcodec: flashcodec's torchcodec backend opens fast
    names = []
    for name, module in PEER_MODULES.items():
        try:
            importlib.import_module(module)
            names.append(name)
        except Exception:
            pass
    return names


def sampling_indices(info, sampling: str) -> list[int] | None:
    """``None`` means the Qwen rules (dense); sparse is 32 frames spread uniformly."""
    if sampling == "dense":
        return None
    if sampling == "sparse":
        n = min(SPARSE_FRAMES, info.num_frames)
        return np.linspace(0, info.num_frames - 1, n).round().astype(int).tolist()
    raise ValueError(f"unknown sampling {sampling!r}")


def measure_decode_floor(source: str, info, plan: VideoPlan) -> float:
    """Single-thread seconds to decode exactly the frames that must be decoded (no conversion)."""
    decoder = PyAVSegmentDecoder(Source.of(source), info, plan.height, plan.width, convert=False)
    started = time.perf_counter()
    for rank in plan.ranks:
        for segment in rank.segments:
            decoder.decode_segment(segment, lambda i, f: None)
    elapsed = time.perf_counter() - started
    decoder.close()
    return elapsed


def _mean_abs_diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.int16) - b.astype(np.int16)).mean())


def best_time(fn, repeat: int):
    """(best seconds, last result) over ``repeat`` timed calls; warm up before calling this."""
    best, result = float("inf"), None
    for _ in range(repeat):
        t = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t)
    return best, result


def machine_info() -> dict:
    import av
    import torch

    commit = source_commit()
    return {"machine": platform.machine(), "processor": platform.processor() or None, "cores": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__, "av": av.__version__,
            "flashcodec": flashcodec.__version__, "commit": commit}


def run_file_benchmark(path: str, *, sampling: str = "dense", peers: str = "all", repeat: int = 1,
                       num_threads: int | None = None, json_path: Path | None = None, verbose: bool = True) -> dict:
    """Benchmark one file and one sampling; returns (and optionally writes) the result dict."""
    say = print if verbose else (lambda *a, **k: None)
    threads = num_threads or os.cpu_count() or 1
    names = installed_peers() if peers == "all" else [p.strip() for p in peers.split(",") if p.strip()]
    unknown = [p for p in names if p not in PEERS]
    if unknown:
        raise ValueError(f"unknown peers {unknown}; choose from {', '.join(PEERS)}")

    sampler = _gpu_sampler()  # engine use during every decode below, when a GPU is present
    probe_s, info = best_time(lambda: flashcodec.probe(path), 1)
    indices = sampling_indices(info, sampling)
    plan = flashcodec.plan_video(info, frame_indices=indices)
    h, w = plan.height, plan.width
    mode_s = {mode: float("inf") for mode in RESIZE_MODES}
    with flashcodec.DecodeEngine("pyav", threads) as engine:
        def run(mode):
            return engine.decode_video(path, frame_indices=indices, resize=mode)

        for mode in RESIZE_MODES:
            warm = run(mode)  # warmup, and the frames to check
            if mode == RESIZE_MODES[0]:
                target = list(warm.frame_indices)
                references = sequential_reference(path, target, h, w)
                reference = references[DEFAULT_RESIZE_MODE]
            if not np.array_equal(warm.frames[: len(target)].numpy(), references[mode]):
                raise AssertionError(f"flashcodec frames (resize={mode}) differ from a sequential PyAV decode "
                                     "converted the same way; refusing to time")
            del warm
        for _ in range(repeat):  # modes alternate, so a busy spell on a shared machine hits both alike
            for mode in RESIZE_MODES:
                seconds, _ = best_time(lambda: run(mode), 1)
                mode_s[mode] = min(mode_s[mode], seconds)
    fc_s = mode_s[DEFAULT_RESIZE_MODE]
    if "torchcodec" in installed_peers():  # the other backend, to pick the default by measurement
        with flashcodec.DecodeEngine("torchcodec", threads) as engine:
            engine.decode_video(path, frame_indices=indices)  # warmup
            tc_s, tc_out = best_time(lambda: engine.decode_video(path, frame_indices=indices), repeat)
        tc_frames = tc_out.frames[: len(target)].numpy()
        results_backend = {"seconds": tc_s, "mean_abs_diff": _mean_abs_diff(tc_frames, reference)}
    else:
        results_backend = None
    floor_1t = measure_decode_floor(path, info, plan)
    floor_s = floor_1t / threads
    must_decode = floor_cost(info, target)
    say(f"{Path(path).name}: {info.codec} {info.width}x{info.height}, {info.num_frames} frames; "
        f"{sampling}: {len(target)} frames at {h}x{w}; {must_decode} frames must be decoded")
    say(f"probe {probe_s:.3f} s ({probe_s / fc_s * 100:.1f}% of the decode)")
    results = {"flashcodec": {"seconds": fc_s, "resize": DEFAULT_RESIZE_MODE, "exact_vs_pyav": True,
                              "mean_abs_diff": 0.0}}
    for mode in RESIZE_MODES:
        if mode != DEFAULT_RESIZE_MODE:
            results[f"flashcodec[{mode}]"] = {"seconds": mode_s[mode], "resize": mode, "exact_vs_pyav": True,
                                              "mean_abs_diff": _mean_abs_diff(references[mode], reference)}
    if results_backend is not None:
        results["flashcodec[torchcodec]"] = results_backend
    for name in names:
        try:
            if repeat > 1:  # a warmup run, as flashcodec had
                PEERS[name](path, target, h, w, threads)
            seconds, frames = best_time(lambda: PEERS[name](path, target, h, w, threads), repeat)
            diff = _mean_abs_diff(frames, reference)
            results[name] = {"seconds": seconds, "mean_abs_diff": diff, "shape": list(frames.shape)}
        except Exception as e:  # a peer's failure is reported, not fatal
            results[name] = {"error": f"{type(e).__name__}: {e}"}
    timed_peers = {k: v["seconds"] for k, v in results.items() if not k.startswith("flashcodec") and "seconds" in v}
    fastest = min(timed_peers, key=timed_peers.get) if timed_peers else None
    summary = {
        "file": str(path), "codec": info.codec, "size": [info.width, info.height], "video_frames": info.num_frames,
        "sampling": sampling, "num_frames": len(target), "out_size": [h, w], "frames_must_decode": must_decode,
        "threads": threads, "probe_s": probe_s, "decode_floor_1thread_s": floor_1t, "decode_floor_s": floor_s,
        "flashcodec_s": fc_s, "flashcodec_vs_floor": fc_s / floor_s, "fastest_peer": fastest,
        "speedup_vs_fastest_peer": (timed_peers[fastest] / fc_s) if fastest else None,
        "resize_s": mode_s,  # flashcodec seconds per resize mode; flashcodec_s is the default's
        "speedups": {mode: {peer: peer_s / s for peer, peer_s in timed_peers.items()} for mode, s in mode_s.items()},
        "results": results, "machine": machine_info(),
    }
    say(f"{'decoder':<22} {'seconds':>8} {'vs flashcodec':>14} {'mean |diff|':>12}")
    for name, r in results.items():
        if "seconds" in r:
            say(f"{name:<22} {r['seconds']:>8.3f} {r['seconds'] / fc_s:>13.2f}x {r['mean_abs_diff']:>12.2f}")
        else:
            say(f"{name:<22} {'failed':>8}  {r['error'][:60]}")
    say(f"decode floor (1-thread decode of the needed frames / {threads} cores): {floor_s:.3f} s; "
        f"flashcodec = {fc_s / floor_s:.2f}x floor" + (f"; {summary['speedup_vs_fastest_peer']:.2f}x faster than "
                                                       f"the fastest peer ({fastest})" if fastest else ""))
    if fastest:
        say("resize modes vs the fastest peer: " + ", ".join(
            f"{mode} {s:.3f} s = {summary['speedups'][mode][fastest]:.2f}x" for mode, s in mode_s.items()))
    if sampler is not None:
        gpus = sampler.stop()
        summary["gpu_telemetry"] = {"unavailable": sampler.unavailable, "gpus": [g.as_dict() for g in gpus]}
        say("GPU engines during the benchmark (NVML): " + (sampler.unavailable or ""))
        for line in (line for g in gpus for line in g.lines()):
            say("  " + line)
    if json_path:
        try:
            Path(json_path).write_text(json.dumps(summary, indent=2))
        except OSError as e:  # after the whole run (the table is printed above): say where it could not go
            raise OSError(e.errno, f"cannot write the results to {json_path}: {e.strerror or e}") from None
    return summary


def _gpu_sampler():
    """A started :class:`~flashcodec.telemetry.TelemetrySampler` when a GPU is visible, else None."""
    from flashcodec.devices import num_visible_gpus
    from flashcodec.telemetry import TelemetrySampler

    return TelemetrySampler().start() if num_visible_gpus() else None

#!/usr/bin/env python3
"""TTFT of one long-video request, stage by stage, and decode TBT of 8 other requests meanwhile.

Starts a server (demo model unless --model), starts ``--num-decoding`` text requests that keep
decoding (ignore_eos), measures their inter-token gaps for a quiet window, then sends one
video request (a generated 3-minute 480p H.264 clip, 2 fps) and measures its TTFT. The stage
breakdown (probe, video_decode, queue, encode, prefill) comes from the server's /metrics. The other
requests' TBT is reported for the quiet window and for the video request's encode+prefill window.

``--ingest both`` (default) runs it once per ingest mode (``serve --ingest streaming`` and
``whole``, a fresh server each) and compares them: when the first encode step started after
decoding started, as a fraction of the decode time (the server's
``unifiedserve_request_first_encode_lag_seconds``: vision's decode start to the start of core's
first encode step for the request, both stamped in the server), and the TTFT gained by streaming
as a fraction of the decode time. Each run also prints the request's timeline: seconds from its
arrival to each milestone on the way to its first token (the server's
``unifiedserve_request_milestone_seconds``: probed, decode start, added and admitted by core, its first
rows of patches handed over by FlashCodec, written by vision and announced to core, all media ready,
first encode step, first prefill chunk, first token), which says where a late first encode waits.

    python bench/serve/ttft_breakdown.py [--ingest both|streaming|whole] [--num-decoding 0] [--result-json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import numpy as np
import openai

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "datasets"))
sys.path.insert(0, str(HERE))

import synthetic_video  # noqa: E402
from unifiedserve.server.metrics import MILESTONES  # noqa: E402
from server_process import (ServerProcess, engine_counters, histogram_totals, iteration_summary,  # noqa: E402
                            memory_accounting, nvml_used_bytes, on_gpu, run_main, server_device)

VIDEO = dict(codec="h264", width=854, height=480, duration_s=180.0, fps=30.0, gop=250, bframes=3, suffix=".mp4",
             preset="veryfast", seed=0)
STAGES = ("probe", "video_decode", "queue", "encode", "prefill")


def percentile(values, q):
    return float(np.percentile(values, q)) if values else float("nan")


def stage_sums(metrics: dict[str, float]) -> dict[str, float]:
    out = {stage: total for stage, (total, _) in
           histogram_totals(metrics, "unifiedserve_request_stage_seconds", "stage").items()}
    lag = histogram_totals(metrics, "unifiedserve_request_first_encode_lag_seconds").get("")
    if lag:
        out["first_encode_lag"] = lag[0]
    return out


def stage_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Seconds each stage took between two :func:`stage_sums` readings."""
    return {stage: after.get(stage, 0) - before.get(stage, 0) for stage in STAGES}


def milestone_sums(metrics: dict[str, float]) -> dict[str, tuple[float, float]]:
    """``(sum, count)`` of ``unifiedserve_request_milestone_seconds`` per milestone."""
    return histogram_totals(metrics, "unifiedserve_request_milestone_seconds", "milestone")


def timeline(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict[str, float]:
    """The one request's milestones between two scrapes (seconds from its arrival), in :data:`MILESTONES`
    order; a milestone it did not reach (or that more than one request reached meanwhile) is left out."""
    out = {}
    for name in MILESTONES:
        (s1, c1), (s0, c0) = after.get(name, (0.0, 0.0)), before.get(name, (0.0, 0.0))
        if round(c1 - c0) == 1:
            out[name] = s1 - s0
    return out


def print_timelines(runs: dict[str, dict]) -> None:
    """Milestones of each run side by side, with the step from the previous one."""
    modes = list(runs)
    print(f"\n{'timeline (s from arrival)':28}" + "".join(f"{m:>12}{'step':>8}" for m in modes))
    last = {m: 0.0 for m in modes}
    for name in MILESTONES:
        row = f"{name:28}"
        for m in modes:
            at = runs[m]["timeline_s"].get(name)
            row += f"{'n/a':>12}{'':>8}" if at is None else f"{at:>12.3f}{at - last[m]:>+8.3f}"
            last[m] = last[m] if at is None else at
        print(row)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-decoding", type=int, default=8,
                   help="requests decoding meanwhile (default 8; 0: an idle server)")
    p.add_argument("--ingest", choices=("both", "streaming", "whole"), default="both",
                   help="the server's --ingest mode, or both one after the other (default both)")
    p.add_argument("--max-pixels", type=int, default=112896,
                   help="video_url max_pixels per frame (default 112896 = 252x448, so the video's ~26k visual "
                        "tokens fit the demo model's 32k context)")
    p.add_argument("--fps", type=float, default=2.0)
    p.add_argument("--quiet-window", type=float, default=4.0, help="seconds of TBT measured before the video request")
    p.add_argument("--server-args", default="", help="extra flags for unifiedserve serve")
    p.add_argument("--warm-video", action="store_true",
                   help="first ask about another clip of the same format (seed 1), so the measured video finds "
                        "the decoders of its format made (NVDEC's are per codec and size) and every kernel on its "
                        "path compiled; that request's TTFT and decode are reported as warm_video")
    p.add_argument("--result-json", type=Path, default=None)
    p.add_argument("--prepare-only", action="store_true",
                   help="make the clips (and --warm-video's) in the media cache, then exit: no server")
    args = p.parse_args(argv)
    if args.num_decoding < 0:
        p.error(f"--num-decoding must be >= 0, got {args.num_decoding}")
    if "--ingest" in args.server_args.split():
        p.error("give the ingest mode with --ingest, not in --server-args")

    clip = synthetic_video.cached_video(VIDEO)
    warm = synthetic_video.cached_video({**VIDEO, "seed": 1}) if args.warm_video else None
    if args.prepare_only:
        print("\n".join(str(c) for c in (clip, warm) if c is not None))
        return 0
    modes = ("streaming", "whole") if args.ingest == "both" else (args.ingest,)
    results = {mode: run_one(clip, mode, args, warm) for mode in modes}
    result = results[modes[0]] if len(modes) == 1 else {"runs": results}
    if len(modes) == 2:
        s, w = results["streaming"], results["whole"]
        decode_s = w["stages_s"]["video_decode"]
        result["ttft_gain_s"] = w["ttft_s"] - s["ttft_s"]
        result["ttft_gain_over_decode"] = result["ttft_gain_s"] / decode_s if decode_s else None
        print(f"\n{'':28}{'streaming':>12}{'whole':>12}")
        for key, label in (("ttft_s", "TTFT s"), ("first_encode_after_decode_start_s", "first encode - decode start s"),
                           ("first_encode_over_decode", "  / decode time")):
            print(f"{label:28}{_fmt(s[key]):>12}{_fmt(w[key]):>12}")
        for stage in STAGES:
            print(f"{'stage ' + stage + ' s':28}{_fmt(s['stages_s'][stage]):>12}{_fmt(w['stages_s'][stage]):>12}")
        print(f"TTFT whole - streaming = {result['ttft_gain_s']:.2f} s = "
              f"{_fmt(result['ttft_gain_over_decode'])} x the decode time ({decode_s:.2f} s, whole run)")
    print_timelines(results)
    print(json.dumps(result, indent=2))
    if args.result_json:
        args.result_json.parent.mkdir(parents=True, exist_ok=True)
        args.result_json.write_text(json.dumps(result, indent=2))
    return 0


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def gpu_index(server_args: str) -> int:
    """The GPU a ``--device cuda[:N]`` server runs on (NVML's numbering, as long as CUDA_VISIBLE_DEVICES is unset)."""
    device = server_device(server_args) or ""
    return int(device[5:]) if device.startswith("cuda:") and device[5:].isdigit() else 0


def describe_memory(m: dict) -> str:
    """One paragraph of :func:`server_process.memory_accounting`."""
    gib = 2 ** 30
    pools = ", ".join(f"{k} {v / gib:.2f}" for k, v in sorted(m["pools_bytes"].items()))
    text = (f"memory: pools {pools} GiB; the weights pool mapped by {', '.join(m['shared_by']) or 'no process'}; "
            f"own weights " + ", ".join(f"{p} {k.get('weights_own', 0) / gib:.2f}" for p, k in
                                         sorted(m["processes_bytes"].items())) + " GiB; "
            f"sent between processes {m['ipc_sent_bytes'] / 2 ** 20:.2f} MiB")
    if "ipc_over_media" in m:
        text += f" ({m['ipc_over_media']:.5f} x the videos' patch bytes)"
    if "device_used_bytes" in m:
        text += (f"; GPU used {m['device_used_bytes'] / gib:.2f} GiB, {m['unexplained_bytes'] / gib:.2f} beyond the "
                 f"pools and the processes' allocator peaks: weights held once: {m['weights_once']}")
    return text


def ask_video(client, clip: Path, args, model: str | None = None) -> tuple[float, float, object]:
    """One streamed question about ``clip``: (TTFT, end to end, usage), in seconds from sending it (the model's
    name, when not given, is asked for before: its round trip is not the request's)."""
    model = model or client.models.list().data[0].id
    sent = time.perf_counter()
    stream = client.chat.completions.create(
        model=model, stream=True, max_tokens=16, temperature=0,
        messages=[{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": f"file://{clip}", "fps": args.fps,
                                                "max_pixels": args.max_pixels}},
            {"type": "text", "text": "What happens in this video?"}]}],
        stream_options={"include_usage": True})
    first = None
    usage = None
    for chunk in stream:
        if first is None and chunk.choices:  # the server sends its first chunk with the first token
            first = time.perf_counter()
        if chunk.usage:
            usage = chunk.usage
    return first - sent, time.perf_counter() - sent, usage


def run_one(clip: Path, mode: str, args, warm: Path | None = None) -> dict:
    """One server in ``mode`` (--ingest), one video request (after one on ``warm``, if given); its stage
    breakdown."""
    flags = ["--allowed-local-media-path", str(clip.parent), "--kv-cache-gb", "1", "--patch-buffer-gb", "1",
             "--ingest", mode, *args.server_args.split()]
    print(f"video: {clip} (3 min 854x480 H.264)\nstarting the server: unifiedserve serve {' '.join(flags)}", flush=True)
    with ServerProcess(flags, ROOT / "bench" / "results" / f"ttft_breakdown_server_{mode}.log") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=3600)
        stop = threading.Event()
        token_times: list[list[float]] = [[] for _ in range(args.num_decoding)]

        def decode_forever(i):
            stream = client.chat.completions.create(
                model=server.health.get("model", None) or client.models.list().data[0].id,
                messages=[{"role": "user", "content": f"Tell me a long story, number {i}."}], max_tokens=20000,
                stream=True, temperature=0, extra_body={"ignore_eos": True})
            for _ in stream:
                token_times[i].append(time.perf_counter())
                if stop.is_set():
                    stream.close()
                    return

        threads = [threading.Thread(target=decode_forever, args=(i,), daemon=True) for i in range(args.num_decoding)]
        for t in threads:
            t.start()
        while token_times and min(len(x) for x in token_times) < 5:
            time.sleep(0.05)
        warm_video = None
        if warm is not None:
            metrics = server.metrics()
            before, milestones_before = stage_sums(metrics), milestone_sums(metrics)
            ttft, _, _ = ask_video(client, warm, args)
            metrics = server.metrics()
            after = stage_sums(metrics)
            warm_video = {"ttft_s": ttft, "stages_s": stage_delta(before, after),
                          "timeline_s": timeline(milestones_before, milestone_sums(metrics))}
            print(f"warm-up video ({warm.name}): TTFT {ttft:.3f} s, "
                  f"decode {warm_video['stages_s']['video_decode']:.3f} s", flush=True)
        quiet_start = time.perf_counter()
        time.sleep(args.quiet_window)
        metrics = server.metrics()
        before, iterations_before = stage_sums(metrics), engine_counters(metrics)
        milestones_before = milestone_sums(metrics)
        sent = time.perf_counter()
        ttft, e2e, usage = ask_video(client, clip, args)
        first, done = sent + ttft, sent + e2e
        stop.set()
        metrics = server.metrics()
        after, iterations = stage_sums(metrics), iteration_summary(iterations_before, engine_counters(metrics))
        milestones = timeline(milestones_before, milestone_sums(metrics))
        gpu = on_gpu(args.server_args)
        # the video's patches: about 4 rows of 1176 values per visual token (Qwen2.5-VL's 2x2 merge), bf16 on a GPU
        patch_bytes = (usage.prompt_tokens if usage else 0) * 4 * 1176 * (2 if gpu else 4)
        memory = memory_accounting(metrics, nvml_used_bytes(gpu_index(args.server_args)) if gpu else None,
                                   media_bytes=patch_bytes * (2 if warm is not None else 1))
        print(describe_memory(memory), flush=True)
        for t in threads:
            t.join(30)

    def gaps(lo, hi):
        return [(b - a) * 1000 for times in token_times for a, b in zip(times, times[1:]) if lo <= a and b <= hi]

    quiet, busy = gaps(quiet_start, sent), gaps(sent, first)
    stages = stage_delta(before, after)
    lag = after.get("first_encode_lag", 0) - before.get("first_encode_lag", 0)
    encode_after = lag if lag > 0 else None
    result = {
        "ingest": mode,
        "video": "3 min, 854x480, H.264, 30 fps, GOP 250", "fps": args.fps, "max_pixels": args.max_pixels,
        "prompt_tokens": usage.prompt_tokens if usage else None,
        "ttft_s": first - sent, "e2e_s": done - sent,
        "stages_s": stages,
        # seconds from the request's arrival to each milestone, stamped in the server (MILESTONES)
        "timeline_s": milestones,
        "first_encode_after_decode_start_s": encode_after,
        "first_encode_over_decode": encode_after / stages["video_decode"]
        if encode_after is not None and stages["video_decode"]
        else None,
        "num_decoding": args.num_decoding,
        "tbt_quiet_ms": {"p50": percentile(quiet, 50), "p99": percentile(quiet, 99), "n": len(quiet)},
        "tbt_during_video_ttft_ms": {"p50": percentile(busy, 50), "p99": percentile(busy, 99), "n": len(busy)},
        # each process's iterations from the request to its last token: how many, how long, how much work each
        "iterations": iterations,
        "warm_video": warm_video,  # --warm-video: the request on another clip of the format before this one
        "memory": memory,  # weights held once, and what crossed between processes (server_process.memory_accounting)
    }
    print(json.dumps(result, indent=2), flush=True)
    return result


if __name__ == "__main__":
    sys.exit(run_main(main, "ttft_breakdown.py"))

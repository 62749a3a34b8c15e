"""The GPU decode benchmark's report: the issue's ratios and targets, and the Markdown summary."""

from __future__ import annotations

import time

#: The issue's targets: (key in ratios, comparison, threshold, what it means).
TARGETS = (("speedup_vs_one_session", ">=", 6.0, "flashcodec GPU vs one NVDEC session"),
           ("fraction_of_ceiling", ">=", 0.85, "flashcodec GPU vs the independent-sessions ceiling"),
           ("speedup_vs_naive_split", ">", 1.0, "flashcodec GPU vs the static GOP split"),
           ("collaborative_fraction", ">=", 0.85, "GPU+CPU throughput vs GPU-alone + CPU-alone"),
           ("gpu_vs_cpu_mean_abs_diff", "<=", 1.0, "mean abs diff of GPU and CPU output, same frames"),
           ("nvdec_engines_busy", ">=", 6, "NVDEC engines >= 50% busy during flashcodec's GPU decode"))

def ratios(m: dict, gpu_vs_cpu: float | None, sessions: int) -> dict:
    """The issue's ratios from the measurements (None where an input is missing)."""
    def s(name):
        return m.get(name, {}).get("seconds")

    def div(a, b):
        return a / b if a is not None and b else None

    fc = s("gpu_alone")
    gpu_fps, cpu_fps, both_fps = (m.get(k, {}).get("fps") for k in ("gpu_alone", "cpu_alone", "gpu_and_cpu"))
    busy = m.get("engines_busy", {})
    return {
        "speedup_vs_one_session": div(s("one_session"), fc),
        "fraction_of_ceiling": div(s("ceiling"), sessions * fc) if fc else None,
        "speedup_vs_naive_split": div(s("naive_split"), fc),
        "speedup_vs_naive_split_opened": div(s("naive_split_opened"), fc),  # not a target: opens in both timers
        "ceiling_vs_one_session": div(sessions * s("one_session"), s("ceiling")) if s("one_session") else None,
        "gpu_vs_cpu_alone": div(gpu_fps, cpu_fps),
        "collaborative_fraction": div(both_fps, (gpu_fps + cpu_fps) if gpu_fps and cpu_fps else None),
        "gpu_and_cpu_vs_gpu_alone": div(fc, s("gpu_and_cpu")),
        # not a target: a CPU decoder thread on every core CPU-alone used, beside the GPU rank
        "collaborative_fraction_all_threads": div(m.get("gpu_and_cpu_all_threads", {}).get("fps"),
                                                  (gpu_fps + cpu_fps) if gpu_fps and cpu_fps else None),
        "sparse_speedup_vs_one_session": div(s("sparse_one_session"), s("sparse_gpu")),
        "gpu_vs_cpu_mean_abs_diff": gpu_vs_cpu,
        "nvdec_engines_busy": busy.get("num_nvdec_busy"),
        "nvdec_engines": len(busy["nvdec_mean_pct"]) if busy.get("nvdec_mean_pct") else None,
    }


def check_targets(ratios_: dict) -> dict:
    ops = {">=": lambda a, b: a >= b, ">": lambda a, b: a > b, "<=": lambda a, b: a <= b}
    return {key: (None if ratios_.get(key) is None else bool(ops[op](ratios_[key], bound)))
            for key, op, bound, _ in TARGETS}


def _note(v: dict) -> str:
    """What a measurement says beyond its time: engines busy, the host's cores, the planner's split."""
    if "num_nvdec_busy" in v:
        return f"{v['num_nvdec_busy']} NVDEC busy >= 50%, means {v['nvdec_mean_pct']}"
    parts = []
    if v.get("host_cores_busy") is not None:
        parts.append(f"host cores busy {v['host_cores_busy']:.1f}")
    if v.get("seconds_full_opens") is not None:  # flashcodec/decode/fast_open.py
        parts.append(f"{v['fast_opens_per_run']:.0f} opens without FFmpeg's stream-info decode per run; all full: "
                     f"{v['seconds_full_opens']:.3f} s" + (f" ({v['full_opens_because']})"
                                                           if v.get("full_opens_because")
                                                           else ""))
    if v.get("cpu_threads") is not None:
        parts.append(f"{v['cpu_threads']} CPU threads")
    if v.get("segments_per_rank"):
        parts.append("segments " + ", ".join(f"{k} {n}" for k, n in v["segments_per_rank"].items()))
    for rank, t in (v.get("trace") or {}).get("ranks", {}).items():
        if t["segments"]:
            parts.append(f"traced {rank}: busy {t['busy']:.2f}, opens {t['open_s_sum']:.3f} s "
                         f"(max {t['open_s_max']:.3f}), "
                         f"first decode {t['first_decode_s']:.3f} s, end {t['end_s']:.3f} s")
    return "; ".join(parts)


def markdown(report: dict) -> str:
    lines = [f"# GPU decode benchmark ({time.strftime('%Y-%m-%d', time.gmtime(report['started']))})", "",
             f"Machine: {report['machine'].get('gpu') or 'no GPU'}, {report['machine']['cores']} cores; "
             f"torch {report['machine']['torch']}, torchcodec {report['machine']['torchcodec']}; "
             f"commit {report['machine']['commit']}. Command: `{report['command']}`", ""]
    lines += [f"- {n}" for n in report["notes"]]
    for codec, r in report["codecs"].items():
        if "error" in r:
            lines += ["", f"## {codec}: {r['error']}"]
            continue
        c = r["clip"]
        lines += ["", f"## {codec}: {c['size'][0]}x{c['size'][1]}, {c['duration_s']:.0f} s, {c['measured_mbit_s']:.1f} "
                  f"Mbit/s ({c['encoder']}); dense {r['dense_frames']} frames at "
                  f"{r['out_size'][0]}x{r['out_size'][1]}, "
                  f"{r['frames_must_decode']} decoded", "", "| measurement | seconds | decoded frames/s | note |",
                  "|---|---|---|---|"]
        for name, v in r["measurements"].items():
            secs = f"{v['seconds']:.3f}" if "seconds" in v else "-"
            fps = f"{v['fps']:.0f}" if "fps" in v else "-"
            note = v.get("skipped") or v.get("error") or _note(v)
            lines.append(f"| {name} | {secs} | {fps} | {note} |")
        lines += ["", "| target | value | goal | met |", "|---|---|---|---|"]
        for key, op, bound, what in TARGETS:
            value, met = r["ratios"].get(key), r["targets"].get(key)
            shown = "-" if value is None else f"{value:.2f}"
            lines.append(f"| {what} | {shown} | {op} {bound} | {'-' if met is None else 'yes' if met else 'NO'} |")
        extra = {k: v for k, v in r["ratios"].items() if k not in {t[0] for t in TARGETS} and v is not None}
        lines += ["", "Other ratios: " + ", ".join(f"{k} {v:.2f}" for k, v in extra.items())] if extra else []
    j = report["jpeg"]
    lines += ["", f"## {j['count']} JPEGs of {j['size'][0]}x{j['size'][1]}", ""]
    for name in ("cpu", "nvjpeg", "nvjpeg_bare"):
        v = j[name]
        lines.append(f"- {name}: " + (f"{v['seconds'] * 1e3:.1f} ms" if "seconds" in v
                                      else v.get("skipped") or v.get("error")))
    if "nvjpeg_speedup_vs_cpu" in j:
        lines.append(f"- nvJPEG vs CPU: {j['nvjpeg_speedup_vs_cpu']:.2f}x")
    return "\n".join(lines) + "\n"

"""What the device runs between two decode-graph replays: a step's cost outside its graph, op by op.

A decode step under async scheduling costs the device its graph replay plus every operation queued around it
(the attention plan's copies, the step's inputs, tokens fed from the step before, the sampler, the copy of the
ids to the host) and whatever time the device waits between them. Issue 13's batch-1 step was 5.874 ms against
a 5.742-ms replay on the H100 (2026-11-27): this module says where the other 0.13 ms goes. It reads torch's
profiler trace (CUPTI): a kernel launched by a graph carries the correlation id of its ``cudaGraphLaunch``.

    summary = profile_steps(lambda: engine.step(), device, steps=12)
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable

import torch

from engine_metrics import check_cuda, cuda_profile, union_length  # bench/engine is on the path here

#: device activity in torch's chrome trace (kernels, copies, memsets)
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
RUNTIME_CATEGORIES = ("cuda_runtime", "cuda_driver")


def summarize_steps(trace: dict, top: int = 16) -> dict:
    """Per step: the replay's device time and what ran between it and the next replay, from a chrome trace.

    Args:
        trace: torch's exported chrome trace (``{"traceEvents": [...]}``).
        top: operations between replays to list, costliest first.

    Returns:
        ``{"replays", "step_us", "replay_us", "replay_busy_us", "between_us", "between_busy_us", "between_idle_us",
        "ops_between_per_step", "between": [{"name", "cat", "per_step", "us"}...]}``, each a mean over the gaps
        between consecutive replays (``us``: an op's mean device time per step); ``{"error": ...}`` when the trace
        holds fewer than two graph replays.
    """
    events = [e for e in trace.get("traceEvents", []) if isinstance(e, dict) and e.get("ph") == "X"]
    launches = {e["args"]["correlation"] for e in events
                if e.get("cat") in RUNTIME_CATEGORIES and "GraphLaunch" in e.get("name", "")
                and "correlation" in e.get("args", {})}
    device = sorted(((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), e) for e in events
                     if e.get("cat") in DEVICE_CATEGORIES), key=lambda item: item[0])
    replays: dict[int, list] = {}
    for start, end, e in device:
        corr = e.get("args", {}).get("correlation")
        if corr in launches:
            replays.setdefault(corr, []).append((start, end))
    spans = sorted((min(s for s, _ in iv), max(e for _, e in iv), union_length(iv)) for iv in replays.values())
    if len(spans) < 2:
        return {"error": f"the trace holds {len(spans)} decode-graph replay(s), not the two a step needs"}
    gaps = len(spans) - 1
    ops: dict[tuple[str, str], list] = {}
    between_us = between_busy = 0.0
    count = 0
    for (_, end, _), (next_start, _, _) in zip(spans, spans[1:]):
        inside = [(max(s, end), min(e_, next_start), ev) for s, e_, ev in device
                  if s < next_start and e_ > end and ev.get("args", {}).get("correlation") not in launches]
        between_us += next_start - end
        between_busy += union_length([(s, e_) for s, e_, _ in inside])
        count += len(inside)
        for s, e_, ev in inside:
            acc = ops.setdefault((ev.get("name", "?")[:100], ev["cat"]), [0, 0.0])
            acc[0] += 1
            acc[1] += e_ - s
    ranked = sorted(ops.items(), key=lambda item: -item[1][1])[:top]
    return {
        "replays": len(spans),
        "step_us": (spans[-1][0] - spans[0][0]) / gaps,
        "replay_us": sum(e - s for s, e, _ in spans) / len(spans),
        "replay_busy_us": sum(b for _, _, b in spans) / len(spans),
        "between_us": between_us / gaps,
        "between_busy_us": between_busy / gaps,
        "between_idle_us": (between_us - between_busy) / gaps,
        "ops_between_per_step": count / gaps,
        "between": [{"name": name, "cat": cat, "per_step": n / gaps, "us": us / gaps}
                    for (name, cat), (n, us) in ranked],
    }


def profile_steps(step: Callable[[], object], device: torch.device, steps: int = 12) -> dict:
    """Run ``step()`` ``steps`` times under torch's profiler (CUDA activity) and :func:`summarize_steps` the trace.

    Returns ``{"error": ...}`` instead of raising when the profiler fails (a machine may refuse CUPTI) or the
    steps replayed fewer than two graphs: a benchmark run keeps its other results.

    Raises:
        ValueError: not a CUDA device, or ``steps`` < 2.
    """
    check_cuda(device, "profile_steps")
    if steps < 2:
        raise ValueError(f"steps must be >= 2, got {steps}")

    def read(prof) -> dict:
        fd, path = tempfile.mkstemp(suffix=".json")
        os.close(fd)
        try:
            prof.export_chrome_trace(path)
            with open(path) as f:
                return json.load(f)
        finally:
            os.unlink(path)

    # the host must stay ahead of the device for the gaps to be the device's own: CUDA activity alone
    trace, error = cuda_profile(lambda: [step() for _ in range(steps)], device, read)
    return {"error": error} if error else summarize_steps(trace)


def format_steps(summary: dict, top: int = 6) -> str:
    """One line: step, replay and between-replay time, and the costliest operations between replays."""
    if "error" in summary:
        return summary["error"]
    ops = "; ".join(f"{op['name'][:48]} {op['us']:.1f} us x{op['per_step']:g}" for op in summary["between"][:top])
    over = f" ({summary['steps_profiled']} steps profiled)" if "steps_profiled" in summary else ""
    return (f"step{over} {summary['step_us']:.1f} us = replay {summary['replay_us']:.1f} + between "
            f"{summary['between_us']:.1f} (ops busy {summary['between_busy_us']:.1f}, idle "
            f"{summary['between_idle_us']:.1f}, {summary['ops_between_per_step']:g} ops): {ops}")

"""What the start-up tunes share (:mod:`unifiedserve.ops.skinny`'s GEMMs, :mod:`unifiedserve.attention.split_kv`'s
decode graphs): the agreement rule a fast path must meet, the GPU time of a CUDA graph of one step's worth of calls,
and which errors leave the GPU unusable.

Why graphs. A tune chooses kernels for decode steps that replay as CUDA graphs, where launching costs the host
nothing. Timed as eager calls instead, a kernel of ~10 us (a 7B's O or Q/K/V projection at batch 1 reads 26-33 MB)
is hidden behind its own launch: Python, Triton's launcher and the argument checks take longer than the kernel, so
the GPU idles between calls and the timing measures the host. One graph of every layer's calls, replayed between two
events, measures what a step's replay will spend.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["capture", "device_fault", "disagreement", "first_line", "graph_time_us", "raise_if_fault", "side_stream"]

# CUDA errors after which the context cannot be used again (the driver's "sticky" errors): every later call in the
# process fails, so a tune cannot skip the culprit and go on
_STICKY = ("illegal memory access", "illegal address", "illegal instruction", "misaligned address",
           "unspecified launch failure", "device-side assert", "hardware stack error", "uncorrectable ecc",
           "invalid program counter", "an exception occurred on the device")


def device_fault(error: BaseException) -> bool:
    """Whether ``error`` is a CUDA fault that leaves this process's GPU context unusable (a kernel's illegal address,
    a device-side assert, ...), as opposed to one call's failure (a config that cannot compile or launch)."""
    text = str(error).lower()
    return any(s in text for s in _STICKY)


def first_line(error: BaseException) -> str:
    """The first line of ``error``'s message (what a tune logs or notes), or its type's name when it has none."""
    text = str(error)
    return text.splitlines()[0] if text.strip() else type(error).__name__


def raise_if_fault(error: BaseException, what: str, way_out: str) -> None:
    """Re-raise ``error`` as a ``RuntimeError`` naming ``what`` ran and ``way_out`` (the switch that avoids it) when it
    is a GPU fault (:func:`device_fault`): nothing can run after one, so a tune cannot skip it and go on."""
    if device_fault(error):
        raise RuntimeError(f"{what} faulted the GPU ({first_line(error)}); the process cannot go on. Start again "
                           f"with {way_out}") from error


def disagreement(got: torch.Tensor, want: torch.Tensor, reference: str) -> str:
    """Why a fast path's ``got`` is not ``want`` (``reference`` names it) up to 16-bit rounding (each value within 2 %
    of the largest): ``"differs from <reference> by ..."``, or '' when it agrees. A NaN disagrees. Start-up tunes
    keep no path that disagrees."""
    scale = want.float().abs().max().item()
    err = (got.float() - want.float()).abs().max().item()
    if err == err and err <= 0.02 * scale + 1e-3:  # (err == err: not NaN)
        return ""
    return f"differs from {reference} by {err:.3g} (largest value {scale:.3g})"


_side_streams: dict[torch.device, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """One stream per device for the tunes' warm-up runs and captures: a new stream per timing would leave cuBLAS a
    workspace for each of the pool's streams it lands on (32 MiB apiece on Hopper, kept for the process's life)."""
    device = torch.device(device)
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device)
    return _side_streams[device]


def capture(graph: torch.cuda.CUDAGraph, run: Callable[[], Any], device: torch.device, *, pool: Any = None,
            warmups: int = 1) -> Any:
    """``run`` ``warmups`` times on :func:`side_stream` (as torch asks before a capture: lazy initialisations,
    cuBLAS workspaces), then captured into ``graph`` on that stream (in ``pool``, a graph memory pool, or a private
    one); returns what the captured call returned (the tensors each replay rewrites). A capture that fails still
    leaves the caller on its own stream (``torch.cuda.graph`` alone would leave it on the capture stream when ending
    the capture raises)."""
    current = torch.cuda.current_stream(device)
    side = side_stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        for _ in range(warmups):
            run()
        with torch.cuda.graph(graph, pool=pool, stream=side):
            out = run()
    current.wait_stream(side)
    return out


def graph_time_us(run: Callable[[], None], repeats: int, device: torch.device) -> float:
    """GPU time of ``run``'s calls as one CUDA graph (:func:`capture`): the fastest of ``repeats`` replays between two
    events, in microseconds. ``run`` must be capturable (no host sync, no allocation it needs to outlive the graph);
    the graph and its memory are released before returning."""
    graph = torch.cuda.CUDAGraph()
    capture(graph, run, device)
    graph.replay()
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1000.0)
    del graph
    return best

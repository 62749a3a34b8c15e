"""Decode attention inside CUDA graphs: split the keys or not, chosen per batch size by timing at start-up.

Why. In CUDA-graph mode flashinfer plans every decode step as split-KV, whatever the lengths: its scheduler splits
whenever CUDA graphs are on (flashinfer 0.6.13, ``include/flashinfer/attention/scheduler.cuh``,
``PrefillBinarySearchKVChunkSize`` returns ``enable_cuda_graph || ...``), so each layer runs the attention kernel
and then a merge kernel. Eager steps split only sequences long enough to need it. On the H100 (2026-11-26, 7B
preset, batch 1, a context of about 96 tokens; ``docs/gpu.md``) a graph step's attention was 28 x (9.4 us of
attention + a 1.7 us merge), plus the gap after each kernel. flashinfer's plan with ``disable_split_kv`` reads each
request's keys in one pass per KV head and launches no merge: right for short sequences, slow for long ones (at
batch 1, a 7B's four KV heads would stream a long context on four CTAs doing the work; the graph launches
``2 x SMs / KV heads`` CTAs a head all the same, the others recomputing request 0's tile, see
``flashinfer_backend._clear_schedule``). So :func:`tune` times both inside CUDA
graphs, per captured batch size, at lengths doubling from 64 tokens, and the backend keeps the split-free graph for
the lengths where it was faster by at least ``margin`` (and agreed with the split one); longer steps replay the
split graph. Sequences in a real long-video request are long, so there the split graph keeps serving.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch

from unifiedserve.attention.flashinfer_backend import SPLIT_KV, WHOLE_KV
from unifiedserve.ops.tuning import disagreement, first_line, graph_time_us, raise_if_fault

log = logging.getLogger(__name__)

#: the sequence lengths timed per batch size, shortest first, until the split-free plan stops winning
LENGTHS = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)

#: ``timer(attn, seqs, batch_size, variant, num_layers) -> (microseconds, layer 0's output)``
Timer = Callable[[object, list, int, str, int], "tuple[float, torch.Tensor]"]


@dataclass
class SplitChoice:
    """What :func:`tune` measured at one captured batch size: a CUDA graph of every layer's decode attention."""

    batch_size: int
    lengths: list[int] = field(default_factory=list)  # tokens per sequence, every sequence of the batch
    split_us: list[float] = field(default_factory=list)
    whole_us: list[float] = field(default_factory=list)
    #: the longest sequence whose steps replay the split-free graph (0: every step splits)
    whole_kv_max: int = 0
    #: why the split-free graph was not kept, when its output disagreed with the split one's
    note: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


_seconds = 0.0


def enabled() -> bool:
    """``UNIFIEDSERVE_SPLIT_FREE_DECODE=0`` keeps every decode graph split-KV (flashinfer's graph-mode plan)."""
    return os.environ.get("UNIFIEDSERVE_SPLIT_FREE_DECODE", "") not in ("0", "off", "false")


def tune_seconds() -> float:
    """Wall time of the last :func:`tune`."""
    return _seconds


def summary(choices: Sequence[SplitChoice]) -> str:
    """One line: per batch size, up to what length the split-free graph runs."""
    parts = [f"batch {c.batch_size}: " + (f"split-free up to {c.whole_kv_max} tokens" if c.whole_kv_max
                                         else "split-KV") for c in choices]
    return "; ".join(parts)


def graph_timer(repeats: int = 5) -> Timer:
    """The device timer: one CUDA graph of ``num_layers`` attention forwards (each layer's own cache, as in a step),
    the fastest of ``repeats`` replays between two events, in microseconds
    (:func:`~unifiedserve.ops.tuning.graph_time_us`); and layer 0's output of the eager warm-up run."""

    def run(attn, seqs: list, size: int, variant: str, num_layers: int) -> tuple[float, torch.Tensor]:
        device, dtype = attn.kv_cache.device, attn.kv_cache.dtype
        gen = torch.Generator(device=device)
        gen.manual_seed(0)  # both variants see the same q and new K/V
        q, k, v = (torch.randn((size, heads, attn.head_dim), generator=gen, device=device, dtype=dtype)
                   for heads in (attn.num_q_heads, attn.num_kv_heads, attn.num_kv_heads))
        attn.plan(seqs, graph_batch_size=size, graph_variant=variant)
        outputs = []

        def step():
            outputs.append(attn.forward(0, q, k, v))
            for layer in range(1, num_layers):
                attn.forward(layer, q, k, v)

        us = graph_time_us(step, repeats, device)  # first eagerly (its layer 0's output is returned), then captured
        return us, outputs[0]

    return run


def tune(attn, num_layers: int, *, lengths: Sequence[int] = LENGTHS, margin: float = 0.02,
         timer: Timer | None = None) -> list[SplitChoice]:
    """Time split-KV against split-free decode graphs of ``attn`` (a ``FlashInferAttention`` after
    ``init_cuda_graph``) at each of its batch sizes and set its whole-KV limits from what was faster.

    Each length's batch holds ``batch_size`` sequences of that length on distinct KV blocks, the pool's last ones
    (lengths past the graphs' ``max_seq_len`` or the cache's blocks are not timed). Start-up only: it writes random
    K/V into the blocks it times (so that the outputs compared are not all equal, nor NaN from the pool's undefined
    memory) and the new tokens' slots. A split-free graph that cannot be planned or captured keeps that size split.
    With ``UNIFIEDSERVE_SPLIT_FREE_DECODE=0`` it times nothing and every graph splits.

    Raises:
        RuntimeError: a split-free graph faulted the GPU (nothing can run after that); the message names
            ``UNIFIEDSERVE_SPLIT_FREE_DECODE=0``.
    """
    global _seconds
    if not enabled():
        attn.set_whole_kv_limits({})
        return []
    start = time.perf_counter()
    timer = timer or graph_timer()
    cache = attn.kv_cache
    choices, limits = [], {}
    with torch.inference_mode():
        for size in sorted(attn.whole_kv_limits()):
            choice = SplitChoice(size)
            for i, length in enumerate(lengths):
                pages = -(-length // cache.block_size)
                if length > attn.graph_max_seq_len or size * pages > cache.num_blocks:
                    break
                first = cache.num_blocks - size * pages  # the pool's last blocks: the least likely in use
                cache.tensor[:, :, first:].normal_()  # keys to attend over (the pool's memory is undefined)
                seqs = [(length - 1, 1, list(range(first + b * pages, first + (b + 1) * pages))) for b in range(size)]
                split_us, split_out = timer(attn, seqs, size, SPLIT_KV, num_layers)
                try:
                    whole_us, whole_out = timer(attn, seqs, size, WHOLE_KV, num_layers)
                except Exception as e:  # flashinfer or the capture refused it: every step of this size splits
                    raise_if_fault(e, f"decode attention tune: the split-free graph at batch {size}",
                                   "UNIFIEDSERVE_SPLIT_FREE_DECODE=0")
                    choice.note = f"at {length} tokens the split-free graph cannot run: {first_line(e)}"
                    choice.whole_kv_max = 0
                    log.warning("decode attention, batch %d: split-free graphs not used: %s", size, choice.note)
                    break
                choice.lengths.append(length)
                choice.split_us.append(round(split_us, 2))
                choice.whole_us.append(round(whole_us, 2))
                wrong = disagreement(whole_out[:size], split_out[:size], "the split-KV output")
                if wrong:
                    choice.note = f"at {length} tokens the split-free output {wrong}"
                    choice.whole_kv_max = 0
                    log.warning("decode attention, batch %d: split-free graphs not used: %s", size, choice.note)
                    break
                if whole_us > split_us * (1.0 - margin):  # it only gets slower with length: stop here
                    break
                choice.whole_kv_max = length
            limits[size] = choice.whole_kv_max
            choices.append(choice)
    attn.set_whole_kv_limits(limits)
    _seconds = time.perf_counter() - start
    return choices

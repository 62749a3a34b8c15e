"""Paged attention on CUDA with flashinfer's kernels (imported lazily: flashinfer is a CUDA-only extra).

* Decode steps run ``BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True)``: the tensor-core
  path is the one that serves Qwen2.5-VL's GQA groups (28/4 for 7B, 16/2 for 3B).
* Every other step (prefill chunks over cached prefix pages, mixed with decode rows) runs
  ``BatchPrefillWithPagedKVCacheWrapper`` with ``causal=True``; flashinfer aligns the causal mask
  to the bottom right, so a chunk's row i sees the cached prefix plus rows 0..i.
* New K/V go into the cache on the slot map: from the model (``forward_rope``) in the same kernel
  as the rotary (``unifiedserve.ops.rotary_cache``), else with one ``index_copy_`` per tensor. The
  project's cache layout per layer (``[blocks, block_size, kv_heads, head_dim]`` for K and for V) is
  flashinfer's ``NHD`` paged layout, passed to the kernels as a ``(k, v)`` tuple.
* CUDA-graph decode: one decode wrapper per captured batch size, all reading fixed indptr/indices/
  last-page-length buffers that ``plan`` overwrites in place (see :class:`AttentionBackend`). In graph mode
  flashinfer always plans split-KV (a merge kernel after each layer's attention), so where start-up timing
  finds its split-free plan faster for short sequences a second graph is captured at that size
  (:mod:`unifiedserve.attention.split_kv`): graph variants ``"split-kv"`` and ``"whole-kv"``.
* A wrapper is planned again only once the host-to-device copy of its previous plan has run
  (:meth:`FlashInferAttention._plan`): flashinfer's ``plan`` writes its schedule into the wrapper's
  page-locked host buffer and queues the copy without waiting, so with async scheduling (step N+1
  planned while step N may still be queued) it would otherwise overwrite what step N's copy has not
  read yet; mini-sglang saw this as illegal memory accesses (sgl-project/mini-sglang#103).
* Kernel families: decode runs flashinfer's FA2 tensor-core kernel (its choice for half-precision
  decode); prefill (and the vision tower's ragged attention, :mod:`unifiedserve.attention.varlen`)
  runs what ``UNIFIEDSERVE_FLASHINFER_PREFILL_BACKEND`` names: ``auto`` (default: flashinfer picks,
  FA3 on Hopper), ``fa2`` or ``fa3``. The knob exists to measure one against the other, and so that a
  GPU run whose carried FA3 kernels cannot load falls back to FA2 (``scripts/flashinfer_kernels.py``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from unifiedserve import ops
from unifiedserve.attention.base import AttentionBackend, KVCache, copy_host_ints
from unifiedserve.attention.metadata import PagedBatch, SeqSpec, build_paged_batch, pad_decode_batch
from unifiedserve.memory.transfer import to_device

#: flashinfer's recommended float workspace (split-KV partial results); shared by all wrappers,
#: which is safe because they run one after another on one stream.
WORKSPACE_BYTES = 128 * 1024 * 1024
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
#: head dims flashinfer's prefill kernels are built for (its Hopper FA3 path asserts 64/128/256)
SUPPORTED_HEAD_DIMS = (64, 128, 256)
PREFILL_BACKEND_ENV = "UNIFIEDSERVE_FLASHINFER_PREFILL_BACKEND"
PREFILL_BACKENDS = ("auto", "fa2", "fa3")
#: the decode graphs' variants: flashinfer's graph-mode plan (KV split into chunks, then merged) and its plan with
#: ``disable_split_kv`` (each request's keys in one pass per KV head, no merge kernel)
SPLIT_KV, WHOLE_KV = "split-kv", "whole-kv"


def _copy_done_event(device: torch.device) -> Any:
    """An event recorded on ``device``'s current stream now: it completes when the work queued so far has run
    (:meth:`FlashInferAttention._plan` waits on it before planning the same wrapper again)."""
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def prefill_backend() -> str:
    """flashinfer's backend for prefill and ragged kernels, from ``UNIFIEDSERVE_FLASHINFER_PREFILL_BACKEND``.

    Raises:
        ValueError: a value other than ``auto``, ``fa2`` or ``fa3``.
    """
    value = os.environ.get(PREFILL_BACKEND_ENV, "") or "auto"
    if value not in PREFILL_BACKENDS:
        raise ValueError(f"{PREFILL_BACKEND_ENV}={value!r}: choose one of {', '.join(PREFILL_BACKENDS)}")
    return value


def unsupported_reason(device: str | torch.device, dtype: torch.dtype | None = None,
                       head_dim: int | None = None) -> str | None:
    """Why this backend cannot serve a cache on ``device`` (``None`` when it can, flashinfer aside).

    ``dtype`` and ``head_dim`` are checked when given. Imports nothing.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return f"device {device} is not CUDA"
    if dtype is not None and dtype not in SUPPORTED_DTYPES:
        return f"flashinfer's kernels take float16/bfloat16, the KV cache is {dtype}"
    if head_dim is not None and head_dim not in SUPPORTED_HEAD_DIMS:
        return f"flashinfer's kernels are built for head dims 64/128/256, the model has {head_dim}"
    return None


def import_flashinfer() -> Any:
    """The ``flashinfer`` module, or an ``ImportError`` that says how to get it."""
    try:
        import flashinfer
    except ImportError as exc:
        raise ImportError("flashinfer is not installed: install flashinfer-python (0.6.x) on the CUDA machine "
                          "(see docs/gpu.md), or use the torch attention backend") from exc
    return flashinfer


def plan_tensors(batch: PagedBatch) -> dict[str, torch.Tensor]:
    """flashinfer's int32 host arrays for a batch (its ``plan`` copies them to the device)."""
    return {name: torch.from_numpy(getattr(batch, name))  # int32 already: shares the array's memory
            for name in ("qo_indptr", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len")}


@dataclass
class _Step:
    wrapper: Any  # the planned flashinfer wrapper this step's layers run
    num_tokens: int
    slot_mapping: torch.Tensor  # int64 [N] on the device
    write_rows: torch.Tensor | None  # int64 [N]: source row of each K/V write (graph padding)


def _step_len(max_batch: int, pages: int) -> int:
    """int64 elements of a graph step's packed inputs (``init_cuda_graph``'s "step" buffer): slot map and write rows,
    ``max_batch`` each, then ``pages`` int32 page indices, two to an element."""
    return 2 * max_batch + -(-pages // 2)


def _clear_schedule(wrapper: Any) -> None:
    """Zero a split-free graph wrapper's schedule (its int workspace and the page-locked copy plans write).

    In CUDA-graph mode flashinfer 0.6.13's tensor-core decode launches ``max(2 x SMs / KV heads, tiles)`` blocks per
    KV head (``PrefillSplitQOKVIndptr`` in ``include/flashinfer/attention/scheduler.cuh``); a plan with
    ``disable_split_kv`` writes the request, query-tile and key-tile index of the real tiles only, and no validity
    mask (which only split plans write), so the other blocks read whatever the buffer held (flashinfer issue #4002).
    The page-locked buffer is ``torch.empty`` host memory, which torch's host allocator recycles from freed wrappers:
    stale indices would send those blocks out of bounds. Zeroed once here (this wrapper's plans never write that
    tail), they recompute request 0's tile and store the same values again.

    Raises:
        RuntimeError: the wrapper has no such buffers (another flashinfer): the split-free graph is not safe there.
    """
    for name in ("_pin_memory_int_workspace_buffer", "_int_workspace_buffer"):
        buffer = getattr(wrapper, name, None)
        if not isinstance(buffer, torch.Tensor):
            raise RuntimeError(f"flashinfer's decode wrapper has no {name} to clear: split-free decode graphs are "
                               "only safe on flashinfer 0.6.13's layout")
        buffer.zero_()


class FlashInferAttention(AttentionBackend):
    """flashinfer paged prefill/decode over the project's KV cache (CUDA, float16/bfloat16 only).

    Raises (constructor):
        ValueError: the cache is not on CUDA or not float16/bfloat16, or the head dim is not 64/128/256.
        ImportError: flashinfer is not installed.
    """

    supports_cuda_graph = True

    def __init__(self, kv_cache: KVCache, num_q_heads: int, num_kv_heads: int, head_dim: int,
                 scale: float | None = None):
        super().__init__(kv_cache, num_q_heads, num_kv_heads, head_dim, scale)
        self._validate_cache(kv_cache)
        if head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(unsupported_reason("cuda", head_dim=head_dim))
        backend = prefill_backend()
        self._fi = import_flashinfer()
        device = kv_cache.device
        self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._prefill = self._fi.BatchPrefillWithPagedKVCacheWrapper(self._workspace, kv_layout="NHD",
                                                                     backend=backend)
        self._decode = self._fi.BatchDecodeWithPagedKVCacheWrapper(self._workspace, kv_layout="NHD",
                                                                   use_tensor_cores=True)
        self._graph_decode: dict[int, dict[str, Any]] = {}  # batch size -> variant -> wrapper on the fixed buffers
        self._whole_kv_max: dict[int, int] = {}  # batch size -> longest sequence the whole-KV graph serves (0: none)
        self._graph_bufs: dict[str, torch.Tensor] = {}
        self._graph_max_seq_len = 0
        self._step: _Step | None = None
        self._planned: dict[int, Any] = {}  # id(wrapper) -> event after its last plan's queued copy

    @staticmethod
    def _validate_cache(kv_cache: KVCache) -> None:
        reason = unsupported_reason(kv_cache.device, kv_cache.dtype)
        if reason is not None:
            raise ValueError(f"FlashInferAttention cannot serve this KV cache: {reason} (use the torch backend)")

    # -- planning (host side, outside the forward and any graph) ------------------------------------

    def _plan(self, wrapper: Any, *args: Any, **kwargs: Any) -> None:
        """``wrapper.plan(*args, **kwargs)`` once the copy its previous plan queued has run (module docstring).

        Waiting costs nothing in the usual case (that copy leads the previous step, behind the step the host
        has already read back); it matters when the device is late, e.g. time-sliced with another process.
        """
        done = self._planned.get(id(wrapper))
        if done is not None:
            done.synchronize()
        wrapper.plan(*args, **kwargs)
        self._planned[id(wrapper)] = _copy_done_event(self.kv_cache.device)

    def _host(self, t: torch.Tensor) -> torch.Tensor:
        """A plan array flashinfer copies up: page-locked on CUDA, so that the copy is queued rather than staged
        by the host."""
        return t.pin_memory() if self.kv_cache.device.type == "cuda" else t

    def _plan_kwargs(self) -> dict[str, Any]:
        dtype = self.kv_cache.dtype
        return dict(pos_encoding_mode="NONE", sm_scale=self.scale, q_data_type=dtype, kv_data_type=dtype)

    def plan(self, seqs: Sequence[SeqSpec], graph_batch_size: int | None = None,
             graph_variant: str | None = None) -> None:
        if graph_batch_size is None and graph_variant is not None:
            raise ValueError(f"graph_variant {graph_variant!r} needs graph_batch_size: eager steps have no variants")
        batch = build_paged_batch(seqs, self.kv_cache.block_size)
        if graph_batch_size is not None:
            if graph_variant is None:
                graph_variant = self.graph_variant(seqs, graph_batch_size)
            self._step = self._plan_graph(batch, graph_batch_size, graph_variant)
            return
        arrays = plan_tensors(batch)
        paged = [self._host(arrays[name]) for name in ("paged_kv_indptr", "paged_kv_indices",
                                                          "paged_kv_last_page_len")]
        if batch.is_decode:
            wrapper = self._decode
            self._plan(wrapper, *paged, self.num_q_heads, self.num_kv_heads, self.head_dim,
                       self.kv_cache.block_size, **self._plan_kwargs())
        else:
            wrapper = self._prefill
            self._plan(wrapper, self._host(arrays["qo_indptr"]), *paged, self.num_q_heads, self.num_kv_heads,
                       self.head_dim, self.kv_cache.block_size, causal=True, **self._plan_kwargs())
        slot_mapping = to_device(torch.from_numpy(batch.slot_mapping), self.kv_cache.device)
        self._step = _Step(wrapper, batch.num_tokens, slot_mapping, None)

    def init_cuda_graph(self, batch_sizes: Sequence[int], max_seq_len: int) -> None:
        if not batch_sizes or min(batch_sizes) < 1 or max_seq_len < 1:
            raise ValueError(f"need batch sizes >= 1 and max_seq_len >= 1, got {list(batch_sizes)} and {max_seq_len}")
        device = self.kv_cache.device
        max_batch = max(batch_sizes)
        max_pages = max_batch * -(-max_seq_len // self.kv_cache.block_size)
        # One set of fixed buffers for the largest batch; each size's wrapper holds prefix views of
        # them (flashinfer sizes its batch from the views' lengths). Only one graph replays at a
        # time and plan() rewrites the buffers before each replay, so sharing them is safe.
        # "step": what this backend sends up per graph step, in one copy (_plan_graph): a size-n step's slot map
        # from offset 0 and its write rows from max_batch (each row then starts 16-byte aligned, as the skinny
        # kernels' tune timed them: Triton specialises pointers on it), then (from 2 x max_batch) the page indices,
        # int32, which are flashinfer's fixed indices buffer itself, so its plan's copy of them finds them in place
        step = torch.zeros(_step_len(max_batch, max_pages), dtype=torch.int64, device=device)
        bufs = {
            "paged_kv_indptr": torch.zeros(max_batch + 1, dtype=torch.int32, device=device),
            "paged_kv_indices": step[2 * max_batch:].view(torch.int32)[:max_pages],
            "paged_kv_last_page_len": torch.zeros(max_batch, dtype=torch.int32, device=device),
            "rows": step[:2 * max_batch].view(2, max_batch),  # slot map, write rows
            "step": step,
        }
        self._graph_bufs = bufs
        self._graph_max_seq_len = max_seq_len
        self._graph_decode = {size: {} for size in sorted(set(batch_sizes))}
        self._whole_kv_max = {size: 0 for size in self._graph_decode}  # split-KV only until tuned

    def _graph_wrapper(self, size: int, variant: str) -> Any:
        """The graph-mode decode wrapper of this size and variant, made on first use (each holds an 8 MB device
        workspace and 8 MB of page-locked host memory, so whole-KV ones exist only where they are used)."""
        if size not in self._graph_decode:
            raise ValueError(f"graph batch size {size} was not given to init_cuda_graph "
                             f"(sizes: {sorted(self._graph_decode)})")
        if variant not in (SPLIT_KV, WHOLE_KV):
            raise ValueError(f"unknown decode graph variant {variant!r}: choose {SPLIT_KV!r} or {WHOLE_KV!r}")
        wrappers = self._graph_decode[size]
        if variant not in wrappers:
            bufs = self._graph_bufs
            wrapper = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, kv_layout="NHD", use_cuda_graph=True, use_tensor_cores=True,
                paged_kv_indptr_buffer=bufs["paged_kv_indptr"][:size + 1],
                paged_kv_indices_buffer=bufs["paged_kv_indices"],
                paged_kv_last_page_len_buffer=bufs["paged_kv_last_page_len"][:size])
            if variant == WHOLE_KV:
                _clear_schedule(wrapper)
            wrappers[variant] = wrapper
        return wrappers[variant]

    # -- graph variants: split-KV or not -----------------------------------------------------------

    def graph_variants(self, batch_size: int) -> tuple[str, ...]:
        return (SPLIT_KV, WHOLE_KV) if self._whole_kv_max.get(batch_size, 0) > 0 else (SPLIT_KV,)

    def graph_variant(self, seqs: Sequence[SeqSpec], batch_size: int) -> str:
        limit = self._whole_kv_max.get(batch_size, 0)
        if limit and max(cached + new for cached, new, _ in seqs) <= limit:
            return WHOLE_KV
        return SPLIT_KV

    @property
    def graph_max_seq_len(self) -> int:
        """The longest sequence a graph step may hold (``init_cuda_graph``'s ``max_seq_len``; 0 before it)."""
        return self._graph_max_seq_len

    def whole_kv_limits(self) -> dict[int, int]:
        """Per captured batch size, the longest sequence (cached + new tokens) whose steps replay the whole-KV graph
        (0: every step splits)."""
        return dict(self._whole_kv_max)

    def set_whole_kv_limits(self, limits: dict[int, int]) -> None:
        """Set :meth:`whole_kv_limits` (after :meth:`init_cuda_graph`, before capture); sizes not given split.

        Raises:
            ValueError: a size not given to ``init_cuda_graph``, or a negative limit.
        """
        unknown = sorted(set(limits) - set(self._graph_decode))
        if unknown or any(v < 0 for v in limits.values()):
            raise ValueError(f"whole-KV limits need sizes given to init_cuda_graph ({sorted(self._graph_decode)}) and "
                             f"limits >= 0, got {dict(limits)}")
        self._whole_kv_max = {size: int(limits.get(size, 0)) for size in self._graph_decode}
        for size, limit in self._whole_kv_max.items():
            if not limit:
                self._graph_decode[size].pop(WHOLE_KV, None)  # its workspaces go with it

    def offer_every_graph_variant(self) -> None:
        self.set_whole_kv_limits({size: self._graph_max_seq_len for size in self._graph_decode})

    def tune_graph_variants(self, num_layers: int) -> list:
        from unifiedserve.attention import split_kv

        return split_kv.tune(self, num_layers)

    def _plan_graph(self, batch: PagedBatch, graph_batch_size: int, variant: str) -> _Step:
        wrapper = self._graph_wrapper(graph_batch_size, variant)
        if batch.max_kv_len > self._graph_max_seq_len:
            raise ValueError(f"a sequence of {batch.max_kv_len} tokens exceeds the graph's max_seq_len "
                             f"{self._graph_max_seq_len}")
        padded = pad_decode_batch(batch, graph_batch_size)
        arrays = plan_tensors(padded)
        # flashinfer's graph-mode plan copies these into the wrapper's fixed buffers. It reads indptr and the
        # last-page lengths on the host too (keep them there: pinned, their copies are queued), but copies the page
        # indices with a blocking copy unless they are on the device already (flashinfer 0.6.13, decode.py, plan:
        # non_blocking=(indices.device == self.device) and non_blocking): a host wait per replay, which the device
        # caught under torch.cuda.set_sync_debug_mode("error"). So they go up first, queued, in the one copy that
        # also carries the slot map and write rows, straight into flashinfer's fixed indices buffer: its
        # ``buf[:k].copy_(indices)`` then copies a view onto the same memory, which torch skips (copy_'s early
        # exit for views of the same data), so the step's attention inputs cost the device one copy instead of
        # four (each operation outside the graph replay costs a few microseconds: issue 13's batch-1 step).
        n = graph_batch_size
        bufs = self._graph_bufs
        max_batch = bufs["rows"].shape[1]
        pages = arrays["paged_kv_indices"].numpy()  # int32 [k]
        k = len(pages)
        packed = np.zeros(_step_len(max_batch, k), dtype=np.int64)
        packed[:n], packed[max_batch:max_batch + n] = padded.slot_mapping, padded.write_rows
        packed[2 * max_batch:].view(np.int32)[:k] = pages
        copy_host_ints(bufs["step"][:len(packed)], packed)  # queued: no host sync per replay
        indices = bufs["paged_kv_indices"][:k]
        indptr, last = (self._host(arrays[name]) for name in ("paged_kv_indptr", "paged_kv_last_page_len"))
        self._plan(wrapper, indptr, indices, last, self.num_q_heads, self.num_kv_heads, self.head_dim,
                   self.kv_cache.block_size, disable_split_kv=variant == WHOLE_KV, **self._plan_kwargs())
        rows = bufs["rows"][:, :n]
        return _Step(wrapper, n, rows[0], rows[1])  # each contiguous, 16-byte aligned: for the fused K/V write

    # -- per layer (inside the forward; no host syncs) --------------------------------------------

    def _checked_step(self, q: torch.Tensor):
        step = self._step
        if step is None:
            raise RuntimeError("call plan(seqs) before the model forward")
        if q.shape[0] != step.num_tokens:
            raise ValueError(f"forward got {q.shape[0]} rows, the plan has {step.num_tokens}")
        return step

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        step = self._checked_step(q)
        dtype = self.kv_cache.dtype
        k_slots, v_slots = self.kv_cache.layer(layer)  # [blocks * block_size, kv_heads, head_dim]
        if step.write_rows is not None:
            k, v = k[step.write_rows], v[step.write_rows]  # padding rows repeat row 0's write
        k_slots.index_copy_(0, step.slot_mapping, k.to(dtype))
        v_slots.index_copy_(0, step.slot_mapping, v.to(dtype))
        return self._attend(step, layer, q)

    def forward_rope(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> torch.Tensor:
        """Rotary and the K/V write in one kernel (:func:`unifiedserve.ops.rotary_cache`), then attention."""
        step = self._checked_step(q)
        k_slots, v_slots = self.kv_cache.layer(layer)
        q = ops.rotary_cache(q, k, v, cos, sin, k_slots, v_slots, step.slot_mapping, step.write_rows)
        return self._attend(step, layer, q)

    def _kv_write_rows(self):
        step = self._step
        return None if step is None else (step.slot_mapping, step.write_rows)

    def forward_rotated(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        return self._attend(self._checked_step(q), layer, q)

    def _attend(self, step, layer: int, q: torch.Tensor) -> torch.Tensor:
        out = step.wrapper.run(q.to(self.kv_cache.dtype), self.kv_cache.paged_layer(layer))  # [N, q_heads, head_dim]
        return out.to(q.dtype)

    def warmup(self) -> None:
        """JIT-compile (or load from ``~/.cache/flashinfer``) the decode and causal prefill kernels.

        Plans a one-token sequence on block 0 and runs both wrappers on layer 0 without writing the
        cache; the first call on a fresh machine takes tens of seconds per kernel.
        """
        layer0 = self.kv_cache.paged_layer(0)
        q = torch.zeros((2, self.num_q_heads, self.head_dim), dtype=self.kv_cache.dtype,
                        device=self.kv_cache.device)
        decode = plan_tensors(build_paged_batch([(0, 1, [0])], self.kv_cache.block_size))
        self._decode.plan(decode["paged_kv_indptr"], decode["paged_kv_indices"], decode["paged_kv_last_page_len"],
                          self.num_q_heads, self.num_kv_heads, self.head_dim, self.kv_cache.block_size,
                          **self._plan_kwargs())
        self._decode.run(q[:1], layer0)
        prefill = plan_tensors(build_paged_batch([(0, 2, [0, 0])], self.kv_cache.block_size))
        self._prefill.plan(prefill["qo_indptr"], prefill["paged_kv_indptr"], prefill["paged_kv_indices"],
                           prefill["paged_kv_last_page_len"], self.num_q_heads, self.num_kv_heads, self.head_dim,
                           self.kv_cache.block_size, causal=True, **self._plan_kwargs())
        self._prefill.run(q, layer0)
        torch.cuda.synchronize(self.kv_cache.device)
        self._step = None  # the warm-up plan is not a step

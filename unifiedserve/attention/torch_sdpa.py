"""Paged attention in plain torch: the CPU backend, the SDPA fallback on CUDA, and the reference.

Everything a layer needs beyond q/k/v (slot maps, gather maps, masks) is built once per step in
:meth:`TorchPagedAttention.plan`, so ``forward`` does only device work: no host syncs per layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from unifiedserve import ops
from unifiedserve.attention.base import AttentionBackend, KVCache, copy_host_ints
from unifiedserve.attention.metadata import PagedBatch, SeqSpec, build_paged_batch, pad_decode_batch
from unifiedserve.memory.transfer import to_device


@dataclass
class _PrefillSeq:
    rows: tuple[int, int]  # [start, end) of the sequence's rows
    slots: torch.Tensor  # int64 [kv_len]: cache slot of each key position
    num_cached: int  # keys before the new rows; row i sees keys 0..num_cached + i

    def mask(self, device: torch.device) -> torch.Tensor | None:
        """bool ``[num_new, kv_len]`` (bottom-right causal), None when plain causal (no cached prefix)."""
        if self.num_cached == 0:
            return None
        num_new = self.rows[1] - self.rows[0]
        return torch.ones((num_new, self.num_cached + num_new), dtype=torch.bool,
                          device=device).tril(diagonal=self.num_cached)


def _flash_cpu():
    """torch's CPU flash-attention op, which also returns the log-sum-exp (None where this torch lacks it)."""
    return getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


@dataclass
class _TorchPlan:
    batch: PagedBatch
    slot_mapping: torch.Tensor  # int64 [N]: where each row's K/V goes
    write_rows: torch.Tensor | None  # int64 [N]: source row of each write (graph padding), None = identity
    decode_slots: torch.Tensor | None  # int64 [B, L]: cache slot of key position l of sequence b
    decode_valid: torch.Tensor | None  # bool [B, L]: l < kv_len[b]
    prefill: list[_PrefillSeq]


class TorchPagedAttention(AttentionBackend):
    """Gathers each sequence's K/V from its blocks and runs SDPA.

    Decode steps (one new token per sequence) run as one padded SDPA call over ``[B, L]`` gathered
    keys; other steps run per sequence with a causal mask offset by the cached prefix. Supports
    CUDA-graph decode: ``L`` is then the fixed ``max_seq_len`` given to :meth:`init_cuda_graph`.
    """

    supports_cuda_graph = True

    def __init__(self, kv_cache: KVCache, num_q_heads: int, num_kv_heads: int, head_dim: int,
                 scale: float | None = None):
        super().__init__(kv_cache, num_q_heads, num_kv_heads, head_dim, scale)
        self._plan: _TorchPlan | None = None
        self._graph_sizes: set[int] = set()
        self._graph_buffers: dict[str, torch.Tensor] = {}

    def init_cuda_graph(self, batch_sizes: Sequence[int], max_seq_len: int) -> None:
        if not batch_sizes or min(batch_sizes) < 1 or max_seq_len < 1:
            raise ValueError(f"need batch sizes >= 1 and max_seq_len >= 1, got {list(batch_sizes)} and {max_seq_len}")
        max_batch = max(batch_sizes)
        device = self.kv_cache.device
        # one set of buffers sized for the largest batch; each graph reads a prefix view of them
        self._graph_buffers = {
            "slot_mapping": torch.zeros(max_batch, dtype=torch.int64, device=device),
            "write_rows": torch.zeros(max_batch, dtype=torch.int64, device=device),
            "decode_slots": torch.zeros((max_batch, max_seq_len), dtype=torch.int64, device=device),
            "decode_valid": torch.zeros((max_batch, max_seq_len), dtype=torch.bool, device=device),
        }
        self._graph_sizes = set(batch_sizes)

    def plan(self, seqs: Sequence[SeqSpec], graph_batch_size: int | None = None,
             graph_variant: str | None = None) -> None:
        if graph_variant not in (None, ""):
            raise ValueError(f"{type(self).__name__} has one kind of decode graph (''), not {graph_variant!r}")
        batch = build_paged_batch(seqs, self.kv_cache.block_size)
        device = self.kv_cache.device
        if graph_batch_size is not None:
            self._plan = self._plan_graph(batch, graph_batch_size)
            return
        slot_mapping = to_device(torch.from_numpy(batch.slot_mapping), device)
        if batch.is_decode:
            slots, valid = self._decode_maps(batch, max_len=batch.max_kv_len)
            self._plan = _TorchPlan(batch, slot_mapping, None, slots, valid, [])
            return
        block_size = self.kv_cache.block_size
        indptr = batch.paged_kv_indptr.tolist()
        pages = to_device(torch.from_numpy(batch.paged_kv_indices).long(), device)
        offsets = torch.arange(block_size, device=device)
        prefill = []
        for b, (num_cached, kv_len) in enumerate(zip(batch.cached_lens.tolist(), batch.kv_lens.tolist())):
            rows = (int(batch.qo_indptr[b]), int(batch.qo_indptr[b + 1]))
            seq_pages = pages[indptr[b]:indptr[b + 1]]  # [P]
            slots = (seq_pages[:, None] * block_size + offsets).flatten()[:kv_len]  # [kv_len]
            # row i sits at absolute position num_cached + i and sees keys 0..num_cached + i
            prefill.append(_PrefillSeq(rows, slots, num_cached))
        self._plan = _TorchPlan(batch, slot_mapping, None, None, None, prefill)

    def _plan_graph(self, batch: PagedBatch, graph_batch_size: int) -> _TorchPlan:
        if graph_batch_size not in self._graph_sizes:
            raise ValueError(f"graph batch size {graph_batch_size} was not given to init_cuda_graph "
                             f"(sizes: {sorted(self._graph_sizes)})")
        bufs = self._graph_buffers
        max_len = bufs["decode_slots"].shape[1]
        if batch.max_kv_len > max_len:
            raise ValueError(f"a sequence of {batch.max_kv_len} tokens exceeds the graph's max_seq_len {max_len}")
        padded = pad_decode_batch(batch, graph_batch_size)
        slots, valid = self._decode_maps(padded, max_len=max_len)
        n = graph_batch_size
        views = {name: buf[:n] for name, buf in bufs.items()}
        # copy_ into the fixed buffers: captured kernels keep reading these addresses
        copy_host_ints(views["slot_mapping"], padded.slot_mapping)  # queued, not waited for: no host sync
        copy_host_ints(views["write_rows"], padded.write_rows)
        views["decode_slots"].copy_(slots)
        views["decode_valid"].copy_(valid)
        return _TorchPlan(padded, views["slot_mapping"], views["write_rows"], views["decode_slots"],
                          views["decode_valid"], [])

    def _decode_maps(self, batch: PagedBatch, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather map and validity of ``[B, max_len]`` key positions, built on the device once per step."""
        block_size = self.kv_cache.block_size
        device = self.kv_cache.device
        num_pages = -(-max_len // block_size)
        # [B, P] page table, 0-padded: row by row for a few sequences, else every page scattered at once (a
        # handful of numpy calls, whatever the batch, against one per row)
        table = np.zeros((batch.num_seqs, num_pages), dtype=np.int64)
        if batch.num_seqs <= 8:
            for b in range(batch.num_seqs):
                pages = batch.pages(b)
                table[b, :len(pages)] = pages
        else:
            counts = np.diff(batch.paged_kv_indptr)
            rows = np.repeat(np.arange(batch.num_seqs), counts)
            cols = np.arange(len(batch.paged_kv_indices)) - np.repeat(batch.paged_kv_indptr[:-1], counts)
            table[rows, cols] = batch.paged_kv_indices
        table = to_device(torch.from_numpy(table), device)
        kv_lens = to_device(torch.from_numpy(batch.kv_lens), device)  # [B]
        positions = torch.arange(max_len, device=device)  # [L]
        slots = table[:, positions // block_size] * block_size + positions % block_size  # [B, L]
        valid = positions[None, :] < kv_lens[:, None]  # [B, L]
        return torch.where(valid, slots, torch.zeros_like(slots)), valid

    def _checked_plan(self, q: torch.Tensor) -> _TorchPlan:
        plan = self._plan
        if plan is None:
            raise RuntimeError("call plan(seqs) before the model forward")
        if q.shape[0] != plan.batch.num_tokens:
            raise ValueError(f"forward got {q.shape[0]} rows, the plan has {plan.batch.num_tokens}")
        return plan

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        plan = self._checked_plan(q)
        k_cache, v_cache = self.kv_cache.layer(layer)  # [slots, kv_heads, head_dim]
        if plan.write_rows is not None:
            k, v = k[plan.write_rows], v[plan.write_rows]  # padding rows repeat row 0's write
        k_cache.index_copy_(0, plan.slot_mapping, k.to(k_cache.dtype))
        v_cache.index_copy_(0, plan.slot_mapping, v.to(v_cache.dtype))
        return self._attend(plan, q, k_cache, v_cache)

    def forward_rope(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> torch.Tensor:
        plan = self._checked_plan(q)
        k_cache, v_cache = self.kv_cache.layer(layer)  # [slots, kv_heads, head_dim]
        q = ops.rotary_cache(q, k, v, cos, sin, k_cache, v_cache, plan.slot_mapping, plan.write_rows)
        return self._attend(plan, q, k_cache, v_cache)

    def _kv_write_rows(self):
        plan = self._plan
        return None if plan is None else (plan.slot_mapping, plan.write_rows)

    def forward_rotated(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        plan = self._checked_plan(q)
        return self._attend(plan, q, *self.kv_cache.layer(layer))

    def _attend(self, plan: _TorchPlan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """Attention of the planned rows over the cache, whose new K/V are already written."""
        if plan.decode_slots is not None:  # on the CPU one kernel reads the keys in place; else gather + SDPA
            return ops.paged_decode_attention(q, k_cache, v_cache, plan.decode_slots, plan.decode_valid, self.scale)
        out = torch.empty_like(q)
        for seq in plan.prefill:
            qs, qe = seq.rows
            keys, values = k_cache[seq.slots], v_cache[seq.slots]  # [kv_len, kv_heads, head_dim]
            if seq.num_cached and q.is_cpu and _flash_cpu() is not None:
                out[qs:qe] = self._after_prefix(q[qs:qe], keys.to(q.dtype), values.to(q.dtype), seq.num_cached)
                continue
            out[qs:qe] = self._sdpa(q[qs:qe].unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
                                    seq.mask(q.device))[0]
        return out

    def _after_prefix(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, num_cached: int) -> torch.Tensor:
        """A chunk's rows ``q [n, Hq, D]`` over a cached prefix of ``num_cached`` keys plus themselves (causal).

        What SDPA with the bottom-right causal mask computes, as two flash-attention calls (CPU): all of the
        prefix, then the chunk causally among itself, merged by their log-sum-exps. SDPA given the mask
        takes a slower kernel and needs the ``[n, kv_len]`` mask itself (47 MB for a 2048-row chunk over a
        23k-token video prompt); the results agree to float32 rounding.
        """
        flash = _flash_cpu()
        qt = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (keys, values))  # [1, Hkv, kv_len, D]
        o1, l1 = flash(qt, kt[:, :, :num_cached], vt[:, :, :num_cached], scale=self.scale)[:2]  # [1, Hq, n, *]
        o2, l2 = flash(qt, kt[:, :, num_cached:], vt[:, :, num_cached:], is_causal=True, scale=self.scale)[:2]
        top = torch.maximum(l1, l2)
        w1, w2 = torch.exp(l1 - top).unsqueeze(-1), torch.exp(l2 - top).unsqueeze(-1)  # [1, Hq, n, 1]
        merged = (o1.float() * w1 + o2.float() * w2) / (w1 + w2)
        return merged[0].transpose(0, 1).to(q.dtype)  # [n, Hq, D]

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """q [B, Lq, Hq, D], k/v [B, Lk, Hkv, D], mask bool [B?, Lq, Lk] or None (causal) -> [B, Lq, Hq, D]."""
        q, k, v = (x.transpose(1, 2) for x in (q, k.to(q.dtype), v.to(q.dtype)))  # [B, H, L, D]
        gqa = self.num_q_heads != self.num_kv_heads
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=gqa)
        else:
            if mask.dim() == 2:
                mask = mask.unsqueeze(0)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1), scale=self.scale,
                                                 enable_gqa=gqa)
        return out.transpose(1, 2)

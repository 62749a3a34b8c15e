"""Paged attention in plain torch (the CPU backend, and the reference for native kernels)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from unifiedserve.attention.base import AttentionBackend


class TorchPagedAttention(AttentionBackend):
    """Gathers each sequence's K/V from its blocks and runs SDPA.

    Decode steps (one new token per sequence) are batched into one padded SDPA call; prefill chunks
    run per sequence with a causal mask offset by the cached context.
    """

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta = self.metadata
        assert meta is not None, "call begin(metadata) before the model forward"
        k_cache, v_cache = self.kv_cache.layer(layer)  # [slots, kv_heads, head_dim]
        k_cache.index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
        v_cache.index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
        if meta.is_decode:
            return self._decode(q, k_cache, v_cache)
        out = torch.empty_like(q)
        starts = meta.query_start_loc.tolist()
        for b, (context_len, seq_len) in enumerate(zip(meta.context_lens.tolist(), meta.seq_lens.tolist())):
            qs, qe = starts[b], starts[b + 1]
            slots = self._slots(meta.block_tables[b], seq_len)
            keys, values = k_cache[slots], v_cache[slots]  # [seq_len, kv_heads, head_dim]
            num_new = qe - qs
            # query i sits at absolute position context_len + i and sees keys 0..context_len + i
            mask = torch.ones((num_new, seq_len), dtype=torch.bool, device=q.device).tril(diagonal=context_len)
            out[qs:qe] = self._sdpa(q[qs:qe].unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), mask)[0]
        return out

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        meta = self.metadata
        seq_lens = meta.seq_lens
        max_len = int(seq_lens.max())
        block_size = self.kv_cache.block_size
        positions = torch.arange(max_len, device=q.device)  # [L]
        blocks = meta.block_tables.gather(1, (positions // block_size).clamp(max=meta.block_tables.shape[1] - 1)
                                          .expand(meta.num_seqs, -1))  # [B, L]
        slots = blocks * block_size + positions % block_size
        valid = positions.unsqueeze(0) < seq_lens.unsqueeze(1)  # [B, L]
        slots = torch.where(valid, slots, torch.zeros_like(slots))
        keys, values = k_cache[slots], v_cache[slots]  # [B, L, kv_heads, head_dim]
        out = self._sdpa(q.unsqueeze(1), keys, values, valid.unsqueeze(1))  # [B, 1, q_heads, head_dim]
        return out[:, 0]

    def _slots(self, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
        block_size = self.kv_cache.block_size
        positions = torch.arange(seq_len, device=block_table.device)
        return block_table[positions // block_size] * block_size + positions % block_size

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q [B, Lq, Hq, D], k/v [B, Lk, Hkv, D], mask bool [B?, Lq, Lk] -> [B, Lq, Hq, D]."""
        q, k, v = (x.transpose(1, 2) for x in (q, k.to(q.dtype), v.to(q.dtype)))  # [B, H, L, D]
        if mask.dim() == 2:
            mask = mask.unsqueeze(0)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1), scale=self.scale,
                                             enable_gqa=self.num_q_heads != self.num_kv_heads)
        return out.transpose(1, 2)

"""Shared helpers for the attention tests: random steps over a paged cache and a dense reference."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from unifiedserve.attention import KVCache


@dataclass
class Step:
    seqs: list[tuple[int, int, list[int]]]
    q: torch.Tensor  # [N, Hq, D]
    k: torch.Tensor  # [N, Hkv, D]: the new rows' keys
    v: torch.Tensor
    full_k: list[torch.Tensor]  # per sequence [kv_len, Hkv, D]: cached prefix + new rows
    full_v: list[torch.Tensor]


def slot(blocks: list[int], pos: int, block_size: int) -> int:
    return blocks[pos // block_size] * block_size + pos % block_size


def make_step(seqs, cache: KVCache, num_q_heads: int, seed: int = 0, layer: int = 0,
              dtype: torch.dtype | None = None) -> Step:
    """Random K/V for every token of every sequence; the cached prefix is written into ``cache``
    by hand (as an earlier step would have), the new rows are returned for the backend to write."""
    g = torch.Generator().manual_seed(seed)
    _, _, _, bs, hkv, d = cache.tensor.shape
    dtype = dtype or cache.dtype
    k_slots, v_slots = cache.layer(layer)
    qs, ks, vs, full_k, full_v = [], [], [], [], []
    for num_cached, num_new, blocks in seqs:
        kv_len = num_cached + num_new
        fk = torch.randn(kv_len, hkv, d, generator=g).to(dtype)
        fv = torch.randn(kv_len, hkv, d, generator=g).to(dtype)
        for pos in range(num_cached):
            k_slots[slot(blocks, pos, bs)] = fk[pos].to(cache.device, cache.dtype)
            v_slots[slot(blocks, pos, bs)] = fv[pos].to(cache.device, cache.dtype)
        qs.append(torch.randn(num_new, num_q_heads, d, generator=g).to(dtype))
        ks.append(fk[num_cached:])
        vs.append(fv[num_cached:])
        full_k.append(fk)
        full_v.append(fv)
    dev = cache.device
    return Step(list(seqs), torch.cat(qs).to(dev), torch.cat(ks).to(dev), torch.cat(vs).to(dev), full_k, full_v)


def dense_reference(step: Step, scale: float) -> torch.Tensor:
    """Causal attention per sequence in float64 from the full K/V: row i of a sequence with
    ``c`` cached tokens sees keys ``0..c+i``. Returns ``[N, Hq, D]`` float64 on the CPU."""
    outs, row = [], 0
    for (num_cached, num_new, _), fk, fv in zip(step.seqs, step.full_k, step.full_v):
        q = step.q[row:row + num_new].double().cpu()  # [n, Hq, D]
        row += num_new
        group = q.shape[1] // fk.shape[1]
        k = fk.double().repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = fv.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("nhd,lhd->hnl", q, k) * scale  # [Hq, n, L]
        allowed = torch.arange(k.shape[0])[None, :] <= (num_cached + torch.arange(num_new))[:, None]  # [n, L]
        scores = scores.masked_fill(~allowed, float("-inf"))
        outs.append(torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v))
    return torch.cat(outs)


#: Several sequences: chunked prefill over cached prefix pages, partial last pages, an exact
#: multiple of the block size (4), a fresh prefill, a one-token decode, extra blocks in a table.
MIXED_SEQS = [(5, 6, [3, 9, 4, 12]), (0, 7, [0, 1]), (8, 1, [5, 6, 7]), (3, 5, [2, 8]), (6, 1, [10, 11, 13, 14])]
DECODE_SEQS = [(5, 1, [3, 9]), (8, 1, [5, 6, 7]), (0, 1, [0]), (11, 1, [1, 2, 8])]


def rotated_write(attn, layer, q, k, v, cos, sin):
    """What a Q/K/V kernel given ``attn.rope_write`` does (unifiedserve.ops.skinny.norm_qkv_rope): rotary on q and k,
    each row's K/V into the slot the write names (a padding row, ``write_rows[r] != r``, leaves row 0's alone)."""
    from unifiedserve.ops import reference

    write = attn.rope_write(layer, cos, sin)
    q, k = reference.rotary(q, k, cos, sin)
    own = torch.arange(q.shape[0]) if write.write_rows is None else write.write_rows
    rows = (own == torch.arange(q.shape[0])).nonzero().flatten()
    write.k_cache[write.slot_mapping[rows]] = k[rows].to(write.k_cache.dtype)
    write.v_cache[write.slot_mapping[rows]] = v[rows].to(write.v_cache.dtype)
    return q, write

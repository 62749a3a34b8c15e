"""Torch references for the native ops in ``csrc/`` (and the fallback when they are not built).

Every function here is device-agnostic torch, written for clarity first; the native kernels must
match them exactly (they only move bytes). Index semantics: :class:`unifiedserve.memory.RaggedIndex`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from unifiedserve.memory.pages import RaggedIndex
from unifiedserve.memory.transfer import to_device


class RaggedIndexTensors(NamedTuple):
    """A :class:`RaggedIndex` as int64 tensors on the buffer's device (argument order of the ops)."""

    pv_indptr: torch.Tensor  # [B+1]
    pv_page_indptr: torch.Tensor  # [B+1]
    pv_page_indices: torch.Tensor  # [num listed pages]
    pv_cu_page_len: torch.Tensor  # [B]

    @classmethod
    def from_index(cls, index: RaggedIndex | "RaggedIndexTensors",
                   device: str | torch.device = "cpu") -> "RaggedIndexTensors":
        """Tensors for ``index`` on ``device`` (tensors already there are passed through).

        Host values go up as queued copies (:func:`~unifiedserve.memory.transfer.to_device`):
        ``torch.as_tensor(values, device=cuda)`` would synchronize the stream once per tensor.
        """
        device = torch.device(device)
        out = []
        for a in (index.pv_indptr, index.pv_page_indptr, index.pv_page_indices, index.pv_cu_page_len):
            t = torch.as_tensor(a, dtype=torch.int64)  # host values stay on the host here
            out.append(to_device(t, device) if t.device.type == "cpu" else t.to(device))
        return cls(*out)


def token_slots(index: RaggedIndexTensors, page_size: int, num_pages: int) -> torch.Tensor:
    """Flat buffer slot (``page * page_size + slot``) of every chunk row: int64 ``[N]``.

    Raises:
        RuntimeError: the index breaks the invariants of :class:`RaggedIndex` (same checks as ``csrc/``).
    """
    pv_indptr, pv_page_indptr, pv_page_indices, pv_cu_page_len = index
    num_requests = pv_cu_page_len.shape[0]
    if pv_indptr.shape[0] != num_requests + 1 or pv_page_indptr.shape[0] != num_requests + 1:
        raise RuntimeError("pv_indptr and pv_page_indptr must have B+1 entries")
    counts = pv_indptr[1:] - pv_indptr[:-1]  # [B] rows per request
    num_listed = pv_page_indptr[1:] - pv_page_indptr[:-1]  # [B] pages per request
    offsets = pv_cu_page_len % page_size  # [B] slot of each request's first row in its first page
    needed = torch.where(counts > 0, (offsets + counts + page_size - 1) // page_size, 0)
    if (int(pv_indptr[0]) != 0 or int(pv_page_indptr[0]) != 0 or int(pv_page_indptr[-1]) != pv_page_indices.shape[0]
            or bool((counts < 0).any()) or bool((pv_cu_page_len < 0).any()) or not torch.equal(needed, num_listed)):
        raise RuntimeError("invalid RaggedIndex: check pv_indptr/pv_page_indptr bounds and that each request "
                           "lists exactly the ceil((cu % page_size + n) / page_size) pages it touches")
    if pv_page_indices.numel() and bool(((pv_page_indices < 0) | (pv_page_indices >= num_pages)).any()):
        raise RuntimeError(f"pv_page_indices out of range for a buffer of {num_pages} pages")

    num_rows = int(pv_indptr[-1])
    request = torch.repeat_interleave(torch.arange(num_requests, device=counts.device), counts,
                                      output_size=num_rows)  # [N] request of each row
    t = torch.arange(num_rows, device=counts.device) - pv_indptr[:-1][request]  # [N] row within its request
    position = offsets[request] + t  # [N] from the start of the request's first listed page
    page = pv_page_indices[pv_page_indptr[:-1][request] + position // page_size]  # [N]
    return page * page_size + position % page_size


def paged_scatter(buffer: torch.Tensor, src: torch.Tensor, index: RaggedIndexTensors) -> None:
    """Write ``src`` [N, ...] into ``buffer`` [num_pages, page_size, ...] at the rows ``index`` names."""
    _check_buffer(buffer)
    if src.dtype != buffer.dtype or tuple(src.shape[1:]) != tuple(buffer.shape[2:]):
        raise RuntimeError(f"src {src.dtype} {tuple(src.shape)} does not match buffer {buffer.dtype} "
                           f"{tuple(buffer.shape)}: expected [N, {', '.join(map(str, buffer.shape[2:]))}]")
    slots = token_slots(index, buffer.shape[1], buffer.shape[0])
    if slots.shape[0] != src.shape[0]:
        raise RuntimeError(f"src has {src.shape[0]} rows, pv_indptr[-1] is {slots.shape[0]}")
    buffer.view(-1, *buffer.shape[2:]).index_copy_(0, slots, src)


def paged_gather(buffer: torch.Tensor, index: RaggedIndexTensors) -> torch.Tensor:
    """Read the rows ``index`` names from ``buffer`` [num_pages, page_size, ...] into a new [N, ...] tensor."""
    _check_buffer(buffer)
    slots = token_slots(index, buffer.shape[1], buffer.shape[0])
    return buffer.view(-1, *buffer.shape[2:]).index_select(0, slots)


def _check_buffer(buffer: torch.Tensor) -> None:
    if buffer.dim() < 2 or not buffer.is_contiguous():
        raise RuntimeError(f"buffer must be a contiguous [num_pages, page_size, ...] tensor, got {tuple(buffer.shape)}")


# -- fused layer ops: the model's unfused torch code, which the fused kernels must reproduce ----------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen2's RMSNorm: normalised in float32, cast back to ``x``'s dtype, then scaled by ``weight``."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x + residual`` (the residual stream after a sublayer), then ``(rms_norm(h), h)``."""
    h = x + residual
    return rms_norm(h, weight, eps), h


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = [gate | up]`` along the last dim."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the last dim (the rotary pairing Qwen uses)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary on ``q [N, Hq, D]`` and ``k [N, Hk, D]`` with ``cos``/``sin [N, D]``, computed in their dtype.

    With ``cos``/``sin`` in the model dtype every product and the sum round to it (the language model);
    with float32 tables the rotation is done in float32 and rounded once (the vision tower).
    """
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)  # [N, 1, D]
    qc, kc = q.to(cos.dtype), k.to(cos.dtype)
    return (qc * c + rotate_half(qc) * s).to(q.dtype), (kc * c + rotate_half(kc) * s).to(k.dtype)


def rotary_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 write_rows: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`rotary` on ``q`` and ``k``, then row ``r``'s K/V (row ``write_rows[r]``'s when given) into
    slot ``slot_mapping[r]`` of ``k_cache``/``v_cache`` ``[slots, Hk, D]``. Returns the rotated ``q``."""
    q, k = rotary(q, k, cos, sin)
    if write_rows is not None:
        k, v = k[write_rows], v[write_rows]
    k_cache.index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slot_mapping, v.to(v_cache.dtype))
    return q


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                           valid: torch.Tensor, scale: float) -> torch.Tensor:
    """Gather each sequence's keys and values (``[B, L, Hkv, D]``), then SDPA over the valid positions."""
    keys, values = k_cache[slots], v_cache[slots]  # [B, L, kv_heads, head_dim]
    qt, kt, vt = q.unsqueeze(2), keys.to(q.dtype).transpose(1, 2), values.to(q.dtype).transpose(1, 2)  # [B, H, L, D]
    out = torch.nn.functional.scaled_dot_product_attention(
        qt, kt, vt, attn_mask=valid[:, None, None, :], scale=scale, enable_gqa=q.shape[1] != k_cache.shape[1])
    return out[:, :, 0]  # [B, q_heads, head_dim]

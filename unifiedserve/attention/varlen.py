"""Bidirectional attention inside consecutive segments of rows (the vision tower's window and
full-frame attention), as one fused call per layer.

Implementations, selectable so a GPU run can measure them against each other:

* ``grouped``: segments of equal length batched into one SDPA call each (a handful of calls per
  layer; lives in :mod:`unifiedserve.model.vision`, the CPU path).
* ``padded``: every segment padded to the longest into one ``[S, H, L, D]`` SDPA call with a
  key-padding mask (the block-diagonal mask, stored per block); one call per layer, at the cost of
  attending over the padding.
* ``flashinfer``: flashinfer's ``BatchPrefillWithRaggedKVCacheWrapper`` (``causal=False``), one
  ragged kernel per layer with no padding of segments; CUDA, float16/bfloat16 only. Its kernels
  are built for head dims 64/128/256 (the FA3 path asserts it), so other head dims (the ViT's 80)
  are zero-padded up to the next one: zeros add nothing to q·k, and the padded output columns
  are dropped. The softmax scale stays that of the true head dim.

``auto`` is ``grouped`` on CPU; on CUDA ``flashinfer`` when it imports and the dtype is half,
else ``grouped``.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from unifiedserve.attention.flashinfer_backend import SUPPORTED_HEAD_DIMS

VARLEN_IMPLS = ("auto", "grouped", "padded", "flashinfer")
_HALF = (torch.float16, torch.bfloat16)
#: planned ragged wrappers kept per (segments, device, dtype, heads, head_dim): the tower uses two
#: segmentations per forward (windows and frames), so a few entries cover the current grids.
_MAX_PLANS = 4


def check_varlen_impl(impl: str) -> str:
    """``impl`` if it is one of :data:`VARLEN_IMPLS`, else ``ValueError`` naming the choices."""
    if impl not in VARLEN_IMPLS:
        raise ValueError(f"unknown vision attention implementation {impl!r}; choose one of {', '.join(VARLEN_IMPLS)}")
    return impl


@functools.lru_cache(maxsize=1)
def _flashinfer_available() -> bool:
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_varlen_impl(impl: str, device: torch.device, dtype: torch.dtype) -> str:
    """The concrete implementation ``impl`` stands for on this device and dtype.

    Raises:
        ValueError: an unknown name, or ``flashinfer`` where it cannot run (not CUDA, not half
            precision, not installed).
    """
    check_varlen_impl(impl)
    usable = device.type == "cuda" and dtype in _HALF and _flashinfer_available()
    if impl == "auto":
        return "flashinfer" if usable else "grouped"
    if impl == "flashinfer" and not usable:
        raise ValueError(f"flashinfer vision attention needs CUDA, float16/bfloat16 and flashinfer installed "
                         f"(device {device}, dtype {dtype})")
    return impl


def fused_varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: Sequence[int],
                           scale: float, impl: str) -> torch.Tensor:
    """Attention inside each segment with one call: q, k, v ``[N, H, D]`` -> ``[N, H, D]``.

    Args:
        seq_lens: segment lengths, summing to ``N``.
        impl: ``padded`` or ``flashinfer`` (``grouped`` lives with the tower).

    Raises:
        ValueError: segments that do not cover the rows, or an implementation not served here.
    """
    if sum(seq_lens) != q.shape[0] or min(seq_lens, default=1) < 1:
        raise ValueError(f"segments {len(seq_lens)} (sum {sum(seq_lens)}) must be positive and cover {q.shape[0]} rows")
    if impl == "padded":
        return _padded(q, k, v, tuple(seq_lens), scale)
    if impl == "flashinfer":
        return _ragged(q, k, v, tuple(seq_lens), scale)
    raise ValueError(f"fused_varlen_attention serves 'padded' and 'flashinfer', got {impl!r}")


@functools.lru_cache(maxsize=8)
def padded_layout(seq_lens: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Index maps for padding segments to the longest one (built once per segmentation).

    Returns:
        ``gather`` int64 [S, L]: source row of each padded position (row 0 for padding);
        ``valid`` bool [S, L]: the position holds a real row;
        ``rows`` int64 [N]: flat padded position ``s * L + i`` of each real row, in row order.
    """
    lens = torch.tensor(seq_lens, dtype=torch.int64)  # [S]
    longest = int(lens.max())
    starts = torch.cumsum(lens, 0) - lens  # [S]
    offsets = torch.arange(longest)  # [L]
    valid = offsets[None, :] < lens[:, None]  # [S, L]
    gather = torch.where(valid, starts[:, None] + offsets[None, :], torch.zeros((), dtype=torch.int64))
    rows = torch.nonzero(valid.flatten()).flatten()  # [N], in row order because segments are consecutive
    # queued copies (host tensors built here): the encode step does not wait for the device
    return gather.to(device, non_blocking=True), valid.to(device, non_blocking=True), rows.to(device, non_blocking=True)


def _padded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: tuple[int, ...],
            scale: float) -> torch.Tensor:
    n, h, d = q.shape
    gather, valid, rows = padded_layout(seq_lens, q.device)
    qs, ks, vs = (x[gather].transpose(1, 2) for x in (q, k, v))  # [S, H, L, D]
    mask = valid[:, None, None, :]  # [S, 1, 1, L]: keys of the segment only
    o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)  # [S, H, L, D]
    return o.transpose(1, 2).reshape(-1, h, d)[rows]  # [N, H, D]


def kernel_head_dim(head_dim: int) -> int | None:
    """The head dim flashinfer's kernel runs for ``head_dim`` (zero-padded up to it), or None past 256."""
    return next((d for d in SUPPORTED_HEAD_DIMS if d >= head_dim), None)


def _ragged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: tuple[int, ...],
            scale: float) -> torch.Tensor:
    head_dim = q.shape[2]
    kernel_dim = kernel_head_dim(head_dim)
    if kernel_dim is None:
        raise ValueError(f"flashinfer vision attention supports head dims up to 256, got {head_dim}")
    if kernel_dim != head_dim:
        q, k, v = (F.pad(x, (0, kernel_dim - head_dim)) for x in (q, k, v))  # [N, H, kernel_dim]
    else:  # the tower's v is a strided view of its fused qkv output; hand the kernel dense rows
        q, k, v = (x.contiguous() for x in (q, k, v))
    wrapper = _ragged_wrapper(seq_lens, q.device, q.dtype, q.shape[1], kernel_dim, scale)
    return wrapper.run(q, k, v)[..., :head_dim]  # [N, H, head_dim]


_WORKSPACES: dict[torch.device, torch.Tensor] = {}
_PLANS: OrderedDict[tuple, Any] = OrderedDict()


def _ragged_wrapper(seq_lens: tuple[int, ...], device: torch.device, dtype: torch.dtype, num_heads: int,
                    head_dim: int, scale: float) -> Any:
    """A ragged prefill wrapper planned for these segments (cached: planning is host work)."""
    key = (seq_lens, device, dtype, num_heads, head_dim, scale)
    wrapper = _PLANS.get(key)
    if wrapper is not None:
        _PLANS.move_to_end(key)
        return wrapper
    from unifiedserve.attention.flashinfer_backend import WORKSPACE_BYTES, import_flashinfer, prefill_backend
    backend = prefill_backend()
    fi = import_flashinfer()
    if device not in _WORKSPACES:
        _WORKSPACES[device] = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    indptr = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(torch.tensor(seq_lens, dtype=torch.int32), 0)
    wrapper = fi.BatchPrefillWithRaggedKVCacheWrapper(_WORKSPACES[device], kv_layout="NHD", backend=backend)
    wrapper.plan(indptr, indptr, num_heads, num_heads, head_dim, causal=False, sm_scale=scale,
                 q_data_type=dtype, kv_data_type=dtype)
    _PLANS[key] = wrapper
    if len(_PLANS) > _MAX_PLANS:
        _PLANS.popitem(last=False)
    return wrapper

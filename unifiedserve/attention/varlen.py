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
* ``varlen``: torch's own ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention-2 inside
  torch, torch >= 2.9): one ragged kernel per layer from cumulative segment offsets, taking the
  tower's head dim 80 as it is and the q/k/v views of the fused qkv output without copies; CUDA,
  float16/bfloat16 only. Against ``flashinfer`` it saves the three pads to 128 and the slice back
  (a quarter of a layer's elementwise traffic) and computes 80 columns instead of 128. On an H100
  (2026-11-26, ``bench/engine``'s vision split, the 7B preset's tower, 23296 patches, bfloat16) the
  whole tower took 67.8 ms with it against 81.0 ms with ``flashinfer``, 73.9 ms ``padded`` and
  84.9 ms ``grouped``.

``auto`` is ``grouped`` on CPU; on CUDA in half precision ``varlen`` when this torch has it, else
``flashinfer`` when it imports, else ``grouped``. ``UNIFIEDSERVE_VISION_ATTENTION`` names the tower's
default instead of ``auto`` (:func:`default_varlen_impl`), so a GPU run can switch the server's kernel
without a code change.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from unifiedserve.attention.flashinfer_backend import SUPPORTED_HEAD_DIMS

VARLEN_IMPLS = ("auto", "grouped", "padded", "flashinfer", "varlen")
#: the environment variable naming the vision tower's default implementation (``auto`` when unset)
VARLEN_IMPL_ENV = "UNIFIEDSERVE_VISION_ATTENTION"
_HALF = (torch.float16, torch.bfloat16)
#: planned ragged wrappers kept per (segments, device, dtype, heads, head_dim): the tower uses two
#: segmentations per forward (windows and frames), so a few entries cover the current grids.
_MAX_PLANS = 4


def check_varlen_impl(impl: str) -> str:
    """``impl`` if it is one of :data:`VARLEN_IMPLS`, else ``ValueError`` naming the choices."""
    if impl not in VARLEN_IMPLS:
        raise ValueError(f"unknown vision attention implementation {impl!r}; choose one of {', '.join(VARLEN_IMPLS)}")
    return impl


def default_varlen_impl() -> str:
    """The tower's default implementation: ``UNIFIEDSERVE_VISION_ATTENTION`` when set, else ``auto``.

    Raises:
        ValueError: the variable names no implementation (the message names the variable and the choices).
    """
    impl = os.environ.get(VARLEN_IMPL_ENV, "").strip() or "auto"
    try:
        return check_varlen_impl(impl)
    except ValueError as e:
        raise ValueError(f"{VARLEN_IMPL_ENV}: {e}") from None


@functools.lru_cache(maxsize=1)
def torch_varlen_attn() -> Any:
    """torch's ``varlen_attn`` (torch >= 2.9), or None when this torch lacks it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


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
    half_on_cuda = device.type == "cuda" and dtype in _HALF
    usable = half_on_cuda and _flashinfer_available()
    if impl == "auto":  # the fastest measured (module docstring) that can run here
        if half_on_cuda and torch_varlen_attn() is not None:
            return "varlen"
        return "flashinfer" if usable else "grouped"
    if impl == "flashinfer" and not usable:
        raise ValueError(f"flashinfer vision attention needs CUDA, float16/bfloat16 and flashinfer installed "
                         f"(device {device}, dtype {dtype})")
    if impl == "varlen" and not (half_on_cuda and torch_varlen_attn() is not None):
        raise ValueError(f"varlen vision attention needs CUDA, float16/bfloat16 and torch >= 2.9 "
                         f"(device {device}, dtype {dtype}, torch {torch.__version__})")
    return impl


def fused_varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: Sequence[int],
                           scale: float, impl: str) -> torch.Tensor:
    """Attention inside each segment with one call: q, k, v ``[N, H, D]`` -> ``[N, H, D]``.

    Args:
        seq_lens: segment lengths, summing to ``N``.
        impl: ``padded``, ``flashinfer`` or ``varlen`` (``grouped`` lives with the tower).

    Raises:
        ValueError: segments that do not cover the rows, or an implementation not served here.
    """
    if sum(seq_lens) != q.shape[0] or min(seq_lens, default=1) < 1:
        raise ValueError(f"segments {len(seq_lens)} (sum {sum(seq_lens)}) must be positive and cover {q.shape[0]} rows")
    if impl == "padded":
        return _padded(q, k, v, tuple(seq_lens), scale)
    if impl == "flashinfer":
        return _ragged(q, k, v, tuple(seq_lens), scale)
    if impl == "varlen":
        return _torch_varlen(q, k, v, tuple(seq_lens), scale)
    raise ValueError(f"fused_varlen_attention serves 'padded', 'flashinfer' and 'varlen', got {impl!r}")


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


@functools.lru_cache(maxsize=8)
def cumulative_offsets(seq_lens: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """int32 ``[S + 1]`` start row of each segment and the total (built once per segmentation, queued copy)."""
    offsets = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    offsets[1:] = torch.cumsum(torch.tensor(seq_lens, dtype=torch.int32), 0)
    return offsets.to(device, non_blocking=True)


@functools.lru_cache(maxsize=1)
def _takes_scale(fn: Any) -> bool:
    """Whether this torch's ``varlen_attn`` takes ``scale`` (2.9's does not: its scale is ``D ** -0.5``)."""
    return "scale" in inspect.signature(fn).parameters


def _torch_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: tuple[int, ...],
                  scale: float) -> torch.Tensor:
    fn = torch_varlen_attn()
    if fn is None:
        raise ValueError(f"varlen vision attention needs torch >= 2.9 (this is {torch.__version__})")
    offsets = cumulative_offsets(seq_lens, q.device)
    longest = max(seq_lens)
    if _takes_scale(fn):
        return fn(q, k, v, offsets, offsets, longest, longest, scale=scale)  # [N, H, D]
    if abs(scale - q.shape[2] ** -0.5) > 1e-12 * scale:
        raise ValueError(f"this torch's varlen_attn ({torch.__version__}) only scales by head_dim ** -0.5, "
                         f"asked for {scale}")
    return fn(q, k, v, offsets, offsets, longest, longest)  # [N, H, D]


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

"""Attention over a paged KV cache: one interface (``plan`` per step, ``forward`` per layer) and its backends.

Backends: :class:`TorchPagedAttention` (plain torch SDPA; the CPU path and the CUDA fallback) and
``FlashInferAttention`` (CUDA, flashinfer's paged prefill/decode kernels; imported lazily).
"""

from __future__ import annotations

import logging

import torch

from unifiedserve.attention.base import AttentionBackend, AttentionMetadata, KVCache
from unifiedserve.attention.metadata import PagedBatch, SeqSpec, build_paged_batch, pad_decode_batch
from unifiedserve.attention.torch_sdpa import TorchPagedAttention

__all__ = ["AttentionBackend", "AttentionMetadata", "KVCache", "PagedBatch", "SeqSpec", "TorchPagedAttention",
           "BACKEND_NAMES", "build_paged_batch", "get_attention_backend", "pad_decode_batch"]

log = logging.getLogger(__name__)

#: Names ``get_attention_backend`` accepts.
BACKEND_NAMES = ("auto", "flashinfer", "torch")


def get_attention_backend(device: str | torch.device, name: str = "auto", dtype: torch.dtype | None = None,
                          head_dim: int | None = None) -> type[AttentionBackend]:
    """The backend class to build for a device.

    Args:
        device: where the KV cache lives (``cpu``, ``cuda``, ``cuda:1``, ...).
        name: ``auto`` (flashinfer on CUDA when it imports and serves ``dtype`` and ``head_dim``,
            else torch, with one log line saying why), ``flashinfer`` or ``torch``.
        dtype: the KV cache dtype, when known (flashinfer takes float16/bfloat16 only).
        head_dim: the attention head dim, when known (flashinfer: 64, 128 or 256).

    Returns:
        An :class:`AttentionBackend` subclass (construct it with the KV cache and head counts).

    Raises:
        ValueError: an unknown name, or ``flashinfer`` asked for where it cannot run.
    """
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")
    if name == "torch":
        return TorchPagedAttention
    from unifiedserve.attention.flashinfer_backend import FlashInferAttention, unsupported_reason
    reason = unsupported_reason(device, dtype, head_dim)
    if reason is None:
        try:
            import flashinfer  # noqa: F401  (a CUDA-only extra: imported only when CUDA asks for it)
        except ImportError as exc:
            reason = f"flashinfer does not import ({exc})"
        else:
            return FlashInferAttention
    if name == "flashinfer":
        raise ValueError(f"the flashinfer attention backend cannot run here: {reason}")
    if torch.device(device).type == "cuda":  # on CPU torch is the only choice: nothing to explain
        log.info("attention backend: torch SDPA (%s)", reason)
    return TorchPagedAttention

"""Attention over a paged KV cache: one interface, a CPU implementation, a CUDA (flashinfer) slot."""

from unifiedserve.attention.base import AttentionBackend, AttentionMetadata, KVCache
from unifiedserve.attention.cpu import TorchPagedAttention

__all__ = ["AttentionBackend", "AttentionMetadata", "KVCache", "TorchPagedAttention", "get_attention_backend"]


def get_attention_backend(device: str) -> type[AttentionBackend]:
    """The backend class for a device: torch on CPU; flashinfer on CUDA comes with the GPU issue."""
    if device.startswith("cuda"):
        raise NotImplementedError("the flashinfer backend for CUDA is not built yet; use --device cpu")
    return TorchPagedAttention

"""One copy of the language model's weights for every process that runs it.

The core process (prefill) and the decode process both run the LLM. Loading it in each would hold
its weights twice: for Qwen2.5-VL-7B in bf16, 2 x 15 GB of one GPU's memory (paper §6 shares them).
Instead the launcher allocates one byte pool of :func:`llm_weight_bytes` (shared memory on CPU, a
CUDA IPC pool on GPU); the core process binds its LLM parameters to views of that pool and fills
them from the checkpoint; the decode process binds its parameters to the same bytes and reads
nothing. Both layouts come from :func:`weight_layout` of the same config, so they agree.

Invariant: a bound parameter *is* a view of the pool (no copy), so a write by one process is seen
by the other; parameters are never written after loading.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from unifiedserve.model.config import ModelConfig

__all__ = ["WeightSlot", "bind_parameters", "llm_weight_bytes", "weight_layout"]

#: Every parameter starts at a multiple of this many bytes (vectorised loads on any device).
ALIGN_BYTES = 256


@dataclass(frozen=True)
class WeightSlot:
    """Where one parameter lives in the pool."""

    name: str
    offset: int  # bytes from the pool's start
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def num_bytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize


def weight_layout(module: nn.Module) -> list[WeightSlot]:
    """Slots for ``module``'s parameters in ``named_parameters`` order (works on a meta module)."""
    slots, offset = [], 0
    for name, param in module.named_parameters():
        slots.append(WeightSlot(name, offset, tuple(param.shape), param.dtype))
        offset += -(-slots[-1].num_bytes // ALIGN_BYTES) * ALIGN_BYTES
    return slots


def llm_weight_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of the pool that holds the language model of ``config`` in ``dtype`` (nothing allocated)."""
    from unifiedserve.model.llm import LanguageModel

    with torch.device("meta"):
        llm = LanguageModel(config.text, config.tie_word_embeddings).to(dtype)
    slots = weight_layout(llm)
    return slots[-1].offset + slots[-1].num_bytes if slots else 0


def bind_parameters(module: nn.Module, storage: torch.Tensor) -> list[WeightSlot]:
    """Make every parameter of ``module`` a view into ``storage``; returns the layout used.

    The parameters' dtypes and shapes are kept (the module may be on the meta device: nothing is
    copied, values are whatever the pool holds).

    Args:
        module: e.g. ``model.language_model``.
        storage: uint8 ``[num_bytes]``, contiguous, at least :func:`weight_layout`'s size, on the device
            the module should run on.
    Raises:
        ValueError: ``storage`` is not a flat contiguous uint8 tensor, or is too small.
    """
    if storage.dtype != torch.uint8 or storage.dim() != 1 or not storage.is_contiguous():
        raise ValueError(f"weight storage must be a flat contiguous uint8 tensor, got {storage.dtype} "
                         f"{list(storage.shape)}")
    slots = weight_layout(module)
    need = slots[-1].offset + slots[-1].num_bytes if slots else 0
    if storage.numel() < need:
        raise ValueError(f"weight storage holds {storage.numel()} bytes, the parameters need {need}")
    owners = dict(module.named_modules())
    for slot in slots:
        parent, _, attr = slot.name.rpartition(".")
        view = storage[slot.offset:slot.offset + slot.num_bytes].view(slot.dtype).view(slot.shape)
        owners[parent]._parameters[attr] = nn.Parameter(view, requires_grad=False)
    return slots

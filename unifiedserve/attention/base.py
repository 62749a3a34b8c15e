"""The attention interface the model calls, and the paged KV cache it reads and writes.

A step's batch is *flattened*: the new tokens of every sequence (a prefill chunk, or one decode
token) are concatenated into ``N`` rows. :class:`AttentionMetadata` says which rows belong to which
sequence, how much of each sequence is already cached, and where each new token's K/V goes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


class KVCache:
    """``[layers, 2, num_blocks, block_size, kv_heads, head_dim]``: K and V per layer, in blocks.

    The tensor may live in shared memory (CPU) or be opened from a CUDA IPC handle: the cache
    never allocates on its own when ``storage`` is given.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 storage: torch.Tensor | None = None):
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        if storage is None:
            storage = torch.zeros(shape, dtype=dtype, device=device)
        elif tuple(storage.shape) != shape:
            raise ValueError(f"KV storage has shape {tuple(storage.shape)}, expected {shape}")
        self.tensor = storage
        self.block_size = block_size
        self.num_blocks = num_blocks

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer as ``[num_blocks * block_size, kv_heads, head_dim]`` (slot-indexed views)."""
        kv = self.tensor[layer]
        return kv[0].flatten(0, 1), kv[1].flatten(0, 1)

    @property
    def num_bytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


@dataclass
class AttentionMetadata:
    """Where a flattened batch's tokens come from and go to. Built once per step by the runner."""

    #: int64 [B+1]: rows of sequence b are ``query_start_loc[b]:query_start_loc[b+1]``.
    query_start_loc: torch.Tensor
    #: int64 [B]: tokens of sequence b already in the cache before this step.
    context_lens: torch.Tensor
    #: int64 [B]: ``context_lens + new tokens``: the keys each sequence attends to after the write.
    seq_lens: torch.Tensor
    #: int64 [B, max_blocks]: KV block ids of each sequence, in order (padding past the end is ignored).
    block_tables: torch.Tensor
    #: int64 [N]: cache slot (``block * block_size + offset``) for each new token's K and V.
    slot_mapping: torch.Tensor
    #: True when every sequence contributes exactly one token (a pure decode step).
    is_decode: bool = False

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @classmethod
    def build(cls, seqs: list[tuple[int, int, list[int]]], block_size: int,
              device: str | torch.device = "cpu") -> "AttentionMetadata":
        """From ``(context_len, num_new_tokens, block_ids)`` per sequence."""
        starts, slots = [0], []
        for context_len, num_new, blocks in seqs:
            starts.append(starts[-1] + num_new)
            for pos in range(context_len, context_len + num_new):
                slots.append(blocks[pos // block_size] * block_size + pos % block_size)
        width = max((len(b) for _, _, b in seqs), default=0)
        tables = torch.zeros((len(seqs), max(width, 1)), dtype=torch.int64)
        for i, (_, _, blocks) in enumerate(seqs):
            tables[i, :len(blocks)] = torch.tensor(blocks, dtype=torch.int64)
        context = torch.tensor([c for c, _, _ in seqs], dtype=torch.int64)
        new = torch.tensor([n for _, n, _ in seqs], dtype=torch.int64)
        return cls(
            query_start_loc=torch.tensor(starts, dtype=torch.int64, device=device),
            context_lens=context.to(device), seq_lens=(context + new).to(device),
            block_tables=tables.to(device), slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            is_decode=bool(seqs) and all(n == 1 for _, n, _ in seqs),
        )


class AttentionBackend(ABC):
    """Causal self-attention of new tokens over each sequence's cached prefix plus themselves.

    ``forward`` first writes the new K/V into their slots, then attends. Shapes:
    q ``[N, q_heads, head_dim]``, k/v ``[N, kv_heads, head_dim]`` -> ``[N, q_heads, head_dim]``.
    """

    def __init__(self, kv_cache: KVCache, num_q_heads: int, num_kv_heads: int, head_dim: int,
                 scale: float | None = None):
        self.kv_cache = kv_cache
        self.num_q_heads = num_q_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale if scale is not None else head_dim ** -0.5
        self.metadata: AttentionMetadata | None = None

    def begin(self, metadata: AttentionMetadata) -> None:
        """Set the metadata for the next model forward (all layers share it)."""
        self.metadata = metadata

    @abstractmethod
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...

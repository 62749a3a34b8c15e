"""The attention interface the model calls, and the paged KV cache it reads and writes.

A step's batch is *flattened*: the new tokens of every sequence (a prefill chunk, or one decode
token) are concatenated into ``N`` rows, sequence after sequence. Once per step, outside the model
forward, the runner hands the backend the step's sequences as :data:`SeqSpec` tuples
(:meth:`AttentionBackend.plan`); the backend builds whatever per-step metadata its kernels need
(slot maps, masks, flashinfer's indptr arrays) and every layer's :meth:`AttentionBackend.forward`
reuses it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from unifiedserve.attention.metadata import SeqSpec
from unifiedserve.memory.transfer import write_to
from unifiedserve.ops.skinny_rope import RopeWrite


class KVCache:
    """``[layers, 2, num_blocks, block_size, kv_heads, head_dim]``: K and V per layer, in blocks.

    Per layer, K and V are each ``[num_blocks, block_size, kv_heads, head_dim]``: flashinfer's
    ``NHD`` paged layout. The tensor may live in shared memory (CPU) or be opened from a CUDA IPC
    handle: the cache never allocates on its own when ``storage`` is given.
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

    def paged_layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer as ``[num_blocks, block_size, kv_heads, head_dim]`` (page-indexed views)."""
        kv = self.tensor[layer]
        return kv[0], kv[1]

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    @property
    def num_bytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


@dataclass
class AttentionMetadata:
    """Where a flattened batch's tokens come from and go to (the pre-``plan`` interface).

    Kept while callers still use :meth:`AttentionBackend.begin`; new code calls ``plan(seqs)``.
    """

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

    def to_seqs(self, block_size: int) -> list[SeqSpec]:
        """The :data:`SeqSpec` tuples this metadata was built from (blocks trimmed to the used ones)."""
        out = []
        for context_len, seq_len, table in zip(self.context_lens.tolist(), self.seq_lens.tolist(),
                                               self.block_tables.tolist()):
            out.append((context_len, seq_len - context_len, table[:-(-seq_len // block_size)]))
        return out


class AttentionBackend(ABC):
    """Causal self-attention of a step's new tokens over each sequence's cached prefix plus themselves.

    Protocol, per step:

    1. ``plan(seqs)`` once, **outside** the model forward and outside any CUDA graph. It may do host
       work (Python loops, host-to-device copies) and validates the step (``ValueError`` on block
       tables too short for their tokens, empty sequences, ...).
    2. ``forward(layer, q, k, v)`` (or ``forward_rope``, which applies the rotary first) once per
       layer inside the forward: writes the new K/V of the ``N`` rows into their cache slots, then
       attends. Shapes: q ``[N, q_heads, head_dim]``,
       k/v ``[N, kv_heads, head_dim]`` -> ``[N, q_heads, head_dim]`` in q's dtype. On CUDA backends
       ``forward`` never synchronizes with the host (no ``.item()``/``.tolist()``, no host-built
       tensors), so a forward can be captured in a CUDA graph. All layers share the plan.

    The plan stays valid until the next ``plan``; a ``forward`` whose row count differs from the
    planned one raises ``ValueError`` (checked from shapes only, no sync).

    **CUDA-graph decode** (backends with ``supports_cuda_graph``):

    1. ``init_cuda_graph(batch_sizes, max_seq_len)`` once, before capture: allocates static
       metadata buffers for each batch size that will be captured.
    2. For capture and for every replay, ``plan(seqs, graph_batch_size=B)`` with ``B`` one of those
       sizes, ``1 <= len(seqs) <= B`` and every sequence a decode (``num_new_tokens == 1``,
       ``num_cached_tokens + 1 <= max_seq_len``). It only *writes into* the static buffers, so a
       graph captured after one such ``plan`` replays correctly after the next.
    3. ``forward`` then takes exactly ``B`` rows: rows ``len(seqs)..B-1`` are padding; their outputs
       are unspecified and they never change the cache (their K/V writes repeat row 0's write).

    A backend may capture more than one graph per batch size (:meth:`graph_variants`: flashinfer's split-KV
    decode and its split-free one); each step then replays the one :meth:`graph_variant` names for it, planned
    with ``plan(seqs, graph_batch_size=B, graph_variant=...)``. Backends with one kind of graph name it ``""``.

    ``warmup()`` compiles or loads the kernels for this backend's shapes and dtype, so that first
    use (a JIT compile of tens of seconds for flashinfer) never lands on a request's path; call it
    once at start-up.
    """

    #: True when :meth:`init_cuda_graph` and ``plan(..., graph_batch_size=...)`` are implemented.
    supports_cuda_graph: bool = False

    def __init__(self, kv_cache: KVCache, num_q_heads: int, num_kv_heads: int, head_dim: int,
                 scale: float | None = None):
        if num_q_heads % num_kv_heads:
            raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.kv_cache = kv_cache
        self.num_q_heads = num_q_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale if scale is not None else head_dim ** -0.5
        self.metadata: AttentionMetadata | None = None

    @abstractmethod
    def plan(self, seqs: Sequence[SeqSpec], graph_batch_size: int | None = None,
             graph_variant: str | None = None) -> None:
        """Build this step's metadata from the sequences, in row order (see the class docstring).

        Args:
            seqs: one :data:`SeqSpec` per sequence, in the order of their rows.
            graph_batch_size: plan a CUDA-graph decode step padded to this many rows (a size given
                to :meth:`init_cuda_graph`); ``None`` for an eager step.
            graph_variant: which graph of that size the step runs (:meth:`graph_variants`); ``None``: the one
                :meth:`graph_variant` picks for these sequences.

        Raises:
            ValueError: empty or inconsistent sequences, or a graph plan the backend cannot serve.
        """

    def begin(self, metadata: AttentionMetadata) -> None:
        """Pre-``plan`` entry point: plans the step described by ``metadata`` (reads it on the host)."""
        self.metadata = metadata
        self.plan(metadata.to_seqs(self.kv_cache.block_size))

    @abstractmethod
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...

    def forward_rope(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` of ``q`` and ``k`` after the rotary embedding (``cos``/``sin [N, head_dim]``).

        What the model calls. Backends that own their K/V write override it to rotate and write the
        cache in one pass (:func:`unifiedserve.ops.rotary_cache`); this default rotates, then forwards.
        """
        from unifiedserve import ops

        q, k = ops.rotary(q, k, cos, sin)
        return self.forward(layer, q, k, v)

    def rope_write(self, layer: int, cos: torch.Tensor, sin: torch.Tensor) -> RopeWrite | None:
        """Where this step's rotary tables come from and its K/V go, for a Q/K/V projection that rotates and writes
        them itself (:func:`unifiedserve.ops.skinny.norm_qkv_rope`): a :class:`~unifiedserve.ops.skinny_rope.RopeWrite`
        over this layer's cache slots, then :meth:`forward_rotated`. None where the backend writes its own K/V
        (no :meth:`_kv_write_rows`), before a plan, or for tables in another dtype than the cache's (the fused
        write stores in the model's dtype): the model then calls :meth:`forward_rope`."""
        rows = self._kv_write_rows()
        if rows is None or cos.dtype != self.kv_cache.dtype:
            return None
        k_slots, v_slots = self.kv_cache.layer(layer)
        return RopeWrite(cos, sin, self.num_q_heads, self.num_kv_heads, k_slots, v_slots, *rows)

    def _kv_write_rows(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The planned step's ``(slot_mapping, write_rows)`` (int64 ``[N]`` on the cache's device; write_rows None
        but for a padded graph step), for backends that can attend over K/V written by the projection; else None."""
        return None

    def forward_rotated(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Attention of ``q [N, Hq, D]``, already rotated, over the cache whose new K/V are already written (what
        :meth:`rope_write` promised)."""
        raise NotImplementedError(f"{type(self).__name__} writes its own K/V: call forward_rope")

    def init_cuda_graph(self, batch_sizes: Sequence[int], max_seq_len: int) -> None:
        """Allocate static metadata buffers for CUDA-graph decode at these batch sizes.

        Args:
            batch_sizes: the decode batch sizes that will be captured (each ≥ 1).
            max_seq_len: the longest sequence (cached tokens + the new one) a graph step may hold.

        Raises:
            ValueError: the backend has no CUDA-graph support (``supports_cuda_graph`` is False),
                or a size is not positive.
        """
        raise ValueError(f"{type(self).__name__} does not support CUDA-graph decode; run decode eagerly")

    def graph_variants(self, batch_size: int) -> tuple[str, ...]:
        """The decode graphs to capture at ``batch_size`` (after :meth:`init_cuda_graph`), by name."""
        return ("",)

    def graph_variant(self, seqs: Sequence[SeqSpec], batch_size: int) -> str:
        """Which of :meth:`graph_variants` a graph step of these sequences, padded to ``batch_size``, replays."""
        return ""

    def tune_graph_variants(self, num_layers: int) -> list:
        """Time this backend's graph variants on the device and keep, per batch size, the one each step length
        runs fastest with (after :meth:`init_cuda_graph`, before capture and before any request: it writes K/V
        into the cache). Returns what it measured; nothing for a backend with one kind of graph."""
        return []

    def offer_every_graph_variant(self) -> None:
        """Capture every variant at every batch size (the memory profile: the most the graphs may hold)."""

    def warmup(self) -> None:
        """Compile/load this backend's kernels for its shapes once, before serving (no-op when none)."""


def copy_host_ints(dst: torch.Tensor, values: Sequence[int]) -> None:
    """Write host ints into a fixed device buffer (a CUDA graph's input) as one queued copy (``write_to``): on every
    graph replay a blocking copy would wait for every step already queued. ``dst`` must be contiguous."""
    write_to(dst, torch.as_tensor(values, dtype=dst.dtype).view(dst.shape))

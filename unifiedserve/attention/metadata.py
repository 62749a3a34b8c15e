"""Per-step paged-attention metadata from block tables: pure Python over ids (no torch).

The arrays follow flashinfer's paged-KV convention, which the torch backends read too:

* ``qo_indptr`` ``[B+1]``: rows of sequence b are ``qo_indptr[b]:qo_indptr[b+1]``.
* ``paged_kv_indptr`` ``[B+1]`` and ``paged_kv_indices``: the KV blocks (pages) sequence b attends
  to, after this step's write, are ``paged_kv_indices[paged_kv_indptr[b]:paged_kv_indptr[b+1]]``.
* ``paged_kv_last_page_len`` ``[B]``: tokens used in that sequence's last page (1..block_size).
* ``slot_mapping`` ``[N]``: cache slot ``block * block_size + offset`` of each new row's K/V.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: One sequence of a step: ``(num_cached_tokens, num_new_tokens, block_ids)``. ``num_cached_tokens``
#: tokens of the sequence are already in the KV cache; the step adds ``num_new_tokens`` (>= 1) rows;
#: ``block_ids`` lists the sequence's KV blocks in order and covers at least
#: ``num_cached_tokens + num_new_tokens`` tokens (blocks past that are ignored).
SeqSpec = tuple[int, int, Sequence[int]]


@dataclass(frozen=True)
class PagedBatch:
    """One step's flattened batch in paged-KV terms (see the module docstring for each array)."""

    qo_indptr: list[int]
    paged_kv_indptr: list[int]
    paged_kv_indices: list[int]
    paged_kv_last_page_len: list[int]
    slot_mapping: list[int]
    #: tokens already cached per sequence before the step
    cached_lens: list[int]
    #: cached + new tokens per sequence: the keys each one attends to after the write
    kv_lens: list[int]
    #: ``[N]``: the row whose K/V each row writes; itself, except padding rows, which repeat row 0
    #: (same slot, same value, so a duplicate index write is harmless)
    write_rows: list[int]
    #: real sequences; rows and sequences past it are CUDA-graph padding
    num_real_seqs: int

    @property
    def num_seqs(self) -> int:
        return len(self.kv_lens)

    @property
    def num_tokens(self) -> int:
        return self.qo_indptr[-1]

    @property
    def is_decode(self) -> bool:
        """Every sequence adds exactly one row."""
        return self.num_tokens == self.num_seqs

    @property
    def max_kv_len(self) -> int:
        return max(self.kv_lens)


def build_paged_batch(seqs: Sequence[SeqSpec], block_size: int) -> PagedBatch:
    """The paged metadata of a step.

    Args:
        seqs: ``(num_cached_tokens, num_new_tokens, block_ids)`` per sequence, in row order.
        block_size: tokens per KV block.

    Returns:
        The step's :class:`PagedBatch`; only the blocks holding the sequence's
        ``num_cached_tokens + num_new_tokens`` tokens are listed.

    Raises:
        ValueError: no sequences, a negative cached count, a sequence with no new token, or a block
            table too short for its tokens.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if not seqs:
        raise ValueError("a step needs at least one sequence")
    qo_indptr, kv_indptr, indices, last_page_len = [0], [0], [], []
    slots, cached_lens, kv_lens = [], [], []
    for i, (num_cached, num_new, blocks) in enumerate(seqs):
        if num_cached < 0 or num_new < 1:
            raise ValueError(f"sequence {i}: needs num_cached_tokens >= 0 and num_new_tokens >= 1, "
                             f"got {num_cached} and {num_new}")
        kv_len = num_cached + num_new
        num_pages = -(-kv_len // block_size)
        if len(blocks) < num_pages:
            raise ValueError(f"sequence {i}: {kv_len} tokens need {num_pages} KV blocks of {block_size}, "
                             f"its block table has {len(blocks)}")
        pages = [int(b) for b in blocks[:num_pages]]
        qo_indptr.append(qo_indptr[-1] + num_new)
        kv_indptr.append(kv_indptr[-1] + num_pages)
        indices.extend(pages)
        last_page_len.append(kv_len - (num_pages - 1) * block_size)
        slots.extend(pages[pos // block_size] * block_size + pos % block_size for pos in range(num_cached, kv_len))
        cached_lens.append(num_cached)
        kv_lens.append(kv_len)
    return PagedBatch(qo_indptr, kv_indptr, indices, last_page_len, slots, cached_lens, kv_lens,
                      write_rows=list(range(qo_indptr[-1])), num_real_seqs=len(seqs))


def pad_decode_batch(batch: PagedBatch, batch_size: int) -> PagedBatch:
    """A decode batch padded to ``batch_size`` sequences for a captured CUDA graph.

    Each padding sequence attends to one token: the first token of sequence 0's first block (a
    harmless read), and rewrites sequence 0's new K/V into sequence 0's slot (a harmless write).

    Raises:
        ValueError: the batch is not a pure decode step, or has more sequences than ``batch_size``.
    """
    if not batch.is_decode:
        raise ValueError("only decode steps (one new token per sequence) can be padded for a CUDA graph")
    if batch.num_seqs > batch_size:
        raise ValueError(f"{batch.num_seqs} decode sequences do not fit a graph of batch size {batch_size}")
    pad = batch_size - batch.num_seqs
    first_page = batch.paged_kv_indices[0]
    return PagedBatch(
        qo_indptr=batch.qo_indptr + [batch.num_tokens + i + 1 for i in range(pad)],
        paged_kv_indptr=batch.paged_kv_indptr + [batch.paged_kv_indptr[-1] + i + 1 for i in range(pad)],
        paged_kv_indices=batch.paged_kv_indices + [first_page] * pad,
        paged_kv_last_page_len=batch.paged_kv_last_page_len + [1] * pad,
        slot_mapping=batch.slot_mapping + [batch.slot_mapping[0]] * pad,
        cached_lens=batch.cached_lens + [0] * pad,
        kv_lens=batch.kv_lens + [1] * pad,
        write_rows=batch.write_rows + [0] * pad,
        num_real_seqs=batch.num_real_seqs,
    )

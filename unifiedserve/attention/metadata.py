"""Per-step paged-attention metadata from block tables: numpy over ids (no torch), vectorized.

The arrays follow flashinfer's paged-KV convention, which the torch backends read too:

* ``qo_indptr`` ``[B+1]``: rows of sequence b are ``qo_indptr[b]:qo_indptr[b+1]``.
* ``paged_kv_indptr`` ``[B+1]`` and ``paged_kv_indices``: the KV blocks (pages) sequence b attends
  to, after this step's write, are ``paged_kv_indices[paged_kv_indptr[b]:paged_kv_indptr[b+1]]``.
* ``paged_kv_last_page_len`` ``[B]``: tokens used in that sequence's last page (1..block_size).
* ``slot_mapping`` ``[N]``: cache slot ``block * block_size + offset`` of each new row's K/V.

A step's host work must not grow with the tokens its sequences hold: a decode step of 8 sequences
of a 23k-token video lists 11.5k pages, which a Python loop over ids turned into 0.6 ms per step,
and its ``torch.tensor`` copy into another 0.6 (this machine, 2026-11-26). So the arrays are
numpy, built with a handful of whole-batch operations, and block tables held as int32 arrays
(:func:`as_block_table`) are sliced, not converted, per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import numpy as np

#: One sequence of a step: ``(num_cached_tokens, num_new_tokens, block_ids)``. ``num_cached_tokens``
#: tokens of the sequence are already in the KV cache; the step adds ``num_new_tokens`` (>= 1) rows;
#: ``block_ids`` lists the sequence's KV blocks in order and covers at least
#: ``num_cached_tokens + num_new_tokens`` tokens (blocks past that are ignored). An int32 numpy
#: array (:func:`as_block_table`) is used as it is; any other sequence of ints is converted.
SeqSpec = tuple[int, int, Sequence[int]]


def as_block_table(blocks: Sequence[int]) -> np.ndarray:
    """A block table as the int32 array :func:`build_paged_batch` slices without converting (keep one per
    request: it is converted once, not at every step)."""
    return np.ascontiguousarray(blocks, dtype=np.int32)


@dataclass(frozen=True)
class PagedBatch:
    """One step's flattened batch in paged-KV terms (see the module docstring for each array).

    The four flashinfer plan arrays are int32, the rest int64; all are 1-D numpy arrays.
    """

    qo_indptr: np.ndarray
    paged_kv_indptr: np.ndarray
    paged_kv_indices: np.ndarray
    paged_kv_last_page_len: np.ndarray
    slot_mapping: np.ndarray
    #: tokens already cached per sequence before the step
    cached_lens: np.ndarray
    #: cached + new tokens per sequence: the keys each one attends to after the write
    kv_lens: np.ndarray
    #: ``[N]``: the row whose K/V each row writes; itself, except padding rows, which repeat row 0
    #: (same slot, same value, so a duplicate index write is harmless)
    write_rows: np.ndarray
    #: real sequences; rows and sequences past it are CUDA-graph padding
    num_real_seqs: int
    #: the longest ``kv_lens`` entry (kept as an int: a numpy reduction per step costs more than the loop's max)
    max_kv_len: int

    @property
    def num_seqs(self) -> int:
        return len(self.kv_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.qo_indptr[-1])

    @property
    def is_decode(self) -> bool:
        """Every sequence adds exactly one row."""
        return self.num_tokens == self.num_seqs

    def pages(self, b: int) -> np.ndarray:
        """The pages sequence ``b`` attends to (a view of ``paged_kv_indices``)."""
        return self.paged_kv_indices[self.paged_kv_indptr[b]:self.paged_kv_indptr[b + 1]]


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
    n = len(seqs)
    # one pass of scalar work per sequence (cheap at any batch); the pages are sliced, never copied one by one
    cached_lens, new_lens, kv_lens, page_counts, last_lens, tables = [], [], [], [], [], []
    for i, (num_cached, num_new, blocks) in enumerate(seqs):
        if num_cached < 0 or num_new < 1:
            raise ValueError(f"sequence {i}: needs num_cached_tokens >= 0 and num_new_tokens >= 1, "
                             f"got {num_cached} and {num_new}")
        kv_len = num_cached + num_new
        num_pages = -(-kv_len // block_size)
        if len(blocks) < num_pages:
            raise ValueError(f"sequence {i}: {kv_len} tokens need {num_pages} KV blocks of {block_size}, "
                             f"its block table has {len(blocks)}")
        table = blocks[:num_pages]
        tables.append(table if isinstance(table, np.ndarray) else np.asarray(table, dtype=np.int32))
        cached_lens.append(num_cached)
        new_lens.append(num_new)
        kv_lens.append(kv_len)
        page_counts.append(num_pages)
        last_lens.append(kv_len - (num_pages - 1) * block_size)
    indices = (tables[0] if n == 1 else np.concatenate(tables)).astype(np.int32, copy=False)
    kv_indptr = np.fromiter(accumulate(page_counts, initial=0), dtype=np.int32, count=n + 1)
    cached = np.array(cached_lens, dtype=np.int64)
    num_tokens = sum(new_lens)
    if num_tokens == n:  # decode: row b is sequence b's one new token, at position cached[b]
        qo_indptr = np.arange(n + 1, dtype=np.int32)
        pos, first_page = cached, kv_indptr[:-1]
    else:  # every new row's position in its sequence, and where its sequence's pages start in the flat list
        qo_indptr = np.fromiter(accumulate(new_lens, initial=0), dtype=np.int32, count=n + 1)
        seq_of_row = np.repeat(np.arange(n), new_lens)  # [N]
        pos = np.arange(num_tokens, dtype=np.int64) - qo_indptr[seq_of_row] + cached[seq_of_row]  # [N]
        first_page = kv_indptr[seq_of_row]
    slots = indices[first_page + pos // block_size].astype(np.int64) * block_size + pos % block_size
    return PagedBatch(qo_indptr, kv_indptr, indices, np.array(last_lens, dtype=np.int32), slots, cached,
                      np.array(kv_lens, dtype=np.int64), write_rows=np.arange(num_tokens, dtype=np.int64),
                      num_real_seqs=n, max_kv_len=max(kv_lens))


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
    if pad == 0:
        return batch

    def grow(a: np.ndarray, tail) -> np.ndarray:
        return np.concatenate((a, np.asarray(tail, dtype=a.dtype)))

    steps = np.arange(1, pad + 1)
    return PagedBatch(
        qo_indptr=grow(batch.qo_indptr, batch.num_tokens + steps),
        paged_kv_indptr=grow(batch.paged_kv_indptr, batch.paged_kv_indptr[-1] + steps),
        paged_kv_indices=grow(batch.paged_kv_indices, np.full(pad, batch.paged_kv_indices[0])),
        paged_kv_last_page_len=grow(batch.paged_kv_last_page_len, np.ones(pad)),
        slot_mapping=grow(batch.slot_mapping, np.full(pad, batch.slot_mapping[0])),
        cached_lens=grow(batch.cached_lens, np.zeros(pad)),
        kv_lens=grow(batch.kv_lens, np.ones(pad)),
        write_rows=grow(batch.write_rows, np.zeros(pad)),
        num_real_seqs=batch.num_real_seqs,
        max_kv_len=batch.max_kv_len,  # padding sequences hold one token
    )

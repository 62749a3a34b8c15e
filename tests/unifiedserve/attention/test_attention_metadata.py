"""Paged metadata from block tables vs hand-made references (flashinfer's indptr convention)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from unifiedserve.attention import AttentionMetadata, build_paged_batch, pad_decode_batch
from unifiedserve.attention.metadata import as_block_table

BS = 4


def test_mixed_batch_against_hand_made_reference():
    seqs = [
        (0, 5, [7, 2, 9]),        # fresh prefill, partial last page (1 of 4)
        (8, 1, [3, 5, 6]),        # decode that opens a new page
        (3, 5, [1, 4]),           # chunk over a cached prefix ending on an exact page boundary
        (6, 1, [0, 8, 11, 12]),   # decode; blocks past the used ones are ignored
    ]
    b = build_paged_batch(seqs, BS)
    assert b.qo_indptr.tolist() == [0, 5, 6, 11, 12]
    assert b.paged_kv_indptr.tolist() == [0, 2, 5, 7, 9]
    assert b.paged_kv_indices.tolist() == [7, 2, 3, 5, 6, 1, 4, 0, 8]
    assert b.paged_kv_last_page_len.tolist() == [1, 1, 4, 3]
    assert b.slot_mapping.tolist() == [28, 29, 30, 31, 8, 24, 7, 16, 17, 18, 19, 34]
    assert b.cached_lens.tolist() == [0, 8, 3, 6] and b.kv_lens.tolist() == [5, 9, 8, 7]
    assert b.write_rows.tolist() == list(range(12)) and b.num_real_seqs == 4
    assert (b.num_seqs, b.num_tokens, b.is_decode, b.max_kv_len) == (4, 12, False, 9)


def test_one_token_decode_batch():
    b = build_paged_batch([(4, 1, [2, 6]), (0, 1, [5]), (6, 1, [1, 3])], BS)
    assert b.is_decode
    assert b.qo_indptr.tolist() == [0, 1, 2, 3]
    assert b.paged_kv_indptr.tolist() == [0, 2, 3, 5] and b.paged_kv_indices.tolist() == [2, 6, 5, 1, 3]
    assert b.paged_kv_last_page_len.tolist() == [1, 1, 3]
    assert b.slot_mapping.tolist() == [24, 20, 14]


def test_exact_multiples_of_the_block_size():
    b = build_paged_batch([(4, 4, [9, 1, 2]), (0, 4, [3])], BS)
    assert b.paged_kv_indices.tolist() == [9, 1, 3]
    assert b.paged_kv_last_page_len.tolist() == [4, 4]
    assert b.slot_mapping.tolist() == [4, 5, 6, 7, 12, 13, 14, 15]


def test_slots_match_attention_metadata_on_random_tables():
    rng = random.Random(3)
    for _ in range(50):
        seqs = []
        for _ in range(rng.randint(1, 6)):
            cached, new = rng.randint(0, 20), rng.randint(1, 9)
            blocks = rng.sample(range(100), -(-(cached + new) // BS) + rng.randint(0, 2))
            seqs.append((cached, new, blocks))
        b = build_paged_batch(seqs, BS)
        meta = AttentionMetadata.build(seqs, BS)
        assert b.slot_mapping.tolist() == meta.slot_mapping.tolist()
        assert b.qo_indptr.tolist() == meta.query_start_loc.tolist()
        assert b.kv_lens.tolist() == meta.seq_lens.tolist()
        # flashinfer's own identity: kv_len = (pages - 1) * page_size + last_page_len
        pages = [e - s for s, e in zip(b.paged_kv_indptr.tolist(), b.paged_kv_indptr.tolist()[1:])]
        assert [(p - 1) * BS + last for p, last in zip(pages, b.paged_kv_last_page_len.tolist())] == b.kv_lens.tolist()
        assert meta.to_seqs(BS) == [(c, n, list(bl[:p])) for (c, n, bl), p in zip(seqs, pages)]


def test_pad_decode_batch_repeats_row_zero_writes():
    b = pad_decode_batch(build_paged_batch([(5, 1, [3, 9]), (2, 1, [4])], BS), 4)
    assert b.num_seqs == 4 and b.num_real_seqs == 2 and b.num_tokens == 4 and b.is_decode
    assert b.qo_indptr.tolist() == [0, 1, 2, 3, 4]
    assert b.paged_kv_indptr.tolist() == [0, 2, 3, 4, 5]
    assert b.paged_kv_indices.tolist() == [3, 9, 4, 3, 3]
    assert b.paged_kv_last_page_len.tolist() == [2, 3, 1, 1]
    assert b.slot_mapping.tolist() == [37, 18, 37, 37]
    assert b.write_rows.tolist() == [0, 1, 0, 0]


@pytest.mark.parametrize("seqs, match", [
    ([], "at least one sequence"),
    ([(3, 0, [1])], "num_new_tokens >= 1"),
    ([(-1, 2, [1])], "num_cached_tokens >= 0"),
    ([(3, 2, [1])], "5 tokens need 2 KV blocks of 4, its block table has 1"),
])
def test_bad_sequences_raise(seqs, match):
    with pytest.raises(ValueError, match=match):
        build_paged_batch(seqs, BS)


def test_bad_padding_raises():
    prefill = build_paged_batch([(0, 3, [1])], BS)
    with pytest.raises(ValueError, match="only decode steps"):
        pad_decode_batch(prefill, 4)
    decode = build_paged_batch([(1, 1, [1]), (1, 1, [2])], BS)
    with pytest.raises(ValueError, match="do not fit a graph of batch size 1"):
        pad_decode_batch(decode, 1)


def test_metadata_is_numpy_of_fixed_dtypes():
    """flashinfer's four plan arrays are int32 (shared with torch without a copy), the rest int64."""
    b = build_paged_batch([(2, 3, (5, 6))], BS)
    for name in ("qo_indptr", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len"):
        assert isinstance(getattr(b, name), np.ndarray) and getattr(b, name).dtype == np.int32, name
    for name in ("slot_mapping", "cached_lens", "kv_lens", "write_rows"):
        assert isinstance(getattr(b, name), np.ndarray) and getattr(b, name).dtype == np.int64, name
    assert not any(isinstance(getattr(b, f), torch.Tensor) for f in ("qo_indptr", "slot_mapping"))


def test_int32_block_tables_are_sliced_as_they_are():
    """A request's table kept as an int32 array (as the runner keeps it) gives the same batch as a list."""
    rng = random.Random(5)
    seqs = [(c, n, rng.sample(range(500), -(-(c + n) // BS) + 3)) for c, n in ((30, 1), (0, 9), (17, 4), (5, 1))]
    as_lists, as_arrays = (build_paged_batch([(c, n, conv(bl)) for c, n, bl in seqs], BS)
                           for conv in (list, as_block_table))
    for f in ("qo_indptr", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len", "slot_mapping",
              "cached_lens", "kv_lens", "write_rows"):
        assert getattr(as_lists, f).tolist() == getattr(as_arrays, f).tolist(), f
    assert as_block_table([3, 1]).dtype == np.int32


def test_pages_of_a_sequence():
    b = build_paged_batch([(4, 1, [2, 6]), (0, 1, [5])], BS)
    assert b.pages(0).tolist() == [2, 6] and b.pages(1).tolist() == [5]


def test_padding_a_full_batch_returns_it():
    b = build_paged_batch([(4, 1, [2, 6]), (0, 1, [5])], BS)
    assert pad_decode_batch(b, 2) is b

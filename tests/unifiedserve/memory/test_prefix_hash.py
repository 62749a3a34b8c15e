"""Chained block hashes: equal prefixes (tokens and media at the same places) hash equal, anything else not."""

from __future__ import annotations

from unifiedserve.memory.prefix_hash import block_hashes

V = 9  # the visual placeholder id


def _prompt(before: int, visual: int, after: list[int]):
    ids = [1] * before + [V] * visual + after
    return ids, list(range(before, before + visual))


def test_full_blocks_only_and_equal_prefixes_hash_equal():
    ids, pos = _prompt(3, 6, [5, 6, 7])  # 12 tokens -> 3 blocks of 4
    a = block_hashes(ids, 4, [(0, 6, "video-a")], pos)
    assert len(a) == 3 and len(set(a)) == 3
    b = block_hashes(ids + [8, 8], 4, [(0, 6, "video-a")], pos)  # a trailing partial block has no hash
    assert b == a
    c = block_hashes(ids[:-1] + [99], 4, [(0, 6, "video-a")], pos)
    assert c[:2] == a[:2] and c[2] != a[2]  # only the block that differs, and those after it


def test_visual_tokens_are_named_by_media_key_and_offset():
    ids, pos = _prompt(2, 8, [5, 5])
    a = block_hashes(ids, 4, [(0, 8, "video-a")], pos)
    b = block_hashes(ids, 4, [(0, 8, "video-b")], pos)
    assert a[0] != b[0]  # same placeholder ids, other video: nothing shared
    # two media back to back: swapping their keys changes the hashes
    two = block_hashes(ids, 4, [(0, 4, "x"), (4, 4, "y")], pos)
    swapped = block_hashes(ids, 4, [(0, 4, "y"), (4, 4, "x")], pos)
    assert two[0] != swapped[0]


def test_a_chain_stops_at_an_unkeyed_media():
    ids, pos = _prompt(5, 4, [5, 5, 5])  # visual tokens at 5..8: blocks 1 and 2
    assert len(block_hashes(ids, 4, [(0, 4, "")], pos)) == 1
    text = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(text) == 2 and text[0] != text[1]


def test_a_chain_extends_from_known_hashes():
    ids, pos = _prompt(3, 6, [5, 6, 7, 8])  # a prompt of 13 tokens: 3 full blocks
    spans = [(0, 6, "video-a")]
    prompt = block_hashes(ids, 4, spans, pos)
    longer = ids + [20, 21, 22, 23, 24, 25, 26]  # its outputs: the partial block fills, one more block
    whole = block_hashes(longer, 4, spans, pos)
    assert len(whole) == 5 and whole[:3] == prompt
    assert block_hashes(longer, 4, spans, pos, start=prompt) == whole  # the same, without rehashing the prompt
    assert block_hashes(longer, 4, spans, pos, start=whole[:1]) == whole

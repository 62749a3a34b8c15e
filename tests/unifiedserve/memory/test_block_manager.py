"""KV block bookkeeping: unit tests plus a hypothesis state machine (no torch)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from unifiedserve.memory.block_manager import BlockManager, OutOfBlocksError


def test_bookkeeping_imports_no_torch():
    code = ("import sys, unifiedserve.memory, unifiedserve.memory.block_manager, unifiedserve.memory.pages; "
            "assert 'torch' not in sys.modules, 'bookkeeping imported torch'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_allocate_append_free():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.allocate("a", 5) == [0, 1]
    assert bm.num_tokens("a") == 5 and bm.num_used_blocks == 2 and bm.num_free_blocks == 6
    assert bm.append("a", 8) == []  # fits in block 1
    assert bm.append("a", 9) == [2]
    assert bm.block_table("a") == [0, 1, 2]
    assert bm.free("a") == [0, 1, 2]
    assert bm.num_free_blocks == 8
    assert bm.allocate("b", 1) == [0]  # freed blocks are reused, low ids first


def _hashes(*names):
    return [n.encode().ljust(16, b"\0") for n in names]


def test_prefix_blocks_are_shared_then_evictable_then_reused_last():
    bm = BlockManager(num_blocks=6, block_size=4)
    a = bm.allocate("a", 10)  # 3 blocks; the first two are full
    bm.register("a", _hashes("h0", "h1"))
    assert bm.num_cached_blocks == 2
    assert bm.match(_hashes("h0", "h1", "h2")) == a[:2]
    assert bm.match(_hashes("x", "h1")) == []  # a chain: the first block must match
    b = bm.allocate("b", 12, cached_blocks=a[:2])
    assert b[:2] == a[:2] and b[2] not in a and bm.ref_count(a[0]) == 2
    assert bm.num_used_blocks == 4
    bm.free("a")
    assert bm.ref_count(a[0]) == 1 and bm.num_used_blocks == 3  # a's private block is free again
    bm.free("b")
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 6 and bm.num_cached_blocks == 2
    # never-registered blocks go first; the cached ones survive until nothing else is left
    c = bm.allocate("c", 16)
    assert not set(c) & set(a[:2]) and bm.match(_hashes("h0", "h1")) == a[:2]
    d = bm.allocate("d", 4)  # the last free block: evicts the least recently freed cached one (the tail)
    assert d == [a[1]] and bm.match(_hashes("h0", "h1")) == [a[0]] and bm.num_evictions == 1


def test_a_held_cached_block_is_never_evicted():
    bm = BlockManager(num_blocks=3, block_size=2)
    a = bm.allocate("a", 2)
    bm.register("a", _hashes("h0"))
    assert not bm.can_allocate(6)  # a still holds its block
    bm.allocate("b", 4)
    assert bm.num_free_blocks == 0 and bm.match(_hashes("h0")) == a


def test_cached_blocks_count_as_free_only_until_taken():
    bm = BlockManager(num_blocks=2, block_size=2)
    a = bm.allocate("a", 2)
    bm.register("a", _hashes("h0"))
    bm.free("a")
    assert bm.num_free_blocks == 2
    assert bm.can_allocate(4, cached_blocks=a)  # the cached block plus one fresh
    assert not bm.can_allocate(6, cached_blocks=a)
    bm.allocate("b", 4, cached_blocks=a)
    assert bm.num_free_blocks == 0


def test_register_keeps_the_first_block_of_a_hash_and_is_off_when_disabled():
    bm = BlockManager(num_blocks=4, block_size=2)
    a, b = bm.allocate("a", 2), bm.allocate("b", 2)
    bm.register("a", _hashes("h0"))
    bm.register("b", _hashes("h0"))  # same content computed twice: the first stays the cached one
    assert bm.match(_hashes("h0")) == a
    bm.free("b")
    assert bm.num_free_blocks == 3 and b[0] not in bm.match(_hashes("h0"))
    off = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    off.allocate("a", 2)
    off.register("a", _hashes("h0"))
    assert off.match(_hashes("h0")) == [] and off.num_cached_blocks == 0
    with pytest.raises(ValueError, match="not a cached block"):
        bm.allocate("c", 2, cached_blocks=[3])


def test_errors():
    bm = BlockManager(num_blocks=2, block_size=4)
    assert not bm.can_allocate(9)
    with pytest.raises(OutOfBlocksError, match="can_allocate"):
        bm.allocate("a", 9)
    assert bm.num_free_blocks == 2 and "a" not in bm
    bm.allocate("a", 4)
    with pytest.raises(ValueError, match="already allocated"):
        bm.allocate("a", 1)
    with pytest.raises(ValueError, match="grows"):
        bm.append("a", 3)
    assert not bm.can_append("a", 13)
    with pytest.raises(OutOfBlocksError):
        bm.append("a", 13)
    assert bm.block_table("a") == [0] and bm.num_tokens("a") == 4
    bm.free("a")
    with pytest.raises(KeyError, match="freed already"):
        bm.free("a")
    with pytest.raises(KeyError):
        bm.block_table("nope")
    with pytest.raises(ValueError):
        BlockManager(0)
    with pytest.raises(ValueError):
        bm.can_allocate(-1)


class BlockManagerMachine(RuleBasedStateMachine):
    """Random interleavings of allocate (with cached prefixes)/append/register/free against a plain model."""

    @initialize(num_blocks=st.integers(1, 40), block_size=st.sampled_from([1, 2, 3, 16]))
    def setup(self, num_blocks, block_size):
        self.bm = BlockManager(num_blocks, block_size)
        self.tokens: dict[int, int] = {}
        self.next_id = 0

    @rule(num_tokens=st.integers(0, 100), prefix=st.lists(st.integers(0, 3), max_size=4))
    def allocate(self, num_tokens, prefix):
        seq, before = self.next_id, self.bm.num_free_blocks
        self.next_id += 1
        cached = self.bm.match(_hashes(*(f"p{'.'.join(map(str, prefix[:i + 1]))}" for i in range(len(prefix)))))
        cached = cached[:self.bm.num_blocks_for(num_tokens)]
        if self.bm.can_allocate(num_tokens, cached):
            table = self.bm.allocate(seq, num_tokens, cached)
            assert len(table) == self.bm.num_blocks_for(num_tokens) and table[:len(cached)] == cached
            self.tokens[seq] = num_tokens
        else:
            with pytest.raises(OutOfBlocksError):
                self.bm.allocate(seq, num_tokens, cached)
            assert self.bm.num_free_blocks == before and seq not in self.bm

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), grow=st.integers(0, 50))
    def append(self, data, grow):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        old_table, new_total = self.bm.block_table(seq), self.tokens[seq] + grow
        if self.bm.can_append(seq, new_total):
            added = self.bm.append(seq, new_total)
            assert self.bm.block_table(seq) == old_table + added  # existing blocks never move
            assert len(old_table + added) == self.bm.num_blocks_for(new_total)
            self.tokens[seq] = new_total
        else:
            with pytest.raises(OutOfBlocksError):
                self.bm.append(seq, new_total)
            assert self.bm.block_table(seq) == old_table

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), path=st.lists(st.integers(0, 3), max_size=4))
    def register(self, data, path):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        n = min(len(path), len(self.bm.block_table(seq)))
        self.bm.register(seq, _hashes(*(f"p{'.'.join(map(str, path[:i + 1]))}" for i in range(n))))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        freed = self.bm.free(seq)
        del self.tokens[seq]
        assert len(freed) == len(set(freed))
        with pytest.raises(KeyError):
            self.bm.free(seq)

    @invariant()
    def refcounts_and_counts_add_up(self):
        if not hasattr(self, "bm"):
            return
        holders: dict[int, int] = {}
        for seq in self.tokens:
            table = self.bm.block_table(seq)
            assert len(table) == len(set(table)), "a sequence holds a block twice"
            for b in table:
                holders[b] = holders.get(b, 0) + 1
        for b, n in holders.items():
            assert 0 <= b < self.bm.num_blocks and self.bm.ref_count(b) == n
            assert n == 1 or b in self.bm._block_hash, "an unregistered block is shared"
        assert len(holders) == self.bm.num_used_blocks
        assert self.bm.num_used_blocks + self.bm.num_free_blocks == self.bm.num_blocks
        for seq, n in self.tokens.items():
            assert self.bm.num_tokens(seq) == n

    def teardown(self):
        if hasattr(self, "bm"):
            for seq in list(self.tokens):
                self.bm.free(seq)
            assert self.bm.num_free_blocks == self.bm.num_blocks, "blocks leaked"
            assert self.bm.can_allocate(self.bm.num_blocks * self.bm.block_size)


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)

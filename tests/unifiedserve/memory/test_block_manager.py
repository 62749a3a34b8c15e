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


def test_reserve_tokens_make_appends_free_of_new_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    table = bm.allocate("a", 3, reserve_tokens=6)  # 9 tokens -> 3 blocks
    assert table == [0, 1, 2] and bm.num_tokens("a") == 3 and bm.headroom_tokens("a") == 9
    for total in range(4, 13):
        assert bm.append("a", total) == []
    assert bm.headroom_tokens("a") == 0
    assert bm.reserve("a", 5) == [3, 4]
    assert bm.reserve("a", 5) == []  # already enough
    assert bm.block_table("a") == [0, 1, 2, 3, 4]


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
    with pytest.raises(OutOfBlocksError):
        bm.reserve("a", 100)
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
    """Random interleavings of allocate/append/reserve/free against a plain model of token counts."""

    @initialize(num_blocks=st.integers(1, 40), block_size=st.sampled_from([1, 2, 3, 16]))
    def setup(self, num_blocks, block_size):
        self.bm = BlockManager(num_blocks, block_size)
        self.tokens: dict[int, int] = {}
        self.next_id = 0

    @rule(num_tokens=st.integers(0, 100), reserve=st.integers(0, 40))
    def allocate(self, num_tokens, reserve):
        seq, before = self.next_id, self.bm.num_free_blocks
        self.next_id += 1
        if self.bm.can_allocate(num_tokens, reserve):
            table = self.bm.allocate(seq, num_tokens, reserve)
            assert len(table) == self.bm.num_blocks_for(num_tokens + reserve)
            self.tokens[seq] = num_tokens
        else:
            with pytest.raises(OutOfBlocksError):
                self.bm.allocate(seq, num_tokens, reserve)
            assert self.bm.num_free_blocks == before and seq not in self.bm

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), grow=st.integers(0, 50))
    def append(self, data, grow):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        old_table, new_total = self.bm.block_table(seq), self.tokens[seq] + grow
        if self.bm.can_append(seq, new_total):
            fits = new_total <= self.bm.capacity_tokens(seq)
            added = self.bm.append(seq, new_total)
            assert (added == []) == fits  # growth within the headroom takes no new block
            assert self.bm.block_table(seq) == old_table + added  # existing blocks never move
            self.tokens[seq] = new_total
        else:
            with pytest.raises(OutOfBlocksError):
                self.bm.append(seq, new_total)
            assert self.bm.block_table(seq) == old_table

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), reserve=st.integers(0, 50))
    def reserve(self, data, reserve):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        if self.bm.can_reserve(seq, reserve):
            self.bm.reserve(seq, reserve)
            assert self.bm.headroom_tokens(seq) >= reserve

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
    def blocks_owned_once_and_counts_add_up(self):
        if not hasattr(self, "bm"):
            return
        owned = [b for seq in self.tokens for b in self.bm.block_table(seq)]
        assert len(owned) == len(set(owned)), "a block is owned twice"
        assert all(0 <= b < self.bm.num_blocks for b in owned)
        assert len(owned) == self.bm.num_used_blocks
        assert self.bm.num_used_blocks + self.bm.num_free_blocks == self.bm.num_blocks
        for seq, n in self.tokens.items():
            assert self.bm.num_tokens(seq) == n
            assert self.bm.capacity_tokens(seq) >= n

    def teardown(self):
        if hasattr(self, "bm"):
            for seq in list(self.tokens):
                self.bm.free(seq)
            assert self.bm.num_free_blocks == self.bm.num_blocks, "blocks leaked"
            assert self.bm.can_allocate(self.bm.num_blocks * self.bm.block_size)


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)

"""Embedding-buffer page bookkeeping: the RaggedIndex planners, checked against a model buffer (no torch)."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from unifiedserve.memory.pages import (
    OutOfPagesError,
    PageAllocator,
    PagedStream,
    RaggedIndex,
    can_plan_write,
    plan_read,
    plan_write,
)


def test_docstring_example():
    alloc = PageAllocator(num_pages=16, page_size=4)
    alloc.allocate_pages(3)  # pages 0..2 belong to someone else
    a, b = PagedStream("A", 4), PagedStream("B", 4)
    first = plan_write([(a, 6)], alloc)
    assert first.pv_page_indices == (3, 4) and first.pv_cu_page_len == (0,)
    index = plan_write([(a, 5), (b, 3)], alloc)
    assert index.pv_indptr == (0, 5, 8)
    assert index.pv_page_indptr == (0, 2, 3)
    assert index.pv_page_indices == (4, 5, 6)
    assert index.pv_cu_page_len == (6, 0)
    assert index.row_locations() == [(4, 2), (4, 3), (5, 0), (5, 1), (5, 2), (6, 0), (6, 1), (6, 2)]

    # reading 7 of A's 11 rows consumes page 3 (tokens 0..3) but not page 4 (tokens 4..7)
    read, to_free = plan_read([(a, 7)], 4)
    assert read.pv_page_indices == (3, 4) and read.pv_cu_page_len == (0,) and to_free == [3]
    assert a.pages == (4, 5)
    read, to_free = plan_read([(a, 4)], 4)  # tokens 7..10: slot 3 of page 4, slots 0..2 of page 5
    assert read.pv_page_indices == (4, 5) and read.pv_cu_page_len == (7,) and to_free == [4]
    assert read.row_locations() == [(4, 3), (5, 0), (5, 1), (5, 2)]


def test_finished_stream_frees_its_partial_last_page():
    alloc = PageAllocator(4, 4)
    s = PagedStream("r", 4, num_tokens=6)
    plan_write([(s, 6)], alloc)
    _, to_free = plan_read([(s, 5)], 4)
    assert to_free == [0]
    _, to_free = plan_read([(s, 1)], 4)
    assert to_free == [1] and s.pages == () and s.is_finished
    with pytest.raises(ValueError, match="has only 6"):
        plan_write([(s, 1)], alloc)


def test_errors_change_nothing():
    alloc = PageAllocator(2, 4)
    a, b = PagedStream("a", 4), PagedStream("b", 4)
    assert not can_plan_write([(a, 5), (b, 5)], alloc)
    with pytest.raises(OutOfPagesError):
        plan_write([(a, 5), (b, 5)], alloc)
    assert alloc.num_free_pages == 2 and a.pages == () and a.num_written_tokens == 0
    with pytest.raises(ValueError, match="twice"):
        plan_write([(a, 1), (a, 1)], alloc)
    plan_write([(a, 3)], alloc)
    with pytest.raises(ValueError, match="only 3"):
        plan_read([(a, 4)], 4)
    with pytest.raises(ValueError, match="page_size"):
        plan_read([(a, 1)], 8)
    assert a.num_read_tokens == 0
    with pytest.raises(ValueError, match="double free"):
        alloc.free([1])
    with pytest.raises(ValueError, match="not in this buffer"):
        alloc.free([7])
    with pytest.raises(ValueError, match="span"):
        RaggedIndex.build([(5, 3, [0])], page_size=4)  # 5 rows from slot 3 need 2 pages


class PagesMachine(RuleBasedStateMachine):
    """Random chunked writes and reads over several streams, checked against a model of the buffer.

    ``self.slots`` maps ``(page, slot)`` to the ``(request, token)`` written there and not read yet.
    """

    @initialize(num_pages=st.integers(1, 30), page_size=st.sampled_from([1, 3, 4, 16]))
    def setup(self, num_pages, page_size):
        self.alloc = PageAllocator(num_pages, page_size)
        self.page_size = page_size
        self.streams: dict[int, PagedStream] = {}
        self.slots: dict[tuple[int, int], tuple[int, int]] = {}

    @rule(total=st.one_of(st.none(), st.integers(0, 80)))
    def add_stream(self, total):
        rid = len(self.streams)
        self.streams[rid] = PagedStream(rid, self.page_size, num_tokens=total)

    def _batch(self, data, limit):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.streams)), unique=True, max_size=4))
        return [(self.streams[i], data.draw(st.integers(0, max(0, limit(self.streams[i]))))) for i in ids]

    @precondition(lambda self: self.streams)
    @rule(data=st.data())
    def write(self, data):
        batch = self._batch(data, lambda s: min(20, (s.num_tokens if s.num_tokens is not None else 10**9)
                                                   - s.num_written_tokens))
        if not can_plan_write(batch, self.alloc):
            before = (self.alloc.num_free_pages, [(s.pages, s.num_written_tokens) for s, _ in batch])
            with pytest.raises(OutOfPagesError):
                plan_write(batch, self.alloc)
            assert before == (self.alloc.num_free_pages, [(s.pages, s.num_written_tokens) for s, _ in batch])
            return
        starts = [s.num_written_tokens for s, _ in batch]
        index = plan_write(batch, self.alloc)
        tokens = [(s.request_id, start + t) for (s, n), start in zip(batch, starts) for t in range(n)]
        assert index.pv_cu_page_len == tuple(starts) and index.num_tokens == len(tokens)
        for (page, slot), (rid, token) in zip(index.row_locations(), tokens):
            assert page in self.streams[rid].pages, "a write lands on a page its stream does not hold"
            assert (page, slot) not in self.slots, "a write overwrites unread rows"
            self.slots[(page, slot)] = (rid, token)

    @precondition(lambda self: self.streams)
    @rule(data=st.data())
    def read(self, data):
        batch = self._batch(data, lambda s: min(20, s.num_unread_tokens))
        starts = [s.num_read_tokens for s, _ in batch]
        index, to_free = plan_read(batch, self.page_size)
        tokens = [(s.request_id, start + t) for (s, n), start in zip(batch, starts) for t in range(n)]
        assert index.pv_cu_page_len == tuple(starts)
        for location, token in zip(index.row_locations(), tokens):
            assert self.slots.pop(location) == token, "a read returns another row than was written"
        held = {p for s in self.streams.values() for p in s.pages}
        for page in to_free:
            assert page not in held, "a freed page is still held by a stream"
            assert not any(p == page for p, _ in self.slots), "a freed page still has unread rows"
        self.alloc.free(to_free)  # freed in the same iteration; raises on a double free

    @precondition(lambda self: self.streams)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.streams)))
        self.alloc.free(self.streams[rid].release())
        self.slots = {loc: tok for loc, tok in self.slots.items() if tok[0] != rid}

    @invariant()
    def pages_held_once_and_only_while_needed(self):
        if not hasattr(self, "alloc"):
            return
        held = [p for s in self.streams.values() for p in s.pages]
        assert len(held) == len(set(held)), "a page is held by two streams"
        assert len(held) + self.alloc.num_free_pages == self.alloc.num_pages, "pages leaked"
        size = self.page_size
        for s in self.streams.values():
            # pages from the read cursor's page to the write cursor's: every fully read page is gone
            expected = 0 if s.is_finished else -(-s.num_written_tokens // size) - s.num_read_tokens // size
            assert len(s.pages) == expected, s

    def teardown(self):
        if not hasattr(self, "alloc"):
            return
        for s in self.streams.values():
            if s.num_tokens is not None and s.num_written_tokens == s.num_tokens:
                _, to_free = plan_read([(s, s.num_unread_tokens)], self.page_size)
                self.alloc.free(to_free)
                assert s.pages == () and s.is_finished
            self.alloc.free(s.release())
        assert self.alloc.num_free_pages == self.alloc.num_pages, "pages leaked"


TestPagesMachine = PagesMachine.TestCase
TestPagesMachine.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)

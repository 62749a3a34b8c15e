"""Paged embedding-buffer bookkeeping (patch buffer, visual-token buffer). Pure Python over page ids.

A producer (vision process, encode) appends a request's rows chunk by chunk; a consumer (encode,
prefill) reads them chunk by chunk. Rows live in fixed-size pages of a shared buffer
``[num_pages, page_size, dim]``. Each iteration's reads or writes over several requests are described by
one :class:`RaggedIndex` (the paper's four arrays, §4.2 Fig. 10), which the copy kernels in
:mod:`unifiedserve.ops` execute.

Page layout of a request. Token ``p`` of a request (its ``p``-th row ever written, 0-based) lives in
the request's page number ``p // page_size`` at slot ``p % page_size``. Pages fill in order, so a page
boundary always falls on a multiple of ``page_size`` in token positions.

Ownership (who may touch a page when):

* :class:`PageAllocator` owns free pages. ``allocate`` hands pages to the caller, who owns them until it
  passes them back to ``free``.
* :func:`plan_write` allocates the pages a write needs and gives them to the request's
  :class:`PagedStream`. The stream holds a page from its first write until a read consumes its last
  slot.
* :func:`plan_read` returns, with the read's index, the pages that read consumes completely
  (``pages_to_free``; a finished stream's partly filled last page counts as consumed). The stream
  has already dropped them; they belong to the caller, who must keep them alive until the copy that
  uses the index has run, then free them **in the same iteration**.
* Aborting a request: :meth:`PagedStream.release` hands back every page the stream still holds.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass


class OutOfPagesError(RuntimeError):
    """Raised when a write needs more free pages than there are. Check ``can_*`` first."""


class PageAllocator:
    """Free-page pool of one paged buffer. ``free`` rejects double frees and foreign ids.

    Args:
        num_pages: pages in the buffer (ids ``0..num_pages-1``).
        page_size: rows (tokens) per page.
    """

    def __init__(self, num_pages: int, page_size: int):
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}; size the buffer from the memory budget")
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free_pages: list[int] = list(range(num_pages - 1, -1, -1))  # a stack, low ids out first
        self._is_free = bytearray(b"\x01") * num_pages

    @property
    def num_free_pages(self) -> int:
        return len(self._free_pages)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - len(self._free_pages)

    def num_pages_for(self, num_tokens: int) -> int:
        """Pages needed for ``num_tokens`` rows starting on a fresh page."""
        return -(-num_tokens // self.page_size)

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether ``allocate(num_tokens)`` would succeed."""
        return self.can_allocate_pages(self.num_pages_for(num_tokens))

    def allocate(self, num_tokens: int) -> list[int]:
        """Pages for ``num_tokens`` rows. Raises :class:`OutOfPagesError` (allocating nothing) if short."""
        return self.allocate_pages(self.num_pages_for(num_tokens))

    def can_allocate_pages(self, num_pages: int) -> bool:
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        return num_pages <= len(self._free_pages)

    def allocate_pages(self, num_pages: int) -> list[int]:
        """``num_pages`` free pages, now owned by the caller until ``free``."""
        if not self.can_allocate_pages(num_pages):
            raise OutOfPagesError(f"need {num_pages} pages but only {len(self._free_pages)} are free; "
                                  "call can_allocate first")
        pages = [self._free_pages.pop() for _ in range(num_pages)]
        for page in pages:
            self._is_free[page] = 0
        return pages

    def free(self, pages: Sequence[int]) -> None:
        """Return ``pages`` to the pool. Raises ``ValueError`` (freeing none) on a free or unknown page."""
        for page in pages:
            if not 0 <= page < self.num_pages:
                raise ValueError(f"page {page} is not in this buffer (0..{self.num_pages - 1})")
            if self._is_free[page]:
                raise ValueError(f"page {page} is already free (double free)")
        if len(set(pages)) != len(pages):
            raise ValueError(f"pages {list(pages)} list a page twice (double free)")
        for page in reversed(pages):
            self._is_free[page] = 1
            self._free_pages.append(page)


@dataclass(frozen=True)
class RaggedIndex:
    """Where each request's rows of one iteration's packed chunk go to (write) or come from (read).

    For request ``b`` of the batch, with ``n = pv_indptr[b+1] - pv_indptr[b]``,
    ``o = pv_cu_page_len[b] % page_size`` and ``pages = pv_page_indices[pv_page_indptr[b]:pv_page_indptr[b+1]]``,
    the chunk's row ``pv_indptr[b] + t`` (``0 <= t < n``) is the request's token
    ``pv_cu_page_len[b] + t`` and lives in page ``pages[(o + t) // page_size]`` at slot
    ``(o + t) % page_size``. ``pages`` lists exactly the pages touched this iteration, in token order:
    ``ceil((o + n) / page_size)`` of them, none when ``n == 0``.

    Example (``page_size = 4``): request A wrote 6 rows earlier (pages ``[8, 11]``, page 11 half full)
    and writes 5 more; new request B writes 3. A's rows fill slots 2..3 of page 11 and 0..2 of a new page
    3; B's fill slots 0..2 of a new page 5::

        pv_indptr       = [0, 5, 8]    # chunk rows 0..4 are A's, 5..7 are B's
        pv_page_indptr  = [0, 2, 3]    # A uses pv_page_indices[0:2], B [2:3]
        pv_page_indices = [11, 3, 5]
        pv_cu_page_len  = [6, 0]       # A's first row is its token 6: slot 6 % 4 = 2 of page 11
    """

    #: [B+1] chunk-row offsets: request b's rows are ``pv_indptr[b]:pv_indptr[b+1]``.
    pv_indptr: tuple[int, ...]
    #: [B+1] request b's pages are ``pv_page_indices[pv_page_indptr[b]:pv_page_indptr[b+1]]``.
    pv_page_indptr: tuple[int, ...]
    #: [sum of pages] page ids touched this iteration, grouped by request, in token order.
    pv_page_indices: tuple[int, ...]
    #: [B] tokens of request b written (for a write) or read (for a read) before this iteration.
    pv_cu_page_len: tuple[int, ...]
    #: rows per page of the buffer this index addresses.
    page_size: int

    @classmethod
    def build(cls, spans: Sequence[tuple[int, int, Sequence[int]]], page_size: int) -> "RaggedIndex":
        """From ``(num_tokens, cu_page_len, pages)`` per request; validates the result."""
        indptr, page_indptr, page_indices, cu = [0], [0], [], []
        for num_tokens, cu_page_len, pages in spans:
            indptr.append(indptr[-1] + num_tokens)
            page_indices.extend(pages)
            page_indptr.append(len(page_indices))
            cu.append(cu_page_len)
        index = cls(tuple(indptr), tuple(page_indptr), tuple(page_indices), tuple(cu), page_size)
        index.validate()
        return index

    @property
    def num_requests(self) -> int:
        return len(self.pv_cu_page_len)

    @property
    def num_tokens(self) -> int:
        return self.pv_indptr[-1]

    def validate(self) -> None:
        """Raise ``ValueError`` unless the arrays satisfy the invariants in the class docstring."""
        num = len(self.pv_cu_page_len)
        if len(self.pv_indptr) != num + 1 or len(self.pv_page_indptr) != num + 1:
            raise ValueError("pv_indptr and pv_page_indptr need one more entry than pv_cu_page_len")
        if self.pv_indptr[0] != 0 or self.pv_page_indptr[0] != 0:
            raise ValueError("pv_indptr and pv_page_indptr must start at 0")
        if self.pv_page_indptr[-1] != len(self.pv_page_indices):
            raise ValueError("pv_page_indptr[-1] must equal len(pv_page_indices)")
        for b in range(num):
            n = self.pv_indptr[b + 1] - self.pv_indptr[b]
            have = self.pv_page_indptr[b + 1] - self.pv_page_indptr[b]
            if n < 0 or have < 0 or self.pv_cu_page_len[b] < 0:
                raise ValueError(f"request {b}: negative row count, page count or pv_cu_page_len")
            if have != _pages_spanned(self.pv_cu_page_len[b], n, self.page_size):
                raise ValueError(f"request {b}: {n} rows from token {self.pv_cu_page_len[b]} span "
                                 f"{_pages_spanned(self.pv_cu_page_len[b], n, self.page_size)} pages, "
                                 f"index lists {have}")

    def row_locations(self) -> list[tuple[int, int]]:
        """``(page, slot)`` of every chunk row in order: the per-row meaning of the index, spelled out."""
        locations = []
        for b in range(self.num_requests):
            offset = self.pv_cu_page_len[b] % self.page_size
            pages = self.pv_page_indices[self.pv_page_indptr[b]:self.pv_page_indptr[b + 1]]
            for t in range(self.pv_indptr[b + 1] - self.pv_indptr[b]):
                locations.append((pages[(offset + t) // self.page_size], (offset + t) % self.page_size))
        return locations


class PagedStream:
    """One request's rows in a paged buffer: appended at the write cursor, consumed at the read cursor.

    Args:
        request_id: the request's id (for error messages).
        page_size: rows per page of the buffer.
        num_tokens: rows the request will write in total, if known; writes past it are rejected.

    The stream holds the pages covering tokens ``[first_page_token, num_written_tokens)`` rounded up to
    whole pages; it changes only through :func:`plan_write`, :func:`plan_read` and :meth:`release`.
    """

    def __init__(self, request_id: Hashable, page_size: int, num_tokens: int | None = None):
        self.request_id = request_id
        self.page_size = page_size
        self.num_tokens = num_tokens
        self.num_written_tokens = 0
        self.num_read_tokens = 0
        self._pages: list[int] = []
        self._first_page_token = 0  # token position where self._pages[0] starts; a multiple of page_size

    def __repr__(self) -> str:
        return (f"PagedStream({self.request_id!r}, written={self.num_written_tokens}, "
                f"read={self.num_read_tokens}, pages={self._pages})")

    @property
    def pages(self) -> tuple[int, ...]:
        """Pages the stream holds now, in token order."""
        return tuple(self._pages)

    @property
    def num_unread_tokens(self) -> int:
        return self.num_written_tokens - self.num_read_tokens

    @property
    def is_finished(self) -> bool:
        """All ``num_tokens`` rows were written and read (always False when the total is unknown)."""
        return self.num_tokens is not None and self.num_read_tokens == self.num_tokens

    def num_pages_to_write(self, num_tokens: int) -> int:
        """New pages a write of ``num_tokens`` rows needs (the last held page may have room)."""
        end_page = _ceil_div(self.num_written_tokens + num_tokens - self._first_page_token, self.page_size)
        return max(0, end_page - len(self._pages))

    def release(self) -> list[int]:
        """Give up every page (e.g. the request was aborted); the caller owns and frees them.

        The stream is finished afterwards: it takes no more writes or reads.
        """
        pages, self._pages = self._pages, []
        self._first_page_token = _ceil_div(self.num_written_tokens, self.page_size) * self.page_size
        self.num_read_tokens = self.num_tokens = self.num_written_tokens
        return pages

    def _span(self, start_token: int, num_tokens: int) -> list[int]:
        """Held pages touched by tokens ``[start_token, start_token + num_tokens)``."""
        if num_tokens == 0:
            return []
        first = (start_token - self._first_page_token) // self.page_size
        last = _ceil_div(start_token + num_tokens - self._first_page_token, self.page_size)
        return self._pages[first:last]


def can_plan_write(writes: Sequence[tuple[PagedStream, int]], allocator: PageAllocator) -> bool:
    """Whether the allocator has the pages :func:`plan_write` needs for ``writes``."""
    return allocator.can_allocate_pages(sum(stream.num_pages_to_write(n) for stream, n in writes))


def plan_write(writes: Sequence[tuple[PagedStream, int]], allocator: PageAllocator) -> RaggedIndex:
    """Plan one iteration's writes: ``(stream, num_tokens)`` per request, in chunk-row order.

    Allocates the new pages each stream needs from ``allocator`` and advances the write cursors. Either
    every write is planned or, on error, nothing changes.

    Returns:
        The index for ``paged_scatter(buffer, chunk, index)``, ``chunk`` holding the rows in ``writes`` order.

    Raises:
        ValueError: a stream appears twice, a count is negative, a write passes the stream's
            ``num_tokens``, or a page size differs from the allocator's.
        OutOfPagesError: the allocator is short of pages (check :func:`can_plan_write`).
    """
    _check_batch(writes, allocator.page_size)
    for stream, n in writes:
        if stream.num_tokens is not None and stream.num_written_tokens + n > stream.num_tokens:
            raise ValueError(f"request {stream.request_id!r} writes {n} rows after {stream.num_written_tokens} "
                             f"but has only {stream.num_tokens}")
    if not can_plan_write(writes, allocator):
        raise OutOfPagesError(f"the writes need {sum(s.num_pages_to_write(n) for s, n in writes)} new pages, "
                              f"{allocator.num_free_pages} are free; call can_plan_write first")
    spans = []
    for stream, n in writes:
        stream._pages.extend(allocator.allocate_pages(stream.num_pages_to_write(n)))
        spans.append((n, stream.num_written_tokens, stream._span(stream.num_written_tokens, n)))
        stream.num_written_tokens += n
    return RaggedIndex.build(spans, allocator.page_size)


def plan_read(reads: Sequence[tuple[PagedStream, int]], page_size: int) -> tuple[RaggedIndex, list[int]]:
    """Plan one iteration's reads: ``(stream, num_tokens)`` per request, in chunk-row order.

    Advances the read cursors and drops the pages the reads consume completely: pages whose every slot
    has been read, plus, once a stream with a known ``num_tokens`` has been read to its end, its partly
    filled last page. Either every read is planned or, on error, nothing changes.

    Returns:
        ``(index, pages_to_free)``: the index for ``paged_gather(buffer, index)``, and the consumed
        pages. The caller owns them: it frees them after the gather has run, in the same iteration.

    Raises:
        ValueError: a stream appears twice, a count is negative, or a read passes the write cursor.
    """
    _check_batch(reads, page_size)
    for stream, n in reads:
        if n > stream.num_unread_tokens:
            raise ValueError(f"request {stream.request_id!r} reads {n} rows but only "
                             f"{stream.num_unread_tokens} are written and unread")
    spans, pages_to_free = [], []
    for stream, n in reads:
        spans.append((n, stream.num_read_tokens, stream._span(stream.num_read_tokens, n)))
        stream.num_read_tokens += n
        if stream.is_finished:  # the last page may be partly filled: nothing more will come to it
            consumed = len(stream._pages)
        else:
            consumed = (stream.num_read_tokens - stream._first_page_token) // page_size
        pages_to_free.extend(stream._pages[:consumed])
        del stream._pages[:consumed]
        stream._first_page_token += consumed * page_size
    return RaggedIndex.build(spans, page_size), pages_to_free


def _check_batch(batch: Sequence[tuple[PagedStream, int]], page_size: int) -> None:
    seen = set()
    for stream, n in batch:
        if id(stream) in seen:
            raise ValueError(f"request {stream.request_id!r} appears twice in one iteration; merge its chunks")
        seen.add(id(stream))
        if n < 0:
            raise ValueError(f"request {stream.request_id!r}: num_tokens must be >= 0, got {n}")
        if stream.page_size != page_size:
            raise ValueError(f"request {stream.request_id!r} has page_size {stream.page_size}, buffer {page_size}")


def _pages_spanned(cu_page_len: int, num_tokens: int, page_size: int) -> int:
    return 0 if num_tokens == 0 else _ceil_div(cu_page_len % page_size + num_tokens, page_size)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)

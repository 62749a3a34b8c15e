"""KV-cache block bookkeeping with prefix caching: which KV blocks each sequence owns. Pure Python over ids.

A sequence of ``num_tokens`` tokens owns ``ceil(num_tokens / block_size)`` KV blocks, in order: token
``i`` lives in block ``block_table[i // block_size]`` at offset ``i % block_size``.

Prefix caching. A *full* block whose keys and values are computed can be registered under a content
hash (:meth:`register`; the hash chains the previous block's, so it names the whole prefix up to the
block's end; see :mod:`unifiedserve.memory.prefix_hash`). Another sequence whose prompt starts with the
same blocks takes them (:meth:`match`, then ``allocate(..., cached_blocks=)``) instead of computing
them again. Blocks are reference counted: a shared block is read by every owner and written by none
(the owners' new tokens go to blocks after it). When its last owner frees it, a registered block stays
in the cache, *evictable*: it counts as free, and is reused, least recently freed first, only when no
never-registered free block is left. A block in use is never evicted.

Protocol: ``match`` → ``can_allocate``/``allocate`` → ``can_append``/``append`` → ``register`` →
``free``. The manager never hands a block to a writer while another sequence holds it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence


class OutOfBlocksError(RuntimeError):
    """Raised when a request needs more free KV blocks than there are. Check ``can_*`` first."""


class BlockManager:
    """Owns ``num_blocks`` KV blocks of ``block_size`` tokens and hands them to sequences.

    Args:
        num_blocks: KV blocks in the cache (block ids are ``0..num_blocks-1``).
        block_size: tokens per KV block.
        enable_prefix_caching: keep registered blocks after their owners free them (off: ``register``
            does nothing and ``match`` finds nothing).

    Raises:
        ValueError: on a non-positive ``num_blocks`` or ``block_size``.
    """

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}; size the KV cache from the memory budget")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # a stack: popping from the end hands out low ids first, which keeps tests readable
        self._free_blocks: list[int] = list(range(num_blocks - 1, -1, -1))  # never registered, or evicted
        self._tables: dict[Hashable, list[int]] = {}
        self._num_tokens: dict[Hashable, int] = {}
        self._num_registered: dict[Hashable, int] = {}  # leading blocks of each table already registered
        self._refs = [0] * num_blocks
        self._block_hash: dict[int, bytes] = {}
        self._cached: dict[bytes, int] = {}  # prefix hash -> its block
        self._evictable: OrderedDict[int, None] = OrderedDict()  # registered, refcount 0; oldest first
        self.num_evictions = 0  # cached blocks reused for other content

    # ----------------------------------------------------------------------------------- queries

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new sequence can take: never-registered free blocks plus evictable cached ones."""
        return len(self._free_blocks) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one sequence."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Registered blocks (in use or evictable)."""
        return len(self._cached)

    def num_blocks_for(self, num_tokens: int) -> int:
        """KV blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._tables

    def block_table(self, seq_id: Hashable) -> list[int]:
        """The KV block ids of ``seq_id`` in token order (a copy)."""
        return list(self._table(seq_id))

    def num_tokens(self, seq_id: Hashable) -> int:
        """Tokens ``seq_id`` has room for in its blocks, as last asked for."""
        self._table(seq_id)
        return self._num_tokens[seq_id]

    def ref_count(self, block: int) -> int:
        """How many sequences hold ``block`` now."""
        return self._refs[block]

    # ------------------------------------------------------------------------------ prefix cache

    def match(self, block_hashes: Sequence[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of ``block_hashes`` (a chain, first block first).

        Takes nothing: pass (a prefix of) the result to :meth:`allocate`.
        """
        found = []
        if self.enable_prefix_caching:
            for h in block_hashes:
                block = self._cached.get(h)
                if block is None:
                    break
                found.append(block)
        return found

    def register(self, seq_id: Hashable, block_hashes: Sequence[bytes]) -> None:
        """The first ``len(block_hashes)`` blocks of ``seq_id`` are full and computed: cache them.

        ``block_hashes[i]`` is the prefix hash of block ``i``. Blocks registered before are skipped;
        a hash another block already holds keeps that block (this one stays private and is freed
        normally).
        """
        if not self.enable_prefix_caching:
            return
        table = self._table(seq_id)
        if len(block_hashes) > len(table):
            raise ValueError(f"sequence {seq_id!r} has {len(table)} blocks, {len(block_hashes)} hashes given")
        for i in range(self._num_registered.get(seq_id, 0), len(block_hashes)):
            block, h = table[i], block_hashes[i]
            if block not in self._block_hash and h not in self._cached:
                self._block_hash[block] = h
                self._cached[h] = block
        self._num_registered[seq_id] = max(self._num_registered.get(seq_id, 0), len(block_hashes))

    # -------------------------------------------------------------------------------- allocation

    def can_allocate(self, num_tokens: int, cached_blocks: Sequence[int] = ()) -> bool:
        """Whether ``allocate(_, num_tokens, cached_blocks)`` would succeed for a new sequence."""
        _check_count(num_tokens, "num_tokens")
        fresh = self.num_blocks_for(num_tokens) - len(cached_blocks)
        # cached blocks that sit in the evictable set stop being free once taken
        taken_free = sum(1 for b in cached_blocks if b in self._evictable)
        return fresh <= self.num_free_blocks - taken_free

    def allocate(self, seq_id: Hashable, num_tokens: int, cached_blocks: Sequence[int] = ()) -> list[int]:
        """Give a new sequence the blocks for ``num_tokens`` tokens, starting with ``cached_blocks``.

        Args:
            seq_id: a sequence id not allocated yet.
            num_tokens: tokens the sequence needs room for.
            cached_blocks: blocks from :meth:`match` (shared, read-only) that hold its first tokens.

        Returns:
            The sequence's block table, in token order.

        Raises:
            ValueError: ``seq_id`` is already allocated, a count is negative, or the cached blocks
                exceed ``num_tokens``.
            OutOfBlocksError: not enough free blocks (nothing is allocated then).
        """
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} is already allocated; free it first or use append")
        if len(cached_blocks) > self.num_blocks_for(num_tokens):
            raise ValueError(f"{len(cached_blocks)} cached blocks for {num_tokens} tokens")
        if not self.can_allocate(num_tokens, cached_blocks):
            raise OutOfBlocksError(
                f"sequence {seq_id!r} needs {self.num_blocks_for(num_tokens) - len(cached_blocks)} KV blocks for "
                f"{num_tokens} tokens but only {self.num_free_blocks} are free; call can_allocate first")
        for b in cached_blocks:
            if b not in self._block_hash:
                raise ValueError(f"block {b} is not a cached block")
            self._evictable.pop(b, None)
            self._refs[b] += 1
        table = list(cached_blocks) + self._take(self.num_blocks_for(num_tokens) - len(cached_blocks))
        self._tables[seq_id] = table
        self._num_tokens[seq_id] = num_tokens
        self._num_registered[seq_id] = len(cached_blocks)
        return list(table)

    def can_append(self, seq_id: Hashable, new_num_tokens: int) -> bool:
        """Whether ``append(seq_id, new_num_tokens)`` would succeed."""
        self._check_growth(seq_id, new_num_tokens)
        missing = self.num_blocks_for(new_num_tokens) - len(self._tables[seq_id])
        return missing <= self.num_free_blocks

    def append(self, seq_id: Hashable, new_num_tokens: int) -> list[int]:
        """Grow ``seq_id`` to room for ``new_num_tokens`` tokens in total.

        Returns:
            The blocks added to the end of its block table (``[]`` when its blocks already suffice).

        Raises:
            KeyError: ``seq_id`` is not allocated.
            ValueError: ``new_num_tokens`` is below the sequence's current token count.
            OutOfBlocksError: not enough free blocks (nothing changes then).
        """
        if not self.can_append(seq_id, new_num_tokens):
            missing = self.num_blocks_for(new_num_tokens) - len(self._tables[seq_id])
            raise OutOfBlocksError(
                f"growing sequence {seq_id!r} to {new_num_tokens} tokens needs {missing} more KV blocks but only "
                f"{self.num_free_blocks} are free; call can_append first")
        table = self._tables[seq_id]
        added = self._take(max(0, self.num_blocks_for(new_num_tokens) - len(table)))
        table.extend(added)
        self._num_tokens[seq_id] = new_num_tokens
        return added

    def free(self, seq_id: Hashable) -> list[int]:
        """Drop ``seq_id``'s hold on its blocks; those nobody holds any more become free (or evictable).

        Returns:
            The sequence's block ids.

        Raises:
            KeyError: ``seq_id`` is not allocated (unknown, or freed already).
        """
        blocks = self._table(seq_id)
        del self._tables[seq_id], self._num_tokens[seq_id]
        self._num_registered.pop(seq_id, None)
        # last block first: the tail of a prefix is evicted before its head, and the first block of an
        # unregistered sequence is handed out first next time
        for b in reversed(blocks):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if b in self._block_hash:
                    self._evictable[b] = None
                else:
                    self._free_blocks.append(b)
        return blocks

    # ---------------------------------------------------------------------------------- internals

    def _table(self, seq_id: Hashable) -> list[int]:
        try:
            return self._tables[seq_id]
        except KeyError:
            raise KeyError(f"sequence {seq_id!r} is not allocated (unknown id, or freed already)") from None

    def _check_growth(self, seq_id: Hashable, new_num_tokens: int) -> None:
        current = self.num_tokens(seq_id)
        if new_num_tokens < current:
            raise ValueError(f"append grows a sequence: {seq_id!r} holds {current} tokens, asked for {new_num_tokens}")

    def _take(self, n: int) -> list[int]:
        """``n`` blocks nobody holds: never-registered ones first, then the least recently freed cached ones."""
        assert n <= self.num_free_blocks, "callers check can_* first"
        taken = []
        while len(taken) < n and self._free_blocks:
            taken.append(self._free_blocks.pop())
        while len(taken) < n:
            block, _ = self._evictable.popitem(last=False)
            del self._cached[self._block_hash.pop(block)]
            self.num_evictions += 1
            taken.append(block)
        for b in taken:
            self._refs[b] = 1
        return taken


def _check_count(n: int, name: str) -> None:
    if n < 0:
        raise ValueError(f"{name} must be >= 0, got {n}")

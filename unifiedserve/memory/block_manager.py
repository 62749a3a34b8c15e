"""KV-cache block bookkeeping: which KV blocks each sequence owns. Pure Python over integer ids.

A sequence of ``num_tokens`` tokens owns ``ceil(num_tokens / block_size)`` KV blocks, in order: token
``i`` lives in block ``block_table[i // block_size]`` at offset ``i % block_size``. A sequence may own
more blocks than it needs (*headroom*, asked for with ``reserve_tokens``) so that a decode process can
grow it token by token without asking the allocator's owner for blocks on every step.

Protocol: ``can_allocate``/``allocate``, ``can_append``/``append``, ``can_reserve``/``reserve``, and
``free``. Blocks returned by ``allocate``/``append``/``reserve`` are owned by the sequence until
``free(seq_id)``; the manager never hands a block to two sequences.
"""

from __future__ import annotations

from collections.abc import Hashable


class OutOfBlocksError(RuntimeError):
    """Raised when a request needs more free KV blocks than there are. Check ``can_*`` first."""


class BlockManager:
    """Owns ``num_blocks`` KV blocks of ``block_size`` tokens and hands them to sequences.

    Args:
        num_blocks: KV blocks in the cache (block ids are ``0..num_blocks-1``).
        block_size: tokens per KV block.

    Raises:
        ValueError: on a non-positive ``num_blocks`` or ``block_size``.
    """

    def __init__(self, num_blocks: int, block_size: int = 16):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}; size the KV cache from the memory budget")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # a stack: popping from the end hands out low ids first, which keeps tests readable
        self._free_blocks: list[int] = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[Hashable, list[int]] = {}
        self._num_tokens: dict[Hashable, int] = {}

    # ----------------------------------------------------------------------------------- queries

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free_blocks)

    def num_blocks_for(self, num_tokens: int) -> int:
        """KV blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._tables

    def block_table(self, seq_id: Hashable) -> list[int]:
        """The KV block ids of ``seq_id`` in token order (a copy), headroom blocks included."""
        return list(self._table(seq_id))

    def num_tokens(self, seq_id: Hashable) -> int:
        """Tokens ``seq_id`` holds now (its headroom not counted)."""
        self._table(seq_id)
        return self._num_tokens[seq_id]

    def capacity_tokens(self, seq_id: Hashable) -> int:
        """Tokens ``seq_id`` can hold in the blocks it owns already."""
        return len(self._table(seq_id)) * self.block_size

    def headroom_tokens(self, seq_id: Hashable) -> int:
        """Tokens ``seq_id`` can still grow by without new blocks (``append`` within it returns ``[]``)."""
        return self.capacity_tokens(seq_id) - self._num_tokens[seq_id]

    # -------------------------------------------------------------------------------- allocation

    def can_allocate(self, num_tokens: int, reserve_tokens: int = 0) -> bool:
        """Whether ``allocate(_, num_tokens, reserve_tokens)`` would succeed for a new sequence."""
        _check_count(num_tokens, "num_tokens")
        _check_count(reserve_tokens, "reserve_tokens")
        return self.num_blocks_for(num_tokens + reserve_tokens) <= len(self._free_blocks)

    def allocate(self, seq_id: Hashable, num_tokens: int, reserve_tokens: int = 0) -> list[int]:
        """Give a new sequence the blocks for ``num_tokens`` tokens plus ``reserve_tokens`` of headroom.

        Args:
            seq_id: a sequence id not allocated yet.
            num_tokens: tokens the sequence holds now (its prompt).
            reserve_tokens: extra tokens the sequence may grow by without new blocks.

        Returns:
            The sequence's block table (all blocks allocated, headroom included), in token order.

        Raises:
            ValueError: ``seq_id`` is already allocated, or a count is negative.
            OutOfBlocksError: not enough free blocks (nothing is allocated then).
        """
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} is already allocated; free it first or use append")
        if not self.can_allocate(num_tokens, reserve_tokens):
            raise OutOfBlocksError(
                f"sequence {seq_id!r} needs {self.num_blocks_for(num_tokens + reserve_tokens)} KV blocks for "
                f"{num_tokens}+{reserve_tokens} tokens but only {len(self._free_blocks)} are free; call can_allocate first")
        self._tables[seq_id] = self._take(self.num_blocks_for(num_tokens + reserve_tokens))
        self._num_tokens[seq_id] = num_tokens
        return list(self._tables[seq_id])

    def can_append(self, seq_id: Hashable, new_num_tokens: int) -> bool:
        """Whether ``append(seq_id, new_num_tokens)`` would succeed."""
        self._check_growth(seq_id, new_num_tokens)
        missing = self.num_blocks_for(new_num_tokens) - len(self._tables[seq_id])
        return missing <= len(self._free_blocks)

    def append(self, seq_id: Hashable, new_num_tokens: int) -> list[int]:
        """Grow ``seq_id`` to ``new_num_tokens`` tokens in total.

        Returns:
            The blocks added to the end of its block table: ``[]`` while the growth fits in the blocks it
            owns (its headroom).

        Raises:
            KeyError: ``seq_id`` is not allocated.
            ValueError: ``new_num_tokens`` is below the sequence's current token count.
            OutOfBlocksError: not enough free blocks (nothing changes then).
        """
        if not self.can_append(seq_id, new_num_tokens):
            missing = self.num_blocks_for(new_num_tokens) - len(self._tables[seq_id])
            raise OutOfBlocksError(
                f"growing sequence {seq_id!r} to {new_num_tokens} tokens needs {missing} more KV blocks but only "
                f"{len(self._free_blocks)} are free; call can_append first")
        added = self._grow_to(seq_id, self.num_blocks_for(new_num_tokens))
        self._num_tokens[seq_id] = new_num_tokens
        return added

    def can_reserve(self, seq_id: Hashable, reserve_tokens: int) -> bool:
        """Whether ``reserve(seq_id, reserve_tokens)`` would succeed."""
        _check_count(reserve_tokens, "reserve_tokens")
        target = self.num_blocks_for(self.num_tokens(seq_id) + reserve_tokens)
        return target - len(self._tables[seq_id]) <= len(self._free_blocks)

    def reserve(self, seq_id: Hashable, reserve_tokens: int) -> list[int]:
        """Make sure ``seq_id`` has headroom for at least ``reserve_tokens`` more tokens.

        Returns:
            The blocks added to the end of its block table (``[]`` if its headroom was already enough).

        Raises:
            KeyError: ``seq_id`` is not allocated.
            OutOfBlocksError: not enough free blocks (nothing changes then).
        """
        if not self.can_reserve(seq_id, reserve_tokens):
            raise OutOfBlocksError(
                f"reserving {reserve_tokens} tokens for sequence {seq_id!r} needs more KV blocks than the "
                f"{len(self._free_blocks)} free; call can_reserve first")
        return self._grow_to(seq_id, self.num_blocks_for(self._num_tokens[seq_id] + reserve_tokens))

    def free(self, seq_id: Hashable) -> list[int]:
        """Return every block of ``seq_id`` (headroom included) to the free pool.

        Returns:
            The freed block ids.

        Raises:
            KeyError: ``seq_id`` is not allocated (unknown, or freed already).
        """
        blocks = self._table(seq_id)
        del self._tables[seq_id], self._num_tokens[seq_id]
        # push in reverse so the sequence's first block is handed out first next time
        self._free_blocks.extend(reversed(blocks))
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

    def _grow_to(self, seq_id: Hashable, num_blocks: int) -> list[int]:
        table = self._tables[seq_id]
        added = self._take(max(0, num_blocks - len(table)))
        table.extend(added)
        return added

    def _take(self, n: int) -> list[int]:
        assert n <= len(self._free_blocks), "callers check can_* first"
        if n == 0:
            return []
        taken = self._free_blocks[-n:]
        del self._free_blocks[-n:]
        taken.reverse()
        return taken


def _check_count(n: int, name: str) -> None:
    if n < 0:
        raise ValueError(f"{name} must be >= 0, got {n}")

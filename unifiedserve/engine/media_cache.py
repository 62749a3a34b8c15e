"""The media cache: encoded visual tokens kept by media key, so a media seen before is neither decoded
nor encoded again, whatever text surrounds it (a question placed before the video, another prompt).

Owned by the model runner (its tensors live on the runner's device); the scheduler only asks for
membership and pins (:class:`unifiedserve.engine.scheduler.MediaCacheIndex`). Bounded in bytes,
least recently used first out; a pinned entry (a request admitted to copy it) is never evicted, and an
entry that does not fit even after evicting every unpinned one is not stored.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from unifiedserve.engine.scheduler import MediaCacheIndex


class MediaCache(MediaCacheIndex):
    """Visual tokens ``[V, hidden]`` per media key, at most ``capacity_bytes`` in all.

    Raises:
        ValueError: a negative capacity.
    """

    def __init__(self, capacity_bytes: int):
        if capacity_bytes < 0:
            raise ValueError(f"the media cache's capacity must be >= 0 bytes, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.num_bytes = 0
        self.num_evictions = 0
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()  # least recently used first
        self._pins: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def pin(self, key: str) -> bool:
        if key not in self._entries:
            return False
        self._entries.move_to_end(key)
        self._pins[key] = self._pins.get(key, 0) + 1
        return True

    def unpin(self, key: str) -> None:
        n = self._pins.get(key, 0)
        if n <= 0:
            raise KeyError(f"media cache entry {key!r} is not pinned")
        if n == 1:
            del self._pins[key]
        else:
            self._pins[key] = n - 1

    def is_pinned(self, key: str) -> bool:
        return key in self._pins

    def get(self, key: str) -> torch.Tensor:
        """The visual tokens of ``key`` (pin it first: an unpinned entry may go at the next :meth:`put`)."""
        return self._entries[key]

    def put(self, key: str, visual: torch.Tensor) -> bool:
        """Keep ``visual`` under ``key``, evicting least recently used unpinned entries to make room.

        Returns whether it is stored (False: larger than what unpinned eviction can free).
        """
        if not key or key in self._entries:
            return key in self._entries
        size = visual.numel() * visual.element_size()
        evictable = sum(t.numel() * t.element_size() for k, t in self._entries.items() if k not in self._pins)
        if size > self.capacity_bytes - (self.num_bytes - evictable):
            return False
        for k in [k for k in self._entries if k not in self._pins]:
            if self.num_bytes + size <= self.capacity_bytes:
                break
            self._drop(k)
            self.num_evictions += 1
        self._entries[key] = visual
        self.num_bytes += size
        return True

    def _drop(self, key: str) -> None:
        t = self._entries.pop(key)
        self.num_bytes -= t.numel() * t.element_size()

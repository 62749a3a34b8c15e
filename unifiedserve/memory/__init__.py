"""Memory bookkeeping (KV blocks, embedding-buffer pages) and the paged buffers themselves.

The bookkeeping modules (:mod:`.block_manager`, :mod:`.pages`) are pure Python and import no torch;
:mod:`.buffers` owns tensors and is imported lazily, so ``import unifiedserve.memory`` stays torch-free.
"""

from unifiedserve.memory.block_manager import BlockManager, OutOfBlocksError
from unifiedserve.memory.pages import (
    OutOfPagesError,
    PageAllocator,
    PagedStream,
    RaggedIndex,
    can_plan_write,
    plan_read,
    plan_write,
)

__all__ = [
    "BlockManager", "OutOfBlocksError", "OutOfPagesError", "PageAllocator", "PagedStream", "RaggedIndex",
    "can_plan_write", "plan_read", "plan_write",
    # from .buffers (lazy: they need torch)
    "PagedBuffer",
]

_LAZY = {"PagedBuffer"}


def __getattr__(name: str):
    if name in _LAZY:
        from unifiedserve.memory import buffers

        return getattr(buffers, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""Paged embedding buffers (patch buffer, visual-token buffer).

Bookkeeping (which pages a request holds) lives in :mod:`unifiedserve.memory.pages`; this module owns
the storage and moves rows in and out of it with the ops of :mod:`unifiedserve.ops`.
"""

from __future__ import annotations

import torch

from unifiedserve import ops
from unifiedserve.memory.pages import RaggedIndex


class PagedBuffer:
    """Storage ``[num_pages, page_size, dim]`` addressed by :class:`RaggedIndex` batches.

    The buffer lives on one device (the CPU, or a GPU for the engine's patch and visual-token buffers);
    rows written to it must already be there: :meth:`write` never copies across devices behind the
    caller's back. On CUDA, reads and writes run the CUDA kernel of :mod:`unifiedserve.ops` when it was
    built (else its torch reference).

    Args:
        num_pages: pages in the buffer.
        page_size: rows (tokens) per page.
        dim: features per row (patch buffer: 1176 for Qwen2.5-VL; visual-token buffer: the LLM hidden size).
        dtype: of the buffer; default float32, or ``storage``'s dtype.
        device: where a buffer allocated here lives (``"cpu"``, ``"cuda"``, ``"cuda:1"``, a
            :class:`torch.device`); default the CPU, or ``storage``'s device.
        storage: an existing contiguous tensor of that shape to wrap instead (shared memory, a CUDA IPC
            handle); the buffer then never allocates. ``dtype`` and ``device``, if given, must match it.

    Raises:
        ValueError: a size is not positive; ``device`` is not a device (or is CUDA without CUDA);
            ``storage`` has the wrong shape, dtype or device, or is not contiguous.
    """

    def __init__(self, num_pages: int, page_size: int, dim: int, dtype: torch.dtype | None = None,
                 device: str | torch.device | None = None, storage: torch.Tensor | None = None):
        if min(num_pages, page_size, dim) <= 0:
            raise ValueError(f"num_pages, page_size and dim must be positive, got {num_pages}, {page_size}, {dim}")
        shape = (num_pages, page_size, dim)
        where = _as_device(device) if device is not None else None
        if storage is None:
            where = where or torch.device("cpu")
            if where.type == "cuda" and not torch.cuda.is_available():
                raise ValueError(f"device {where} requested, but torch.cuda.is_available() is False")
            storage = torch.zeros(shape, dtype=dtype or torch.float32, device=where)
        else:
            if tuple(storage.shape) != shape or not storage.is_contiguous():
                raise ValueError(f"storage must be a contiguous {shape} tensor, got {tuple(storage.shape)}")
            if dtype is not None and storage.dtype != dtype:
                raise ValueError(f"storage is {storage.dtype}, but dtype={dtype} was asked for")
            if where is not None and not _same_device(where, storage.device):
                raise ValueError(f"storage is on {storage.device}, but device={where} was asked for")
        self.tensor = storage  # [num_pages, page_size, dim]
        self.num_pages, self.page_size, self.dim = shape

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    def __repr__(self) -> str:
        return (f"PagedBuffer(num_pages={self.num_pages}, page_size={self.page_size}, dim={self.dim}, "
                f"dtype={self.tensor.dtype}, device={self.tensor.device}, MiB={self.num_bytes / 2**20:.1f})")

    @property
    def num_bytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    @staticmethod
    def num_pages_for_budget(num_bytes: int, page_size: int, dim: int, dtype: torch.dtype) -> int:
        """Whole pages that fit in a memory budget of ``num_bytes``."""
        return max(0, num_bytes // (page_size * dim * dtype.itemsize))

    def write(self, src: torch.Tensor, index: RaggedIndex) -> None:
        """Write the packed chunk ``src`` [N, dim] where ``index`` (from ``plan_write``) says.

        Raises:
            ValueError: ``index`` was planned for another page size, or ``src`` is not of the buffer's
                dtype or not on its device.
            RuntimeError: ``src``'s shape or the index do not fit (nothing is written then).
        """
        if index.page_size != self.page_size:
            raise ValueError(f"index was planned for page_size {index.page_size}, buffer has {self.page_size}")
        if src.dtype != self.dtype or not _same_device(src.device, self.device):
            raise ValueError(f"src is {src.dtype} on {src.device}; the buffer is {self.dtype} on {self.device}")
        ops.paged_scatter(self.tensor, src, index)

    def read(self, index: RaggedIndex) -> torch.Tensor:
        """The rows ``index`` (from ``plan_read``) names, as a new packed [N, dim] tensor."""
        if index.page_size != self.page_size:
            raise ValueError(f"index was planned for page_size {index.page_size}, buffer has {self.page_size}")
        return ops.paged_gather(self.tensor, index)


def _as_device(device: str | torch.device) -> torch.device:
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device must be like 'cpu', 'cuda' or 'cuda:1', got {device!r}") from exc


def _same_device(asked: torch.device, actual: torch.device) -> bool:
    """``cuda`` (no index) matches any CUDA device; ``cuda:1`` only that one."""
    return asked.type == actual.type and (asked.index is None or actual.index is None or asked.index == actual.index)

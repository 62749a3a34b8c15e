"""When flashcodec's Triton kernels run (the fused resize, the fused patchify), shared by both.

They run on CUDA tensors when Triton imports (the GPU machine's torch ships it), and on any tensors
under Triton's interpreter (``TRITON_INTERPRET=1``, how the CPU tests run them). ``FLASHCODEC_NO_TRITON=1``
sends both back to their torch reference paths.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable, Hashable

import torch


def interpreting() -> bool:
    """Whether Triton's interpreter is on (read each time: the tests switch it per process)."""
    return os.environ.get("TRITON_INTERPRET", "") not in ("", "0")


@functools.lru_cache(maxsize=1)
def import_triton():
    """``(triton, triton.language)``, or ``None`` when Triton is not installed or does not import."""
    try:
        import triton
        import triton.language as tl
    except Exception:  # not installed, or a broken install: the torch paths serve
        return None
    return triton, tl


def triton_usable(device: torch.device | str) -> bool:
    """Whether a flashcodec Triton kernel may run on ``device``."""
    if os.environ.get("FLASHCODEC_NO_TRITON", "") not in ("", "0"):
        return False
    if torch.device(device).type != "cuda" and not interpreting():
        return False
    return import_triton() is not None


def on_device(device: torch.device):
    """``torch.cuda.device(device)`` for a CUDA device (Triton launches on the current one), else a no-op."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


class CompileOnce:
    """Launches of one kernel whose first launch per variant compiles under a lock: the NVDEC sessions' threads
    all start on the same video at once, and each would otherwise compile the same variant."""

    def __init__(self):
        self._done: set = set()
        self._lock = threading.Lock()

    def launch(self, variant: Hashable, launch: Callable[[], None]) -> None:
        """``launch()``; the first time for ``variant`` (what Triton specialises on), under the lock."""
        if variant in self._done:
            launch()
            return
        with self._lock:
            launch()
            self._done.add(variant)

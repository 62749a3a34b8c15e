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
from typing import Any

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
    _mend_interpreter()
    return triton, tl


def _mend_interpreter() -> None:
    """Two mends to Triton's interpreter (3.6), which the CPU tests run the kernels under. Compiled kernels are
    untouched: both act only inside the interpreter's launches.

    - A loop bounded by a runtime scalar (``for i in range(tl.cdiv(K, BLOCK))``): the interpreter holds every
      scalar as a one-element numpy array and converts it for ``range`` with ``int(array)``, which numpy 2.4 no
      longer allows for arrays of one dimension (TypeError). Its per-launch patch of ``tl.tensor`` is wrapped so
      that the conversion takes the element.
    - ``tl.dot`` of bfloat16 tiles: the interpreter stores bfloat16 as its uint16 bits and multiplied those
      bits as integers. Such tiles are now widened to float32 first (exact: bfloat16 is float32's top half).
    """
    try:
        import numpy as np
        from triton.runtime import interpreter
    except Exception:
        return
    patch = getattr(interpreter, "_patch_lang", None)
    if patch is None or getattr(patch, "_flashcodec_mended", False):
        return
    builder = getattr(interpreter, "InterpreterBuilder", None)
    dot = getattr(builder, "create_dot", None)
    if dot is not None:
        import triton.language as tl

        def widened(handle):
            if handle.dtype.scalar == tl.bfloat16:
                bits = handle.data.astype(np.uint32) << 16
                return interpreter.TensorHandle(bits.view(np.float32), tl.float32)
            return handle

        def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
            return dot(self, widened(a), widened(b), d, input_precision, max_num_imprecise_acc)

        builder.create_dot = create_dot

    def patched(fn):
        scope = patch(fn)
        if hasattr(scope, "set_attr"):
            import triton.language as tl

            scope.set_attr(tl.core.tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
        return scope

    patched._flashcodec_mended = True
    interpreter._patch_lang = patched


def kernel_builder(build: Callable[[Any, Any], Any]) -> Callable[[bool], tuple[Any, Any] | None]:
    """A module's ``_kernel(interpret) -> (triton, kernel)``, or None when Triton does not import.

    ``build(triton, tl)`` defines the ``triton.jit`` kernel and runs on first use, once per interpreter mode
    (``interpret`` keys the cache: whether the interpreter runs a kernel is fixed when ``triton.jit`` runs, and the
    tests switch it per process).
    """

    @functools.lru_cache(maxsize=2)
    def kernel(interpret: bool):
        found = import_triton()
        if found is None:
            return None
        return found[0], build(*found)

    return kernel


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

"""Native ops from ``csrc/`` with a torch fallback: the one module that binds them.

On first use the extension is compiled against the installed torch with
``torch.utils.cpp_extension.load`` (ninja, JIT) into a per-torch-version cache directory, and later
processes just load it. On a CUDA build of torch with nvcc at hand (``CUDA_HOME``) the CUDA kernels
(``csrc/*.cu``) are compiled in too; if that build fails, one warning is logged and the CPU-only
extension is built instead, so CUDA tensors take the torch reference. If there is no compiler or the
build fails, one warning is logged and every op runs its torch reference
(:mod:`unifiedserve.ops.reference`) instead. Set ``UNIFIEDSERVE_NO_NATIVE=1`` to force the reference;
``UNIFIEDSERVE_CACHE_DIR`` moves the build cache.

Ops: :func:`paged_scatter`, :func:`paged_gather` (paged embedding buffers, index semantics in
:class:`unifiedserve.memory.RaggedIndex`).
"""

from __future__ import annotations

import fcntl
import logging
import os
import pathlib
import threading
import time

import torch

from unifiedserve.memory.pages import RaggedIndex
from unifiedserve.ops import reference
from unifiedserve.ops.reference import RaggedIndexTensors

__all__ = ["RaggedIndexTensors", "build_info", "cache_dir", "native_available", "paged_gather",
           "paged_scatter"]

logger = logging.getLogger(__name__)

_EXTENSION_NAME = "unifiedserve_ops"
_CSRC = pathlib.Path(__file__).resolve().parents[2] / "csrc"
_SOURCES = [_CSRC / "paged_copy.cpp"]  # every build
_CUDA_SOURCES = [_CSRC / "paged_copy_cuda.cu"]  # added when torch is a CUDA build and nvcc is found
_CFLAGS = ["-O3", "-fopenmp"]  # -fopenmp: at::parallel_for is inline OpenMP; without it the copy runs serially
_CUDA_CFLAGS = ["-O3", "--expt-relaxed-constexpr"]
_LDFLAGS = ["-fopenmp"]

_load_lock = threading.Lock()
_native: bool | None = None  # None until the first attempt
_info: dict = {}


def cache_dir() -> pathlib.Path:
    """Where the compiled extension lives: one directory per torch version."""
    root = os.environ.get("UNIFIEDSERVE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "unifiedserve")
    return pathlib.Path(root) / "ops" / f"torch-{torch.__version__}"


def native_available() -> bool:
    """Whether the native ops are loaded; builds or loads them on the first call (seconds, once)."""
    global _native
    if _native is None:
        with _load_lock:
            if _native is None:
                _native = _load()
    return _native


def build_info() -> dict:
    """How the ops were loaded.

    Returns:
        ``native`` (the extension is loaded), ``cuda`` (its CUDA kernels are in it), ``seconds`` (build or
        load), ``built`` (compiled now), ``reason`` (why not native), ``cuda_reason`` (why no CUDA kernels).
    """
    native_available()
    return dict(_info)


def _native_for(buffer: torch.Tensor) -> bool:
    """Whether the extension has a kernel for ``buffer``'s device (CPU always; CUDA when built with nvcc)."""
    if buffer.device.type == "cpu":
        return native_available()
    return buffer.device.type == "cuda" and native_available() and bool(_info.get("cuda"))


def paged_scatter(buffer: torch.Tensor, src: torch.Tensor, index: RaggedIndex | RaggedIndexTensors) -> None:
    """Write the packed chunk ``src`` [N, ...] into the pages of ``buffer`` [num_pages, page_size, ...].

    Row ``r`` of ``src`` goes where ``index`` puts it (see :class:`~unifiedserve.memory.RaggedIndex`).
    ``buffer`` must be contiguous and share ``src``'s dtype; rows may start at any slot of a page and
    cross page boundaries. The index must not name one slot twice. On CUDA the kernel (when built)
    validates a host copy of the index first, so a call waits for the work already queued on the
    current stream (see csrc/README.md).

    Raises:
        RuntimeError: shapes, dtypes or the index do not fit (nothing is written then).
    """
    ix = RaggedIndexTensors.from_index(index, buffer.device)
    if _native_for(buffer):
        torch.ops.unifiedserve.paged_scatter(buffer, src, *ix)
    else:
        reference.paged_scatter(buffer, src, ix)


def paged_gather(buffer: torch.Tensor, index: RaggedIndex | RaggedIndexTensors) -> torch.Tensor:
    """Read the rows ``index`` names from ``buffer`` [num_pages, page_size, ...] into a new [N, ...] tensor.

    The result is on ``buffer``'s device; on CUDA the call syncs once, as :func:`paged_scatter` does.

    Raises:
        RuntimeError: the buffer or the index do not fit.
    """
    ix = RaggedIndexTensors.from_index(index, buffer.device)
    if _native_for(buffer):
        return torch.ops.unifiedserve.paged_gather(buffer, *ix)
    return reference.paged_gather(buffer, ix)


def _cuda_toolchain() -> str:
    """Why the CUDA kernels cannot be built here, or '' when they can (CUDA torch, nvcc, sources)."""
    if not _CUDA_SOURCES:
        return "no CUDA sources"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is not a CUDA build"
    from torch.utils import cpp_extension

    home = cpp_extension.CUDA_HOME
    if home is None or not (pathlib.Path(home) / "bin" / "nvcc").exists():
        return "nvcc not found (set CUDA_HOME)"
    return ""


def _load() -> bool:
    if os.environ.get("UNIFIEDSERVE_NO_NATIVE", "") not in ("", "0"):
        _info.update(native=False, cuda=False, seconds=0.0, built=False, reason="UNIFIEDSERVE_NO_NATIVE is set",
                     cuda_reason="UNIFIEDSERVE_NO_NATIVE is set")
        logger.debug("unifiedserve.ops: UNIFIEDSERVE_NO_NATIVE is set; using the torch reference")
        return False
    start = time.perf_counter()
    cuda_reason = _cuda_toolchain()
    if not cuda_reason:
        # its own directory and name: a failed CUDA build must not leave a half-written CPU-only build behind
        try:
            built = _build(cache_dir() / "cuda", f"{_EXTENSION_NAME}_cuda", _SOURCES + _CUDA_SOURCES)
        except Exception as exc:  # nvcc errors, an arch nvcc does not know: the CPU kernels still help
            cuda_reason = f"{type(exc).__name__}: {_first_error_line(str(exc))}"
            logger.warning("unifiedserve.ops: CUDA kernels unavailable (%s); CUDA tensors use the torch reference",
                           cuda_reason)
        else:
            return _loaded(start, built, cuda=True, cuda_reason="")
    try:
        built = _build(cache_dir(), _EXTENSION_NAME, _SOURCES)
    except Exception as exc:  # no compiler, no ninja, a compile error: all mean "use the reference"
        reason = f"{type(exc).__name__}: {_first_error_line(str(exc))}"
        _info.update(native=False, cuda=False, seconds=time.perf_counter() - start, built=False, reason=reason,
                     cuda_reason=cuda_reason)
        logger.warning("unifiedserve.ops: native kernels unavailable (%s); using the torch reference "
                       "(set UNIFIEDSERVE_NO_NATIVE=1 to skip the build)", reason)
        return False
    return _loaded(start, built, cuda=False, cuda_reason=cuda_reason)


def _loaded(start: float, built: bool, cuda: bool, cuda_reason: str) -> bool:
    seconds = time.perf_counter() - start
    _info.update(native=True, cuda=cuda, seconds=seconds, built=built, reason="", cuda_reason=cuda_reason,
                 cache_dir=str(cache_dir() / "cuda" if cuda else cache_dir()))
    logger.info("unifiedserve.ops: native kernels%s %s in %.1f s (%s)", " with CUDA" if cuda else "",
                "built" if built else "loaded", seconds, _info["cache_dir"])
    return True


def _build(build_dir: pathlib.Path, name: str, sources: list[pathlib.Path]) -> bool:
    """Compile (if stale) and load ``sources`` as extension ``name``; whether it was compiled now.

    Raises:
        FileNotFoundError: a source is missing (an install without ``csrc/``).
        Exception: whatever ``cpp_extension.load`` raises for a failed build or load.
    """
    missing = [str(s) for s in sources if not s.is_file()]
    if missing:
        raise FileNotFoundError(f"sources not found: {', '.join(missing)} (install from a source checkout)")
    from torch.utils import cpp_extension

    build_dir.mkdir(parents=True, exist_ok=True)
    library = build_dir / f"{name}.so"
    before = library.stat().st_mtime_ns if library.exists() else None
    cuda = any(s.suffix == ".cu" for s in sources)
    # cpp_extension's own lock is a file that stays behind if a build is killed, and then every later
    # load waits forever. We serialise builds with an flock instead (released by the kernel when a
    # process dies), so a 'lock' file seen while holding it is such a leftover.
    with open(build_dir / "build.flock", "w") as flock:
        fcntl.flock(flock, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        # copies: cpp_extension appends to the lists it is given (a CUDA attempt would leave -ltorch_cuda
        # in _LDFLAGS for the CPU-only build that follows it)
        cpp_extension.load(name=name, sources=[str(s) for s in sources], build_directory=str(build_dir),
                           extra_cflags=list(_CFLAGS), extra_cuda_cflags=list(_CUDA_CFLAGS) if cuda else None,
                           extra_ldflags=list(_LDFLAGS), extra_include_paths=[str(_CSRC)], with_cuda=cuda,
                           is_python_module=False, verbose=False)
    return library.exists() and library.stat().st_mtime_ns != before


def _first_error_line(message: str) -> str:
    """The compiler's first ``error:`` line if there is one (a build log is long), else the first line."""
    lines = [line.strip() for line in message.strip().splitlines()] or [""]
    errors = [line for line in lines if "error:" in line.lower()]
    return (errors or lines)[0][:200]

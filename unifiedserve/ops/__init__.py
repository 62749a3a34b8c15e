"""Native ops from ``csrc/`` with a torch fallback: the one module that binds them.

On first use the extension is compiled against the installed torch with
``torch.utils.cpp_extension.load`` (ninja, JIT) into a per-torch-version cache directory, and later
processes just load it. On a CUDA build of torch with nvcc at hand (``CUDA_HOME``) the CUDA kernels
(``csrc/*.cu``) are compiled in too; if that build fails, one warning is logged and the CPU-only
extension is built instead, so CUDA tensors take the torch reference. If there is no compiler or the
build fails, one warning is logged and every op runs its torch reference
(:mod:`unifiedserve.ops.reference`) instead. Set ``UNIFIEDSERVE_NO_NATIVE=1`` to force the reference;
``UNIFIEDSERVE_CACHE_DIR`` moves the build cache.

Ops:

- :func:`paged_scatter`, :func:`paged_gather`: paged embedding buffers (index semantics in
  :class:`unifiedserve.memory.RaggedIndex`).
- :func:`rms_norm`, :func:`fused_add_rms_norm`, :func:`silu_and_mul`, :func:`rotary`,
  :func:`rotary_cache`: the decoder layer's small ops fused, one pass over a row each instead of up
  to ten torch ops (csrc/fused_ops.cpp); ``rotary_cache`` also writes the new K/V into the paged cache.
  They round where the model's unfused torch code rounds (:mod:`unifiedserve.ops.reference`), so they
  give its results up to the order of the RMSNorm's sum. They take the reference whenever autograd
  would need to see them (grad mode with an input that requires grad) or a dtype they do not cover.
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

__all__ = ["RaggedIndexTensors", "build_info", "cache_dir", "fused_add_rms_norm", "fused_enabled", "native_available",
           "paged_decode_attention", "paged_gather", "paged_scatter", "rms_norm", "rotary", "rotary_cache",
           "silu_and_mul"]

logger = logging.getLogger(__name__)

_EXTENSION_NAME = "unifiedserve_ops"
_CSRC = pathlib.Path(__file__).resolve().parents[2] / "csrc"
_SOURCES = [_CSRC / "ops.cpp", _CSRC / "paged_copy.cpp", _CSRC / "fused_ops.cpp", _CSRC / "paged_attention.cpp"]
# added when torch is a CUDA build and nvcc is found (paged_copy_cuda_host.cpp, the host side of the .cu
# beside it, needs the CUDA headers)
_CUDA_SOURCES = [_CSRC / "paged_copy_cuda.cu", _CSRC / "paged_copy_cuda_host.cpp", _CSRC / "fused_ops_cuda.cu"]
# -fopenmp: at::parallel_for is inline OpenMP; without it the copy runs serially.
# -ffp-contract=off: no fused multiply-adds, which round once where the reference rounds twice (fused_ops.h).
_CFLAGS = ["-O3", "-fopenmp", "-ffp-contract=off"]
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


_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def fused_enabled() -> bool:
    """Whether the fused layer ops may run their kernels: ``UNIFIEDSERVE_NO_FUSED_OPS=1`` sends them to the
    torch reference (to measure the fusion, or to rule it out), without turning off the other native ops."""
    return os.environ.get("UNIFIEDSERVE_NO_FUSED_OPS", "") in ("", "0")


_FUSED = fused_enabled()  # read once: the ops run per layer


def _fused_native(*tensors: torch.Tensor) -> bool:
    """Whether the fused kernels take these tensors: a kernel for their device, a dtype they cover, and
    nothing autograd would have to record (the kernels have no backward). Runs per layer: kept cheap."""
    t = tensors[0]
    if not _FUSED or t.dtype not in _FUSED_DTYPES:
        return False
    if torch.is_grad_enabled():
        for x in tensors:
            if x.requires_grad:
                return False
    if t.is_cuda:
        return native_available() and bool(_info.get("cuda"))
    return t.is_cpu and native_available()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen2's RMSNorm of the last dim: ``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)``.

    Args:
        x: ``[..., hidden]``; weight: ``[hidden]``, in ``x``'s dtype for the fused kernel.

    Returns:
        A new tensor shaped like ``x``.
    """
    if weight.dtype != x.dtype or not _fused_native(x, weight):
        return reference.rms_norm(x, weight, eps)
    if x.dim() == 2 and x.stride(-1) == 1:
        rows = x  # [N, hidden]
    else:
        rows = x.reshape(-1, x.shape[-1]) if x.stride(-1) == 1 else x.contiguous().view(-1, x.shape[-1])
    out = torch.empty_like(rows, memory_format=torch.contiguous_format)  # [N, hidden]
    torch.ops.unifiedserve.rms_norm(out, rows, weight, float(eps))
    return out if rows is x else out.view(x.shape)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A sublayer's output added to the residual stream, then the next RMSNorm: ``h = x + residual``,
    returns ``(rms_norm(h), h)``.

    The fused kernel writes both results into the inputs' memory (``h`` into ``residual``, the norm into
    ``x``) and returns them; the reference returns new tensors. Callers use the returned pair and do not
    read ``x`` or ``residual`` again.

    Args:
        x, residual: ``[N, hidden]`` of one dtype; weight: ``[hidden]``.
    """
    if (weight.dtype != x.dtype or residual.dtype != x.dtype or x.dim() != 2 or residual.shape != x.shape
            or not _fused_native(x, residual, weight)):
        return reference.fused_add_rms_norm(x, residual, weight, eps)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if residual.stride(-1) != 1:
        residual = residual.contiguous()
    torch.ops.unifiedserve.fused_add_rms_norm(x, residual, weight, float(eps))
    return x, residual


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's ``silu(gate) * up`` for ``gate_up = [gate | up]`` ``[..., 2 * I]``; returns ``[..., I]``."""
    # CUDA only: on the CPU, torch's vectorised silu and mul beat a fused loop with a scalar exp (0.3-0.9x
    # in bench/kernels/bench_fused_ops.py), so CPU tensors take the reference
    if not gate_up.is_cuda or not _fused_native(gate_up) or gate_up.shape[-1] % 2:
        return reference.silu_and_mul(gate_up)
    shape = gate_up.shape
    rows = gate_up.reshape(-1, shape[-1]) if gate_up.stride(-1) == 1 else gate_up.contiguous().view(-1, shape[-1])
    out = torch.empty((rows.shape[0], shape[-1] // 2), dtype=gate_up.dtype, device=gate_up.device)  # [N, I]
    torch.ops.unifiedserve.silu_and_mul(out, rows)
    return out.view(*shape[:-1], shape[-1] // 2)


def _rotary_fits(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """The layouts and dtypes the rotary kernels take (anything else runs the reference)."""
    return (q.dim() == 3 and k.dim() == 3 and q.stride(-1) == 1 and k.stride(-1) == 1 and k.dtype == q.dtype
            and cos.dtype == sin.dtype and cos.dtype in (q.dtype, torch.float32)
            and cos.shape == sin.shape == (q.shape[0], q.shape[2]) and cos.is_contiguous() and sin.is_contiguous())


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of ``q [N, Hq, D]`` and ``k [N, Hk, D]`` with ``cos``/``sin [N, D]``:
    ``x * cos + rotate_half(x) * sin``, computed in the tables' dtype (see :func:`reference.rotary`).

    The fused kernel rotates ``q`` and ``k`` in place (they may be views into one QKV projection) and
    returns them; the reference returns new tensors. Callers use the returned pair.
    """
    if not _rotary_fits(q, k, cos, sin) or not _fused_native(q, k, cos, sin):
        return reference.rotary(q, k, cos, sin)
    torch.ops.unifiedserve.rotary_(q, k, cos, sin)
    return q, k


def rotary_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 write_rows: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`rotary` of ``q`` and ``k`` with the new K/V written into the paged cache in the same pass.

    Row ``r``'s rotated K and its V (row ``write_rows[r]``'s when given: CUDA-graph padding rows repeat
    row 0's write) go to slot ``slot_mapping[r]`` of ``k_cache``/``v_cache`` ``[slots, Hk, D]``; ``k``
    and ``v`` themselves are not changed. Returns the rotated ``q`` (rotated in place when fused).

    On CUDA the fused kernel cannot raise on an index value: a slot or row out of range skips that
    row's write (the attention planners build these indices and check them on the host); the CPU
    kernel and the reference raise.
    """
    fits = (_rotary_fits(q, k, cos, sin) and v.shape == k.shape and v.dtype == k.dtype and v.stride(-1) == 1
            and k_cache.dtype == k.dtype and v_cache.dtype == k.dtype and k_cache.is_contiguous()
            and v_cache.is_contiguous() and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous()
            and (write_rows is None or (write_rows.dtype == torch.int64 and write_rows.is_contiguous())))
    if not fits or not _fused_native(q, k, v, cos, sin, k_cache, v_cache):
        return reference.rotary_cache(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, write_rows)
    torch.ops.unifiedserve.rotary_cache_(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, write_rows)
    return q


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                           valid: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of one new token per sequence over its cached keys, read where they lie in the cache.

    Args:
        q: ``[B, q_heads, head_dim]``; k_cache, v_cache: ``[slots, kv_heads, head_dim]``;
        slots: int64 ``[B, L]`` cache slot of key position ``l`` of sequence ``b``;
        valid: bool ``[B, L]``, the positions that count; scale: the softmax scale.

    Returns:
        ``[B, q_heads, head_dim]`` in q's dtype. On the CPU (native build) one kernel reads each key and
        value row in place; elsewhere the reference gathers them and runs SDPA.
    """
    fits = (q.dim() == 3 and q.stride(-1) == 1 and k_cache.dtype == q.dtype and v_cache.dtype == q.dtype
            and k_cache.is_contiguous() and v_cache.is_contiguous() and slots.dtype == torch.int64
            and slots.is_contiguous() and valid.dtype == torch.bool and valid.is_contiguous())
    if fits and q.is_cpu and _fused_native(q, k_cache, v_cache):
        return torch.ops.unifiedserve.paged_decode_attention(q, k_cache, v_cache, slots, valid, float(scale))
    return reference.paged_decode_attention(q, k_cache, v_cache, slots, valid, scale)


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

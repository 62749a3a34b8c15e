"""Decode-sized GEMMs: ``x [M, K] @ W[N, K]^T`` for ``M <= 16`` rows, with the epilogues the decoder needs.

Why. At decode batch sizes a layer's GEMMs only stream their weights: on the H100 (2026-11-26, 7B preset,
batch 1, `docs/gpu.md`) cuBLAS read the 7B's weights at 2.67 TB/s against a 3.01 TB/s device copy, with the
small projections well below that (Q/K/V 75 %, O 74 %), the down projection as a split-K GEMM with a memset
and a reduction kernel beside it, and SwiGLU's activation as a kernel of its own. A kernel made for this
shape can stream each weight once with deep pipelining and fold what follows into its epilogue:

- ``bias``: added in float32 before the one rounding (as cuBLAS's bias epilogue does);
- ``silu_mul``: ``W = [gate | up]`` (``[2 * I, K]``), output ``[M, I]`` = ``silu(x @ gate^T) * (x @ up^T)``,
  rounded where the unfused path rounds (the GEMM's output, the SiLU, the product: ``csrc/fused_ops.h``), so
  the fused kernel differs from GEMM + ``silu_and_mul`` only by the GEMM's summation order.

The kernel (Triton) computes ``W_tile @ x^T`` ("swap AB"): the weight's rows fill the matrix unit's M side and
the ``M <= 16`` activation rows its N side (padded to 16 with zeros, loaded from L2, never from HBM). Each
program owns ``BLOCK_N`` output columns over all of K, so no split-K workspace, no memset, no second kernel,
and the sums are deterministic (a CUDA graph replays the eager bits). Loads are pipelined ``stages`` deep.

Which kernel runs is measured, not assumed: :func:`tune` times cuBLAS and each :data:`CONFIGS` entry on the
model's own weights (every layer's, in order, so each read comes from HBM as in a step, not from L2) at each
row count the engine will run, and :func:`linear` / :func:`gate_up_silu` take the skinny kernel only where it
won. Untuned shapes, CPU tensors, float32 (whose ``tl.dot`` would round to TF32), more than 16 rows,
autograd and ``UNIFIEDSERVE_SKINNY_GEMM=0`` all take cuBLAS (and ``silu_and_mul``) as before.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flashcodec._triton import CompileOnce, import_triton, interpreting, on_device

__all__ = ["CONFIGS", "MAX_ROWS", "Choice", "SkinnyConfig", "Weights", "enabled", "gate_up_silu", "linear", "reset", "skinny_gemm",
           "summary", "table", "tune"]

log = logging.getLogger(__name__)

#: the most activation rows the kernel takes (the matrix unit's N side is padded to this)
MAX_ROWS = 16
_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class SkinnyConfig:
    """One launch configuration: ``block_n`` output columns per program, ``block_k`` of K per pipeline stage."""

    block_n: int
    block_k: int
    stages: int
    warps: int = 4

    def __str__(self) -> str:
        return f"n{self.block_n}k{self.block_k}s{self.stages}w{self.warps}"


#: the candidates :func:`tune` times. Narrow column blocks keep every SM busy on the 3584-wide outputs (224
#: programs at 16); deep K blocks keep 32-64 KB in flight per program. Each fits Hopper's shared memory
#: (stages x (block_n + 16) x block_k x 2 bytes <= 160 KB; checked by the compile test).
CONFIGS: tuple[SkinnyConfig, ...] = (
    SkinnyConfig(16, 512, 4),
    SkinnyConfig(16, 256, 6),
    SkinnyConfig(32, 256, 4),
    SkinnyConfig(64, 128, 4),
)


def enabled() -> bool:
    """``UNIFIEDSERVE_SKINNY_GEMM=0`` keeps every GEMM on cuBLAS (to measure what the kernel buys)."""
    return os.environ.get("UNIFIEDSERVE_SKINNY_GEMM", "") not in ("0", "off", "false")


@functools.lru_cache(maxsize=2)
def _kernel(interpret: bool):
    """The Triton kernel, built on first use (``interpret`` keys the cache: the tests switch it per process)."""
    found = import_triton()
    if found is None:
        return None
    triton, tl = found

    # M and N are runtime values, not specialised: one compilation per (config, epilogue, dtype, K divisible by the
    # K block) serves every shape, so tune() compiles each once and no step compiles. K, the row strides and the
    # pointers stay specialised: their divisibility by 16 is what lets Triton load 16 bytes at a time
    @triton.jit(do_not_specialize=("M", "N"))
    def skinny_kernel(x, w, bias, out, M, N, K, stride_xm, stride_wn, stride_om, up_offset,
                      HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid = tl.program_id(0)
        rn = (pid * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)  # this program's output columns
        rm = tl.arange(0, BLOCK_M)  # activation rows, padded
        rk = tl.arange(0, BLOCK_K)
        n_ok = rn < N
        m_ok = rm < M
        w_ptrs = w + rn[:, None] * stride_wn + rk[None, :]  # [BLOCK_N, BLOCK_K], K contiguous
        u_ptrs = w + (rn + up_offset)[:, None] * stride_wn + rk[None, :]  # the up rows (SILU_MUL)
        x_ptrs = x + rm[None, :] * stride_xm + rk[:, None]  # [BLOCK_K, BLOCK_M]: x^T
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for i in range(tl.cdiv(K, BLOCK_K)):
            if EVEN_K:  # no mask along K: 16-byte loads
                w_mask = n_ok[:, None]
                x_mask = m_ok[None, :]
            else:
                k_ok = rk < K - i * BLOCK_K
                w_mask = n_ok[:, None] & k_ok[None, :]
                x_mask = k_ok[:, None] & m_ok[None, :]
            xt = tl.load(x_ptrs, mask=x_mask, other=0.0)
            acc = tl.dot(tl.load(w_ptrs, mask=w_mask, other=0.0), xt, acc)
            if SILU_MUL:
                acc_up = tl.dot(tl.load(u_ptrs, mask=w_mask, other=0.0), xt, acc_up)
                u_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        if HAS_BIAS:
            acc += tl.load(bias + rn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
            if SILU_MUL:
                acc_up += tl.load(bias + up_offset + rn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        dtype = out.dtype.element_ty
        if SILU_MUL:
            # rounded where GEMM + silu_and_mul round: the GEMM's two outputs, the SiLU, the product
            gate = acc.to(dtype).to(tl.float32)
            up = acc_up.to(dtype).to(tl.float32)
            silu = tl.math.div_rn(gate, 1.0 + tl.exp(-gate)).to(dtype).to(tl.float32)
            result = silu * up
        else:
            result = acc
        o_ptrs = out + rm[None, :] * stride_om + rn[:, None]  # [BLOCK_N, BLOCK_M] of out [M, N]
        tl.store(o_ptrs, result.to(dtype), mask=n_ok[:, None] & m_ok[None, :])

    return triton, skinny_kernel


_launches = CompileOnce()


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool) -> tuple[int, int, int]:
    """``(M, N, K)`` of a call the kernel takes (``N``: output columns), else ``ValueError``."""
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"x and weight must be 2-D, got {list(x.shape)} and {list(weight.shape)}")
    m, k = x.shape
    rows = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"x has {k} columns, weight {list(weight.shape)} has {weight.shape[1]}")
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"the skinny GEMM takes 1 to {MAX_ROWS} rows, got {m}")
    if x.dtype not in _DTYPES or weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"x, weight and bias must all be bfloat16 or float16, got {x.dtype}, {weight.dtype}"
                         + ("" if bias is None else f", {bias.dtype}"))
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and weight need a contiguous last dim")
    if silu_mul and rows % 2:
        raise ValueError(f"silu_mul needs [gate | up] weight rows (an even count), got {rows}")
    n = rows // 2 if silu_mul else rows
    if bias is not None and (bias.shape != (rows,) or bias.stride(0) != 1):
        raise ValueError(f"bias must be contiguous [{rows}], got {list(bias.shape)}")
    if x.device != weight.device or (bias is not None and bias.device != x.device):
        raise ValueError("x, weight and bias must be on one device")
    return m, n, k


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, silu_mul: bool = False,
                config: SkinnyConfig = CONFIGS[0], out: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` (``silu_mul``: then SwiGLU of its ``[gate | up]`` halves) in one kernel.

    Args:
        x: ``[M, K]``, ``1 <= M <= 16``, bfloat16 or float16, contiguous rows; weight ``[N, K]`` (``[2 * I, K]``
            with ``silu_mul``) and bias ``[N]`` of the same dtype, on the same device.
        config: the launch configuration (:func:`tune` picks one per shape).
        out: where to write ``[M, N]`` (``[M, I]``); a new tensor when None.
    Raises:
        ValueError: a call the kernel does not take (see Args); RuntimeError: Triton cannot run here.
    """
    m, n, k = _check(x, weight, bias, silu_mul)
    found = _kernel(interpreting())
    if found is None:
        raise RuntimeError("the skinny GEMM needs Triton")
    triton, kernel = found
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"out must be [{m}, {n}] {x.dtype} with a contiguous last dim")
    grid = (triton.cdiv(n, config.block_n),)
    even_k = k % config.block_k == 0
    variant = (config, bias is not None, silu_mul, even_k, x.dtype)
    with on_device(x.device):
        _launches.launch(variant, lambda: kernel[grid](
            x, weight, x if bias is None else bias, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0), n,
            HAS_BIAS=bias is not None, SILU_MUL=silu_mul, EVEN_K=even_k, BLOCK_M=MAX_ROWS, BLOCK_N=config.block_n,
            BLOCK_K=config.block_k, num_stages=config.stages, num_warps=config.warps))
    return out


# -- the choice per shape ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Choice:
    """What :func:`tune` measured for one weight shape at one row count (microseconds per call, all layers' mean)."""

    kind: str  # what the weights are (``qkv_proj``, ``gate_up_proj+silu``, ...)
    rows: int
    n: int
    k: int
    cublas_us: float
    skinny_us: float | None  # the best config's
    config: SkinnyConfig | None  # the best config; None when cuBLAS stays
    configs_us: dict[str, float]  # every config that ran

    @property
    def chosen(self) -> bool:
        return self.config is not None

    def as_dict(self) -> dict:
        return {"kind": self.kind, "rows": self.rows, "n": self.n, "k": self.k, "cublas_us": round(self.cublas_us, 2),
                "skinny_us": None if self.skinny_us is None else round(self.skinny_us, 2),
                "config": None if self.config is None else str(self.config),
                "speedup": None if self.skinny_us is None else round(self.cublas_us / self.skinny_us, 3),
                "configs_us": {name: round(us, 2) for name, us in self.configs_us.items()}}


# (N rows of weight, K, dtype, has bias, silu_mul) -> [(rows bucket, config or None)], buckets ascending
_table: dict[tuple, list[tuple[int, SkinnyConfig | None]]] = {}
_report: list[Choice] = []


def _key(weight: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool) -> tuple:
    return weight.shape[0], weight.shape[1], weight.dtype, bias is not None, silu_mul


def table() -> list[Choice]:
    """What the last :func:`tune` measured, one entry per (shape, row count)."""
    return list(_report)


def summary(results: Sequence[Choice]) -> str:
    """One line per kind for the start-up log: which row counts took the skinny kernel, and its time at 1 row."""
    kinds: dict[str, list[Choice]] = {}
    for c in results:
        kinds.setdefault(c.kind, []).append(c)
    parts = []
    for kind, choices in kinds.items():
        won = [c.rows for c in choices if c.chosen]
        first = choices[0]
        timing = f"{first.cublas_us:.1f} us cuBLAS" + (
            "" if first.skinny_us is None else f" vs {first.skinny_us:.1f} us skinny at {first.rows} row(s)")
        where = f"skinny at rows {won}" if won else "cuBLAS"
        parts.append(f"{kind} [{first.n}x{first.k}]: {where} ({timing})")
    return "; ".join(parts)


def reset() -> None:
    """Forget every choice: every GEMM takes cuBLAS until the next :func:`tune`."""
    _table.clear()
    _report.clear()


def _lookup(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool) -> SkinnyConfig | None:
    """The tuned config for this call, or None (cuBLAS). Runs per linear per step in eager mode: kept cheap."""
    if not _table or x.dim() != 2 or not (x.is_cuda or interpreting()):  # CPU tensors: the CPU tests' interpreter
        return None
    buckets = _table.get(_key(weight, bias, silu_mul))
    if buckets is None:
        return None
    m = x.shape[0]
    for rows, config in buckets:  # the smallest tuned row count that covers m
        if m <= rows:
            break
    else:
        return None
    if config is None or x.dtype != weight.dtype or x.stride(1) != 1 or weight.stride(1) != 1:
        return None
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return None  # no backward
    return config


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, through the skinny kernel where :func:`tune` measured it faster for this shape and row count."""
    config = _lookup(x, weight, bias, False)
    if config is None:
        return F.linear(x, weight, bias)
    return skinny_gemm(x, weight, bias, config=config)


def gate_up_silu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 silu_and_mul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """SwiGLU's ``silu(gate) * up`` of ``F.linear(x, [gate | up], bias)``: one skinny kernel where :func:`tune`
    measured it faster than the GEMM followed by ``silu_and_mul`` (the op passed in), else those two."""
    config = _lookup(x, weight, bias, True)
    if config is None:
        return silu_and_mul(F.linear(x, weight, bias))
    return skinny_gemm(x, weight, bias, silu_mul=True, config=config)


@dataclass(frozen=True)
class Weights:
    """One kind of projection to tune: every layer's weight (and bias) of one shape, in the order a step reads them."""

    kind: str
    weights: Sequence[torch.Tensor]
    biases: Sequence[torch.Tensor | None]
    silu_mul: bool = False


def _time_us(run: Callable[[], None], repeats: int, device: torch.device) -> float:
    """The fastest of ``repeats`` timed calls of ``run`` (CUDA events), in microseconds."""
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1000.0)
    return best


def _disagreement(got: torch.Tensor, want: torch.Tensor) -> str:
    """Why ``got`` is not ``want`` up to 16-bit rounding (each value within 2 % of the output's largest), or ''."""
    scale = want.float().abs().max().item()
    err = (got.float() - want.float()).abs().max().item()
    if err == err and err <= 0.02 * scale + 1e-3:  # (err == err: not NaN)
        return ""
    return f"its output differs from cuBLAS's by {err:.3g} (largest value {scale:.3g})"


def tune(groups: Iterable[Weights], rows: Iterable[int], *, silu_and_mul: Callable[[torch.Tensor], torch.Tensor],
         configs: Sequence[SkinnyConfig] = CONFIGS, repeats: int = 5, margin: float = 0.02,
         timer: Callable[[Callable[[], None], int, torch.device], float] | None = None) -> list[Choice]:
    """Time cuBLAS and each config on each group's weights at each row count; keep the skinny kernel where its best
    config is at least ``margin`` faster. Replaces the choices of earlier calls for these shapes.

    Each timed call runs the group's every weight in order (one step's reads of that projection, from HBM rather
    than L2), once to compile and warm, then ``repeats`` times. A config that fails to compile or launch, or whose
    output on the first weight differs from cuBLAS's by more than 16-bit rounding, is skipped with a warning. Call before capturing CUDA graphs; it must not run inside one.

    Args:
        groups: the projections (:class:`Weights`); CPU, float32 or grad-requiring groups are skipped.
        rows: the row counts steps will run (those above :data:`MAX_ROWS` are ignored).
        silu_and_mul: the op the unfused SwiGLU path runs after its GEMM (timed with it).
        timer: ``timer(run, repeats, device) -> us`` (tests); CUDA events by default.
    Returns:
        The measurements, also kept for :func:`table`.
    """
    timer = timer or _time_us
    counts = sorted({r for r in rows if 1 <= r <= MAX_ROWS})
    results: list[Choice] = []
    if not enabled() or not counts:
        return results
    failed: dict[tuple, str] = {}  # (config, epilogue) -> why it cannot run here: not tried again, said once
    for group in groups:
        if not group.weights:
            continue
        w0 = group.weights[0]
        if ((w0.device.type != "cuda" and not interpreting()) or w0.dtype not in _DTYPES
                or (w0.requires_grad and torch.is_grad_enabled())):
            continue
        b0 = group.biases[0]
        n = w0.shape[0] // 2 if group.silu_mul else w0.shape[0]
        buckets: list[tuple[int, SkinnyConfig | None]] = []
        pairs = list(zip(group.weights, group.biases))
        for m in counts:
            x = torch.randn((m, w0.shape[1]), dtype=w0.dtype, device=w0.device)
            out = torch.empty((m, n), dtype=w0.dtype, device=w0.device)

            def cublas(x=x):
                for w, b in pairs:
                    y = F.linear(x, w, b)
                    if group.silu_mul:
                        silu_and_mul(y)

            def skinny(config, x=x, out=out):
                for w, b in pairs:
                    skinny_gemm(x, w, b, silu_mul=group.silu_mul, config=config, out=out)

            cublas()
            cublas_us = timer(cublas, repeats, w0.device) / len(pairs)
            measured: dict[str, float] = {}
            best: tuple[float, SkinnyConfig] | None = None
            reference = F.linear(x, w0, b0)
            if group.silu_mul:
                reference = silu_and_mul(reference)
            for config in configs:
                variant = (config, b0 is not None, group.silu_mul)
                if variant in failed:
                    continue
                try:
                    skinny(config)
                    wrong = _disagreement(skinny_gemm(x, w0, b0, silu_mul=group.silu_mul, config=config), reference)
                except Exception as e:  # a config this GPU or Triton cannot compile or launch: the others may
                    failed[variant] = str(e).splitlines()[0] if str(e) else type(e).__name__
                    log.warning("skinny GEMM: config %s (bias %s, SwiGLU %s) cannot run here, skipped: %s", config,
                                b0 is not None, group.silu_mul, failed[variant])
                    continue
                if wrong:
                    log.warning("skinny GEMM %s %s, %d rows: config %s skipped: %s", group.kind, list(w0.shape), m,
                                config, wrong)
                    continue
                us = timer(lambda config=config: skinny(config), repeats, w0.device) / len(pairs)
                measured[str(config)] = us
                if best is None or us < best[0]:
                    best = (us, config)
            win = best is not None and best[0] <= cublas_us * (1.0 - margin)
            choice = Choice(group.kind, m, n, w0.shape[1], cublas_us, None if best is None else best[0],
                            best[1] if win else None, measured)
            results.append(choice)
            buckets.append((m, choice.config))
        _table[_key(w0, b0, group.silu_mul)] = buckets
    keys = {(c.kind, c.rows) for c in results}
    _report[:] = [c for c in _report if (c.kind, c.rows) not in keys] + results
    return results

"""Which GEMM runs at decode batch sizes: cuBLAS, or the skinny kernel (:mod:`unifiedserve.ops.skinny_kernel`:
one kernel per projection streaming the weight once, with the bias or SwiGLU in its epilogue).

Which kernel runs is measured, not assumed: :func:`tune` times cuBLAS and each :data:`CONFIGS` entry on the
model's own weights (every layer's, in order, so each read comes from HBM as in a step, not from L2) at each
row count the engine will run, and :func:`linear` / :func:`gate_up_silu` take the skinny kernel only where it
won. Untuned shapes, CPU tensors, float32 (whose ``tl.dot`` would round to TF32), more than 16 rows,
autograd and ``UNIFIEDSERVE_SKINNY_GEMM=0`` all take cuBLAS (and ``silu_and_mul``) as before.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flashcodec._triton import import_triton, interpreting
from unifiedserve.ops.skinny_kernel import _DTYPES, CONFIGS, MAX_ROWS, SkinnyConfig, skinny_gemm

__all__ = ["CONFIGS", "MAX_ROWS", "Choice", "SkinnyConfig", "Weights", "enabled", "gate_up_silu", "linear", "reset",
           "skinny_gemm", "summary", "table", "tune"]

log = logging.getLogger(__name__)


def enabled() -> bool:
    """``UNIFIEDSERVE_SKINNY_GEMM=0`` keeps every GEMM on cuBLAS (to measure what the kernel buys)."""
    return os.environ.get("UNIFIEDSERVE_SKINNY_GEMM", "") not in ("0", "off", "false")


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
    output on the last weight differs from cuBLAS's by more than 16-bit rounding, is skipped with a warning.
    Without Triton nothing is tuned.
    Call before capturing CUDA graphs; it must not run inside one.

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
    if import_triton() is None:
        log.info("decode GEMMs stay on cuBLAS: Triton does not import")
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
            reference = F.linear(x, *pairs[-1])  # what the warm-up pass leaves in out: the last weight's output
            if group.silu_mul:
                reference = silu_and_mul(reference)
            for config in configs:
                variant = (config, b0 is not None, group.silu_mul)
                if variant in failed:
                    continue
                try:
                    skinny(config)
                    wrong = _disagreement(out, reference)
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

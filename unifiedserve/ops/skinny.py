"""Which GEMM runs at decode batch sizes: cuBLAS, or the skinny kernel (:mod:`unifiedserve.ops.skinny_kernel`:
one kernel per projection streaming the weight once, with the bias or SwiGLU in its epilogue, and for the two
projections that follow an RMSNorm, the residual add and the norm in its prologue; for Q/K/V also the rotary and the
K/V-cache write in its epilogue, :mod:`unifiedserve.ops.skinny_rope`).

Which kernel runs is measured, not assumed: :func:`tune` times cuBLAS and each :data:`CONFIGS` entry on the
model's own weights (every layer's, in order, so each read comes from HBM as in a step, not from L2) at each
row count the engine will run, and :func:`linear` / :func:`gate_up_silu` take the skinny kernel only where it
won; :func:`norm_linear` takes the kernel with the norm folded in only where that beat the norm kernel followed
by the faster of the two, and :func:`norm_qkv_rope` the one with rotary and the K/V write too (with the norm
folded in, or after the norm kernel) only where that beat :func:`norm_linear` followed by csrc's ``rotary_cache``.
Untuned shapes, CPU tensors, float32 (whose ``tl.dot`` would round to TF32), more than 16 rows, autograd and
``UNIFIEDSERVE_SKINNY_GEMM=0`` all take cuBLAS (and ``silu_and_mul``, the norm kernel and ``rotary_cache``) as
before.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flashcodec._triton import import_triton, interpreting
from unifiedserve import ops
from unifiedserve.ops.skinny_kernel import _DTYPES, CONFIGS, MAX_ROWS, SkinnyConfig, skinny_gemm
from unifiedserve.ops.skinny_rope import RopeWrite
from unifiedserve.ops.tuning import disagreement, first_line, graph_time_us, raise_if_fault

__all__ = ["CONFIGS", "MAX_ROWS", "Choice", "RopeWrite", "SkinnyConfig", "Weights", "disagreement", "enabled",
           "gate_up_silu", "linear", "norm_linear", "norm_qkv_rope", "reset", "rope_chosen", "skinny_gemm", "summary",
           "table", "tune", "tune_seconds"]

log = logging.getLogger(__name__)


def enabled() -> bool:
    """``UNIFIEDSERVE_SKINNY_GEMM=0`` keeps every GEMM on cuBLAS (to measure what the kernel buys)."""
    return os.environ.get("UNIFIEDSERVE_SKINNY_GEMM", "") not in ("0", "off", "false")


@dataclass(frozen=True)
class Choice:
    """What :func:`tune` measured for one weight shape at one row count (microseconds per call, all layers' mean).

    For a ``norm+`` kind (the RMSNorm folded into the kernel), ``cublas_us`` is what it replaces: the norm kernel
    followed by that projection's own choice at this row count (``baseline`` names it). For a ``+rope`` kind it is
    :func:`norm_linear` followed by ``rotary_cache``, and a ``<kind>+rope`` config's time includes the norm kernel in
    front of it. ``config`` is None where the baseline stays, and for the slower of two ``+rope`` forms that both won.
    """

    kind: str  # what the weights are (``qkv_proj``, ``gate_up_proj+silu``, ``norm+qkv_proj``, ...)
    rows: int
    n: int
    k: int
    cublas_us: float
    skinny_us: float | None  # the best config's
    config: SkinnyConfig | None  # the best config; None when the baseline stays
    configs_us: dict[str, float]  # every config that ran
    baseline: str = "cuBLAS"
    note: str = ""  # why none is chosen: RIVAL_FASTER (won, the other +rope form faster), or "not timed: ..."

    @property
    def chosen(self) -> bool:
        return self.config is not None

    def as_dict(self) -> dict:
        return {"kind": self.kind, "rows": self.rows, "n": self.n, "k": self.k, "cublas_us": round(self.cublas_us, 2),
                "skinny_us": None if self.skinny_us is None else round(self.skinny_us, 2),
                "config": None if self.config is None else str(self.config),
                "baseline": self.baseline,
                "speedup": None if self.skinny_us is None else round(self.cublas_us / self.skinny_us, 3),
                "configs_us": {name: round(us, 2) for name, us in self.configs_us.items()}, "note": self.note}


# (N rows of weight, K, dtype, has bias, silu_mul, norm folded in, rope epilogue) -> [(rows bucket, config or None)],
# ascending
_table: dict[tuple, list[tuple[int, SkinnyConfig | None]]] = {}
_report: list[Choice] = []
_seconds: list[float] = [0.0]  # the last tune()'s wall time (compilations included)


def _key(weight: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool, norm: bool = False,
         rope: bool = False) -> tuple:
    return weight.shape[0], weight.shape[1], weight.dtype, bias is not None, silu_mul, norm, rope


def table() -> list[Choice]:
    """What the last :func:`tune` measured, one entry per (shape, row count)."""
    return list(_report)


def tune_seconds() -> float:
    """Wall time of the last :func:`tune` that ran, Triton's compilations included (0 before any)."""
    return _seconds[0]


#: the note of a qkv_proj+rope choice that beat its baseline but gave way to the other rope form, faster still
RIVAL_FASTER = "won, but the other rope form was faster"


def summary(results: Sequence[Choice]) -> str:
    """One line per kind for the start-up log: which row counts took the skinny kernel, and its time at 1 row."""
    kinds: dict[str, list[Choice]] = {}
    for c in results:
        kinds.setdefault(c.kind, []).append(c)
    parts = []
    for kind, choices in kinds.items():
        won = [c.rows for c in choices if c.chosen]
        first = choices[0]
        timing = f"{first.cublas_us:.1f} us {first.baseline}" + (
            "" if first.skinny_us is None else f" vs {first.skinny_us:.1f} us skinny at {first.rows} row(s)")
        where = f"skinny at rows {won}" if won else first.baseline
        noted = [c.rows for c in choices if c.note == RIVAL_FASTER]
        where += f" (also won at rows {noted}, where the other rope form was faster)" if noted else ""
        parts.append(f"{kind} [{first.n}x{first.k}]: {where} ({timing})")
    return "; ".join(parts)


def reset() -> None:
    """Forget every choice: every GEMM takes cuBLAS until the next :func:`tune`."""
    _table.clear()
    _report.clear()


def _lookup(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool,
            norm: bool = False, rope: bool = False) -> SkinnyConfig | None:
    """The tuned config for this call, or None (cuBLAS). Runs per linear per step in eager mode: kept cheap."""
    if not _table or x.dim() != 2 or not (x.is_cuda or interpreting()):  # CPU tensors: the CPU tests' interpreter
        return None
    buckets = _table.get(_key(weight, bias, silu_mul, norm, rope))
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


def norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                weight: torch.Tensor, bias: torch.Tensor | None = None,
                silu_and_mul: Callable[[torch.Tensor], torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """A projection after a residual add and Qwen2's RMSNorm: ``h = x + residual`` (``x`` when ``residual`` is
    None), returns ``(linear(rms_norm(h)), h)``; with ``silu_and_mul``, the projection is :func:`gate_up_silu`.

    One skinny kernel (add, norm, GEMM, epilogue) where :func:`tune` measured that faster than the norm kernel
    followed by the projection's own choice; else those two, as :func:`unifiedserve.ops.fused_add_rms_norm`
    (which may reuse ``x``'s and ``residual``'s memory: use the results, not the inputs).
    """
    silu = silu_and_mul is not None
    config = _lookup(x, weight, bias, silu, norm=True)  # tuned only for norms in the weights' dtype
    if config is not None:  # (operands the kernel cannot take raise its ValueError: a caller's bug, not a fallback)
        return _with_norm(x, residual, norm_weight, eps, weight, bias, config, silu_mul=silu)
    normed, stream = _norm_kernel(x, residual, norm_weight, eps)
    out = gate_up_silu(normed, weight, bias, silu_and_mul) if silu else linear(normed, weight, bias)
    return out, stream


def _norm_kernel(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The norm kernel a projection without the norm folded in follows: ``(rms_norm(h), h)``, ``h = x + residual``
    (``x`` itself without a residual; with one, csrc's add + RMSNorm, which may reuse the inputs' memory)."""
    if residual is None:
        return ops.rms_norm(x, norm_weight, eps), x
    return ops.fused_add_rms_norm(x, residual, norm_weight, eps)


def rope_chosen(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether :func:`tune` kept a kernel with rotary and the K/V write folded in for this Q/K/V weight at ``x``'s row
    count, with or without the norm (:func:`norm_qkv_rope` then runs it; the caller first asks its attention backend
    where the K/V go: ``AttentionBackend.rope_write``)."""
    return (_lookup(x, weight, bias, False, norm=True, rope=True) is not None
            or _lookup(x, weight, bias, False, rope=True) is not None)


def norm_qkv_rope(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                  weight: torch.Tensor, bias: torch.Tensor | None, write: RopeWrite
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Qwen2's attention input with rotary and the K/V write folded into the projection: ``h = x + residual``,
    RMSNorm, the Q/K/V projection, rotary on Q and K, K and V written into the paged cache (``write``). Returns
    ``(q [M, Hq * D] rotated, h)`` where :func:`tune` measured either form faster than :func:`norm_linear` followed
    by csrc's ``rotary_cache``: one kernel with the norm folded in too (``norm+<kind>+rope``), or the norm kernel
    followed by the projection with rotary and the write (``<kind>+rope``). None elsewhere (the caller runs those
    two)."""
    config = _lookup(x, weight, bias, False, norm=True, rope=True)
    if config is not None:
        return _with_norm(x, residual, norm_weight, eps, weight, bias, config, rope=write)
    config = _lookup(x, weight, bias, False, rope=True)
    if config is None:
        return None
    normed, stream = _norm_kernel(x, residual, norm_weight, eps)
    return skinny_gemm(normed, weight, bias, rope=write, config=config), stream


def _with_norm(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
               weight: torch.Tensor, bias: torch.Tensor | None, config: SkinnyConfig,
               **epilogue) -> tuple[torch.Tensor, torch.Tensor]:
    """The skinny kernel with the add + RMSNorm in front: ``(output, h)``, ``h = x + residual`` written into memory
    of its own (``x`` itself without a residual)."""
    stream = x if residual is None else torch.empty_like(x, memory_format=torch.contiguous_format)
    out = skinny_gemm(x, weight, bias, norm_weight=norm_weight, eps=eps, residual=residual,
                      stream_out=None if residual is None else stream, config=config, **epilogue)
    return out, stream


@dataclass(frozen=True)
class Weights:
    """One kind of projection to tune: every layer's weight (and bias) of one shape, in the order a step reads them.

    ``norms``: each layer's RMSNorm weight when an add + RMSNorm precedes the projection (:func:`norm_linear`);
    tune() then also times the kernel with the norm folded in. ``rope_heads``: ``(q_heads, kv_heads)`` of a fused
    Q/K/V projection (with ``norms``): tune() then also times :func:`norm_qkv_rope`'s two forms.
    """

    kind: str
    weights: Sequence[torch.Tensor]
    biases: Sequence[torch.Tensor | None]
    silu_mul: bool = False
    norms: Sequence[torch.Tensor] | None = None
    eps: float = 1e-6
    rope_heads: tuple[int, int] | None = None


def _disagreement(got: torch.Tensor, want: torch.Tensor) -> str:
    """:func:`disagreement` of the kernel's output against the unfused path's, or ''."""
    wrong = disagreement(got, want, "the unfused path's")
    return wrong and f"its output {wrong}"


def _best(kind: str, m: int, n: int, k: int, baseline: str, baseline_us: float, run: Callable[[SkinnyConfig], None],
          check: Callable[[SkinnyConfig], str], configs: Sequence[SkinnyConfig], epilogue: tuple,
          failed: dict[tuple, str], time_us: Callable[[Callable[[], None]], float], margin: float,
          outputs: Sequence[torch.Tensor] = (),
          verify: Callable[[SkinnyConfig], str] | None = None) -> Choice:
    """Time each config (``run(config)`` covers every layer) against ``baseline_us``; ``check(config)`` says why the
    output the first, warming ``run`` left in ``outputs`` is wrong ('' when right). ``outputs`` are filled with NaN
    before each config's first run, so a config that leaves any of them unwritten disagrees. A config that cannot run
    goes into ``failed``. ``verify(best)`` checks the winner's other variants (the kernel's forms the step also
    runs but the timing does not): if it says why one is wrong, or one cannot run, the baseline stays.

    Raises:
        RuntimeError: a config faulted the GPU (an illegal address, ...): nothing can run after that.
    """
    measured: dict[str, float] = {}
    best: tuple[float, SkinnyConfig] | None = None
    for config in configs:
        variant = (config, *epilogue)
        if variant in failed:
            continue
        try:
            for t in outputs:
                t.fill_(float("nan"))
            run(config)
            wrong = check(config)
            us = None if wrong else time_us(lambda config=config: run(config))
        except Exception as e:  # a config this GPU or Triton cannot compile, launch or capture: the others may
            _raise_if_fault(e, kind, config)
            failed[variant] = first_line(e)
            log.warning("skinny GEMM: config %s (bias %s, SwiGLU %s, norm %s%s) cannot run here, skipped: %s", config,
                        *epilogue[:3], ", rotary + K/V write" if epilogue[3:] else "", failed[variant])
            continue
        if wrong:
            log.warning("skinny GEMM %s [%dx%d], %d rows: config %s skipped: %s", kind, n, k, m, config, wrong)
            continue
        measured[str(config)] = us
        if best is None or us < best[0]:
            best = (us, config)
    win = best is not None and best[0] <= baseline_us * (1.0 - margin)
    if win and verify is not None:
        try:
            wrong = verify(best[1])
        except Exception as e:
            _raise_if_fault(e, kind, best[1])
            wrong = f"cannot run: {first_line(e)}"
        if wrong:
            log.warning("skinny GEMM %s [%dx%d], %d rows: config %s not kept (%s stays): another form of it %s", kind,
                        n, k, m, best[1], baseline, wrong)
            win = False
    return Choice(kind, m, n, k, baseline_us, None if best is None else best[0], best[1] if win else None, measured,
                  baseline)


def _raise_if_fault(error: Exception, kind: str, config: SkinnyConfig | None) -> None:
    """Re-raise a GPU fault (:func:`~unifiedserve.ops.tuning.raise_if_fault`) naming what ran, with the way out."""
    what = f"config {config} for {kind}" if config is not None else kind
    raise_if_fault(error, f"skinny GEMM tune: {what}", "UNIFIEDSERVE_SKINNY_GEMM=0 to keep cuBLAS")


def tune(groups: Iterable[Weights], rows: Iterable[int], *, silu_and_mul: Callable[[torch.Tensor], torch.Tensor],
         configs: Sequence[SkinnyConfig] = CONFIGS, repeats: int = 5, margin: float = 0.02,
         timer: Callable[[Callable[[], None], int, torch.device], float] | None = None) -> list[Choice]:
    """Time cuBLAS and each config on each group's weights at each row count; keep the skinny kernel where its best
    config is at least ``margin`` faster. Replaces the choices of earlier calls for these shapes.

    A group with ``norms`` is then timed again with the add + RMSNorm in front: the norm kernel followed by the
    choice just made, against each config with the norm folded in (``norm+`` kinds in the results).

    Each timed call runs the group's every weight in order (one step's reads of that projection, from HBM rather
    than L2), once to compile and warm, then ``repeats`` times. A config that fails to compile or launch, or whose
    output on the last weight differs from the unfused path's by more than 16-bit rounding, is skipped with a
    warning. Without Triton nothing is tuned.
    Call before capturing CUDA graphs; it must not run inside one.

    Args:
        groups: the projections (:class:`Weights`); CPU, float32 or grad-requiring groups are skipped.
        rows: the row counts steps will run (those above :data:`MAX_ROWS` are ignored).
        silu_and_mul: the op the unfused SwiGLU path runs after its GEMM (timed with it).
        timer: ``timer(run, repeats, device) -> us`` (tests); by default the GPU time of ``run`` captured as one
            CUDA graph (:func:`~unifiedserve.ops.tuning.graph_time_us`), as a step's replay runs it.
    Returns:
        The measurements, also kept for :func:`table`.
    Raises:
        RuntimeError: a config faulted the GPU (an illegal address, ...), which no later call survives; the message
            names it and ``UNIFIEDSERVE_SKINNY_GEMM=0``. Any other failure skips the config, or the group.
    """
    timer = timer or graph_time_us
    counts = sorted({r for r in rows if 1 <= r <= MAX_ROWS})
    results: list[Choice] = []
    if not enabled() or not counts:
        return results
    if import_triton() is None:
        log.info("decode GEMMs stay on cuBLAS: Triton does not import")
        return results
    failed: dict[tuple, str] = {}  # (config, epilogue) -> why it cannot run here: not tried again, said once
    start = time.perf_counter()
    for group in groups:
        if not group.weights:
            continue
        w0 = group.weights[0]
        if ((w0.device.type != "cuda" and not interpreting()) or w0.dtype not in _DTYPES
                or (w0.requires_grad and torch.is_grad_enabled())):
            continue
        try:
            _tune_group(group, counts, silu_and_mul, configs, margin, failed,
                        lambda run, n_layers: timer(run, repeats, w0.device) / n_layers, results)
        except Exception as e:  # its baseline cannot be timed here: the group keeps what it had chosen, if anything
            _raise_if_fault(e, group.kind, None)
            log.warning("skinny GEMM: tuning %s stopped, what it had not chosen stays on cuBLAS and the unfused "
                        "kernels: %s", group.kind, first_line(e))
    _seconds[0] = time.perf_counter() - start
    keys = {(c.kind, c.rows) for c in results}
    _report[:] = [c for c in _report if (c.kind, c.rows) not in keys] + results
    return results


def _tune_group(group: Weights, counts: list[int], silu_and_mul: Callable[[torch.Tensor], torch.Tensor],
                configs: Sequence[SkinnyConfig], margin: float, failed: dict[tuple, str],
                per_layer_us: Callable[[Callable[[], None], int], float], results: list[Choice]) -> None:
    """:func:`tune` for one group: the plain projection at each row count, then (``norms``) with the norm in front.
    Each pass's choices go into ``results`` as the pass ends (a later pass that fails leaves them reported)."""
    w0, b0 = group.weights[0], group.biases[0]
    silu = group.silu_mul
    n, k = (w0.shape[0] // 2 if silu else w0.shape[0]), w0.shape[1]
    pairs = list(zip(group.weights, group.biases))
    layers = len(pairs)

    def unfused(x, w, b):
        y = F.linear(x, w, b)
        return silu_and_mul(y) if silu else y

    rng = torch.Generator(device=w0.device).manual_seed(0)  # the same inputs at every start-up

    def randn(m):
        return torch.randn((m, k), generator=rng, device=w0.device).to(w0.dtype)

    buckets, plain_choices = [], []
    for m in counts:
        x = randn(m)
        out = torch.empty((m, n), dtype=w0.dtype, device=w0.device)

        def cublas(x=x):
            for w, b in pairs:
                unfused(x, w, b)

        def run(config, x=x, out=out):
            for w, b in pairs:
                skinny_gemm(x, w, b, silu_mul=silu, config=config, out=out)

        cublas()
        reference = unfused(x, *pairs[-1])  # what the warm-up pass leaves in out: the last weight's output
        choice = _best(group.kind, m, n, k, "cuBLAS", per_layer_us(cublas, layers), run,
                       lambda _, out=out, reference=reference: _disagreement(out, reference), configs,
                       (b0 is not None, silu, False), failed, lambda f: per_layer_us(f, layers), margin, (out,))
        plain_choices.append(choice)
        buckets.append((m, choice.config))
    _table[_key(w0, b0, silu)] = buckets
    results += plain_choices
    if not group.norms or any(g.dtype != w0.dtype for g in group.norms):  # (the kernel takes norms in x's dtype)
        return
    norm_buckets, norm_choices = [], []
    layers_norms = list(zip(pairs, group.norms))
    for m, (_, plain) in zip(counts, buckets):
        x, residual = randn(m), randn(m)
        stream = torch.empty_like(x)
        out = torch.empty((m, n), dtype=w0.dtype, device=w0.device)
        (w_last, b_last), g_last = layers_norms[-1]
        normed, want_stream = ops.fused_add_rms_norm(x.clone(), residual.clone(), g_last, group.eps)
        reference = unfused(normed, w_last, b_last)
        xb, rb = x.clone(), residual.clone()  # the unfused path writes its inputs: buffers of its own

        def norm_then_choice(xb=xb, rb=rb):
            for (w, b), g in layers_norms:
                y, _ = ops.fused_add_rms_norm(xb, rb, g, group.eps)
                gate_up_silu(y, w, b, silu_and_mul) if silu else linear(y, w, b)

        def run(config, x=x, residual=residual, stream=stream, out=out):
            for (w, b), g in layers_norms:
                skinny_gemm(x, w, b, silu_mul=silu, norm_weight=g, eps=group.eps, residual=residual,
                            stream_out=stream, config=config, out=out)

        def check(_, out=out, reference=reference, stream=stream, want_stream=want_stream):
            return _disagreement(out, reference) or _disagreement(stream, want_stream)

        # the first layer's form: no residual (the embeddings are the stream), so no add and no stream written
        reference_first = unfused(ops.rms_norm(x, g_last, group.eps), w_last, b_last)

        def verify(config, x=x, out=out, reference_first=reference_first):
            out.fill_(float("nan"))
            skinny_gemm(x, w_last, b_last, silu_mul=silu, norm_weight=g_last, eps=group.eps, config=config, out=out)
            wrong = _disagreement(out, reference_first)
            return wrong and f"without the add, {wrong}"

        norm_then_choice()
        baseline = "norm kernel + " + ("cuBLAS" if plain is None else f"skinny {plain}")
        choice = _best("norm+" + group.kind, m, n, k, baseline, per_layer_us(norm_then_choice, layers), run, check,
                       configs, (b0 is not None, silu, True), failed, lambda f: per_layer_us(f, layers), margin,
                       (out, stream), verify)
        norm_choices.append(choice)
        norm_buckets.append((m, choice.config))
    _table[_key(w0, b0, silu, True)] = norm_buckets
    results += norm_choices
    if group.rope_heads is not None and not silu:
        from unifiedserve.ops.skinny_rope import tune_rope

        folded, behind = tune_rope(group, counts, configs, margin, failed, per_layer_us)
        _table[_key(w0, b0, False, True, True)] = [(c.rows, c.config) for c in folded]
        _table[_key(w0, b0, False, False, True)] = [(c.rows, c.config) for c in behind]
        results += folded + behind

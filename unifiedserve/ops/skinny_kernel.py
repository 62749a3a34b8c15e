"""The skinny GEMM kernel: ``x [M, K] @ W[N, K]^T`` for ``M <= 16`` rows, with the epilogues the decoder needs.

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

:mod:`unifiedserve.ops.skinny` decides where it runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashcodec._triton import CompileOnce, interpreting, kernel_builder, on_device

__all__ = ["CONFIGS", "MAX_ROWS", "SkinnyConfig", "skinny_gemm"]

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


#: the candidates :func:`unifiedserve.ops.skinny.tune` times. Narrow column blocks keep every SM busy on the
#: 3584-wide outputs (224 programs at 16); deep K blocks keep 32-64 KB in flight per program. Each fits Hopper's
#: shared memory (96 KB or less, 144 KB for the SwiGLU variants, as compiled for sm_90; the compile test checks).
CONFIGS: tuple[SkinnyConfig, ...] = (
    SkinnyConfig(16, 512, 4),
    SkinnyConfig(16, 256, 6),
    SkinnyConfig(32, 256, 4),
    SkinnyConfig(64, 128, 4),
)


def _build(triton, tl):
    """The Triton kernel (:data:`_kernel` builds it on first use)."""

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

    return skinny_kernel


_kernel = kernel_builder(_build)  # (triton, the kernel) or None; the argument: interpreted


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
        config: the launch configuration (:func:`unifiedserve.ops.skinny.tune` picks one per shape).
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

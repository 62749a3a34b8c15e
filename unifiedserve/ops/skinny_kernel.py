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
from unifiedserve.ops.skinny_rope import RopeWrite

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
    @triton.jit(do_not_specialize=("M", "N", "k_float", "eps", "q_heads", "kv_heads", "num_slots"))
    def skinny_kernel(x, w, bias, out, r, g, h, M, N, K, stride_xm, stride_wn, stride_om, stride_rm, stride_hm,
                      up_offset, k_float, eps, cos, sin, stride_cm, k_cache, v_cache, stride_slot, slot_mapping,
                      write_rows, q_heads, kv_heads, num_slots, HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr,
                      NORM: tl.constexpr, NORM_M: tl.constexpr, NORM_K: tl.constexpr, EVEN_K: tl.constexpr,
                      ROPE: tl.constexpr, HALF: tl.constexpr, WRITE_ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid = tl.program_id(0)
        rn = (pid * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)  # this program's output columns (ROPE: pairs)
        rm = tl.arange(0, BLOCK_M)  # activation rows, padded
        rk = tl.arange(0, BLOCK_K)
        n_ok = rn < N
        m_ok = rm < M
        dtype = out.dtype.element_ty
        if NORM != 0:
            # the norm's first pass: each row's sum of squares of the stream (x + r, rounded as the add rounds);
            # the first program also writes the stream out. x and r are a few KB, read from L2 by every program in
            # [NORM_M, NORM_K] tiles (_norm_tile: at batch 1 one tile holds a 7B's whole row, so this pass is one
            # load deep before the weight streams)
            rp = tl.arange(0, NORM_M)
            pk = tl.arange(0, NORM_K)
            ss = tl.zeros((NORM_M,), dtype=tl.float32)
            for i in range(tl.cdiv(K, NORM_K)):
                kk = i * NORM_K + pk
                s_mask = (rp < M)[:, None] & (kk < K)[None, :]
                s = tl.load(x + rp[:, None] * stride_xm + kk[None, :], mask=s_mask, other=0.0)  # [NORM_M, NORM_K]
                if NORM == 2:
                    s = (s.to(tl.float32) + tl.load(r + rp[:, None] * stride_rm + kk[None, :], mask=s_mask,
                                                    other=0.0).to(tl.float32)).to(dtype)
                    tl.store(h + rp[:, None] * stride_hm + kk[None, :], s, mask=s_mask & (pid == 0))
                sf = s.to(tl.float32)
                ss += tl.sum(sf * sf, axis=1)
            # 1 / sqrt(mean + eps) with correctly rounded steps, as csrc's inv_rms (and torch's rsqrt)
            inv_rows = tl.math.div_rn(1.0, tl.math.sqrt_rn(tl.math.div_rn(ss, k_float) + eps))  # [NORM_M]
            inv = tl.zeros((BLOCK_M,), dtype=tl.float32)  # the dot's padded rows: 0 past M
            for j in tl.static_range(NORM_M):
                inv = tl.where(rm == j, tl.sum(tl.where(rp == j, inv_rows, 0.0), axis=0), inv)
        if ROPE:  # pair j is (lo, hi) = columns (d, d + HALF) of head j // HALF, d = j % HALF: rotary's two halves
            head = rn // HALF
            lo_row = head * (2 * HALF) + rn % HALF
            hi_row = lo_row + HALF
        else:  # the output columns, and (SILU_MUL) the up rows beside them
            lo_row = rn
            hi_row = rn + up_offset
        w_ptrs = w + lo_row[:, None] * stride_wn + rk[None, :]  # [BLOCK_N, BLOCK_K], K contiguous
        u_ptrs = w + hi_row[:, None] * stride_wn + rk[None, :]  # the second rows (SILU_MUL, ROPE)
        x_ptrs = x + rm[None, :] * stride_xm + rk[:, None]  # [BLOCK_K, BLOCK_M]: x^T
        r_ptrs = r + rm[None, :] * stride_rm + rk[:, None]  # the residual (NORM == 2), x's layout
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
            if NORM != 0:
                # RMSNorm's output, rounded where Qwen2RMSNorm (and csrc's rms_scale) rounds: the stream, the
                # normalised value, the product with the weight
                if NORM == 2:
                    xt = (xt.to(tl.float32) + tl.load(r_ptrs, mask=x_mask, other=0.0).to(tl.float32)).to(dtype)
                    r_ptrs += BLOCK_K
                if EVEN_K:
                    gk = tl.load(g + i * BLOCK_K + rk).to(tl.float32)
                else:
                    gk = tl.load(g + i * BLOCK_K + rk, mask=rk < K - i * BLOCK_K, other=0.0).to(tl.float32)
                xt = (gk[:, None] * (xt.to(tl.float32) * inv[None, :]).to(dtype).to(tl.float32)).to(dtype)
            acc = tl.dot(tl.load(w_ptrs, mask=w_mask, other=0.0), xt, acc)
            if SILU_MUL or ROPE:
                acc_up = tl.dot(tl.load(u_ptrs, mask=w_mask, other=0.0), xt, acc_up)
                u_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        if HAS_BIAS:
            acc += tl.load(bias + lo_row, mask=n_ok, other=0.0).to(tl.float32)[:, None]
            if SILU_MUL or ROPE:
                acc_up += tl.load(bias + hi_row, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        if ROPE:
            # Q/K/V's column pairs (see skinny_rope): Q and K rotated, Q into out [M, Hq * D], K and V into the paged
            # cache's slots; rounded where the unfused path rounds: the GEMM's output, then rotary's two products and
            # their sum in the tables' dtype (csrc/fused_ops.h, rotate_pair)
            d = rn % HALF
            ct = cos.dtype.element_ty
            a = acc.to(dtype).to(tl.float32)
            b = acc_up.to(dtype).to(tl.float32)
            cm = m_ok[None, :] & n_ok[:, None]
            c_ptrs = rm[None, :] * stride_cm + d[:, None]  # [BLOCK_N, BLOCK_M] into cos / sin [M, D]
            cos_lo = tl.load(cos + c_ptrs, mask=cm, other=0.0).to(tl.float32)
            sin_lo = tl.load(sin + c_ptrs, mask=cm, other=0.0).to(tl.float32)
            cos_hi = tl.load(cos + c_ptrs + HALF, mask=cm, other=0.0).to(tl.float32)
            sin_hi = tl.load(sin + c_ptrs + HALF, mask=cm, other=0.0).to(tl.float32)
            rot_lo = ((a * cos_lo).to(ct).to(tl.float32) + (-b * sin_lo).to(ct).to(tl.float32)).to(ct).to(tl.float32)
            rot_hi = ((b * cos_hi).to(ct).to(tl.float32) + (a * sin_hi).to(ct).to(tl.float32)).to(ct).to(tl.float32)
            rotated = (head < q_heads + kv_heads)[:, None]
            lo = tl.where(rotated, rot_lo, a).to(dtype)
            hi = tl.where(rotated, rot_hi, b).to(dtype)
            col = head * (2 * HALF) + d  # the lo column within Q (or within one cache slot's [Hk * D])
            is_q = (head < q_heads) & n_ok
            q_ptrs = out + rm[None, :] * stride_om + col[:, None]
            tl.store(q_ptrs, lo, mask=is_q[:, None] & m_ok[None, :])
            tl.store(q_ptrs + HALF, hi, mask=is_q[:, None] & m_ok[None, :])
            # the cache write: row m into slot_mapping[m]; a CUDA-graph padding row (write_rows[m] != m) repeats row 0's
            # write to row 0's slot (attention/metadata.py), which row 0 makes here itself, so it writes nothing
            slot = tl.load(slot_mapping + rm, mask=m_ok, other=-1).to(tl.int64)
            ok = m_ok & (slot >= 0) & (slot < num_slots)
            if WRITE_ROWS:
                ok = ok & (tl.load(write_rows + rm, mask=m_ok, other=-1) == rm)
            is_k = (head >= q_heads) & (head < q_heads + kv_heads) & n_ok
            is_v = (head >= q_heads + kv_heads) & n_ok
            kv_col = tl.where(is_k, col - q_heads * (2 * HALF), col - (q_heads + kv_heads) * (2 * HALF))
            c_off = slot[None, :] * stride_slot + kv_col[:, None]
            tl.store(k_cache + c_off, lo, mask=is_k[:, None] & ok[None, :])
            tl.store(k_cache + c_off + HALF, hi, mask=is_k[:, None] & ok[None, :])
            tl.store(v_cache + c_off, lo, mask=is_v[:, None] & ok[None, :])
            tl.store(v_cache + c_off + HALF, hi, mask=is_v[:, None] & ok[None, :])
        else:
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


#: elements of x (and of the residual) one step of the norm's first pass loads: 64 a thread at 4 warps
NORM_TILE = 8192


def _norm_tile(m: int, k: int) -> tuple[int, int]:
    """The norm pass's ``(rows, columns)`` tile for ``m`` rows of ``k``: one row at batch 1 (a 7B's whole row in one
    load), else all 16; the columns are the rest of :data:`NORM_TILE`, no wider than ``k`` needs. Two compilations
    per config and epilogue, not one per row count."""
    rows = 1 if m == 1 else MAX_ROWS
    return rows, min(max(16, 1 << (k - 1).bit_length()), NORM_TILE // rows)


def _check_norm(x: torch.Tensor, norm_weight: torch.Tensor | None, residual: torch.Tensor | None,
                stream_out: torch.Tensor | None) -> None:
    """``ValueError`` unless the norm's operands suit ``x``."""
    if norm_weight is None:
        if residual is not None or stream_out is not None:
            raise ValueError("residual and stream_out come with norm_weight (the add feeds the RMSNorm)")
        return
    k = x.shape[1]
    if norm_weight.shape != (k,) or norm_weight.dtype != x.dtype or norm_weight.stride(0) != 1:
        raise ValueError(f"norm_weight must be contiguous [{k}] {x.dtype}, got {list(norm_weight.shape)} "
                         f"{norm_weight.dtype}")
    if (residual is None) != (stream_out is None):
        raise ValueError("residual needs stream_out (where x + residual goes), and stream_out needs residual")
    for name, t in (("residual", residual), ("stream_out", stream_out)):
        if t is not None and (t.shape != x.shape or t.dtype != x.dtype or t.stride(1) != 1):
            raise ValueError(f"{name} must be {list(x.shape)} {x.dtype} with a contiguous last dim, got "
                             f"{list(t.shape)} {t.dtype}")
    if any(t is not None and t.device != x.device for t in (norm_weight, residual, stream_out)):
        raise ValueError("x, norm_weight, residual and stream_out must be on one device")
    if stream_out is not None and residual is not None and stream_out.data_ptr() in (x.data_ptr(),
                                                                                     residual.data_ptr()):
        raise ValueError("stream_out must not share memory with x or residual (other programs still read them)")


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, silu_mul: bool = False,
                norm_weight: torch.Tensor | None = None, eps: float = 1e-6, residual: torch.Tensor | None = None,
                stream_out: torch.Tensor | None = None, rope: RopeWrite | None = None,
                config: SkinnyConfig = CONFIGS[0], out: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` (``silu_mul``: then SwiGLU of its ``[gate | up]`` halves) in one kernel;
    with ``norm_weight``, of ``rms_norm(x)`` or ``rms_norm(x + residual)`` instead of ``x``.

    Args:
        x: ``[M, K]``, ``1 <= M <= 16``, bfloat16 or float16, contiguous rows; weight ``[N, K]`` (``[2 * I, K]``
            with ``silu_mul``) and bias ``[N]`` of the same dtype, on the same device.
        norm_weight, eps: Qwen2's RMSNorm (weight ``[K]``, x's dtype) applied to the input first, rounded as
            :func:`unifiedserve.ops.rms_norm` rounds; the sum of squares is summed in another order.
        residual, stream_out: with ``norm_weight``: the input is ``x + residual`` (rounded once, as torch's add),
            which the kernel also writes into ``stream_out`` (``[M, K]``, memory of its own).
        config: the launch configuration (:func:`unifiedserve.ops.skinny.tune` picks one per shape).
        rope: Qwen2's fused Q/K/V projection's epilogue (:class:`~unifiedserve.ops.skinny_rope.RopeWrite`): rotary
            on Q and K, K and V written into the paged cache; the output is then the rotated Q, ``[M, Hq * D]``.
        out: where to write ``[M, N]`` (``[M, I]``; ``[M, Hq * D]`` with ``rope``); a new tensor when None.
    Raises:
        ValueError: a call the kernel does not take (see Args); RuntimeError: Triton cannot run here.
    """
    m, n, k = _check(x, weight, bias, silu_mul)
    _check_norm(x, norm_weight, residual, stream_out)
    width = n  # the output's columns; the grid covers n columns, or (rope) n // 2 column pairs
    if rope is not None:
        if silu_mul:
            raise ValueError("rope and silu_mul are two different epilogues")
        rope.check(x, weight.shape[0])
        width, n = rope.q_heads * rope.head_dim, n // 2
    found = _kernel(interpreting())
    if found is None:
        raise RuntimeError("the skinny GEMM needs Triton")
    triton, kernel = found
    if out is None:
        out = torch.empty((m, width), dtype=x.dtype, device=x.device)
    elif out.shape != (m, width) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"out must be [{m}, {width}] {x.dtype} with a contiguous last dim")
    grid = (triton.cdiv(n, config.block_n),)
    even_k = k % config.block_k == 0
    norm = 0 if norm_weight is None else 1 if residual is None else 2
    r = x if residual is None else residual
    h = x if stream_out is None else stream_out
    norm_m, norm_k = _norm_tile(m, k) if norm else (1, 16)
    half = rope.head_dim // 2 if rope else 1
    write_rows = rope is not None and rope.write_rows is not None
    variant = (config, bias is not None, silu_mul, norm, norm_m, norm_k, even_k, x.dtype, half, write_rows)
    with on_device(x.device):
        _launches.launch(variant, lambda: kernel[grid](
            x, weight, x if bias is None else bias, out, r, x if norm_weight is None else norm_weight, h, m, n, k,
            x.stride(0), weight.stride(0), out.stride(0), r.stride(0), h.stride(0), n, float(k), float(eps),
            *((rope.cos, rope.sin, rope.cos.stride(0), rope.k_cache, rope.v_cache, rope.k_cache.stride(0),
               rope.slot_mapping, rope.write_rows if write_rows else rope.slot_mapping, rope.q_heads, rope.kv_heads,
               rope.k_cache.shape[0]) if rope else (x, x, 0, x, x, 0, x, x, 0, 0, 0)),  # (no rope: unused pointers)
            HAS_BIAS=bias is not None, SILU_MUL=silu_mul, NORM=norm, NORM_M=norm_m, NORM_K=norm_k, EVEN_K=even_k,
            ROPE=rope is not None, HALF=half, WRITE_ROWS=write_rows, BLOCK_M=MAX_ROWS, BLOCK_N=config.block_n,
            BLOCK_K=config.block_k, num_stages=config.stages, num_warps=config.warps))
    return out

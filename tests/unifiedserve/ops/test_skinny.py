"""The decode-sized GEMM (unifiedserve/ops/skinny.py): its Triton kernel under Triton's interpreter on the CPU
(plain, with the norm folded in, with rotary and the K/V write), the calls it refuses, and its compilation for
Hopper. The choice per shape that tune() makes: test_skinny_tune.py and test_skinny_tune_qkv.py; on CUDA against
cuBLAS: test_skinny_cuda.py."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import torch

from tests.unifiedserve.ops.skinny_reference import needs_triton, run_interpreted
from unifiedserve.ops import skinny, skinny_kernel


KERNEL = """
    import os, sys, torch
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernel is built
    sys.path.insert(0, {root!r})
    from unifiedserve.ops import skinny
    from tests.unifiedserve.ops.skinny_reference import expected
    g = torch.Generator().manual_seed(0)
    C = skinny.SkinnyConfig
    # (rows, output columns, K, bias, silu_mul, config): uneven N and K, every epilogue, 1 to 16 rows
    cases = [(1, 40, 96, True, False, C(16, 32, 2)), (3, 50, 64, False, False, C(16, 64, 3)),
             (16, 33, 160, True, True, C(32, 64, 2)), (5, 64, 128, False, True, C(16, 64, 2)),
             (2, 48, 256, False, False, C(16, 128, 2)), (7, 20, 24, True, False, skinny.CONFIGS[0])]
    for dtype in (torch.float16, torch.bfloat16):
        for m, n, k, bias, silu, config in cases:
            x = torch.randn(m, k, generator=g).to(dtype)
            w = (torch.randn(2 * n if silu else n, k, generator=g) / k ** 0.5).to(dtype)
            b = torch.randn(w.shape[0], generator=g).to(dtype) if bias else None
            want = expected(x, w, b, silu)
            got = skinny.skinny_gemm(x, w, b, silu_mul=silu, config=config)
            # in steps of the dtype at each value's magnitude (at least 1/64 of the output's largest)
            floor = want.float().abs().max() / 64
            steps = ((got.float() - want.float()).abs() / want.float().abs().clamp_min(floor)).max().item()
            steps /= torch.finfo(dtype).eps
            print(str(dtype).split(".")[1], m, n, k, int(bias), int(silu), tuple(got.shape) == (m, n), steps)
    # into a given out (a strided view whose rows are contiguous), x a row slice with a wider stride
    big = torch.randn(4, 200, generator=g).to(torch.float16)
    x = big[:, :96]
    w = (torch.randn(40, 96, generator=g) / 10).to(torch.float16)
    out = torch.zeros(4, 64, dtype=torch.float16)[:, 8:48]
    got = skinny.skinny_gemm(x, w, config=C(16, 32, 2), out=out)
    err = (got.float() - expected(x, w, None, False).float()).abs().max().item()
    print("out", int(got.data_ptr() == out.data_ptr()), err)
"""


@needs_triton
def test_kernel_under_the_triton_interpreter_matches_the_unfused_path():
    """The kernel itself on the CPU, against the float32 GEMM rounded once (then SwiGLU's roundings): within one
    step of the dtype (the float32 sums differ from torch's in order; the interpreter truncates float32 to bfloat16
    where the GPU rounds to nearest), and float16 exact where the order does not matter."""
    lines = run_interpreted(KERNEL)
    rows = [line.split() for line in lines if not line.startswith("out")]
    assert len(rows) == 12
    for dtype, m, n, k, bias, silu, shaped, err in rows:
        assert shaped == "True", (dtype, m, n, k)
        # bfloat16 SwiGLU: the gate, the SiLU and the product each truncated by the interpreter, one step each
        limit = 4.0 if dtype == "bfloat16" and silu == "1" else 1.0
        assert float(err) <= limit, (dtype, m, n, k, bias, silu, err)
    out = next(line.split() for line in lines if line.startswith("out"))
    assert out[1] == "1" and float(out[2]) == 0.0


NORM_KERNEL = """
    import os, sys, torch
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, {root!r})
    from unifiedserve.ops import skinny
    from tests.unifiedserve.ops.skinny_reference import emulated_norm, expected_norm, truncated
    g = torch.Generator().manual_seed(2)
    C = skinny.SkinnyConfig

    # (rows, output columns, K, bias, silu_mul, residual, config): the add or not, every epilogue, uneven K, the
    # norm pass in one tile and in several (_norm_tile: 16 rows of 1000 columns take two [16, 512] tiles)
    cases = [(1, 40, 96, True, False, True, C(16, 32, 2)), (3, 50, 64, False, True, False, C(16, 64, 2)),
             (16, 33, 160, True, True, True, C(32, 64, 2)), (5, 24, 200, False, False, True, C(16, 64, 2)),
             (2, 48, 256, False, True, True, skinny.CONFIGS[3]), (16, 16, 1000, True, False, True, C(16, 128, 2))]
    for dtype in (torch.float16, torch.bfloat16):
        rnd = truncated if dtype == torch.bfloat16 else (lambda t: t.to(torch.float16))
        for m, n, k, bias, silu, add, config in cases:
            x = torch.randn(m, k, generator=g).to(dtype)
            r = torch.randn(m, k, generator=g).to(dtype) if add else None
            nw = (1 + 0.2 * torch.randn(k, generator=g)).to(dtype)
            w = (torch.randn(2 * n if silu else n, k, generator=g) / k ** 0.5).to(dtype)
            b = torch.randn(w.shape[0], generator=g).to(dtype) if bias else None
            stream = torch.full_like(x, float("nan")) if add else None
            got = skinny.skinny_gemm(x, w, b, silu_mul=silu, norm_weight=nw, residual=r, stream_out=stream,
                                     config=config)
            for name, (want, want_stream) in (("emulated", emulated_norm(x, r, nw, w, b, silu, rnd)),
                                              ("unfused", expected_norm(x, r, nw, w, b, silu))):
                floor = want.float().abs().max() / 64
                steps = ((got.float() - want.float()).abs() / want.float().abs().clamp_min(floor)).max().item()
                same = stream is None or torch.equal(stream, want_stream)
                print(name, str(dtype).split(".")[1], m, n, k, int(bias), int(silu), int(add), int(same),
                      steps / torch.finfo(dtype).eps)
"""


@needs_triton
def test_kernel_with_the_norm_folded_in_matches_the_unfused_path_under_the_interpreter():
    """With the add + RMSNorm in its prologue the kernel rounds where the unfused path rounds: against those
    roundings emulated in torch (as the interpreter makes them: bfloat16 by truncation, float16 to nearest) it is
    within two steps of the dtype (the sums' order differs: one normalised value may round the other way), the
    stream it writes is the add's exactly, and in float16, whose roundings the interpreter makes as the GPU does,
    it matches the unfused path itself as closely."""
    lines = [line.split() for line in run_interpreted(NORM_KERNEL)]
    assert len(lines) == 24
    for name, dtype, m, n, k, bias, silu, add, same, err in lines:
        if name == "emulated" or dtype == "float16":
            assert same == "1" and float(err) <= 2.0, (dtype, m, n, k, bias, silu, add, err)


ROPE_KERNEL = """
    import os, sys, torch
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, {root!r})
    from unifiedserve.ops import skinny
    from tests.unifiedserve.ops.skinny_reference import (emulated_norm, expected, expected_norm, rope_reference,
                                                         truncated)
    g = torch.Generator().manual_seed(3)
    C = skinny.SkinnyConfig

    def steps(got, want, dtype):  # in steps of the dtype at each value's magnitude (>= 1/64 of the largest)
        same_nan = torch.equal(got.isnan(), want.isnan())
        got, want = got.float().nan_to_num(0.0), want.float().nan_to_num(0.0)
        floor = want.abs().max() / 64
        return int(same_nan), ((got - want).abs() / want.abs().clamp_min(floor)).max().item() / torch.finfo(dtype).eps

    # (rows, q heads, kv heads, head dim, K, bias, norm: 0 none / 1 / 2 with the add, graph padding rows, config):
    # column pairs split across programs and heads, 1 to 16 rows
    cases = [(1, 4, 2, 8, 64, True, 2, 0, C(16, 32, 2)), (5, 6, 2, 16, 96, False, 1, 2, C(16, 64, 2)),
             (16, 2, 1, 32, 80, True, 0, 3, C(32, 64, 2)), (3, 4, 4, 16, 128, True, 2, 0, skinny.CONFIGS[3])]
    slots = 20
    for dtype in (torch.float16, torch.bfloat16):
        rnd = truncated if dtype == torch.bfloat16 else (lambda t: t.to(torch.float16))
        for m, hq, hk, d, k, bias, norm, pad, config in cases:
            n = (hq + 2 * hk) * d
            x = torch.randn(m, k, generator=g).to(dtype)
            r = torch.randn(m, k, generator=g).to(dtype) if norm == 2 else None
            nw = (1 + 0.2 * torch.randn(k, generator=g)).to(dtype) if norm else None
            w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
            b = torch.randn(n, generator=g).to(dtype) if bias else None
            angles = torch.rand(m, d // 2, generator=g) * 6.3
            cos, sin = torch.cat((angles, angles), -1).cos().to(dtype), torch.cat((angles, angles), -1).sin().to(dtype)
            slot_mapping = torch.randperm(slots, generator=g)[:m]
            write_rows = None
            if pad:  # the last rows are a graph's padding: row 0's slot, row 0's write
                write_rows = torch.arange(m)
                write_rows[-pad:] = 0
                slot_mapping[-pad:] = slot_mapping[0]
            k_cache = torch.full((slots, hk, d), float("nan"), dtype=dtype)
            v_cache = k_cache.clone()
            stream = torch.full_like(x, float("nan")) if r is not None else None
            write = skinny.RopeWrite(cos, sin, hq, hk, k_cache, v_cache, slot_mapping, write_rows)
            q = skinny.skinny_gemm(x, w, b, norm_weight=nw, residual=r, stream_out=stream, rope=write, config=config)
            if norm:
                emulated_y, want_stream = emulated_norm(x, r, nw, w, b, False, rnd)
                unfused_y = expected_norm(x, r, nw, w, b, False)[0]
            else:
                emulated_y = rnd(torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float()))
                unfused_y, want_stream = expected(x, w, b, False), None
            for name, want in (("emulated", rope_reference(emulated_y, hq, hk, cos, sin, slot_mapping, write_rows,
                                                           slots, rnd)),
                               ("unfused", rope_reference(unfused_y, hq, hk, cos, sin, slot_mapping, write_rows,
                                                          slots))):
                same_stream = stream is None or torch.equal(stream, want_stream)
                print(name, str(dtype).split(".")[1], m, hq, hk, d, int(same_stream), tuple(q.shape) == (m, hq * d),
                      *steps(q, want[0], dtype), *steps(k_cache, want[1], dtype), *steps(v_cache, want[2], dtype))
"""


@needs_triton
def test_kernel_with_rotary_and_the_kv_write_matches_the_unfused_path_under_the_interpreter():
    """Q/K/V's epilogue (rope=): Q rotated into the output, K rotated and V into exactly the slots the unfused
    rotary_cache writes (no other slot touched, a graph's padding rows leaving row 0's write as it is), rounded where
    the unfused path rounds: against those roundings emulated in torch within two steps of the dtype (the GEMM's sums
    in another order), with or without the norm in front, and in float16 against the unfused path itself."""
    lines = [line.split() for line in run_interpreted(ROPE_KERNEL)]
    assert len(lines) == 16
    for name, dtype, m, hq, hk, d, same_stream, shaped, *errs in lines:
        assert same_stream == "1" and shaped == "True", (name, dtype, m)
        nan_q, err_q, nan_k, err_k, nan_v, err_v = errs
        assert nan_q == nan_k == nan_v == "1", (name, dtype, m, errs)  # the same slots written, no others
        if name == "emulated" or dtype == "float16":
            assert max(float(err_q), float(err_k), float(err_v)) <= 2.0, (name, dtype, m, hq, hk, d, errs)


def test_calls_it_does_not_take_are_refused_with_the_reason():
    x = torch.zeros(2, 8, dtype=torch.bfloat16)
    w = torch.zeros(6, 8, dtype=torch.bfloat16)
    cases = [
        (torch.zeros(0, 8, dtype=torch.bfloat16), w, None, False, "1 to 16 rows, got 0"),
        (torch.zeros(17, 8, dtype=torch.bfloat16), w, None, False, "1 to 16 rows, got 17"),
        (x.float(), w.float(), None, False, "bfloat16 or float16"),
        (x, w.half(), None, False, "bfloat16 or float16"),
        (x, torch.zeros(6, 9, dtype=torch.bfloat16), None, False, "x has 8 columns"),
        (x, w.t().contiguous().t(), None, False, "contiguous last dim"),
        (x, torch.zeros(5, 8, dtype=torch.bfloat16), None, True, "an even count"),
        (x, w, torch.zeros(5, dtype=torch.bfloat16), False, r"bias must be contiguous \[6\]"),
        (x[0], w, None, False, "2-D"),
    ]
    for xi, wi, bi, silu, message in cases:
        with pytest.raises(ValueError, match=message):
            skinny.skinny_gemm(xi, wi, bi, silu_mul=silu)
    g = torch.ones(8, dtype=torch.bfloat16)
    r = torch.zeros_like(x)
    norm_cases = [
        (dict(residual=r, stream_out=torch.empty_like(x)), "come with norm_weight"),
        (dict(norm_weight=g[:7]), r"norm_weight must be contiguous \[8\]"),
        (dict(norm_weight=g.float()), "norm_weight must be"),
        (dict(norm_weight=g, residual=r), "residual needs stream_out"),
        (dict(norm_weight=g, stream_out=torch.empty_like(x)), "residual needs stream_out"),
        (dict(norm_weight=g, residual=r[:1], stream_out=torch.empty_like(x)), r"residual must be \[2, 8\]"),
        (dict(norm_weight=g, residual=r, stream_out=torch.empty(2, 8)), "stream_out must be"),
        (dict(norm_weight=g, residual=r, stream_out=r), "must not share memory"),
    ]
    for kwargs, message in norm_cases:
        with pytest.raises(ValueError, match=message):
            skinny.skinny_gemm(x, w, **kwargs)


@needs_triton
def test_kernel_compiles_for_hopper_with_pipelined_16_byte_loads():
    """Every config and epilogue, with and without the norm in front, compiles for sm_90 here (Triton's own ptxas),
    fits in Hopper's shared memory with room for a second program per SM on the narrow plain configs, streams the
    weight with 16-byte asynchronous copies, and is not specialised on the row count or width (one compilation
    serves every shape). The plain kernels spill no register; with the norm in front the widest K blocks spill a
    little (read from the cubin's resource usage: ptxas spills show there, not in the PTX), which the tune's timing
    weighs."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = skinny_kernel._kernel(False)[1]
    runtime = {"M", "N", "k_float", "eps", "q_heads", "kv_heads", "num_slots"}
    assert {p.name for p in kernel.params if p.do_not_specialize} == runtime
    pointers = ("x", "w", "bias", "out", "r", "g", "h", "cos", "sin", "k_cache", "v_cache")
    ints = ("M", "N", "K", "stride_xm", "stride_wn", "stride_om", "stride_rm", "stride_hm", "up_offset", "stride_cm",
            "stride_slot", "q_heads", "kv_heads", "num_slots")
    aligned = set(pointers) | {"slot_mapping", "write_rows"} | (set(ints) - runtime)
    # (bias, SwiGLU, norm, the norm pass's tile, rope, write_rows): the norm with the add at batch 1 (one tile holds
    # the 7B's row) and at 16 rows, without the add at batch 1; Q/K/V's rotary + K/V write with and without the
    # graph's write_rows, at 1 and 16 rows, and after the norm kernel (no norm in front) with and without write_rows
    variants = [(False, False, 0, 1, 16, False, False), (True, False, 0, 1, 16, False, False),
                (False, True, 0, 1, 16, False, False), (True, False, 2, 1, 4096, False, False),
                (False, True, 2, 16, 512, False, False), (True, False, 1, 1, 4096, False, False),
                (True, False, 2, 1, 4096, True, True), (True, False, 1, 16, 512, True, False),
                (True, False, 0, 1, 16, True, True), (True, False, 0, 1, 16, True, False)]
    for config in skinny.CONFIGS:
        for bias, silu, norm, norm_m, norm_k, rope, write_rows in variants:
            constants = {"HAS_BIAS": bias, "SILU_MUL": silu, "NORM": norm, "NORM_M": norm_m, "NORM_K": norm_k,
                         "EVEN_K": True, "ROPE": rope, "HALF": 64, "WRITE_ROWS": write_rows,
                         "BLOCK_M": skinny.MAX_ROWS, "BLOCK_N": config.block_n, "BLOCK_K": config.block_k}
            types = {**{p: "*bf16" for p in pointers}, **{i: "i32" for i in ints}, "k_float": "fp32", "eps": "fp32",
                     "slot_mapping": "*i64", "write_rows": "*i64", **{c: "constexpr" for c in constants}}
            signature = {p.name: types[p.name] for p in kernel.params}
            attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(signature) if name in aligned}
            compiled = triton.compile(ASTSource(kernel, signature=signature, constexprs=constants, attrs=attrs),
                                      target=GPUTarget("cuda", 90, 32),
                                      options={"num_warps": config.warps, "num_stages": config.stages})
            ptx = compiled.asm["ptx"]
            where = (config, bias, silu, norm, rope, compiled.metadata.shared)
            assert compiled.metadata.shared <= 227 * 1024, where
            if not silu and not rope and not norm and config.block_n <= 32:  # (SwiGLU and rope: two weight tiles)
                assert compiled.metadata.shared <= 113 * 1024, where
            stack = _stack_bytes(compiled.asm["cubin"])
            assert stack <= (128 if norm else 0), (*where, "stack bytes", stack)
            assert re.search(r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], 0x10", ptx), where
            assert "cp.async.wait_group" in ptx


def _stack_bytes(cubin: bytes) -> int:
    """The per-thread stack a compiled kernel uses (spilled registers), from ``cuobjdump -res-usage`` (Triton's own,
    else the CUDA toolkit's)."""
    import shutil
    import tempfile

    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    tool = str(tool) if tool.exists() else shutil.which("cuobjdump")
    assert tool, "no cuobjdump (Triton's or the CUDA toolkit's) to read the kernel's resource usage"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    return int(re.search(r"STACK:(\d+)", usage).group(1))

"""The decode-sized GEMM (unifiedserve/ops/skinny.py): its Triton kernel under Triton's interpreter on the CPU,
its compilation for Hopper, the choice per shape that tune() makes, and on CUDA against cuBLAS."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from unifiedserve.ops import reference, skinny, skinny_kernel

ROOT = Path(__file__).resolve().parents[3]
HAVE_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")


def expected(x, w, b, silu_mul):
    """What the unfused path computes: the GEMM in float32 rounded once to the dtype, then silu_and_mul's
    roundings (torch's silu rounds, the product rounds)."""
    y = F.linear(x.float(), w.float(), None if b is None else b.float()).to(x.dtype)
    return reference.silu_and_mul(y) if silu_mul else y


def run_interpreted(script: str, timeout: int = 300) -> list[str]:
    env = dict(os.environ, TRITON_INTERPRET="1")
    code = textwrap.dedent(script).format(root=str(ROOT))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=timeout)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout.splitlines()


KERNEL = """
    import os, sys, torch
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernel is built
    sys.path.insert(0, {root!r})
    from unifiedserve.ops import skinny
    from tests.unifiedserve.ops.test_skinny import expected
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


def expected_norm(x, residual, norm_weight, w, b, silu_mul, eps=1e-6):
    """The unfused path with the add + RMSNorm in front: ``(output, stream)``."""
    if residual is None:
        normed, stream = reference.rms_norm(x, norm_weight, eps), x
    else:
        normed, stream = reference.fused_add_rms_norm(x.clone(), residual.clone(), norm_weight, eps)
    return expected(normed, w, b, silu_mul), stream


def emulated_norm(x, residual, norm_weight, w, b, silu_mul, rnd, eps=1e-6):
    """The fused path's arithmetic in float32 torch with each rounding done by ``rnd`` (float32 -> the dtype): the
    add, 1 / sqrt(mean of squares + eps), the normalised value, the product with the weight, the GEMM's output(s),
    the SiLU, SwiGLU's product. ``(output, stream)``."""
    stream = x if residual is None else rnd(x.float() + residual.float())
    s = stream.float()
    inv = 1.0 / torch.sqrt((s * s).sum(-1, keepdim=True) / s.shape[-1] + eps)
    normed = rnd(norm_weight.float() * rnd(s * inv).float()).float()
    y = F.linear(normed, w.float(), None if b is None else b.float())
    if not silu_mul:
        return rnd(y), stream
    gate, up = (rnd(t).float() for t in y.chunk(2, dim=-1))
    return rnd(rnd(gate / (1.0 + torch.exp(-gate))).float() * up), stream


def truncated(t):
    """float32 -> bfloat16 as Triton's interpreter converts: dropping the low bits (the GPU rounds to nearest)."""
    return (t.float().view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)


NORM_KERNEL = """
    import os, sys, torch
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, {root!r})
    from unifiedserve.ops import skinny
    from tests.unifiedserve.ops.test_skinny import emulated_norm, expected_norm, truncated
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


def rope_reference(y, hq, hk, cos, sin, slot_mapping, write_rows, slots, rnd=None):
    """Rotary + the K/V write on the projection's output ``y [M, (Hq + 2 Hk) * D]``: ``(q [M, Hq * D], k_cache,
    v_cache)`` with unwritten slots NaN. ``rnd`` None: the unfused path (csrc's reference, rotary_cache); else its
    arithmetic in float32 with each rounding done by ``rnd``."""
    m, d = y.shape[0], cos.shape[1]
    q, k, v = (t.reshape(m, -1, d) for t in y.split([hq * d, hk * d, hk * d], -1))
    k_cache = torch.full((slots, hk, d), float("nan"), dtype=y.dtype)
    v_cache = k_cache.clone()
    if rnd is None:
        q = reference.rotary_cache(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, write_rows)
        return q.reshape(m, -1), k_cache, v_cache

    def rotate(t):
        a, b = t.float().chunk(2, -1)
        c, s = cos.float()[:, None], sin.float()[:, None]
        half = d // 2
        lo = rnd(rnd(a * c[..., :half]).float() + rnd(-b * s[..., :half]).float())
        hi = rnd(rnd(b * c[..., half:]).float() + rnd(a * s[..., half:]).float())
        return torch.cat((lo, hi), -1)

    q, k = rotate(q), rotate(k)
    src = torch.arange(m) if write_rows is None else write_rows
    k_cache[slot_mapping] = k[src]
    v_cache[slot_mapping] = v[src]
    return q.reshape(m, -1), k_cache, v_cache


ROPE_KERNEL = """
    import os, sys, torch
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, {root!r})
    from unifiedserve.ops import skinny
    from tests.unifiedserve.ops.test_skinny import emulated_norm, expected, expected_norm, rope_reference, truncated
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


@pytest.fixture
def clean_table():
    skinny.reset()
    yield
    skinny.reset()


def fake_timer(times):
    """A tune() timer that runs the call once and returns the next of ``times`` (cuBLAS first, then each config)."""
    it = iter(times)

    def timer(run, repeats, device):
        run()
        return next(it)

    return timer


def test_tune_keeps_cublas_on_the_cpu_and_when_turned_off(monkeypatch, clean_table):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    w = torch.zeros(32, 16, dtype=torch.bfloat16)
    group = skinny.Weights("o_proj", [w, w], [None, None])
    assert skinny.tune([group], [1, 2], silu_and_mul=reference.silu_and_mul, timer=fake_timer([])) == []
    monkeypatch.setenv("UNIFIEDSERVE_SKINNY_GEMM", "0")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert skinny.tune([group], [1, 2], silu_and_mul=reference.silu_and_mul, timer=fake_timer([])) == []
    assert skinny.table() == []
    x = torch.ones(1, 16, dtype=torch.bfloat16)
    assert skinny._lookup(x, w, None, False) is None


def _fake_kernel(wrong_for=(), skip=(), fault=(), wrong_without_add=()):
    """A stand-in for the Triton kernel (no interpreter): the unfused path's result, except that configs in
    ``skip`` write nothing, in ``wrong_for`` write zeros, in ``fault`` fault the GPU, and in ``wrong_without_add``
    are wrong only with the norm and no residual (the first layer's form)."""

    def kernel(x, w, b=None, *, silu_mul=False, norm_weight=None, eps=1e-6, residual=None, stream_out=None,
               rope=None, config=None, out=None):
        if config in fault:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        h = x if residual is None else (x.float() + residual.float()).to(x.dtype)
        y = h if norm_weight is None else reference.rms_norm(h, norm_weight, eps)
        y = F.linear(y, w, b)
        y = reference.silu_and_mul(y) if silu_mul else y
        if config in wrong_for or (config in wrong_without_add and norm_weight is not None and residual is None):
            y = torch.zeros_like(y)
        out = torch.empty_like(y) if out is None else out
        if config not in skip:
            out.copy_(y)
            if stream_out is not None:
                stream_out.copy_(h)
        return out

    return kernel


def test_tune_never_keeps_a_config_that_leaves_its_output_unwritten(monkeypatch, clean_table):
    """Each config's output buffer is filled with NaN before its first run, so a config that writes nothing
    disagrees, instead of being checked against what the config before it left there."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    c1, c2 = skinny.SkinnyConfig(16, 32, 2), skinny.SkinnyConfig(16, 64, 2)
    monkeypatch.setattr(skinny, "skinny_gemm", _fake_kernel(skip=(c2,)))
    w = [torch.randn(32, 16).bfloat16() for _ in range(2)]
    res = skinny.tune([skinny.Weights("o_proj", w, [None, None])], [1], silu_and_mul=reference.silu_and_mul,
                      configs=(c1, c2), timer=fake_timer([100.0, 50.0, 10.0]))
    assert [(c.config, list(c.configs_us)) for c in res] == [(c1, ["n16k32s2w4"])]


def test_a_gpu_fault_stops_the_tune_and_a_failing_group_keeps_cublas(monkeypatch, clean_table, caplog):
    """A config that faults the GPU stops the tune with the way out (no later call would run); a group whose
    baseline cannot be timed keeps cuBLAS and the next group is tuned; a winner whose first-layer form (no residual)
    disagrees is not kept."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    c1, c2 = skinny.SkinnyConfig(16, 32, 2), skinny.SkinnyConfig(16, 64, 2)
    w = [torch.randn(32, 16).bfloat16() for _ in range(2)]
    monkeypatch.setattr(skinny, "skinny_gemm", _fake_kernel(fault=(c2,)))
    with pytest.raises(RuntimeError, match=r"config n16k64s2w4 for o_proj faulted the GPU \(CUDA error: an illegal "
                                           r"memory access was encountered\).*UNIFIEDSERVE_SKINNY_GEMM=0"):
        skinny.tune([skinny.Weights("o_proj", w, [None, None])], [1], silu_and_mul=reference.silu_and_mul,
                    configs=(c1, c2), timer=fake_timer([100.0, 50.0]))

    skinny.reset()
    monkeypatch.setattr(skinny, "skinny_gemm", _fake_kernel(wrong_without_add=(c1,)))
    times = iter([100.0, 50.0, 100.0, 50.0])

    def timer(run, repeats, device):
        if len(calls) == 0:
            calls.append("refused")
            raise RuntimeError("operation not permitted when stream is capturing")
        run()
        return next(times)

    calls = []
    norms = [(1 + 0.1 * torch.randn(16)).bfloat16() for _ in range(2)]
    groups = [skinny.Weights("lm_head", w[:1], [None]), skinny.Weights("qkv_proj", w, [None, None], norms=norms)]
    with caplog.at_level("WARNING", logger="unifiedserve.ops.skinny"):
        res = skinny.tune(groups, [1], silu_and_mul=reference.silu_and_mul, configs=(c1,), timer=timer)
    assert [(c.kind, c.config) for c in res] == [("qkv_proj", c1), ("norm+qkv_proj", None)]
    assert res[1].skinny_us == 25.0  # timed and faster, but its form without the add disagreed
    logged = caplog.text
    assert "tuning lm_head stopped" in logged and "operation not permitted" in logged
    assert "config n16k32s2w4 not kept (norm kernel + skinny n16k32s2w4 stays): another form of it without the add" \
        in logged
    x = torch.randn(1, 16).bfloat16()
    assert skinny._lookup(x, w[0], None, False) == c1 and skinny._lookup(x, w[0], None, False, norm=True) is None


TUNE = """
    import os, sys, torch
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, {root!r})
    from unifiedserve.ops import reference, skinny
    from tests.unifiedserve.ops.test_skinny import fake_timer
    import logging
    logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="log %(message)s")
    C = skinny.SkinnyConfig
    configs = (C(16, 32, 2), C(16, 48, 2), C(16, 64, 2))  # the middle one cannot compile (48 is no power of 2)
    g = torch.Generator().manual_seed(1)
    w = [(torch.randn(48, 64, generator=g) / 8).to(torch.bfloat16) for _ in range(2)]
    b = [torch.randn(48, generator=g).to(torch.bfloat16) for _ in range(2)]
    up = [(torch.randn(40, 64, generator=g) / 8).to(torch.bfloat16) for _ in range(2)]
    groups = [skinny.Weights("qkv", w, b), skinny.Weights("mlp", up, [None, None], silu_mul=True)]
    # per (group, rows): cuBLAS, then the two configs. qkv: rows 1 the second config wins, rows 4 only 1 % faster
    # (under the 2 % margin: cuBLAS stays); mlp: rows 1 the first wins, rows 4 the second
    times = [100.0, 90.0, 80.0, 100.0, 99.0, 120.0, 50.0, 40.0, 45.0, 50.0, 49.5, 30.0]
    res = skinny.tune(groups, [4, 1, 32], silu_and_mul=reference.silu_and_mul, configs=configs,
                      timer=fake_timer(times))
    for c in res:
        print("choice", c.kind, c.rows, c.config, round(c.cublas_us, 3), round(c.skinny_us, 3), len(c.configs_us))
    print("summary", skinny.summary(res))
    print("seconds", int(skinny.tune_seconds() > 0))
    calls = []
    real = skinny.skinny_gemm
    skinny.skinny_gemm = lambda *a, **k: calls.append(k["config"]) or real(*a, **k)
    x = torch.randn(3, 64, generator=g).to(torch.bfloat16)
    for rows in (1, 3, 4, 5):
        calls.clear()
        y = skinny.linear(x[:1].expand(rows, 64).contiguous() if rows > 3 else x[:rows], w[0], b[0])
        print("linear", rows, calls[0] if calls else None, tuple(y.shape))
    calls.clear()
    got = skinny.gate_up_silu(x[:1], up[1], None, reference.silu_and_mul)
    want = reference.silu_and_mul(torch.nn.functional.linear(x[:1].float(), up[1].float()).to(torch.bfloat16))
    print("silu", calls[0] if calls else None, (got.float() - want.float()).abs().max().item())
    strided = w[0].t().contiguous().t()
    print("other", skinny._lookup(x[:1], w[0], None, False), skinny._lookup(x[:1], strided, b[0], False))
    # a kernel whose output is not the unfused path's is never chosen, however fast (here the unfused path is
    # made to differ: the check compares the two)
    skinny.skinny_gemm = real
    res = skinny.tune([skinny.Weights("mlp", up, [None, None], silu_mul=True)], [1],
                      silu_and_mul=lambda y: reference.silu_and_mul(y) * 3, configs=configs,
                      timer=fake_timer([50.0]))
    print("wrong", res[0].config, len(res[0].configs_us), skinny._lookup(x[:1], up[0], None, True))
"""


@needs_triton
def test_tune_chooses_per_shape_and_row_count_and_linear_follows(clean_table):
    """tune() keeps the skinny kernel only where its best config beats cuBLAS by the margin, per shape and row
    count; a call takes the choice of the smallest tuned row count that covers it, and cuBLAS past the largest
    (or for another shape, or strided weights). A config that cannot compile is tried once per epilogue, and one
    whose output disagrees with the unfused path is skipped."""
    lines = run_interpreted(TUNE)
    choices = [line.split() for line in lines if line.startswith("choice")]
    assert choices == [
        ["choice", "qkv", "1", "n16k64s2w4", "50.0", "40.0", "2"],
        ["choice", "qkv", "4", "None", "50.0", "49.5", "2"],
        ["choice", "mlp", "1", "n16k32s2w4", "25.0", "20.0", "2"],
        ["choice", "mlp", "4", "n16k64s2w4", "25.0", "15.0", "2"],
    ]  # us per call: each timed run covers both layers' weights; rows 32 is past the kernel's 16
    cannot = [line for line in lines if line.startswith("log") and "cannot run here" in line]
    # once per epilogue and tune() call: the first call's two (bias, SwiGLU), the last call's one (SwiGLU)
    assert len(cannot) == 3 and all("n16k48s2w4" in line for line in cannot), cannot
    assert "seconds 1" in lines
    summary = next(line for line in lines if line.startswith("summary"))
    assert "qkv [48x64]: skinny at rows [1]" in summary and "mlp [20x64]: skinny at rows [1, 4]" in summary
    linear = {int(line.split()[1]): line.split()[2] for line in lines if line.startswith("linear")}
    assert linear == {1: "n16k64s2w4", 3: "None", 4: "None", 5: "None"}  # rows 3 take rows 4's choice: cuBLAS
    silu = next(line.split() for line in lines if line.startswith("silu"))
    assert silu[1] == "n16k32s2w4" and float(silu[2]) <= 0.07  # one bfloat16 step of values up to ~8
    assert next(line for line in lines if line.startswith("other")) == "other None None"
    assert next(line for line in lines if line.startswith("wrong")) == "wrong None 0 None"


QKV_TUNE_SETUP = """
    import os, sys, torch
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, {root!r})
    from unifiedserve.ops import reference, skinny
    from tests.unifiedserve.ops.test_skinny import expected_norm, fake_timer, rope_reference
    C = skinny.SkinnyConfig
    configs = (C(16, 32, 2), C(16, 64, 2))

    def qkv_weights(seed):  # two layers' 48x64 Q/K/V (4 query heads and 1 K/V head of 8), biases and norms
        g = torch.Generator().manual_seed(seed)
        w = [(torch.randn(48, 64, generator=g) / 8).to(torch.bfloat16) for _ in range(2)]
        b = [torch.randn(48, generator=g).to(torch.bfloat16) for _ in range(2)]
        nw = [(1 + 0.1 * torch.randn(64, generator=g)).to(torch.bfloat16) for _ in range(2)]
        return g, w, b, nw
"""

TUNE_NORM = QKV_TUNE_SETUP + """
    g, w, b, nw = qkv_weights(3)
    # plain, rows 1: cuBLAS 100, the configs 60 and 50; rows 4: 100, 99, 99.5 (cuBLAS stays). With the norm, rows 1:
    # the norm kernel + the plain choice 80, the configs 70 and 79; rows 4: 80, 79, 79.5 (under the margin)
    times = [100.0, 60.0, 50.0, 100.0, 99.0, 99.5, 80.0, 70.0, 79.0, 80.0, 79.0, 79.5]
    res = skinny.tune([skinny.Weights("qkv", w, b, norms=nw, eps=1e-5)], [1, 4], silu_and_mul=reference.silu_and_mul,
                      configs=configs, timer=fake_timer(times))
    for c in res:
        print("choice", c.kind, c.rows, c.config, c.cublas_us, c.baseline.replace(" ", "_"))
    calls = []
    real = skinny.skinny_gemm
    skinny.skinny_gemm = lambda *a, **k: calls.append(
        (str(k["config"]), k.get("norm_weight") is not None, k.get("residual") is not None)) or real(*a, **k)
    x = torch.randn(4, 64, generator=g).to(torch.bfloat16)
    r = torch.randn(4, 64, generator=g).to(torch.bfloat16)
    for rows, add in ((1, True), (1, False), (3, True)):
        calls.clear()
        res_in = r[:rows].clone() if add else None
        out, stream = skinny.norm_linear(x[:rows].clone(), res_in, nw[0], 1e-5, w[0], b[0])
        want, want_stream = expected_norm(x[:rows], r[:rows] if add else None, nw[0], w[0], b[0], False, eps=1e-5)
        err = (out.float() - want.float()).abs().max().item() / want.float().abs().max().item()
        stream_err = (stream.float() - want_stream.float()).abs().max().item()
        print("norm_linear", rows, int(add), calls, err, stream_err)
    skinny.skinny_gemm = real
    # norms kept in float32 beside bfloat16 weights: the kernel cannot take them, so only the plain rows are timed
    fp32 = skinny.Weights("qkv", w, b, norms=[t.float() for t in nw])
    res = skinny.tune([fp32], [1], silu_and_mul=reference.silu_and_mul, configs=configs,
                      timer=fake_timer([100.0, 60.0, 50.0]))
    print("float32_norms", *[c.kind for c in res])
"""


@needs_triton
def test_tune_times_the_norm_folded_in_against_the_norm_kernel_and_the_projections_choice(clean_table):
    """A group with norms is tuned twice: the plain projection, then with the add + RMSNorm in front, where the
    baseline is the norm kernel followed by the plain choice at that row count (named in the results).
    norm_linear then runs one kernel where the fused config won, with or without the add, and the norm kernel
    followed by the plain choice elsewhere; both give the unfused path's output and stream."""
    lines = run_interpreted(TUNE_NORM)
    choices = [line.split()[1:] for line in lines if line.startswith("choice")]
    assert choices == [["qkv", "1", "n16k64s2w4", "50.0", "cuBLAS"], ["qkv", "4", "None", "50.0", "cuBLAS"],
                       ["norm+qkv", "1", "n16k32s2w4", "40.0", "norm_kernel_+_skinny_n16k64s2w4"],
                       ["norm+qkv", "4", "None", "40.0", "norm_kernel_+_cuBLAS"]]
    runs = [line for line in lines if line.startswith("norm_linear")]
    assert runs[0].startswith("norm_linear 1 1 [('n16k32s2w4', True, True)] ")
    assert runs[1].startswith("norm_linear 1 0 [('n16k32s2w4', True, False)] ")
    assert runs[2].startswith("norm_linear 3 1 [] ")  # rows 3 take rows 4's choice: the norm kernel, then cuBLAS
    assert "float32_norms qkv" in lines
    for line in runs:
        err, stream_err = map(float, line.split()[-2:])
        # bfloat16 rounding (the interpreter truncates); the stream within one bfloat16 step of values up to ~8
        assert err <= 0.02 and stream_err <= 0.07, line


TUNE_ROPE = QKV_TUNE_SETUP + """
    g, w, b, nw = qkv_weights(4)
    # plain and norm+ as in TUNE_NORM; then with rotary and the K/V write, at each row count the norm folded in, then
    # the norm kernel in front, each against norm_linear + rotary_cache 90. Rows 1: folded 95 and 85, behind 80 and 95
    # (both win: behind's 80 stays); rows 4: folded 80 and 95, behind 87 and 95 (both win: the folded 80 stays). Each
    # per layer in the results (half)
    times = [100.0, 60.0, 50.0, 100.0, 99.0, 99.5, 80.0, 70.0, 79.0, 80.0, 79.0, 79.5, 90.0, 95.0, 85.0, 90.0, 80.0,
             95.0, 90.0, 80.0, 95.0, 90.0, 87.0, 95.0]
    group = skinny.Weights("qkv", w, b, norms=nw, eps=1e-5, rope_heads=(4, 1))
    res = skinny.tune([group], [1, 4], silu_and_mul=reference.silu_and_mul, configs=configs, timer=fake_timer(times))
    for c in res:
        print("choice", c.kind, c.rows, c.config, c.cublas_us, c.baseline.replace(" ", "_"), int(bool(c.note)))
    x = torch.randn(4, 64, generator=g).to(torch.bfloat16)
    r = torch.randn(4, 64, generator=g).to(torch.bfloat16)
    print("chosen", *(int(skinny.rope_chosen(x[:rows], w[0], b[0])) for rows in (1, 3, 4)))
    calls = []
    real = skinny.skinny_gemm
    skinny.skinny_gemm = lambda *a, **k: calls.append(
        (str(k["config"]), k.get("rope") is not None, k.get("norm_weight") is not None)) or real(*a, **k)
    for rows in (1, 3):
        calls.clear()
        angles = torch.rand(rows, 4, generator=g) * 6.3
        cos, sin = torch.cat((angles, angles), -1).cos().to(torch.bfloat16), torch.cat((angles, angles), -1).sin().to(
            torch.bfloat16)
        slots = torch.arange(rows) + 2
        k_cache = torch.full((8, 1, 8), float("nan"), dtype=torch.bfloat16)
        v_cache = k_cache.clone()
        write = skinny.RopeWrite(cos, sin, 4, 1, k_cache, v_cache, slots)
        got = skinny.norm_qkv_rope(x[:rows].clone(), r[:rows].clone(), nw[0], 1e-5, w[0], b[0], write)
        if got is None:
            print("norm_qkv_rope", rows, "None", calls)
            continue
        y, want_stream = expected_norm(x[:rows], r[:rows], nw[0], w[0], b[0], False, eps=1e-5)
        want_q, want_k, want_v = rope_reference(y, 4, 1, cos, sin, slots, None, 8)
        errs = [((a.float() - c.float()).nan_to_num(0.0).abs().max() / c.float().nan_to_num(0.0).abs().max()).item()
                for a, c in ((got[0], want_q), (k_cache, want_k), (v_cache, want_v), (got[1], want_stream))]
        print("norm_qkv_rope", rows, "q", calls, int(torch.equal(k_cache.isnan(), want_k.isnan())), *errs)
    skinny.skinny_gemm = real
"""


@needs_triton
def test_tune_times_rotary_and_the_kv_write_folded_in_against_norm_linear_then_rotary_cache(clean_table):
    """A Q/K/V group with rope_heads is tuned once more at each row count: norm_linear (with the choices just made)
    followed by rotary_cache, against each config with the norm, rotary and K/V write in one kernel, and against the
    norm kernel followed by each config with rotary and the K/V write only. Where both forms win, only the faster
    stays chosen. norm_qkv_rope then runs the form that won (rotated Q, K/V in the cache, the stream: the unfused
    path's within bfloat16 rounding), as rope_chosen says beforehand."""
    lines = run_interpreted(TUNE_ROPE)
    choices = [line.split()[1:] for line in lines if line.startswith("choice")]
    # (the last field: a note that the config won but the other form was faster)
    assert choices[4:] == [["norm+qkv+rope", "1", "None", "45.0", "norm_linear_+_rotary_cache", "1"],
                           ["norm+qkv+rope", "4", "n16k32s2w4", "45.0", "norm_linear_+_rotary_cache", "0"],
                           ["qkv+rope", "1", "n16k32s2w4", "45.0", "norm_linear_+_rotary_cache", "0"],
                           ["qkv+rope", "4", "None", "45.0", "norm_linear_+_rotary_cache", "1"]]
    assert "chosen 1 1 1" in lines
    runs = [line for line in lines if line.startswith("norm_qkv_rope")]
    assert runs[0].startswith("norm_qkv_rope 1 q [('n16k32s2w4', True, False)] 1 "), runs[0]  # after the norm kernel
    assert runs[1].startswith("norm_qkv_rope 3 q [('n16k32s2w4', True, True)] 1 "), runs[1]  # one kernel
    for run in runs:
        errs = list(map(float, run.split()[-4:]))
        assert max(errs) <= 0.02, run  # bfloat16 rounding (the interpreter truncates)


TUNE_ROPE_CHECKS = QKV_TUNE_SETUP + """
    from unifiedserve import ops
    g, w, b, nw = qkv_weights(5)
    c1, c2 = configs
    real = skinny.skinny_gemm

    def sabotaged(*a, **k):  # the form behind the norm kernel: c2 writes a wrong K, c1 nothing in eager steps
        rope = k.get("rope")
        behind = rope is not None and k.get("norm_weight") is None
        if behind and k["config"] == c1 and rope.write_rows is None:
            return k["out"]
        out = real(*a, **k)
        if behind and k["config"] == c2:
            rope.k_cache.fill_(0.0)
        return out

    skinny.skinny_gemm = sabotaged
    norms = []
    real_norm = ops.fused_add_rms_norm
    ops.fused_add_rms_norm = lambda *a: norms.append(1) or real_norm(*a)
    # every baseline and config 100 (nothing chosen) but c1 behind the norm kernel: 50
    times = iter([100.0] * 10 + [50.0])
    deltas = []

    def timer(run, repeats, device):  # the norm kernels each timed call runs
        before = len(norms)
        run()
        deltas.append(len(norms) - before)
        return next(times)

    group = skinny.Weights("qkv", w, b, norms=nw, eps=1e-5, rope_heads=(4, 1))
    res = skinny.tune([group], [1], silu_and_mul=reference.silu_and_mul, configs=configs, timer=timer)
    behind = [c for c in res if c.kind == "qkv+rope"][0]
    print("behind", behind.config, *sorted(behind.configs_us))
    print("norm_kernels_per_timed_call", *deltas)
    # a baseline that cannot be timed again for the form behind the norm kernel: the folded form's choice stands
    times = iter([100.0] * 6 + [100.0, 50.0, 100.0])

    def failing(run, repeats, device):
        run()
        value = next(times, None)
        if value is None:
            raise RuntimeError("timer broke")
        return value

    skinny.reset()
    res = skinny.tune([group], [1], silu_and_mul=reference.silu_and_mul, configs=configs, timer=failing)
    ropes = [c.kind + ":" + str(c.config) for c in res if "rope" in c.kind]
    print("after_failure", *ropes, res[-1].note.replace(" ", "_"))
    print("still_chosen", int(skinny.rope_chosen(torch.zeros(1, 64, dtype=torch.bfloat16), w[0], b[0])))
"""


@needs_triton
def test_tune_rejects_a_rope_config_behind_the_norm_kernel_that_is_wrong_in_any_form(clean_table):
    """The form behind the norm kernel: a config whose K/V write is wrong is never timed, and one that is right as a
    graph step runs it (write_rows) but writes nothing in an eager step is not chosen however fast. Each of its timed
    calls runs the norm kernel once a layer, as its baseline (norm_linear + rotary_cache) does."""
    lines = run_interpreted(TUNE_ROPE_CHECKS)
    assert "behind None n16k32s2w4" in lines  # c2 (n16k64s2w4) was never timed; c1 won, wrote nothing when eager
    # plain: the baseline and two configs (no norm); norm+: the norm kernel + cuBLAS baseline (2 layers), the two
    # configs with the norm folded in; then folded rope: norm_linear's norm kernel in its baseline; behind: baseline, c1
    assert "norm_kernels_per_timed_call 0 0 0 2 0 0 2 0 0 2 2" in lines
    # its baseline failing the second time: that form is not chosen, with the reason; the folded form's choice stands
    assert "after_failure norm+qkv+rope:n16k32s2w4 qkv+rope:None not_timed:_timer_broke" in lines
    assert "still_chosen 1" in lines


MODEL = """
    import os, sys, torch
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, {root!r})
    from unifiedserve import ops
    from unifiedserve.ops import skinny
    from unifiedserve.attention import AttentionMetadata, KVCache, TorchPagedAttention
    from unifiedserve.model.config import TextConfig
    from unifiedserve.model.llm import LanguageModel
    from tests.unifiedserve.ops.test_skinny import fake_timer
    torch.manual_seed(0)
    cfg = TextConfig(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, mrope_section=(4, 2, 2))
    lm = LanguageModel(cfg).to(torch.bfloat16).eval()
    for p in lm.parameters():
        p.requires_grad_(False)
        torch.nn.init.normal_(p, std=0.05)

    def step(ids):
        cache = KVCache(cfg.num_hidden_layers, 8, 16, cfg.num_key_value_heads, cfg.head_dim, dtype=torch.bfloat16)
        attn = TorchPagedAttention(cache, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        attn.begin(AttentionMetadata.build([(0, len(ids), [0])], 16))
        pos = torch.arange(len(ids)).expand(3, -1)
        h = lm(lm.embed_tokens(torch.tensor(ids)), pos, attn)
        return lm.compute_logits(h).float()

    def same_top(got, want):  # 1: the same top token wherever want's top two differ by more than twice the error
        top2 = want.topk(2, -1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * (got - want).abs().max()
        return int(bool(clear.any()) and torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear]))

    ids = [3, 14, 15, 92, 65]
    with torch.inference_mode():
        before = step(ids)
        kinds = [g.kind for g in lm.skinny_groups()]
        n = (len(kinds) + 4) * 2  # rows 4 and 8: the baseline then the config, each kind, both norm+ kinds, both rope
        res = skinny.tune(lm.skinny_groups(), [4, 8], silu_and_mul=ops.silu_and_mul,
                          configs=(skinny.SkinnyConfig(16, 32, 2),), timer=fake_timer([100.0, 50.0] * n))
        calls = []
        real = skinny.skinny_gemm
        skinny.skinny_gemm = lambda *a, **k: calls.append(
            (k.get("silu_mul", False), k.get("norm_weight") is not None, k.get("residual") is not None,
             k.get("rope") is not None)
        ) or real(*a, **k)
        norm_kernels = []
        real_norm = ops.fused_add_rms_norm
        ops.fused_add_rms_norm = lambda *a: norm_kernels.append(1) or real_norm(*a)
        after = step(ids)
        # Q/K/V's rotary and K/V write behind the norm kernel: the form with the norm folded in loses this time
        counted = (len(calls), *(sum(c[i] for c in calls) for i in range(4))), len(norm_kernels)
        skinny.reset()
        times = [100.0, 50.0] * 4 + [100.0, 100.0, 100.0, 50.0] * 2 + [100.0, 50.0] * 12
        skinny.tune(lm.skinny_groups(), [4, 8], silu_and_mul=ops.silu_and_mul,
                    configs=(skinny.SkinnyConfig(16, 32, 2),), timer=fake_timer(times))
        calls.clear()
        norm_kernels.clear()
        behind = step(ids)
    print("calls_behind", len(calls), *(sum(c[i] for c in calls) for i in range(4)))
    print("norm_kernels_behind", len(norm_kernels))
    print("diff_behind", (behind - before).abs().max().item())
    print("argmax_behind", same_top(behind, before))
    print("kinds", *kinds)
    print("chosen", sum(c.chosen for c in res), len(res))
    print("calls", *counted[0])
    print("norm_kernels", counted[1])
    print("diff", (after - before).abs().max().item(), before.abs().max().item())
    print("argmax", same_top(after, before))
"""


@needs_triton
def test_the_language_model_runs_its_projections_through_the_tuned_kernel():
    """Once tuned, a 5-token step of a bfloat16 decoder runs every projection and the LM head through the skinny
    kernel (the SwiGLU fused, each RMSNorm but the final one folded into the projection after it, rotary and the K/V
    write into Q/K/V's), and its logits stay within bfloat16 rounding of cuBLAS's."""
    lines = dict((line.split()[0], line.split()[1:]) for line in run_interpreted(MODEL))
    assert lines["kinds"] == ["qkv_proj", "o_proj", "gate_up_proj+silu", "down_proj", "lm_head"]
    assert lines["chosen"] == ["16", "18"]  # both rope forms tie: the one with the norm folded in stays
    # 4 per layer and the head: per layer one SwiGLU, two with the norm, one with rotary and the K/V write; the add in
    # all but layer 0's first
    assert lines["calls"] == ["9", "2", "4", "3", "2"]
    assert lines["norm_kernels"] == ["1"]  # the final norm's
    diff, scale = map(float, lines["diff"])
    assert 0 < scale and diff <= 0.02 * scale
    assert lines["argmax"] == ["1"]
    # tuned again with Q/K/V's rotary and K/V write chosen behind the norm kernel: per layer that form (no norm in the
    # kernel), the SwiGLU with its norm and add; the norm kernels: layer 1's add + RMSNorm before Q/K/V, the final one
    assert lines["calls_behind"] == ["9", "2", "2", "2", "2"]
    assert lines["norm_kernels_behind"] == ["2"]
    assert float(lines["diff_behind"][0]) <= 0.02 * scale
    assert lines["argmax_behind"] == ["1"]


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


# -- on the GPU ---------------------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available() or not HAVE_TRITON, reason="needs CUDA and Triton")

SHAPES_7B = [("qkv_proj", 4608, 3584, True, False), ("o_proj", 3584, 3584, False, False),
             ("gate_up_proj+silu", 2 * 18944, 3584, False, True), ("down_proj", 3584, 18944, False, False)]


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_cuda_every_config_matches_cublas_on_the_7b_shapes(rows):
    g = torch.Generator(device="cuda").manual_seed(rows)
    for kind, n, k, bias, silu in SHAPES_7B:
        x = torch.randn(rows, k, device="cuda", generator=g).to(torch.bfloat16)
        w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).to(torch.bfloat16)
        b = torch.randn(n, device="cuda", generator=g).to(torch.bfloat16) if bias else None
        y = F.linear(x, w, b)
        want = reference.silu_and_mul(y) if silu else y
        for config in skinny.CONFIGS:
            got = skinny.skinny_gemm(x, w, b, silu_mul=silu, config=config)
            torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=2e-2, msg=f"{kind} {config}")


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_cuda_the_norm_folded_in_matches_the_norm_kernel_then_cublas(rows):
    """Q/K/V and gate/up of the 7B with the add + RMSNorm in front: the stream is torch's add bit for bit, the
    output the native norm kernel followed by cuBLAS (and silu_and_mul) within bfloat16 rounding: every config with
    the add, the first without (layer 0's)."""
    from unifiedserve import ops

    g = torch.Generator(device="cuda").manual_seed(rows)
    for kind, n, k, bias, silu in (SHAPES_7B[0], SHAPES_7B[2]):
        x = torch.randn(rows, k, device="cuda", generator=g).to(torch.bfloat16)
        r = (4 * torch.randn(rows, k, device="cuda", generator=g)).to(torch.bfloat16)
        nw = (1 + 0.2 * torch.randn(k, device="cuda", generator=g)).to(torch.bfloat16)
        w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).to(torch.bfloat16)
        b = torch.randn(n, device="cuda", generator=g).to(torch.bfloat16) if bias else None
        for add in (True, False):
            if add:
                normed, want_stream = ops.fused_add_rms_norm(x.clone(), r.clone(), nw, 1e-6)
            else:
                normed, want_stream = ops.rms_norm(x, nw, 1e-6), x
            y = F.linear(normed, w, b)
            want = ops.silu_and_mul(y) if silu else y
            for config in skinny.CONFIGS if add else skinny.CONFIGS[:1]:  # (each variant compiles: ~1 s)
                stream = torch.full_like(x, float("nan")) if add else None
                got = skinny.skinny_gemm(x, w, b, silu_mul=silu, norm_weight=nw, eps=1e-6, residual=r if add else None,
                                         stream_out=stream, config=config)
                if add:
                    assert torch.equal(stream, want_stream), (kind, config)
                torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=2e-2,
                                           msg=f"{kind} {config} add={add}")


@pytest.mark.cuda
@cuda
def test_cuda_graph_replay_equals_eager_and_tune_measures_every_config():
    """The kernel in a captured CUDA graph gives eager's bits (fixed summation order, no workspace), with the norm
    in front too, and tune() on real weights measures cuBLAS and every config, with the norm and without."""
    g = torch.Generator(device="cuda").manual_seed(0)
    w = [(torch.randn(2 * 1024, 1024, device="cuda", generator=g) / 32).to(torch.bfloat16) for _ in range(4)]
    x = torch.randn(2, 1024, device="cuda", generator=g).to(torch.bfloat16)
    r = torch.randn(2, 1024, device="cuda", generator=g).to(torch.bfloat16)
    nw = torch.rand(1024, device="cuda", generator=g).to(torch.bfloat16)
    eager = skinny.skinny_gemm(x, w[0], silu_mul=True)
    eager_stream = torch.empty_like(x)
    eager_norm = skinny.skinny_gemm(x, w[1], silu_mul=True, norm_weight=nw, residual=r, stream_out=eager_stream)
    out, out_norm, out_stream = torch.empty_like(eager), torch.empty_like(eager), torch.empty_like(x)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        skinny.skinny_gemm(x, w[0], silu_mul=True, out=out)
        skinny.skinny_gemm(x, w[1], silu_mul=True, norm_weight=nw, residual=r, stream_out=out_stream, out=out_norm)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager) and torch.equal(out_norm, eager_norm) and torch.equal(out_stream, eager_stream)
    skinny.reset()
    try:
        norms = [torch.rand(1024, device="cuda", generator=g).to(torch.bfloat16) for _ in w]
        res = skinny.tune([skinny.Weights("mlp", w, [None] * 4, silu_mul=True, norms=norms)], [1, 2],
                          silu_and_mul=reference.silu_and_mul)
        assert [(c.kind, c.rows) for c in res] == [("mlp", 1), ("mlp", 2), ("norm+mlp", 1), ("norm+mlp", 2)]
        assert all(c.cublas_us > 0 and len(c.configs_us) == len(skinny.CONFIGS) for c in res), res
    finally:
        skinny.reset()


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_cuda_rotary_and_the_kv_write_folded_in_match_norm_linear_then_rotary_cache(rows):
    """The 7B's Q/K/V (28 + 2 x 4 heads of 128) with the add + RMSNorm in front and rotary + the K/V write behind, every
    config: Q and the written slots within bfloat16 rounding of the native norm kernel, cuBLAS and csrc's rotary_cache
    (no other slot touched, a graph's padding rows leaving row 0's write alone), the stream bit for bit; the same
    without the norm folded in, on the norm kernel's output (qkv_proj+rope); in a captured
    CUDA graph, eager's bits; and tune() on such weights measures the baseline and every config."""
    from unifiedserve import ops

    g = torch.Generator(device="cuda").manual_seed(rows)
    hq, hk, d, k, slots = 28, 4, 128, 3584, 40
    x = torch.randn(rows, k, device="cuda", generator=g).to(torch.bfloat16)
    r = (4 * torch.randn(rows, k, device="cuda", generator=g)).to(torch.bfloat16)
    nw = (1 + 0.2 * torch.randn(k, device="cuda", generator=g)).to(torch.bfloat16)
    w = (torch.randn((hq + 2 * hk) * d, k, device="cuda", generator=g) / k ** 0.5).to(torch.bfloat16)
    b = torch.randn(w.shape[0], device="cuda", generator=g).to(torch.bfloat16)
    angles = torch.rand(rows, d // 2, device="cuda", generator=g) * 6.3
    cos, sin = (f(torch.cat((angles, angles), -1)).to(torch.bfloat16) for f in (torch.cos, torch.sin))
    slot_mapping = torch.randperm(slots, device="cuda", generator=g)[:rows]
    write_rows = torch.arange(rows, device="cuda")
    pad = rows // 3  # the last rows as a graph's padding
    if pad:
        write_rows[-pad:] = 0
        slot_mapping[-pad:] = slot_mapping[0]
    normed, want_stream = ops.fused_add_rms_norm(x.clone(), r.clone(), nw, 1e-6)
    q, kk, v = (t.view(rows, -1, d) for t in F.linear(normed, w, b).split([hq * d, hk * d, hk * d], -1))
    want_k, want_v = (torch.full((slots, hk, d), float("nan"), device="cuda", dtype=torch.bfloat16) for _ in range(2))
    want_q = ops.rotary_cache(q, kk, v, cos, sin, want_k, want_v, slot_mapping, write_rows).reshape(rows, -1)

    def fused(config, out=None, stream=None, k_cache=None, v_cache=None):
        stream = torch.full_like(x, float("nan")) if stream is None else stream
        k_cache = torch.full_like(want_k, float("nan")) if k_cache is None else k_cache
        v_cache = torch.full_like(want_v, float("nan")) if v_cache is None else v_cache
        write = skinny.RopeWrite(cos, sin, hq, hk, k_cache, v_cache, slot_mapping, write_rows)
        got = skinny.skinny_gemm(x, w, b, norm_weight=nw, eps=1e-6, residual=r, stream_out=stream, rope=write,
                                 config=config, out=out)
        return got, stream, k_cache, v_cache

    for config in skinny.CONFIGS:
        got, stream, k_cache, v_cache = fused(config)
        assert torch.equal(stream, want_stream), config
        for name, a, e in (("q", got, want_q), ("k", k_cache, want_k), ("v", v_cache, want_v)):
            assert torch.equal(a.isnan(), e.isnan()), (name, config)
            torch.testing.assert_close(a.float().nan_to_num(0.0), e.float().nan_to_num(0.0), rtol=1.6e-2, atol=2e-2,
                                       msg=f"{name} {config}")
        # the form after the norm kernel (qkv_proj+rope): the same projection, rotary and write on its output
        k_cache, v_cache = torch.full_like(want_k, float("nan")), torch.full_like(want_v, float("nan"))
        got = skinny.skinny_gemm(normed, w, b, config=config, rope=skinny.RopeWrite(
            cos, sin, hq, hk, k_cache, v_cache, slot_mapping, write_rows))
        for name, a, e in (("q", got, want_q), ("k", k_cache, want_k), ("v", v_cache, want_v)):
            assert torch.equal(a.isnan(), e.isnan()), (name, config, "after the norm kernel")
            torch.testing.assert_close(a.float().nan_to_num(0.0), e.float().nan_to_num(0.0), rtol=1.6e-2, atol=2e-2,
                                       msg=f"{name} {config}, after the norm kernel")
    eager = fused(skinny.CONFIGS[0])
    captured = [torch.empty_like(eager[0]), torch.empty_like(x), torch.full_like(want_k, float("nan")),
                torch.full_like(want_v, float("nan"))]
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
        fused(skinny.CONFIGS[0], *captured)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a.nan_to_num(0.0), e.nan_to_num(0.0)) for a, e in zip(captured, eager))
    if rows == 1:
        skinny.reset()
        try:
            group = skinny.Weights("qkv_proj", [w, w.clone()], [b, b.clone()], norms=[nw, nw.clone()],
                                   rope_heads=(hq, hk))
            res = skinny.tune([group], [1], silu_and_mul=reference.silu_and_mul)
            assert [c.kind for c in res] == ["qkv_proj", "norm+qkv_proj", "norm+qkv_proj+rope", "qkv_proj+rope"]
            assert all(c.cublas_us > 0 and len(c.configs_us) == len(skinny.CONFIGS) for c in res), res
        finally:
            skinny.reset()


def test_the_start_up_summary_names_only_rope_forms_that_won_but_gave_way():
    """A +rope row whose config gave way to the faster other form is logged as having won there; one that was never
    timed (its baseline could not run again) is not."""
    config = skinny.CONFIGS[0]
    gave_way = skinny.Choice("qkv_proj+rope", 1, 512, 256, 20.0, 15.0, None, {str(config): 15.0},
                             note=skinny.RIVAL_FASTER)
    untimed = skinny.Choice("qkv_proj+rope", 2, 512, 256, 20.0, None, None, {}, note="not timed: out of memory")
    chosen = skinny.Choice("qkv_proj+rope", 4, 512, 256, 20.0, 14.0, config, {str(config): 14.0})
    line = skinny.summary([gave_way, untimed, chosen])
    assert "skinny at rows [4]" in line and "also won at rows [1]," in line

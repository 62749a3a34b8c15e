"""The skinny decode GEMM on CUDA (unifiedserve/ops/skinny.py), against the native norm kernel, cuBLAS and csrc's
rotary_cache on the 7B's shapes: every config and epilogue, graphs, and tune() on real weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.unifiedserve.ops.skinny_reference import HAVE_TRITON
from unifiedserve.ops import reference, skinny

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

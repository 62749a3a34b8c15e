"""Segment (window/full) attention of the vision tower: the fused implementations vs the grouped
CPU path, selection and errors, and the tower with each implementation."""

from __future__ import annotations

import pytest
import torch

from unifiedserve.attention import varlen
from unifiedserve.attention.varlen import (VARLEN_IMPL_ENV, VARLEN_IMPLS, default_varlen_impl, fused_varlen_attention,
                                           padded_layout, resolve_varlen_impl)
from unifiedserve.model.config import VisionConfig
from unifiedserve.model.vision import VisionTower, varlen_attention, vision_layout

SEGMENTS = (64, 64, 32, 64, 16, 8, 64, 48)


def _qkv(n, heads=2, dim=16, seed=0, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, heads, dim, generator=g).to(device, dtype) for _ in range(3)]


def _segment_reference(q, k, v, seq_lens, scale):
    """One dense softmax per segment, in float64."""
    out, start = [], 0
    for n in seq_lens:
        qs, ks, vs = (x[start:start + n].double() for x in (q, k, v))
        out.append(torch.einsum("qhk,khd->qhd", torch.einsum("qhd,khd->qhk", qs, ks).mul(scale).softmax(-1), vs))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("impl", ["grouped", "padded"])
def test_cpu_implementations_match_reference(impl):
    q, k, v = _qkv(sum(SEGMENTS))
    out = varlen_attention(q, k, v, SEGMENTS, 0.25, impl)
    torch.testing.assert_close(out.double(), _segment_reference(q, k, v, SEGMENTS, 0.25), atol=1e-5, rtol=1e-5)


def test_padded_layout_maps_rows_back_in_order():
    gather, valid, rows = padded_layout((3, 1, 2), torch.device("cpu"))
    assert gather.tolist() == [[0, 1, 2], [3, 0, 0], [4, 5, 0]]
    assert valid.tolist() == [[True] * 3, [True, False, False], [True, True, False]]
    assert rows.tolist() == [0, 1, 2, 3, 6, 7]


def test_auto_is_grouped_on_cpu_and_names_are_checked():
    assert resolve_varlen_impl("auto", torch.device("cpu"), torch.bfloat16) == "grouped"
    assert resolve_varlen_impl("padded", torch.device("cpu"), torch.float32) == "padded"
    with pytest.raises(ValueError, match="choose one of auto, grouped, padded, flashinfer, varlen"):
        resolve_varlen_impl("flash", torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="flashinfer vision attention needs CUDA"):
        resolve_varlen_impl("flashinfer", torch.device("cpu"), torch.bfloat16)
    with pytest.raises(ValueError, match="varlen vision attention needs CUDA, float16/bfloat16 and torch >= 2.9"):
        resolve_varlen_impl("varlen", torch.device("cpu"), torch.bfloat16)
    q, k, v = _qkv(10)
    with pytest.raises(ValueError, match="cover 10 rows"):
        fused_varlen_attention(q, k, v, (4, 4), 0.25, "padded")


TOWER_CONFIG = VisionConfig(depth=3, hidden_size=64, num_heads=2, intermediate_size=96, out_hidden_size=48,
                            fullatt_block_indexes=(1,))


def test_tower_default_is_the_grouped_path_exactly():
    """``auto`` on CPU runs the grouped path: the same tokens as selecting it by name."""
    torch.manual_seed(0)
    tower = VisionTower(TOWER_CONFIG).eval()
    grids = [(2, 10, 18), (1, 4, 6)]
    patches = torch.randn(sum(t * h * w for t, h, w in grids), TOWER_CONFIG.patch_dim,
                          generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        auto = tower(patches, grids)
        tower.set_attention_impl("grouped")
        grouped = tower(patches, grids)
        tower.set_attention_impl("padded")
        padded = tower(patches, grids)
    assert torch.equal(auto, grouped)
    torch.testing.assert_close(padded, grouped, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="unknown vision attention implementation 'sdpa'"):
        tower.set_attention_impl("sdpa")


@pytest.mark.cuda
@pytest.mark.parametrize("impl", ["padded", "flashinfer", "varlen"])
def test_cuda_implementations_match_grouped(impl):
    if impl == "flashinfer":
        pytest.importorskip("flashinfer")
    if impl == "varlen" and varlen.torch_varlen_attn() is None:
        pytest.skip(f"torch {torch.__version__} has no torch.nn.attention.varlen")
    layout = vision_layout(((2, 32, 56),), 2, 4)
    for seq_lens in (layout.window_lens, layout.frame_lens):
        q, k, v = _qkv(sum(seq_lens), heads=16, dim=80, seed=3, dtype=torch.bfloat16, device="cuda")
        out = varlen_attention(q, k, v, seq_lens, 80 ** -0.5, impl)
        expected = varlen_attention(q, k, v, seq_lens, 80 ** -0.5, "grouped")
        torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)


@pytest.mark.cuda
def test_cuda_varlen_takes_the_fused_qkv_views_without_copies():
    """The tower hands q/k/v as strided views of one [N, 3, H, D] output: the kernel reads them in place."""
    if varlen.torch_varlen_attn() is None:
        pytest.skip(f"torch {torch.__version__} has no torch.nn.attention.varlen")
    lens = vision_layout(((2, 16, 24),), 2, 4).window_lens
    g = torch.Generator(device="cuda").manual_seed(5)
    qkv = torch.randn(sum(lens), 3, 16, 80, generator=g, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.unbind(1)  # [N, H, D] each, row stride 3 * H * D
    assert not q.is_contiguous()
    out = varlen_attention(q, k, v, lens, 80 ** -0.5, "varlen")
    expected = _segment_reference(q, k, v, lens, 80 ** -0.5)
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)


def test_impl_names_are_listed():
    assert VARLEN_IMPLS == ("auto", "grouped", "padded", "flashinfer", "varlen")


def test_default_impl_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(VARLEN_IMPL_ENV, raising=False)
    assert default_varlen_impl() == "auto"
    monkeypatch.setenv(VARLEN_IMPL_ENV, " padded ")
    assert default_varlen_impl() == "padded"
    tower = VisionTower(TOWER_CONFIG)
    assert {block.attn.attention_impl for block in tower.blocks} == {"padded"}
    monkeypatch.setenv(VARLEN_IMPL_ENV, "fa3")
    with pytest.raises(ValueError, match=f"{VARLEN_IMPL_ENV}: unknown vision attention implementation 'fa3'"):
        VisionTower(TOWER_CONFIG)


def _fake_varlen(calls, takes_scale):
    """Stands in for torch's varlen_attn (CUDA only): records the call, attends per segment from the offsets."""

    def run(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs):
        assert cu_q is cu_k and cu_q.dtype == torch.int32
        lens = cu_q.diff().tolist()
        assert cu_q[0] == 0 and max_q == max_k == max(lens)
        calls.append(dict(lens=lens, strides=(q.stride(), k.stride(), v.stride()), **kwargs))
        scale = kwargs.get("scale", q.shape[2] ** -0.5)
        return _segment_reference(q, k, v, lens, scale).to(q.dtype)

    if takes_scale:
        return lambda q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None: run(q, k, v, cu_q, cu_k, max_q, max_k,
                                                                                 scale=scale)
    return lambda q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False: run(q, k, v, cu_q, cu_k, max_q, max_k)


@pytest.mark.parametrize("takes_scale", [True, False])
def test_torch_varlen_path_passes_offsets_scale_and_views(monkeypatch, takes_scale):
    calls: list[dict] = []
    monkeypatch.setattr(varlen, "torch_varlen_attn", lambda: _fake_varlen(calls, takes_scale))
    qkv = torch.randn(sum(SEGMENTS), 3, 2, 16, generator=torch.Generator().manual_seed(6))
    q, k, v = qkv.unbind(1)  # strided views, as the tower passes them
    for _ in range(2):  # two layers: one offsets tensor, built once
        out = fused_varlen_attention(q, k, v, SEGMENTS, 0.25, "varlen")
    torch.testing.assert_close(out.double(), _segment_reference(q, k, v, SEGMENTS, 0.25), atol=1e-5, rtol=1e-5)
    assert [c["lens"] for c in calls] == [list(SEGMENTS)] * 2
    assert calls[0]["strides"][0] == (3 * 2 * 16, 16, 1)  # no copy made of the views
    assert [c.get("scale") for c in calls] == ([0.25] * 2 if takes_scale else [None] * 2)
    if not takes_scale:  # torch 2.9's varlen_attn scales by head_dim ** -0.5 only
        with pytest.raises(ValueError, match=r"only scales by head_dim \*\* -0.5, asked for 0.3"):
            fused_varlen_attention(q, k, v, SEGMENTS, 0.3, "varlen")
    monkeypatch.setattr(varlen, "torch_varlen_attn", lambda: None)
    with pytest.raises(ValueError, match="needs torch >= 2.9"):
        fused_varlen_attention(q, k, v, SEGMENTS, 0.25, "varlen")


class _FakeRagged:
    """Stands in for flashinfer's ragged prefill wrapper: records the plan, attends per segment."""

    planned: list[dict] = []

    backends: list[str] = []

    def __init__(self, workspace, kv_layout="NHD", backend="auto"):
        assert kv_layout == "NHD"
        _FakeRagged.backends.append(backend)

    def plan(self, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk, causal=False, sm_scale=None,
             q_data_type=None, kv_data_type=None):
        assert torch.equal(qo_indptr, kv_indptr) and qo_indptr.dtype == torch.int32 and not causal
        self.args = dict(lens=qo_indptr.diff().tolist(), heads=(num_qo_heads, num_kv_heads), dim=head_dim_qk,
                         scale=sm_scale, dtype=q_data_type)
        _FakeRagged.planned.append(self.args)

    def run(self, q, k, v):
        assert q.shape[2] == self.args["dim"] and q.dtype == self.args["dtype"]
        return _segment_reference(q, k, v, self.args["lens"], self.args["scale"]).to(q.dtype)


def test_flashinfer_path_pads_head_dim_80_and_plans_once(monkeypatch):
    import types

    from unifiedserve.attention import flashinfer_backend as fib
    from unifiedserve.attention import varlen

    monkeypatch.setattr(fib, "import_flashinfer",
                        lambda: types.SimpleNamespace(BatchPrefillWithRaggedKVCacheWrapper=_FakeRagged))
    monkeypatch.setattr(fib, "WORKSPACE_BYTES", 1024)
    monkeypatch.setattr(varlen, "_PLANS", varlen.OrderedDict())
    monkeypatch.setattr(varlen, "_WORKSPACES", {})
    monkeypatch.setattr(_FakeRagged, "planned", [])
    monkeypatch.setattr(_FakeRagged, "backends", [])
    monkeypatch.setenv("UNIFIEDSERVE_FLASHINFER_PREFILL_BACKEND", "fa2")
    q, k, v = _qkv(sum(SEGMENTS), heads=2, dim=80, seed=4)
    for _ in range(3):  # three layers, one plan
        out = fused_varlen_attention(q, k, v, SEGMENTS, 80 ** -0.5, "flashinfer")
    assert out.shape == q.shape
    torch.testing.assert_close(out.double(), _segment_reference(q, k, v, SEGMENTS, 80 ** -0.5), atol=1e-5, rtol=1e-5)
    assert _FakeRagged.planned == [dict(lens=list(SEGMENTS), heads=(2, 2), dim=128, scale=80 ** -0.5,
                                        dtype=torch.float32)]
    assert _FakeRagged.backends == ["fa2"]  # the prefill-backend knob reaches the ragged wrapper
    big = _qkv(8, dim=300)
    with pytest.raises(ValueError, match="head dims up to 256, got 300"):
        fused_varlen_attention(*big, (8,), 0.1, "flashinfer")

"""Segment (window/full) attention of the vision tower: the fused implementations vs the grouped
CPU path, selection and errors, and the tower with each implementation."""

from __future__ import annotations

import pytest
import torch

from unifiedserve.attention.varlen import (VARLEN_IMPLS, fused_varlen_attention, padded_layout,
                                           resolve_varlen_impl)
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
    with pytest.raises(ValueError, match="choose one of auto, grouped, padded, flashinfer"):
        resolve_varlen_impl("flash", torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="flashinfer vision attention needs CUDA"):
        resolve_varlen_impl("flashinfer", torch.device("cpu"), torch.bfloat16)
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
@pytest.mark.parametrize("impl", ["padded", "flashinfer"])
def test_cuda_implementations_match_grouped(impl):
    if impl == "flashinfer":
        pytest.importorskip("flashinfer")
    layout = vision_layout(((2, 32, 56),), 2, 4)
    for seq_lens in (layout.window_lens, layout.frame_lens):
        q, k, v = _qkv(sum(seq_lens), heads=16, dim=80, seed=3, dtype=torch.bfloat16, device="cuda")
        out = varlen_attention(q, k, v, seq_lens, 80 ** -0.5, impl)
        expected = varlen_attention(q, k, v, seq_lens, 80 ** -0.5, "grouped")
        torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)


def test_impl_names_are_listed():
    assert VARLEN_IMPLS == ("auto", "grouped", "padded", "flashinfer")


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

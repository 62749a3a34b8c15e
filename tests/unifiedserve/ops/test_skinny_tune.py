"""tune(), the skinny decode GEMM's choice per shape and row count (unifiedserve/ops/skinny.py): with a stand-in
kernel (no interpreter), under Triton's interpreter with fake timings, its start-up summary, and a bfloat16 decoder
routed through the kernels it keeps. Q/K/V's forms with the norm and rotary: test_skinny_tune_qkv.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.unifiedserve.ops.skinny_reference import fake_timer, needs_triton, run_interpreted
from unifiedserve.ops import reference, skinny


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
    from tests.unifiedserve.ops.skinny_reference import fake_timer
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


MODEL = """
    import os, sys, torch
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, {root!r})
    from unifiedserve import ops
    from unifiedserve.ops import skinny
    from unifiedserve.attention import AttentionMetadata, KVCache, TorchPagedAttention
    from unifiedserve.model.config import TextConfig
    from unifiedserve.model.llm import LanguageModel
    from tests.unifiedserve.ops.skinny_reference import fake_timer
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

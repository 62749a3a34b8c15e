"""tune() for Q/K/V and gate/up with the add + RMSNorm folded in, and for Q/K/V with rotary and the K/V write in
its epilogue (after the norm kernel or with the norm in front), under Triton's interpreter with fake timings."""

from __future__ import annotations

from tests.unifiedserve.ops.skinny_reference import needs_triton, run_interpreted


QKV_TUNE_SETUP = """
    import os, sys, torch
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, {root!r})
    from unifiedserve.ops import reference, skinny
    from tests.unifiedserve.ops.skinny_reference import expected_norm, fake_timer, rope_reference
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

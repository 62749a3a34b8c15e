"""bench/engine: FLOP and byte counts against hand-computed values, and a tiny CPU run end to end."""

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "engine"))

import engine_metrics as em  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from unifiedserve.model.demo import write_demo_model
    from unifiedserve.model.loader import load_model

    path = tmp_path_factory.mktemp("demo")
    write_demo_model(path)
    return load_model(path, torch.float32, "cpu")[0]


def test_prefill_flops(model):
    t = model.config.text
    per_layer = (t.hidden_size * (t.num_attention_heads + 2 * t.num_key_value_heads) * t.head_dim  # qkv
                 + t.num_attention_heads * t.head_dim * t.hidden_size  # o
                 + 3 * t.hidden_size * t.intermediate_size)  # gate, up, down
    expected = 2 * per_layer * t.num_hidden_layers * 100 + 2 * t.num_hidden_layers * t.num_attention_heads * \
        t.head_dim * 100 ** 2
    assert em.prefill_flops(t, model.language_model.layers, 100) == pytest.approx(expected)


def test_vit_flops(model):
    v = model.config.vision
    grid = [(2, 8, 12)]
    p = 2 * 8 * 12
    d = v.hidden_size
    per_patch = 4 * d * d + 3 * d * v.intermediate_size  # qkv + proj, gate/up/down
    merged = d * v.spatial_merge_size ** 2
    merger = merged * merged + merged * v.out_hidden_size
    window = min((v.window_size // v.patch_size) ** 2, 96)
    full = len(v.fullatt_block_indexes)
    attention = 4 * d * p * ((v.depth - full) * window + full * 96)
    patch_dim = 3 * v.temporal_patch_size * v.patch_size ** 2
    expected = 2 * (v.depth * per_patch * p + patch_dim * d * p + merger * p / v.spatial_merge_size ** 2) + attention
    assert em.vit_flops(v, model.visual, grid) == pytest.approx(expected)


def test_vit_flops_count_the_checkpoints_widths_not_the_padding(model):
    import copy

    padded = copy.deepcopy(model.visual)
    assert padded.align_mlp(64) != model.config.vision.intermediate_size
    grid = [(2, 8, 12)]
    assert em.vit_flops(model.config.vision, padded, grid) == em.vit_flops(model.config.vision, model.visual, grid)


def test_vision_split_times_a_padded_mlp_at_both_widths(model):
    import copy

    tower = copy.deepcopy(model.visual)
    width = tower.config.intermediate_size
    x = torch.randn(5, tower.config.hidden_size)
    with torch.no_grad():
        before = tower.blocks[0].mlp(x)
        tower.align_mlp(64)
        cut = em._unpadded_mlp(tower.blocks[0].mlp, width)  # the checkpoint's function, at its width
        assert cut.intermediate_size == width and cut.down_proj.weight.shape[1] == width
        torch.testing.assert_close(cut(x), before, atol=1e-6, rtol=0)
        grid = [(2, 8, 12)]
        patches = torch.randn(2 * 8 * 12, tower.config.patch_dim)
        split = em.vision_split(tower, patches, grid, torch.device("cpu"), repeats=1)
    assert split["mlp_width"] == tower.blocks[0].mlp.intermediate_size > width
    assert split["mlp_checkpoint_width_ms"] > 0 and split["mlp_ms"] > 0
    unpadded = em.vision_split(model.visual, patches, grid, torch.device("cpu"), repeats=1)
    assert unpadded["mlp_width"] == width and "mlp_checkpoint_width_ms" not in unpadded


def test_summarize_kernels_by_kind_with_overlap_and_gaps():
    kernels = [  # two calls of: a GEMM, attention overlapping it by 2 us, a norm after a 3 us gap
        ("nvjet_tst_128x64_64x4_1x1_v_bz_TNT", 0.0, 10.0),
        ("void flashinfer::BatchDecodeWithPagedKVCacheKernel<...>", 8.0, 12.0),
        ("void fused_add_rms_norm_kernel<c10::BFloat16>(...)", 15.0, 16.0),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", 100.0, 110.0),
        ("void flashinfer::BatchDecodeWithPagedKVCacheKernel<...>", 108.0, 112.0),
        ("void rms_norm_kernel<c10::BFloat16>(...)", 115.0, 116.0),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::direct_copy_kernel_cuda...>", 116.0, 117.0),
        ("some_unknown_kernel", 117.0, 117.5),
    ]
    s = em.summarize_kernels(kernels, calls=2, top=3)
    assert s["kinds"]["gemm"] == {"us": 10.0, "count": 1.0}
    assert s["kinds"]["attention"] == {"us": 4.0, "count": 1.0}
    assert s["kinds"]["norm/rotary/act"] == {"us": 1.0, "count": 1.0}
    assert s["kinds"]["copy/index"]["us"] == 0.5 and s["kinds"]["other"]["us"] == 0.25
    assert list(s["kinds"])[0] == "gemm"  # costliest first
    assert s["busy_us"] == pytest.approx((12 + 1 + 12 + 1 + 1 + 0.5) / 2)  # the overlap counted once
    assert s["span_us"] == pytest.approx(117.5 / 2) and s["kernels_per_call"] == 4
    assert [k["kind"] for k in s["top"]] == ["gemm", "gemm", "attention"]  # by name: each GEMM 5 us a call
    assert s["top"][2]["us"] == 4.0 and s["top"][2]["count"] == 1.0
    line = em.format_kernels(s)
    assert line.startswith("gemm 10.0 (1), attention 4.0 (1)") and "copy/index 0.5 (0.5)" in line
    assert line.endswith("busy 13.8 of 58.8 us (4 kernels)")
    assert em.format_kernels({"error": "the profiler recorded no kernel"}) == "the profiler recorded no kernel"
    assert em.kernel_kind("skinny_kernel") == "gemm"  # the Triton decode GEMM (unifiedserve/ops/skinny_kernel.py)
    with pytest.raises(ValueError, match="calls"):
        em.summarize_kernels(kernels, calls=0)
    with pytest.raises(ValueError, match="CUDA"):
        em.kernel_profile(lambda: None, torch.device("cpu"))


@pytest.mark.cuda
def test_cuda_kernel_profile_sees_a_graph_replays_kernels(tmp_path):
    """CUPTI records the kernels inside a decode graph's replay, and the kinds name the GEMMs and attention."""
    pytest.importorskip("flashinfer")  # the attention group's run (the decode group's wheels have none)
    from unifiedserve.engine import LLM, EngineConfig, SamplingParams
    from unifiedserve.model.demo import write_demo_model

    engine = LLM(write_demo_model(tmp_path / "demo"), EngineConfig(device="cuda", num_kv_blocks=64,
                                                                    max_cuda_graph_batch=2))
    engine.generate([([5, 6, 7, 8], [], SamplingParams(max_tokens=3, ignore_eos=True))])  # prepares a 1-seq step
    with torch.inference_mode():
        s = em.kernel_profile(engine.runner.graphs.graph_for(1).replay, torch.device("cuda"), calls=3)
    if s.get("error", "").startswith("the profiler failed"):
        pytest.skip(s["error"])  # the machine refuses CUPTI: a platform fact, said in the skip reason
    assert "error" not in s, s  # the profiler ran but saw no kernel in the replay
    assert s["kinds"]["gemm"]["count"] >= engine.model_config.text.num_hidden_layers * 4  # qkv, o, gate_up, down
    assert s["kinds"]["attention"]["count"] >= engine.model_config.text.num_hidden_layers
    assert 0 < s["busy_us"] <= s["span_us"]


def test_decode_bytes(model):
    t = model.config.text
    lm = model.language_model
    all_weights = sum(p.numel() for p in lm.parameters()) * 4
    kv = 3 * 50 * t.num_hidden_layers * 2 * t.num_key_value_heads * t.head_dim * 4
    table = lm.tok_embeddings.weight.numel() * 4
    gathered = 3 * t.hidden_size * 4
    expected = all_weights + kv if lm.lm_head is None else all_weights - table + gathered + kv
    assert em.decode_bytes(model, 3, 50) == expected


def test_peak_tflops():
    assert em.peak_tflops(torch.device("cpu"), "float32", 123.0) == (123.0, "--peak-tflops")
    peak, why = em.peak_tflops(torch.device("cpu"), "float32", None)
    assert peak is None and "--peak-tflops" in why


@pytest.mark.slow
def test_bench_engine_runs_on_cpu(tmp_path):
    import bench_engine

    out = tmp_path / "engine.json"
    assert bench_engine.main(["--device", "cpu", "--batches", "1,2", "--prefill-tokens", "32", "--new-tokens", "3",
                              "--slices", "1", "--repeats", "1", "--prompt-tokens", "8", "--agreement-steps", "24",
                              "--prefill-chunk", "12", "--async-scheduling", "both", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    r = report["results"]
    assert report["config"]["dtype"] == "float32" and report["machine"]["device"] == "cpu"
    assert r["correctness"]["greedy_agreement"] == 1.0 and r["correctness"]["prefill_logits_cosine"] > 0.999
    # float32: every greedy token is transformers' top-1 on the same sequence, logits all but identical
    assert r["correctness"]["agreement_steps"] == 24 and r["correctness"]["top1_agreement"] == 1.0
    assert r["correctness"]["logits_cosine_min"] > 0.9999
    # the 32-token prompt prefilled in chunks of 12, 12, 8 (each over the pages before it) = transformers'
    assert r["prefill"]["chunk"] == 12 and r["correctness"]["chunked_prefill_logits_cosine"] > 0.99999
    assert set(r["decode"]) == {"1", "2"} and all(d["ours_tokens_per_s"] > 0 for d in r["decode"].values())
    assert all(d["async_step_ms"] > 0 and d["graph_replay_ms"] is None for d in r["decode"].values())
    assert r["prefill"]["tokens"] == 32 and r["vision"]["patches"] == 28 * 52
    split = r["vision"]["split"]  # the tower with each attention kernel, and its parts alone
    assert split["attention_impl"] == "grouped" and isinstance(split["tower_ms"]["grouped"], float)
    assert isinstance(split["tower_ms"]["padded"], float) and "flashinfer" in split["tower_ms"]["flashinfer"]
    assert all(split[k] > 0 for k in ("mlp_ms", "attn_linears_ms", "attention_window_ms", "attention_full_ms"))
    assert "other_ms" in split
    assert "ours_mfu" not in r["prefill"]  # no peak known for a CPU
    assert r["correctness_failed"] == []


@pytest.mark.slow
def test_bench_engine_times_only_the_parts_asked_and_a_failed_check_still_times(tmp_path, monkeypatch, capsys):
    """--parts decode: no prefill or vision timing; a correctness check that fails (here: a cosine bound no
    model meets) is recorded, the timings still run and are saved, and the exit status is 1."""
    import bench_engine

    monkeypatch.setattr(bench_engine, "MIN_COSINE", 1.5)
    out = tmp_path / "engine.json"
    assert bench_engine.main(["--device", "cpu", "--batches", "1", "--new-tokens", "3", "--slices", "1",
                              "--prompt-tokens", "8", "--agreement-steps", "0", "--parts", "decode",
                              "--penalties", "--out", str(out)]) == 1
    r = json.loads(out.read_text())["results"]
    assert set(r["decode"]) == {"1"} and "prefill" not in r and "vision" not in r
    assert r["penalties"]["1"]["ratio"] > 0 and r["penalties"]["1"]["steps_timed"] >= 1
    assert [f.split(" ")[0] for f in r["correctness_failed"]] == ["prefill", "vision"]
    assert "read them as unverified" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_engine.parse_args(["--parts", "decode,training"])
    with pytest.raises(SystemExit):
        bench_engine.parse_args(["--parts", "prefill", "--penalties"])
    with pytest.raises(SystemExit):
        bench_engine.parse_args(["--profile-steps", "1"])


def test_async_steps_are_profiled_overlapped_and_every_request_finishes(tmp_path, monkeypatch):
    """The step profile (CUDA only; its step loop here with the profiler stood in for): the requests have their
    first token and run overlapped before the profiled steps, no request ends inside them, and all finish after."""
    import decode_overhead
    import step_trace

    from unifiedserve.engine.llm import LLM, EngineConfig
    from unifiedserve.model.demo import write_demo_model

    write_demo_model(tmp_path)
    engine = LLM(tmp_path, EngineConfig(num_kv_blocks=64))
    seen = []

    def fake_profile(step, device, steps):
        for _ in range(steps):
            seen.append((engine.core.async_scheduling, engine.core._pending is not None,
                         sorted(len(r.output_token_ids) for r in engine.scheduler.requests.values())))
            step()
        return {"between_us": 1.0}

    monkeypatch.setattr(step_trace, "profile_steps", fake_profile)
    summary = decode_overhead._trace_async_steps(engine, [[11, 12, 13], [14, 15, 16, 17]], 9, 4, torch.device("cpu"))
    assert summary == {"between_us": 1.0} and len(seen) == 4
    assert all(overlapped and pending and len(counts) == 2 for overlapped, pending, counts in seen)
    assert not engine.has_unfinished
    assert engine.pool_usage() == {"kv_blocks_used": 0, "patch_pages_used": 0, "visual_pages_used": 0}


@pytest.mark.slow
def test_bench_multiturn_runs_and_the_answer_is_cached(tmp_path):
    import bench_multiturn

    out = tmp_path / "multiturn.json"
    assert bench_multiturn.main(["--answer-tokens", "40", "--repeats", "1", "--video-seconds", "2",
                                 "--out", str(out)]) == 0
    r = json.loads(out.read_text())["results"]
    cached, prompt_only, off = (r[m][0] for m in bench_multiturn.MODES)
    prompt = cached["turn_two_tokens"] - 40 - 12  # turn two: turn one's prompt, the answer, 12 tokens of question
    # from the cache: the full blocks of the prompt and the answer but its last token; prompt only: the prompt's
    assert cached["cached_tokens"] == (prompt + 39) // 16 * 16
    assert prompt_only["cached_tokens"] == prompt // 16 * 16 and off["cached_tokens"] == 0


def test_bf16_agreement_is_read_against_float32_transformers_and_its_weights_come_back_exact(tmp_path):
    """In bf16 the long agreement also reads both models' top-1 against transformers in float32 (the reference's own
    bf16 flips beside ours); the upcast is undone exactly: every parameter and buffer has its dtype and bits back."""
    import engine_parity
    from transformers import Qwen2_5_VLForConditionalGeneration

    from unifiedserve.engine.llm import LLM, EngineConfig
    from unifiedserve.engine.runner import forward_tokens
    from unifiedserve.model.demo import write_demo_model

    write_demo_model(tmp_path)
    engine = LLM(tmp_path, EngineConfig(dtype="bfloat16", num_kv_blocks=64))
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    before = {n: t.clone() for n, t in list(hf.named_parameters()) + list(hf.named_buffers())}
    r = engine_parity._long_agreement(engine, engine.model, engine.runner, hf, list(range(20, 36)), 12,
                                      torch.device("cpu"), forward_tokens)
    after = dict(list(hf.named_parameters()) + list(hf.named_buffers()))
    assert before.keys() == after.keys()
    assert all(after[n].dtype == t.dtype and torch.equal(after[n], t) for n, t in before.items())
    assert r["agreement_steps"] == 12 and 0 <= r["top1_agreement"] <= 1
    assert 0 <= r["top1_vs_float32"] <= 1 and 0 <= r["transformers_top1_vs_float32"] <= 1
    wrong = round((1 - r["top1_vs_float32"]) * 12)
    assert len(r["tie_margins"]) == wrong and all(m >= 0 for m in r["tie_margins"]) and r["median_margin"] >= 0
    hf32 = Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.float32).eval()
    engine32 = LLM(tmp_path, EngineConfig(num_kv_blocks=64))
    r32 = engine_parity._long_agreement(engine32, engine32.model, engine32.runner, hf32, list(range(20, 36)), 4,
                                        torch.device("cpu"), forward_tokens)
    assert "top1_vs_float32" not in r32  # float32 already: no second reference

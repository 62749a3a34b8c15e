"""``serve --gpu-memory-utilization``: the KV pool sized from a profile before any worker starts
(``runtime/memory_plan.py``). The arithmetic, the flags and the child process's error path run here; the
profile itself, and a server that stays inside its share, run on a GPU (``cuda``)."""

from __future__ import annotations

import pytest
import torch

from unifiedserve.engine.config import EngineConfig
from unifiedserve.engine.profile import MemoryProfile
from unifiedserve.engine.scheduler import SchedulerConfig
from unifiedserve.runtime import memory_plan
from unifiedserve.runtime.memory_plan import VISION_DECODER_GB, plan_server_kv, profile_budgets, profile_in_child

GiB = 2**30
MiB = 2**20


def _profile(**kw) -> MemoryProfile:
    figures = dict(total=80 * GiB, non_torch=3 * GiB, weights=16 * GiB, activations=2 * GiB,
                   buffers=3 * GiB, bytes_per_block=MiB, decode=GiB)
    figures.update(kw)
    return MemoryProfile(**figures)


def test_the_kv_pool_gets_what_every_process_leaves():
    # 80 x 0.9 = 72; before 2; weights 16; core 3 + 2 + media 1; decode 1; vision 2 + allowance;
    # contexts: the child held 3 beside torch, 2 of them there before it: 1 each for 3 workers
    sizing = plan_server_kv(_profile(), 0.9, 2 * GiB, media_cache_bytes=GiB, vision_ahead_bytes=2 * GiB,
                            num_contexts=3, decode_here=True)
    left = 72 * GiB - 2 * GiB - 16 * GiB - 6 * GiB - GiB - (2 * GiB + int(VISION_DECODER_GB * GiB)) - 3 * GiB
    assert sizing.num_blocks == left // MiB and sizing.kv_bytes == left
    assert (sizing.core, sizing.decode, sizing.contexts, sizing.num_contexts) == (6 * GiB, GiB, 3 * GiB, 3)
    text = sizing.describe()
    for part in ("x --gpu-memory-utilization 0.90", "in use before 2.00", "weights 16.00", "core 6.00",
                 "decode 1.00", "3 contexts 3.00"):
        assert part in text, text


def test_a_decode_runner_elsewhere_and_fewer_workers_leave_more():
    here = plan_server_kv(_profile(), 0.9, 2 * GiB, media_cache_bytes=0, vision_ahead_bytes=0, num_contexts=3,
                          decode_here=True)
    away = plan_server_kv(_profile(), 0.9, 2 * GiB, media_cache_bytes=0, vision_ahead_bytes=0, num_contexts=2,
                          decode_here=False)
    assert away.kv_bytes - here.kv_bytes == GiB + GiB  # decode's figure and one context
    with pytest.raises(ValueError, match="no decode figure"):
        plan_server_kv(_profile(decode=None), 0.9, 0, media_cache_bytes=0, vision_ahead_bytes=0, num_contexts=1,
                       decode_here=True)


def test_memory_freed_by_others_during_the_profile_never_counts_negative():
    sizing = plan_server_kv(_profile(non_torch=GiB), 0.9, 2 * GiB, media_cache_bytes=0, vision_ahead_bytes=0,
                            num_contexts=3, decode_here=True)
    assert sizing.contexts == 0


@pytest.mark.parametrize("utilization", [0.0, -0.5, 1.5])
def test_a_share_outside_zero_to_one_is_refused(utilization):
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        plan_server_kv(_profile(), utilization, 0, media_cache_bytes=0, vision_ahead_bytes=0, num_contexts=3,
                       decode_here=True)


def test_no_room_names_every_figure_and_the_flags_to_change():
    with pytest.raises(ValueError) as e:
        plan_server_kv(_profile(), 0.3, 2 * GiB, media_cache_bytes=0, vision_ahead_bytes=0, num_contexts=3,
                       decode_here=True)
    text = str(e.value)
    assert text.startswith("--gpu-memory-utilization: no room for the KV cache")
    assert "weights 16.00" in text and "--patch-buffer-gb" in text and "--kv-cache-gb" in text


def test_budgets_profiled_are_the_largest_core_may_use():
    from unifiedserve.runtime.budget import ALPHA_RANGE, TAU_RANGE

    base = SchedulerConfig(prefill_token_budget=512, encode_token_budget=4096)
    assert profile_budgets(base, None, {}) is base
    derived = profile_budgets(base, 50.0, {})  # core derives its budgets from the SLO at start-up: up to the range
    assert (derived.prefill_token_budget, derived.encode_token_budget) == (TAU_RANGE[1], ALPHA_RANGE[1])
    kept = profile_budgets(base, 50.0, {"encode_token_budget": 2048})  # an explicit flag wins over the derivation
    assert (kept.prefill_token_budget, kept.encode_token_budget) == (TAU_RANGE[1], 2048)


def test_the_child_reports_its_failure_in_one_line(demo_path):
    engine = EngineConfig(device="cpu", num_kv_blocks=8)
    with pytest.raises(RuntimeError) as e:  # an empty CUDA_VISIBLE_DEVICES: no GPU, even on a machine with one
        profile_in_child(demo_path, engine, {"CUDA_VISIBLE_DEVICES": ""}, decode_batch=4, graph_batch=None,
                         timeout=120)
    text = str(e.value)
    assert text.startswith("memory profile for --gpu-memory-utilization failed: ") and "\n" not in text


def test_zero_model_has_the_checkpoints_shapes_and_reads_nothing(demo_path, tmp_path):
    import shutil

    from unifiedserve.model.loader import load_model, zero_model

    shutil.copy(f"{demo_path}/config.json", tmp_path / "config.json")  # a folder with no weights at all
    zero, _ = zero_model(tmp_path, torch.bfloat16, "cpu")
    loaded, _ = load_model(demo_path, torch.bfloat16, "cpu")
    shapes = {n: (tuple(p.shape), p.dtype) for n, p in loaded.named_parameters()}
    assert {n: (tuple(p.shape), p.dtype) for n, p in zero.named_parameters()} == shapes
    assert all(not p.any() for p in zero.parameters())


def test_the_server_refuses_conflicting_or_misplaced_flags(monkeypatch):
    import argparse

    from unifiedserve.server import serve_setup
    from unifiedserve.server.serve_flags import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    with pytest.raises(ValueError, match="applies to a CUDA server"):
        serve_setup.build_runtime(p.parse_args(["--device", "cpu", "--gpu-memory-utilization", "0.9"]))
    monkeypatch.setattr("unifiedserve.engine.device.resolve_device", lambda device: "cuda")  # checks before any GPU
    for extra in (["--kv-cache-gb", "4"], ["--num-kv-blocks", "100"]):
        with pytest.raises(ValueError, match="not both"):
            serve_setup.build_runtime(p.parse_args(["--gpu-memory-utilization", "0.9", *extra]))
    with pytest.raises(ValueError, match=r"must be in \(0, 1\], got 1.5"):
        serve_setup.build_runtime(p.parse_args(["--gpu-memory-utilization", "1.5"]))


@pytest.mark.cuda
def test_the_profile_measures_every_figure_on_the_gpu(demo_path):
    from unifiedserve.runtime.config import PoolBudgets
    from unifiedserve.runtime.gpu_placement import ProcessPlacement

    engine = EngineConfig(device="cuda", dtype="bfloat16")
    env = ProcessPlacement(0, None).env(use_mps=False)  # GPU 0 of the ones this process sees
    sizing = memory_plan.size_server_kv(demo_path, engine, PoolBudgets(), utilization=0.5, gpu=0,
                                        process_env={"vision": env, "core": env, "decode": env},
                                        vision_ahead_gb=0.5)
    assert sizing.num_blocks > 0 and sizing.weights > 0 and sizing.core > 0 and sizing.decode > 0
    assert sizing.contexts > 0  # the child's CUDA context and kernels, once per worker
    free, total = torch.cuda.mem_get_info()
    assert sizing.total == total and sizing.kv_bytes < total * 0.5

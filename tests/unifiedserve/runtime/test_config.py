"""The server's configuration tree refuses impossible values when built, before any process or pool exists;
it is frozen, and the engine's values live in one place (RuntimeConfig.engine, an EngineConfig)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from unifiedserve.engine.config import EngineConfig
from unifiedserve.engine.scheduler import SchedulerConfig
from unifiedserve.runtime.config import PoolBudgets, RuntimeConfig

BASE = dict(model="m", served_model_name="m")


@pytest.mark.parametrize("bad, match", [
    (dict(policy="bogus"), "policy must be one of"),
    (dict(max_model_len=-5), "max_model_len must be a positive integer"),
    (dict(default_max_tokens=0), "default_max_tokens must be a positive integer"),
    (dict(vision_threads=-1), "vision_threads must be >= 0"),
    (dict(max_video_seconds=0), "max_video_seconds must be positive"),
    (dict(tbt_slo_ms=0), "tbt_slo_ms must be positive"),
    (dict(nice={"cor": 5}), "unknown processes"),
    (dict(engine={"block_size": 4}), "engine must be an EngineConfig"),
    (dict(vision_device="gpu"), "vision_device must be one of auto, cpu, cuda"),
    (dict(vision_ahead_gb=float("nan")), "vision_ahead_gb must be a positive finite number"),
    (dict(vision_device="cuda"), "vision_device cuda \\(NVDEC\\) needs the server on CUDA"),
])
def test_bad_values_fail_at_construction(bad, match):
    with pytest.raises(ValueError, match=match):
        RuntimeConfig(**BASE, **bad)


@pytest.mark.parametrize("bad, match", [
    (dict(device="gpu"), "device must be one of auto, cpu, cuda"),
    (dict(device="cuda:x"), "device must be one of"),
    (dict(dtype="int8"), "dtype must be one of"),
    (dict(num_kv_blocks=0), "num_kv_blocks must be a positive integer"),
    (dict(page_size=2.5), "page_size must be a positive integer"),
    (dict(block_size=True), "block_size must be a positive integer"),
    (dict(media_cache_gb=-1.0), "media_cache_gb must be a finite number >= 0"),
    (dict(media_cache_gb=float("nan")), "media_cache_gb"),
    (dict(scheduler=SchedulerConfig), "scheduler must be a SchedulerConfig"),
])
def test_the_engines_values_are_checked_by_the_engine_config(bad, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**bad)


@pytest.mark.parametrize("bad, match", [
    (dict(max_decode_batch=0), "max_decode_batch must be at least 1"),
    (dict(prefill_token_budget=0), "prefill_token_budget must be at least 1"),
])
def test_scheduler_values(bad, match):
    with pytest.raises(ValueError, match=match):
        SchedulerConfig(**bad)


@pytest.mark.parametrize("bad, match", [
    (dict(kv_cache_gb=0), "kv_cache_gb must be a positive finite number"),
    (dict(patch_buffer_gb=float("inf")), "patch_buffer_gb"),
    (dict(num_kv_blocks=0), "num_kv_blocks must be a positive integer"),
])
def test_pool_budgets(bad, match):
    with pytest.raises(ValueError, match=match):
        PoolBudgets(**bad)


def test_good_values_and_frozen():
    engine = EngineConfig(num_kv_blocks=64, scheduler=SchedulerConfig(max_decode_batch=8))
    cfg = RuntimeConfig(**BASE, engine=engine, policy="split", torch_threads={"core": 2})
    assert cfg.processes == ("vision", "core", "decode")
    assert (cfg.engine.device, cfg.engine.dtype, cfg.engine.scheduler.max_decode_batch) == ("cpu", "float32", 8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.policy = "unified"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.engine.block_size = 4
    assert dataclasses.replace(cfg, policy="monolithic").processes == ("vision", "core")
    # the engine's fields are not repeated on the server's config
    shared = {f.name for f in dataclasses.fields(EngineConfig)} & {f.name for f in dataclasses.fields(RuntimeConfig)}
    assert shared == set()


def test_config_imports_no_torch():
    code = ("import sys, unifiedserve.runtime.config, unifiedserve.engine.config; "
            "assert 'torch' not in sys.modules, 'the config tree imported torch'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)

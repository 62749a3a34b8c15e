"""RuntimeConfig refuses impossible values when built, before any process or pool exists; it is frozen."""

from __future__ import annotations

import dataclasses

import pytest

from unifiedserve.runtime.config import RuntimeConfig

BASE = dict(model="m", served_model_name="m")


@pytest.mark.parametrize("bad, match", [
    (dict(policy="bogus"), "policy must be one of"),
    (dict(device="gpu"), "device must be"),
    (dict(device="cuda:x"), "device must be"),
    (dict(dtype="int8"), "dtype must be"),
    (dict(num_kv_blocks=0), "num_kv_blocks must be a positive integer"),
    (dict(max_model_len=-5), "max_model_len must be a positive integer"),
    (dict(page_size=2.5), "page_size must be a positive integer"),
    (dict(vision_threads=-1), "vision_threads must be >= 0"),
    (dict(max_video_seconds=0), "max_video_seconds must be positive"),
    (dict(tbt_slo_ms=0), "tbt_slo_ms must be positive"),
    (dict(media_cache_gb=-1.0), "media_cache_gb"),
    (dict(nice={"cor": 5}), "unknown processes"),
])
def test_bad_values_fail_at_construction(bad, match):
    with pytest.raises(ValueError, match=match):
        RuntimeConfig(**BASE, **bad)


def test_good_values_and_frozen():
    cfg = RuntimeConfig(**BASE, device="cuda:1", policy="split", torch_threads={"core": 2})
    assert cfg.processes == ("vision", "core", "decode")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.policy = "unified"
    assert dataclasses.replace(cfg, policy="monolithic").processes == ("vision", "core")

"""Helpers shared by the engine tests."""

from __future__ import annotations

from unifiedserve.engine.core import EngineCore
from unifiedserve.engine.runner import ModelRunner
from unifiedserve.engine.scheduler import Scheduler, SchedulerConfig


def decode_side(llm, max_decode_batch: int | None = None) -> EngineCore:
    """The decode process's engine core: a runner without embedding buffers over ``llm``'s KV cache."""
    cfg = llm.config
    runner = ModelRunner(llm.model, num_kv_blocks=cfg.num_kv_blocks, block_size=cfg.block_size, num_patch_pages=0,
                         num_visual_pages=0, page_size=cfg.page_size, kv_storage=llm.runner.kv_cache.tensor)
    assert runner.patch_buffer is None and runner.visual_buffer is None
    config = SchedulerConfig() if max_decode_batch is None else SchedulerConfig(max_decode_batch=max_decode_batch)
    return EngineCore(Scheduler.decode_only(config), runner)

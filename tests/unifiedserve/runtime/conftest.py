"""Fixtures shared by the runtime's tests: the demo model, the vision process's clips, pools for a worker."""

from __future__ import annotations

import pytest

from unifiedserve.model.demo import write_demo_model
from unifiedserve.runtime import protocol


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory):
    return str(write_demo_model(tmp_path_factory.mktemp("demo"), seed=1))


@pytest.fixture(scope="module")
def clips(video_factory, image_factory):
    """Two videos of several GOPs (8 and 4 sampled frames at 2 fps) and an image."""
    a = video_factory(codec="h264", bframes=2, suffix=".mp4", width=128, height=96, duration_s=4.0, fps=24.0,
                      gop=12, seed=21)
    b = video_factory(codec="h264", suffix=".mp4", width=96, height=64, duration_s=2.0, fps=24.0, gop=6, seed=22)
    image = image_factory(".png", width=90, height=60, seed=23)
    small = dict(min_pixels=3136, max_pixels=128 * 96)  # frames at about their own size, not upscaled
    return [protocol.MediaRef("video", path=str(a), **small), protocol.MediaRef("image", path=str(image)),
            protocol.MediaRef("video", path=str(b), **small)]


@pytest.fixture
def make_runtime(demo_model, tmp_path):
    """``make_runtime(policy="unified", engine=None)``: a runtime's config and pools (small) for the demo model, as a
    server would make them before starting its workers; stopped after the test."""
    from unifiedserve.engine.config import EngineConfig
    from unifiedserve.runtime.config import PoolBudgets
    from unifiedserve.runtime.launcher import Runtime, build_config

    made = []

    def make(policy: str = "unified", engine: EngineConfig | None = None) -> Runtime:
        config = build_config(demo_model, engine or EngineConfig(device="cpu"),
                              PoolBudgets(kv_cache_gb=0.02, patch_buffer_gb=0.02, visual_buffer_gb=0.01),
                              served_model_name="demo", policy=policy)
        folder = tmp_path / f"pools{len(made)}"
        folder.mkdir()
        runtime = Runtime(config, shm_dir=str(folder))
        made.append(runtime)
        runtime.create_pools()
        return runtime

    yield make
    for runtime in made:
        runtime.stop()

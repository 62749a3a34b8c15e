"""Fixtures shared by the vision process's tests (``test_vision_*.py``)."""

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

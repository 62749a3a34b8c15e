"""flashcodec.decode.shared_engine: one warm engine per device for the module-level calls, a private one otherwise."""

import pytest
import torch

import flashcodec
from flashcodec.decode import shared_engine
from flashcodec.decode.engine import DecodeEngine

TINY = dict(width=128, height=96, duration_s=2.0, fps=24.0, gop=12)


def test_one_engine_per_device_kept_for_the_process():
    cpu = shared_engine.default_engine("cpu")
    assert shared_engine.default_engine("cpu") is cpu and shared_engine.default_engine(" cpu ") is cpu
    assert flashcodec.default_engine is shared_engine.default_engine  # the package's name for it


def test_the_one_call_decode_uses_the_warm_engine_unless_asked_otherwise(video_factory, monkeypatch):
    path = video_factory(codec="h264", suffix=".mp4", bframes=2, **TINY)
    warm = shared_engine.default_engine("cpu")
    seen = []
    original = DecodeEngine.decode_video

    def spy(self, source, **kwargs):
        seen.append(self)
        return original(self, source, **kwargs)

    monkeypatch.setattr(DecodeEngine, "decode_video", spy)
    shared = flashcodec.decode_video(path, fps=2.0)
    assert seen == [warm]
    private = flashcodec.decode_video(path, num_threads=1, fps=2.0)  # a thread count of its own: a private engine
    assert len(seen) == 2 and seen[1] is not warm
    assert torch.equal(shared.frames, private.frames) and shared.frame_indices == private.frame_indices
    assert shared_engine.default_engine("cpu") is warm  # the private engine was not kept


def test_an_unknown_device_is_one_clear_error():
    with pytest.raises(ValueError):
        shared_engine.default_engine("tpu:0")

"""Fakes for the GPU-side probes, shared by the device and NVDEC tests (no GPU needed)."""

import pytest

from flashcodec.nvcuvid import DecoderCaps


def _h100_caps(codec, chroma, depth):
    """What cuvidGetDecoderCaps reported on the project's H100 (docs/gpu.md, 2026-11-23)."""
    supported = {("h264", "420", 8): 4096, ("hevc", "420", 8): 8192, ("hevc", "420", 10): 8192,
                 ("hevc", "444", 8): 8192, ("hevc", "444", 10): 8192, ("vp9", "420", 8): 8192,
                 ("mpeg4", "420", 8): 2048}
    size = supported.get((codec, chroma, depth))
    if size is None:
        return DecoderCaps(codec, chroma, depth, False, 0, 0, 0, 0, 0, 0)
    return DecoderCaps(codec, chroma, depth, True, 7, size, size, size * size // 256, 48, 16)


def _fake_probes(num_gpus, broken=None):
    """``resolve_devices``/``make_layout`` probes for a machine with ``num_gpus`` GPUs; ``broken``:
    the reason NVDEC is unusable on every one of them."""
    def reason(i):
        if i >= num_gpus:
            return f"there is no cuda:{i}" if num_gpus else "no CUDA GPU is visible"
        return broken
    return {"unavailable_reason": reason, "gpu_count": lambda: num_gpus}


@pytest.fixture
def h100_caps():
    return _h100_caps


@pytest.fixture
def fake_probes():
    return _fake_probes

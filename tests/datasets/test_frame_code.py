"""Tests for datasets/frame_code.py (the frame-index code in synthetic frames and images)."""

from __future__ import annotations

import av
import numpy as np
import pytest

import frame_code as fc


def test_read_frame_index_inputs(tiny_h264):
    with av.open(str(tiny_h264)) as c:
        frames = [f for _, f in zip(range(6), c.decode(video=0))]
    f = frames[5]
    rgb = f.to_ndarray(format="rgb24")
    assert fc.read_frame_index(f) == 5
    assert fc.read_frame_index(rgb) == 5
    assert fc.read_frame_index(np.moveaxis(rgb, 2, 0)) == 5  # CHW
    assert fc.read_frame_index(rgb.astype(np.float32) / 255.0) == 5  # float [0, 1]
    assert fc.read_frame_index(f.to_ndarray(format="gray")) == 5  # luma only
    torch = pytest.importorskip("torch")
    assert fc.read_frame_index(torch.from_numpy(rgb).permute(2, 0, 1)) == 5


def test_read_frame_index_rejects_garbage():
    rng = np.random.default_rng(0)
    for img in (
        np.zeros((96, 128, 3), np.uint8),
        np.full((96, 128, 3), 255, np.uint8),
    ):
        with pytest.raises(fc.FrameIndexError):
            fc.read_frame_index(img)
    misses = sum(
        fc.try_read_frame_index(rng.integers(0, 256, (96, 128, 3), dtype=np.uint8)) is None
        for _ in range(50)
    )
    assert misses >= 40  # a 6-bit check passes ~1/64 of random patterns


# ---------------------------------------------------------------------------
# marked tests (see tests/conftest.py)
# ---------------------------------------------------------------------------


@pytest.mark.cuda
def test_read_frame_index_cuda_tensor(tiny_h264):
    import torch

    with av.open(str(tiny_h264)) as c:
        f = next(c.decode(video=0))
    t = torch.from_numpy(f.to_ndarray(format="rgb24")).cuda()
    assert fc.read_frame_index(t) == 0
    assert fc.read_frame_index(t.permute(2, 0, 1).float() / 255) == 0

"""Tests for datasets/video_frames.py (the frames' presentation times and pixels)."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

import frame_code
import video_frames as vf


def test_code_roundtrip_all_bits():
    synth = vf.FrameSynth(64, 48, 0)
    buf = np.empty(64 * 48 * 3 // 2, np.uint8)
    for idx in (0, 1, 2, 63, 64, 4095, 12345, frame_code.MAX_FRAMES - 1):
        synth.render(idx, buf)
        y = buf[: 64 * 48].reshape(48, 64)
        assert frame_code.read_frame_index(y) == idx
    with pytest.raises(ValueError):
        synth.render(frame_code.MAX_FRAMES, buf)


def test_frame_times():
    cfr = vf.frame_times(duration_s=2.0, fps=24.0)
    assert len(cfr) == 48 and cfr[1] - cfr[0] == Fraction(1, 24)
    ntsc = vf.frame_times(duration_s=1.0, fps=29.97)
    assert ntsc[1] == Fraction(1001, 30000)
    v0 = vf.frame_times(duration_s=2.0, fps=24.0, vfr=True, seed=0)
    assert v0 == vf.frame_times(duration_s=2.0, fps=24.0, vfr=True, seed=0)
    assert v0 != vf.frame_times(duration_s=2.0, fps=24.0, vfr=True, seed=1)
    steps = {b - a for a, b in zip(v0, v0[1:])}
    assert steps == {Fraction(1, 24), Fraction(2, 24)}
    assert v0[-1] < 2 and 24 <= len(v0) < 48

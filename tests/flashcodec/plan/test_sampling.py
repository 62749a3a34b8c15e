"""Frame selection and sizes follow qwen-vl-utils 0.0.14.

Expected values below were cross-checked against qwen-vl-utils' own ``smart_resize`` and
``smart_nframes`` (40,000 random cases, no mismatch) when this module was written.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashcodec.plan.sampling import (
    FPS_MAX_FRAMES,
    VIDEO_MAX_PIXELS,
    VIDEO_MIN_PIXELS,
    SamplingOptions,
    image_target_size,
    linspace_indices,
    sample_frame_indices,
    smart_nframes,
    smart_resize,
    video_target_size,
)


def test_five_minute_30fps_video_samples_600_frames_at_2fps():
    indices, sample_fps = sample_frame_indices(9000, 30.0)
    assert len(indices) == 600
    assert sample_fps == pytest.approx(2.0)
    assert indices == torch.linspace(0, 8999, 600).round().long().tolist()
    assert indices[0] == 0 and indices[-1] == 8999


def test_long_video_is_capped_at_768_frames():
    indices, sample_fps = sample_frame_indices(30 * 60 * 30, 30.0)  # 30 minutes
    assert len(indices) == FPS_MAX_FRAMES
    assert sample_fps == pytest.approx(768 / 54000 * 30)


def test_short_video_gets_at_least_four_frames_and_even_counts():
    assert smart_nframes(10, 30.0) == 4  # 0.67 frames at 2 fps -> raised to FPS_MIN_FRAMES
    assert smart_nframes(3, 30.0) == 2  # never more than the video has, kept even
    assert smart_nframes(99, 30.0) == 6  # 6.6 -> floor to even


def test_overrides():
    assert smart_nframes(9000, 30.0, SamplingOptions(fps=1.0)) == 300
    assert smart_nframes(9000, 30.0, SamplingOptions(num_frames=33)) == 32  # round(16.5) is 16: half to even
    assert smart_nframes(9000, 30.0, SamplingOptions(num_frames=35)) == 36
    assert smart_nframes(9000, 30.0, SamplingOptions(max_frames=101)) == 100
    assert smart_nframes(100, 30.0, SamplingOptions(min_frames=13)) == 14


@pytest.mark.parametrize("kwargs", [dict(fps=2.0, num_frames=4), dict(fps=0.0), dict(num_frames=0),
                                    dict(max_frames=-1), dict(height=28), dict(fps=float("nan")),
                                    dict(min_frames=8, max_frames=4), dict(max_pixels=2**26),
                                    dict(height=10_000, width=10_000), dict(fps="2"), dict(fps=True)])
def test_bad_options_raise_value_error(kwargs):
    with pytest.raises(ValueError):
        SamplingOptions(**kwargs)


def test_too_few_frames_is_a_clear_error():
    with pytest.raises(ValueError, match="the video has 1 frame; sampling needs at least 2 .*send a still picture"):
        smart_nframes(1, 30.0)
    with pytest.raises(ValueError, match=r"cannot sample 4 frames from a video of 3 frames \(need between 2 and 3\)"):
        smart_nframes(3, 30.0, SamplingOptions(num_frames=3))  # rounds to 4
    for name in ("num_frames", "max_frames"):  # 1 would round to 0 frames: said of the option itself
        with pytest.raises(ValueError, match=f"{name} must be at least 2 \\(one temporal patch of frames\\), got 1"):
            SamplingOptions(**{name: 1})
    with pytest.raises(ValueError, match="no frames"):
        sample_frame_indices(0, 30.0)


def test_video_target_size_720p_default_budget():
    # 600 frames share the total budget: 90% of 128k tokens -> 301,056 pixels per frame.
    assert video_target_size(720, 1280, 600) == (392, 728)
    assert video_target_size(1080, 1920, 600) == (392, 728)
    # Few frames: the per-frame cap VIDEO_MAX_PIXELS (768 tokens) applies.
    assert video_target_size(720, 1280, 40) == (560, 1008)
    # A long video shrinks frames to fit the total pixel budget.
    h, w = video_target_size(720, 1280, 768, SamplingOptions(total_pixels=768 * 224 * 224))
    assert h * w <= 2 * 224 * 224 and h % 28 == 0 and w % 28 == 0


def test_video_max_pixels_below_the_default_min_pixels_follows_qwen_vl_utils():
    """qwen-vl-utils' fetch_video up to 0.0.11 (0.0.8 at Qwen2.5-VL's release) takes such a max_pixels as it is:
    a large frame is scaled down to it, a small one up to the default min_pixels (its smart_resize checks the larger
    budget first and has no order check; 0.0.13 on asserts max_pixels >= min_pixels)."""
    assert video_target_size(720, 1280, 40, SamplingOptions(max_pixels=50_000)) == (140, 280)
    assert 140 * 280 <= 50_000
    h, w = video_target_size(56, 84, 40, SamplingOptions(max_pixels=50_000))
    assert h * w >= VIDEO_MIN_PIXELS and (h, w) == (280, 392)
    with pytest.raises(ValueError, match="must not exceed"):  # both given the wrong way round: refused
        video_target_size(720, 1280, 40, SamplingOptions(min_pixels=60_000, max_pixels=50_000))
    with pytest.raises(ValueError, match="must not exceed"):  # and the general resize keeps its check
        smart_resize(720, 1280, min_pixels=60_000, max_pixels=50_000)


def test_explicit_size_is_rounded_to_28():
    assert video_target_size(720, 1280, 10, SamplingOptions(height=224, width=400)) == (224, 392)


def test_image_size_and_aspect_ratio_limit():
    assert image_target_size(61, 97) == (56, 84)
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(10, 2100)


@settings(max_examples=300, deadline=None)
@given(h=st.integers(1, 5000), w=st.integers(1, 5000),
       budget=st.sampled_from([(VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS), (4 * 784, 16384 * 784), (784, 784 * 4)]))
def test_smart_resize_properties(h, w, budget):
    if max(h, w) / min(h, w) > 200:
        return
    lo, hi = budget
    rh, rw = smart_resize(h, w, min_pixels=lo, max_pixels=hi)
    assert rh % 28 == 0 and rw % 28 == 0 and rh >= 28 and rw >= 28
    assert rh * rw <= max(hi, 28 * 28 * math.ceil(max(h, w) / min(h, w)))  # the floor of one 28x28 cell wins
    # orientation is kept
    if h > 1.5 * w:
        assert rh >= rw
    if w > 1.5 * h:
        assert rw >= rh


@settings(max_examples=200, deadline=None)
@given(total=st.integers(2, 40000), fps=st.sampled_from([1.0, 23.976, 25.0, 30.0, 60.0]),
       want=st.one_of(st.none(), st.floats(0.1, 8.0)))
def test_sample_frame_indices_properties(total, fps, want):
    indices, sample_fps = sample_frame_indices(total, fps, SamplingOptions(fps=want))
    assert len(indices) % 2 == 0 and 2 <= len(indices) <= min(total, FPS_MAX_FRAMES)
    assert indices == sorted(indices) and indices[0] == 0 and indices[-1] == total - 1
    assert sample_fps == pytest.approx(len(indices) / total * fps)


@settings(max_examples=200, deadline=None)
@given(last=st.integers(0, 50000), count=st.integers(1, 800))
def test_linspace_indices_match_torch(last, count):
    assert linspace_indices(0, last, count) == torch.linspace(0, last, count).round().long().tolist()


def test_min_pixels_at_the_cap_cannot_round_past_it():
    """qwen-vl-utils' video budget lets max_pixels reach 1.05 x min_pixels and rounds up to multiples of 28: at
    the cap, a 4:3 frame came out at 5180x6916 (35,824,880 pixels, over 35,651,584)."""
    with pytest.raises(ValueError, match=r"the frames would be \d+x\d+ \(\d+ pixels\), over the 35651584"):
        video_target_size(240, 320, 120, SamplingOptions(min_pixels=35651584))
    h, w = video_target_size(240, 320, 120, SamplingOptions(min_pixels=20_000_000))
    assert h * w <= 35651584

"""M-RoPE positions: the released Qwen2.5-VL rule, held by these tests themselves.

Hand-computed positions for the cases that matter, and an independent restatement of the rule
(:func:`_released_rule`) for random prompts. transformers is consulted only for images, where all
of its 5.x releases agree with the released rule; for text after a video its releases disagree with
the training and with each other (5.17 vs 5.23), so no assertion here depends on which is installed.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from unifiedserve.model.config import ModelConfig
from unifiedserve.model.rope import decode_positions, get_rope_index

transformers = pytest.importorskip("transformers")
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel  # noqa: E402

# 7B sizes (transformers' default text config is the 72B one, which does not fit the default vision tower).
HF_CONFIG = transformers.Qwen2_5_VLConfig(
    vision_config={"tokens_per_second": 2},
    text_config={"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                 "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064},
)
CONFIG = ModelConfig.from_dict(HF_CONFIG.to_dict())
IMG, VID, TEXT = CONFIG.image_token_id, CONFIG.video_token_id, 100


class _Reference:
    """Just enough of ``Qwen2_5_VLModel`` to call its ``get_rope_index`` without weights."""

    get_rope_index = Qwen2_5_VLModel.get_rope_index
    get_vision_position_ids = Qwen2_5_VLModel.get_vision_position_ids

    def __init__(self, config):
        self.config = config


def _reference(ids, image_grids, video_grids, seconds):
    input_ids = torch.tensor([ids])
    token_type = (input_ids == IMG).int() + 2 * (input_ids == VID).int()
    positions, delta = _Reference(HF_CONFIG).get_rope_index(
        input_ids, token_type,
        image_grid_thw=torch.tensor(image_grids) if image_grids else None,
        video_grid_thw=torch.tensor(video_grids) if video_grids else None,
        second_per_grid_ts=torch.tensor(seconds, dtype=torch.float32) if seconds is not None else None,
    )
    return positions[:, 0], int(delta)


def _build(segments):
    """``[("text", n) | ("image", grid) | ("video", grid, seconds)]`` -> ids, grids, seconds."""
    ids, images, videos, seconds = [], [], [], []
    for seg in segments:
        if seg[0] == "text":
            ids += [TEXT] * seg[1]
        else:
            t, h, w = seg[1]
            ids += [IMG if seg[0] == "image" else VID] * (t * h * w // 4)
            (images if seg[0] == "image" else videos).append(seg[1])
            if seg[0] == "video":
                seconds.append(seg[2])
    return ids, images, videos, seconds


def _released_rule(segments):
    """The released rule restated independently, one token at a time (see rope.py's docstring).

    ``segments`` as for :func:`_build`. Returns positions as a ``[3, L]`` list of lists.
    """
    rows, nxt = [[], [], []], 0
    for seg in segments:
        if seg[0] == "text":
            for _ in range(seg[1]):
                for axis in rows:
                    axis.append(nxt)
                nxt += 1
            continue
        t, h, w = seg[1]
        seconds = (seg[2] if seg[2] is not None else 1.0) if seg[0] == "video" else None
        start, largest = nxt, nxt
        for i_t in range(t):
            if seconds is None:
                temporal = 0
            else:  # float32, left to right, truncated
                temporal = int(np.float32(np.float32(i_t) * np.float32(seconds)) * np.float32(2))
            for i_h in range(h // 2):
                for i_w in range(w // 2):
                    triple = (start + temporal, start + i_h, start + i_w)
                    for axis, value in zip(rows, triple):
                        axis.append(value)
                    largest = max(largest, *triple)
        nxt = largest + 1
    return rows


def _check(segments, pass_seconds=True):
    ids, images, videos, seconds = _build(segments)
    if not pass_seconds:
        seconds = None
        segments = [(s[0], s[1], None) if s[0] == "video" else s for s in segments]
    positions, delta = get_rope_index(ids, images, videos, seconds, CONFIG)
    assert positions.dtype == torch.int64 and positions.shape == (3, len(ids))
    assert positions.tolist() == _released_rule(segments)
    assert delta == int(positions.max()) + 1 - len(ids)
    return positions, delta


def test_text_image_text_by_hand():
    """2 text, a 4x6-patch image (2x3 visual tokens), 2 text: the image starts at 2, text resumes at 5."""
    positions, delta = _check([("text", 2), ("image", (1, 4, 6)), ("text", 2)])
    assert positions.tolist() == [[0, 1, 2, 2, 2, 2, 2, 2, 5, 6],
                                  [0, 1, 2, 2, 2, 3, 3, 3, 5, 6],
                                  [0, 1, 2, 3, 4, 2, 3, 4, 5, 6]]
    assert delta == 7 - 10


def test_text_video_text_with_temporal_extent_beyond_spatial():
    """A video of 4 temporal grids, 2x2 tokens each, 1 s per grid, 2 tokens per second: temporal offsets
    0, 2, 4, 6 exceed the spatial 0..1, so the text after it starts past 6 (at 2 + 6 + 1 = 9)."""
    positions, delta = _check([("text", 2), ("video", (4, 4, 4), 1.0), ("text", 2)])
    t, h, w = positions[:, 2:18]
    assert t.tolist() == [2] * 4 + [4] * 4 + [6] * 4 + [8] * 4
    assert h.tolist() == [2, 2, 3, 3] * 4 and w.tolist() == [2, 3, 2, 3] * 4
    assert positions[:, 18:].tolist() == [[9, 10]] * 3  # transformers >= 5.3 would give 4, 5
    assert delta == 11 - 20


def test_two_videos_back_to_back():
    """Two videos with no text between them: the second starts past the first one's largest position."""
    ids = [TEXT] + [VID] * 8 + [VID] * 4 + [TEXT]
    positions, delta = get_rope_index(ids, None, [(2, 4, 4), (1, 4, 4)], [1.0, 1.0], CONFIG)
    assert positions[0, 1:9].tolist() == [1] * 4 + [3] * 4  # first video: start 1, t offsets 0 and 2
    assert positions[:, 9:13].tolist() == [[4, 4, 4, 4], [4, 4, 5, 5], [4, 5, 4, 5]]  # second: start 3 + 1
    assert positions[:, 13].tolist() == [6, 6, 6]
    assert delta == 7 - 14


def test_video_seconds_per_grid_other_than_one():
    """0.75 s per grid x 2 tokens/s = 1.5 per grid, truncated: 0, 1, 3, 4 (the float32 products 0, 1.5, 3, 4.5)."""
    positions, _ = _check([("text", 1), ("video", (4, 2, 2), 0.75), ("text", 1)])
    assert positions[0, 1:5].tolist() == [1, 2, 4, 5]
    assert positions[:, 5].tolist() == [6, 6, 6]


def test_image_and_video_in_one_prompt():
    positions, _ = _check([("text", 1), ("image", (1, 2, 4)), ("text", 1), ("video", (3, 2, 2), 2.0), ("text", 1)])
    assert positions[:, 1:3].tolist() == [[1, 1], [1, 1], [1, 2]]  # image: one row of 2 tokens
    assert positions[:, 3].tolist() == [3, 3, 3]  # text resumes past the image's largest (2)
    assert positions[0, 4:7].tolist() == [4, 8, 12]  # 2 s per grid x 2 tokens/s = 4 per grid
    assert positions[:, 7].tolist() == [13, 13, 13]


@pytest.mark.parametrize("name, segments", [
    ("text only", [("text", 9)]),
    ("image", [("text", 5), ("image", (1, 4, 6)), ("text", 7)]),
    ("video with second_per_grid_ts", [("text", 3), ("video", (5, 6, 10), 0.75), ("text", 4)]),
    ("long video, temporal extent beyond spatial", [("text", 2), ("video", (16, 4, 4), 2.0), ("text", 3)]),
    ("image + video", [("text", 4), ("image", (1, 8, 4)), ("text", 2), ("video", (3, 6, 10), 0.5), ("text", 5)]),
    ("video + image + video", [("text", 1), ("video", (2, 4, 4), 1 / 3), ("text", 1), ("image", (1, 2, 6)),
                               ("text", 2), ("video", (4, 2, 2), 1.5), ("text", 1)]),
    ("media first and last", [("image", (1, 4, 4)), ("text", 2), ("video", (2, 4, 6), 1.0)]),
])
def test_matches_the_released_rule(name, segments):
    _check(segments)


@pytest.mark.parametrize("segments", [
    [("text", 5), ("image", (1, 4, 6)), ("text", 7)],
    [("image", (1, 8, 4)), ("text", 2), ("image", (1, 2, 6)), ("text", 3)],
])
def test_images_match_installed_transformers(segments):
    """For images (no time axis) every transformers 5.x agrees with the released rule: a link to the reference."""
    ids, images, _, _ = _build(segments)
    positions, delta = get_rope_index(ids, images, None, None, CONFIG)
    ref_positions, ref_delta = _reference(ids, images, [], None)
    assert torch.equal(positions, ref_positions) and delta == ref_delta


def test_video_without_seconds_uses_one_second_per_grid():
    positions, _ = _check([("text", 2), ("video", (3, 4, 4), None), ("text", 2)], pass_seconds=False)
    # tokens_per_second = 2: temporal positions step by 2 per grid.
    assert positions[0, 2:2 + 12].tolist() == [2] * 4 + [4] * 4 + [6] * 4


def test_text_only_is_arange_with_zero_delta():
    positions, delta = get_rope_index(list(range(7)), None, None, None, CONFIG)
    assert torch.equal(positions, torch.arange(7).expand(3, -1))
    assert delta == 0


def test_decode_positions_continue_after_max():
    ids, images, videos, seconds = _build([("text", 3), ("video", (4, 4, 4), 2.0), ("text", 2)])
    positions, delta = get_rope_index(ids, images, videos, seconds, CONFIG)
    nxt = decode_positions(len(ids), delta, count=3)
    assert nxt.shape == (3, 3)
    assert nxt[:, 0].tolist() == [int(positions.max()) + 1] * 3
    assert nxt[0].tolist() == list(range(len(ids) + delta, len(ids) + delta + 3))


_grid = st.tuples(st.integers(1, 4), st.sampled_from([2, 4, 6, 8]), st.sampled_from([2, 4, 6, 10]))
_media = st.one_of(
    st.tuples(st.just("image"), _grid.map(lambda g: (1, g[1], g[2]))),
    st.tuples(st.just("video"), _grid, st.sampled_from([0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 1 / 3, 0.4])),
)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 4), _media), max_size=4), st.integers(0, 3))
def test_random_prompts_follow_the_released_rule(parts, tail):
    segments = []
    for text_len, media in parts:  # text between media, as every chat template writes
        segments += [("text", text_len), media]
    if tail or not segments:
        segments.append(("text", max(tail, 1)))
    _check(segments)


def test_back_to_back_media_of_one_kind():
    """Two images with no token between them (transformers cannot place these): each media gets
    its own grid, the second starting where the first left the counter."""
    ids = [TEXT] + [IMG] * 4 + [IMG] * 6 + [TEXT]
    positions, _ = get_rope_index(ids, [(1, 4, 4), (1, 4, 6)], None, None, CONFIG)
    assert positions[1, 1:5].tolist() == [1, 1, 2, 2]
    assert positions[2, 5:11].tolist() == [3, 4, 5, 3, 4, 5]
    assert positions[:, -1].tolist() == [6, 6, 6]


@pytest.mark.parametrize("ids, images, videos, seconds, match", [
    ([], None, None, None, "empty"),
    ([TEXT, IMG, IMG, IMG, IMG], None, None, None, "more image placeholder"),
    ([TEXT] + [IMG] * 3, [(1, 4, 4)], None, None, "needs 4"),
    ([TEXT], [(1, 4, 4)], None, None, "1 image grids but only 0"),
    ([TEXT] + [VID] * 4, None, [(1, 4, 4)], [1.0, 2.0], "2 values for 1 videos"),
    ([TEXT], [(1, 0, 4)], None, None, "positive"),
])
def test_errors(ids, images, videos, seconds, match):
    with pytest.raises(ValueError, match=match):
        get_rope_index(ids, images, videos, seconds, CONFIG)

"""M-RoPE positions against transformers' own ``Qwen2_5_VLModel.get_rope_index``."""

from __future__ import annotations

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


def _check(segments, pass_seconds=True):
    ids, images, videos, seconds = _build(segments)
    seconds = seconds if pass_seconds else None
    positions, delta = get_rope_index(ids, images, videos, seconds, CONFIG)
    ref_positions, ref_delta = _reference(ids, images, videos, seconds)
    assert positions.dtype == torch.int64 and positions.shape == (3, len(ids))
    assert torch.equal(positions, ref_positions)
    assert delta == ref_delta
    return positions, delta


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
def test_matches_transformers(name, segments):
    _check(segments)


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
def test_random_prompts_match_transformers(parts, tail):
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

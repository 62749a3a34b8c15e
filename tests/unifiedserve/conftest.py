"""Fixtures shared by the unifiedserve tests."""

from __future__ import annotations

import pytest
import torch


def _released_get_rope_index(model_config):
    """A drop-in for transformers' ``Qwen2_5_VLModel.get_rope_index`` that returns the released rule's
    positions (``unifiedserve.model.rope``), for one sequence at a time."""
    from unifiedserve.model.rope import get_rope_index

    def rope_index(input_ids, *args, image_grid_thw=None, video_grid_thw=None, second_per_grid_ts=None,
                   attention_mask=None, **kwargs):
        if input_ids.shape[0] != 1:
            raise NotImplementedError("the parity tests pass one sequence at a time")
        ids = input_ids[0] if attention_mask is None else input_ids[0][attention_mask[0].bool()]
        positions, delta = get_rope_index(ids.tolist(), image_grid_thw, video_grid_thw,
                                          None if second_per_grid_ts is None else second_per_grid_ts.tolist(),
                                          model_config)
        return positions.unsqueeze(1).to(input_ids.device), torch.tensor([[delta]], device=input_ids.device)

    return rope_index


@pytest.fixture(scope="session")
def use_released_rope():
    """``use_released_rope(hf_model)``: make a transformers Qwen2.5-VL place tokens by the released M-RoPE rule.

    transformers >= 5.3 places text after a video by another rule than the one Qwen2.5-VL was trained
    with (see ``unifiedserve/model/rope.py``), and its releases disagree with each other. The parity
    tests compare the *models*, so transformers is given the project's positions: its forward and
    ``generate`` both ask ``model.model.get_rope_index``, which this replaces on that one instance.
    """
    from unifiedserve.model.config import ModelConfig

    def apply(hf_model):
        hf_model.model.get_rope_index = _released_get_rope_index(ModelConfig.from_dict(hf_model.config.to_dict()))
        return hf_model

    return apply

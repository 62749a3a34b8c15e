"""Fixtures shared by the unifiedserve tests."""

from __future__ import annotations

import contextlib

import pytest
import torch


@pytest.fixture(scope="session")
def demo_path(tmp_path_factory):
    """A demo checkpoint (default seed), written once per session; tests only read it."""
    from unifiedserve.model.demo import write_demo_model

    path = tmp_path_factory.mktemp("demo-model")
    write_demo_model(path)
    return path


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


def _hf_generate(model, ids, vision, new_tokens: int, **generate_kwargs):
    """transformers' greedy ``generate`` of exactly ``new_tokens`` for one prompt whose placeholders are
    expanded; ``vision`` as the engine takes it, on the model's device; ``generate_kwargs`` go to ``generate``
    (e.g. ``repetition_penalty``). Returns ``(token ids, raw logits [new_tokens, vocab] on the CPU)``."""
    kwargs = {}
    images = [v for v in vision if v.kind == "image"]
    videos = [v for v in vision if v.kind == "video"]
    if images:
        kwargs.update(pixel_values=torch.cat([v.patches for v in images]),
                      image_grid_thw=torch.tensor([v.grid_thw for v in images]))
    if videos:
        kwargs.update(pixel_values_videos=torch.cat([v.patches for v in videos]),
                      video_grid_thw=torch.tensor([v.grid_thw for v in videos]),
                      second_per_grid_ts=torch.tensor([v.second_per_grid_t for v in videos]))
    # transformers 5 computes M-RoPE positions only when told each token's modality
    cfg = model.config
    kwargs["mm_token_type_ids"] = torch.tensor([[1 if t == cfg.image_token_id else 2 if t == cfg.video_token_id
                                                 else 0 for t in ids]])
    kwargs = {k: v.to(model.device) for k, v in kwargs.items()}
    with torch.no_grad():
        out = model.generate(torch.tensor([ids], device=model.device), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, **kwargs, **generate_kwargs)
    return out.sequences[0, len(ids):].tolist(), torch.cat(out.logits).cpu()


@pytest.fixture(scope="session")
def hf_generate():
    """``hf_generate(model, ids, vision, new_tokens)``: the transformers reference run of the parity tests."""
    return _hf_generate


@contextlib.contextmanager
def _recording_logits(engine):
    rows: dict[str, list[torch.Tensor]] = {}
    execute = engine.runner.execute

    def recording(out, requests):
        result = execute(out, requests)
        for request_id, row in result.items():
            rows.setdefault(request_id, []).append(row.clone())
        return result

    engine.runner.execute = recording
    try:
        yield rows
    finally:
        del engine.runner.execute  # back to the class's method


@pytest.fixture(scope="session")
def record_logits():
    """``with record_logits(engine) as rows:`` collects, per request id, the logits each token was sampled from."""
    return _recording_logits

"""Presets carry the public checkpoints' architecture; shrunk ones keep its structure; the CLI writes them."""

from __future__ import annotations

import json

import pytest

from unifiedserve.cli import main as cli_main
from unifiedserve.model.config import ModelConfig
from unifiedserve.model.presets import PRESETS, preset_architecture, scale_fullatt_blocks

# Architecture values of the public Qwen/Qwen2.5-VL-3B-Instruct and -7B-Instruct config.json files.
PUBLIC_VISION = {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "patch_size": 14,
                 "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
                 "fullatt_block_indexes": (7, 15, 23, 31), "tokens_per_second": 2, "hidden_act": "silu"}
PUBLIC = {
    "qwen2.5-vl-3b": ({"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 11008,
                       "num_hidden_layers": 36, "num_attention_heads": 16, "num_key_value_heads": 2,
                       "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "mrope_section": (16, 24, 24),
                       "max_position_embeddings": 128000, "hidden_act": "silu"},
                      {**PUBLIC_VISION, "out_hidden_size": 2048}, True),
    "qwen2.5-vl-7b": ({"vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
                       "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                       "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "mrope_section": (16, 24, 24),
                       "max_position_embeddings": 128000, "hidden_act": "silu"},
                      {**PUBLIC_VISION, "out_hidden_size": 3584}, False),
}


@pytest.mark.parametrize("name", list(PUBLIC))
def test_presets_equal_the_public_configs(name):
    text, vision, tie = preset_architecture(name)
    public_text, public_vision, public_tie = PUBLIC[name]
    assert {k: getattr(text, k) for k in public_text} == public_text
    assert {k: getattr(vision, k) for k in public_vision} == public_vision
    assert tie == public_tie and text.head_dim == 128 and vision.head_dim == 80


def test_shrinking_keeps_full_attention_at_relative_places():
    assert scale_fullatt_blocks((7, 15, 23, 31), 32, 8) == (1, 3, 5, 7)
    assert scale_fullatt_blocks((7, 15, 23, 31), 32, 4) == (0, 1, 2, 3)
    assert scale_fullatt_blocks((7, 15, 23, 31), 32, 32) == (7, 15, 23, 31)
    text, vision, _ = preset_architecture("qwen2.5-vl-7b", num_text_layers=2, num_vision_layers=16, vocab_size=4096)
    assert (text.num_hidden_layers, text.vocab_size, text.hidden_size) == (2, 4096, 3584)
    assert vision.depth == 16 and vision.fullatt_block_indexes == (3, 7, 11, 15)


@pytest.mark.parametrize("kwargs, match", [
    (dict(name="qwen2.5-vl-72b"), "unknown preset"),
    (dict(name="qwen2.5-vl-3b", num_vision_layers=3), "at least 4"),
    (dict(name="qwen2.5-vl-3b", num_text_layers=0), "num_text_layers must be a positive integer"),
    (dict(name="qwen2.5-vl-3b", vocab_size=-1), "vocab_size"),
])
def test_bad_presets(kwargs, match):
    with pytest.raises(ValueError, match=match):
        preset_architecture(kwargs.pop("name"), **kwargs)


def test_cli_writes_a_shrunk_preset(tmp_path, capsys):
    out = tmp_path / "3b"
    assert cli_main(["demo-model", str(out), "--preset", "qwen2.5-vl-3b", "--num-text-layers", "1",
                     "--num-vision-layers", "4", "--dtype", "bfloat16", "--shards", "2"]) == 0
    config = ModelConfig.from_json(out)
    assert config.text.hidden_size == 2048 and config.text.num_hidden_layers == 1 and config.tie_word_embeddings
    assert config.vision.fullatt_block_indexes == (0, 1, 2, 3) and config.text.vocab_size == 151936
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 2 and "lm_head.weight" not in index["weight_map"]
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert "qwen2.5-vl-3b, bfloat16" in capsys.readouterr().out


def test_cli_refuses_bad_values(tmp_path, capsys):
    assert cli_main(["demo-model", str(tmp_path), "--num-text-layers", "2"]) == 1
    assert "the tiny preset takes no num_text_layers" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["demo-model", str(tmp_path), "--preset", "qwen2.5-vl-72b"])
    assert "invalid choice" in capsys.readouterr().err
    assert set(PRESETS) == {"tiny", "qwen2.5-vl-3b", "qwen2.5-vl-7b"}

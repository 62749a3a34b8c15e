"""ModelConfig from both config.json layouts, its validation, and its round trip."""

from __future__ import annotations

import dataclasses
import json

import pytest

from unifiedserve.model.config import ModelConfig, TextConfig, VisionConfig

# The published Qwen/Qwen2.5-VL-7B-Instruct config.json (legacy flat layout), abridged.
LEGACY_7B = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "bos_token_id": 151643, "eos_token_id": 151645,
    "vision_start_token_id": 151652, "vision_end_token_id": 151653, "vision_token_id": 151654,
    "image_token_id": 151655, "video_token_id": 151656,
    "hidden_act": "silu", "hidden_size": 3584, "intermediate_size": 18944, "max_position_embeddings": 128000,
    "max_window_layers": 28, "model_type": "qwen2_5_vl", "num_attention_heads": 28, "num_hidden_layers": 28,
    "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
    "vision_config": {
        "depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
        "in_chans": 3, "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2,
        "spatial_patch_size": 14, "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31],
        "tokens_per_second": 2, "temporal_patch_size": 2,
    },
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vocab_size": 152064,
}


def test_legacy_flat_layout_is_qwen2_5_vl_7b():
    config = ModelConfig.from_dict(LEGACY_7B)
    assert config == ModelConfig()  # the dataclass defaults are the 7B model's
    assert config.text.head_dim == 128 and config.vision.head_dim == 80
    assert config.vision.patch_dim == 1176 and config.vision.window_merge_units == 4


def test_nested_layout_from_transformers_save_pretrained(tmp_path):
    transformers = pytest.importorskip("transformers")
    hf = transformers.Qwen2_5_VLConfig(
        text_config={"vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "eos_token_id": 7, "bos_token_id": 6,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 5e5, "mrope_section": [8, 12, 12]}},
        vision_config={"depth": 4, "hidden_size": 64, "num_heads": 2, "intermediate_size": 96,
                       "out_hidden_size": 256, "fullatt_block_indexes": [1, 3], "tokens_per_second": 3},
        image_token_id=10, video_token_id=11, vision_start_token_id=12, vision_end_token_id=13,
        tie_word_embeddings=True,
    )
    hf.save_pretrained(tmp_path)
    config = ModelConfig.from_json(tmp_path)
    assert config.text == TextConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, rope_theta=5e5,
                                     rms_norm_eps=hf.text_config.rms_norm_eps, mrope_section=(8, 12, 12),
                                     max_position_embeddings=hf.text_config.max_position_embeddings)
    assert config.vision == VisionConfig(depth=4, hidden_size=64, num_heads=2, intermediate_size=96,
                                         out_hidden_size=256, fullatt_block_indexes=(1, 3), tokens_per_second=3)
    assert (config.image_token_id, config.video_token_id) == (10, 11)
    assert (config.vision_start_token_id, config.vision_end_token_id) == (12, 13)
    assert config.eos_token_ids == (7,) and config.bos_token_id == 6
    assert config.tie_word_embeddings


def test_round_trip_through_hf_dict():
    config = dataclasses.replace(ModelConfig(), eos_token_ids=(151645, 151643), tie_word_embeddings=True)
    assert ModelConfig.from_dict(json.loads(json.dumps(config.to_hf_dict()))) == config


def _legacy(**changes):
    cfg = json.loads(json.dumps(LEGACY_7B))
    for key, value in changes.items():
        if key.startswith("vision."):
            cfg["vision_config"][key.removeprefix("vision.")] = value
        else:
            cfg[key] = value
    return cfg


@pytest.mark.parametrize("changes, match", [
    ({"rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 16]}}, "mrope_section"),
    ({"num_key_value_heads": 5}, "multiple of num_key_value_heads"),
    ({"num_attention_heads": 27}, "divisible by num_attention_heads"),
    ({"vision.fullatt_block_indexes": [7, 32]}, r"\[32\] are outside 0..31"),
    ({"vision.window_size": 100}, "multiple of patch_size"),
    ({"vision.num_heads": 15}, "divisible by vision.num_heads"),
    ({"vision.out_hidden_size": 2048}, "must equal the language model's hidden_size"),
    ({"image_token_id": 200000}, "outside the vocabulary"),
    ({"video_token_id": 151655}, "must differ"),
    ({"model_type": "qwen2_vl"}, "only 'qwen2_5_vl'"),
    ({"vision_config": None}, "no 'vision_config'"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"hidden_act": "relu"}, "not supported"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
    ({"vocab_size": 0}, "positive integer"),
    # wrong types and values no checkpoint means: each named, never a traceback nor garbage served
    ({"hidden_size": None}, r"text hidden_size must be an integer, got None"),
    ({"hidden_size": 3584.5}, "text hidden_size must be an integer"),
    ({"num_key_value_heads": 0}, "num_key_value_heads must be a positive integer"),
    ({"rope_theta": float("nan")}, "text rope_theta must be a finite number"),
    ({"rope_theta": 0}, "text.rope_theta must be a positive finite number"),
    ({"max_position_embeddings": 0}, "max_position_embeddings must be a positive integer"),
    ({"rope_scaling": "mrope"}, "rope_scaling must be a JSON object"),
    ({"vision.tokens_per_second": "fast"}, "tokens_per_second must be a finite number"),
    ({"vision.tokens_per_second": True}, "tokens_per_second must be a finite number"),
    ({"vision.fullatt_block_indexes": "37"}, "fullatt_block_indexes must be a list of integers"),
    ({"vision_config": [1, 2]}, "vision_config must be a JSON object"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false"),
    ({"eos_token_id": []}, "eos_token_id must name at least one token"),
    ({"eos_token_id": 1.5}, "eos_token_id must be an integer"),
    ({"bos_token_id": "a"}, "bos_token_id must be an integer"),
])
def test_invalid_configs_raise_with_a_fix(changes, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_dict(_legacy(**changes))


def test_missing_size_is_named():
    cfg = _legacy()
    del cfg["vision_config"]["depth"]
    with pytest.raises(ValueError, match="vision_config 'depth'"):
        ModelConfig.from_dict(cfg)


def test_config_file_errors(tmp_path):
    with pytest.raises(ValueError, match="needs a config.json"):
        ModelConfig.from_json(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        ModelConfig.from_json(tmp_path)
    (tmp_path / "config.json").write_bytes(b'{"model_type": "\xff"}')
    with pytest.raises(ValueError, match="not valid JSON"):
        ModelConfig.from_json(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=f"{tmp_path}/config.json: config must be a JSON object"):
        ModelConfig.from_json(tmp_path)


def test_configs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ModelConfig().text.hidden_size = 1  # type: ignore[misc]

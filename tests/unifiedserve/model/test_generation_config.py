"""generation_config.json: the end-of-sequence ids it adds and the sampling defaults it sets."""

from __future__ import annotations

import json

import pytest

from unifiedserve.model.config import ModelConfig
from unifiedserve.model.demo import write_demo_model
from unifiedserve.model.generation import GenerationDefaults, generation_eos_ids, read_generation_config

#: a generation config shaped like the Qwen instruct checkpoints' (two EOS ids, a repetition penalty, near-greedy
#: sampling); the values are this test's own
QWEN_INSTRUCT = {"bos_token_id": 151643, "pad_token_id": 151643, "do_sample": True,
                 "eos_token_id": [151645, 151643], "repetition_penalty": 1.05, "temperature": 1e-06,
                 "top_p": 1.0, "top_k": 1}


def test_defaults_are_the_fields_the_file_sets():
    d = GenerationDefaults.from_config(QWEN_INSTRUCT)
    assert (d.temperature, d.top_p, d.top_k, d.repetition_penalty, d.max_tokens) == (1e-06, 1.0, 1, 1.05, None)
    assert d.unsupported == () and not d.is_empty
    assert d.describe() == "temperature=1e-06, top_p=1.0, top_k=1, repetition_penalty=1.05"
    assert GenerationDefaults.from_config({"max_new_tokens": 64, "do_sample": False}).max_tokens == 64
    assert GenerationDefaults.from_config({"do_sample": True, "eos_token_id": 3}).is_empty


def test_unsupported_fields_are_listed_only_when_they_ask_for_something():
    d = GenerationDefaults.from_config({"min_p": 0.05, "num_beams": 1, "typical_p": 1.0, "no_repeat_ngram_size": 3,
                                        "epsilon_cutoff": 3e-4})
    assert d.unsupported == (("epsilon_cutoff", 3e-4), ("no_repeat_ngram_size", 3))
    assert d.min_p == 0.05 and d.describe() == "min_p=0.05"


@pytest.mark.parametrize("cfg, message", [
    ({"temperature": -0.5}, "temperature must be a number >= 0"),
    ({"temperature": "0.7"}, "temperature must be a number >= 0"),
    ({"top_p": 0}, r"top_p must be in \(0, 1\]"),
    ({"top_k": 2.5}, "top_k must be an integer >= 0"),
    ({"top_k": True}, "top_k must be an integer >= 0"),
    ({"repetition_penalty": 3.0}, r"repetition_penalty must be in \[0.01, 2\]"),
    ({"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1"),
    ({"min_p": 1.2}, r"min_p must be in \[0, 1\]"),
])
def test_bad_values_name_the_file_and_the_field(cfg, message):
    with pytest.raises(ValueError, match=message):
        GenerationDefaults.from_config(cfg, "x/generation_config.json")


def test_reading_the_file(tmp_path):
    assert read_generation_config(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        read_generation_config(tmp_path)
    (tmp_path / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="must hold a JSON object"):
        read_generation_config(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps(QWEN_INSTRUCT))
    assert GenerationDefaults.load(tmp_path).repetition_penalty == 1.05


def test_eos_ids():
    assert generation_eos_ids({}) == ()
    assert generation_eos_ids({"eos_token_id": 7}) == (7,)
    assert generation_eos_ids({"eos_token_id": [7, 9]}) == (7, 9)
    with pytest.raises(ValueError, match="eos_token_id must be an integer or a list"):
        generation_eos_ids({"eos_token_id": ["<|im_end|>"]})


def test_model_config_stops_on_the_generation_configs_eos_too(tmp_path):
    """config.json names <|im_end|>; generation_config.json adds <|endoftext|> (as Qwen2.5-VL-Instruct's do)."""
    path = write_demo_model(tmp_path / "m")
    hf = json.loads((path / "config.json").read_text())
    gen = json.loads((path / "generation_config.json").read_text())
    im_end, endoftext = gen["eos_token_id"]
    assert ModelConfig.from_dict(hf).eos_token_ids == (im_end,)
    assert ModelConfig.from_json(path).eos_token_ids == (im_end, endoftext)
    assert ModelConfig.from_json(path / "config.json").eos_token_ids == (im_end, endoftext)
    (path / "generation_config.json").unlink()
    assert ModelConfig.from_json(path).eos_token_ids == (im_end,)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 10**9}))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        ModelConfig.from_json(path)

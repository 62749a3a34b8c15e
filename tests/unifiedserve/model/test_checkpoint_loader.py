"""load_model: single file and sharded checkpoints, both name layouts, dtypes, and its errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from unifiedserve.model import CheckpointError, load_model
from unifiedserve.model.demo import write_demo_model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_demo_model(tmp_path_factory.mktemp("single"), seed=2)


@pytest.fixture(scope="module")
def reference(checkpoint):
    model, config = load_model(checkpoint)
    return model, config, load_file(checkpoint / "model.safetensors")


def _rewrite(src, dst, edit):
    """Copy a single-file checkpoint to ``dst`` with its tensors passed through ``edit(dict)``."""
    shutil.copytree(src, dst)
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


def _assert_same_params(a, b):
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name


def test_loaded_model_is_materialised_for_inference(reference):
    model, _, _ = reference
    for name, param in model.named_parameters():
        assert param.device.type == "cpu" and param.dtype == torch.float32, name
        assert not param.requires_grad
    assert not model.training


def test_parameters_equal_the_checkpoint_tensors(reference):
    model, config, tensors = reference
    params = dict(model.named_parameters())
    layer = "model.layers.1.self_attn"
    qkv = torch.cat([tensors[f"{layer}.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(params["language_model.layers.1.self_attn.qkv_proj.weight"], qkv)
    gate_up = torch.cat([tensors[f"visual.blocks.2.mlp.{p}_proj.bias"] for p in ("gate", "up")])
    assert torch.equal(params["visual.blocks.2.mlp.gate_up_proj.bias"], gate_up)
    conv = tensors["visual.patch_embed.proj.weight"]
    assert conv.shape == (config.vision.hidden_size, 3, 2, 14, 14)
    assert torch.equal(params["visual.patch_embed.weight"], conv.reshape(config.vision.hidden_size, -1))
    assert torch.equal(params["visual.merger.fc1.weight"], tensors["visual.merger.mlp.0.weight"])
    assert torch.equal(params["language_model.lm_head.weight"], tensors["lm_head.weight"])


def test_sharded_checkpoint_loads_the_same(tmp_path, reference):
    path = write_demo_model(tmp_path, seed=2, num_shards=3)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3
    assert not (path / "model.safetensors").exists()
    model, _ = load_model(path)
    _assert_same_params(model, reference[0])


def test_transformers_in_memory_names_load_the_same(tmp_path, checkpoint, reference):
    def rename(tensors):
        for key in list(tensors):
            if key.startswith("model."):
                tensors["model.language_model." + key[len("model."):]] = tensors.pop(key)
            elif key.startswith("visual."):
                tensors["model." + key] = tensors.pop(key)
    model, _ = load_model(_rewrite(checkpoint, tmp_path / "renamed", rename))
    _assert_same_params(model, reference[0])


def test_bfloat16(checkpoint, reference):
    model, _ = load_model(checkpoint, dtype=torch.bfloat16)
    ref = dict(reference[0].named_parameters())
    for name, param in model.named_parameters():
        assert param.dtype == torch.bfloat16
        assert torch.equal(param, ref[name].to(torch.bfloat16)), name


def test_tied_embeddings(tmp_path):
    path = write_demo_model(tmp_path, seed=3, tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(path / "model.safetensors")
    model, config = load_model(path)
    assert config.tie_word_embeddings and model.language_model.lm_head is None
    hidden = torch.randn(2, config.text.hidden_size)
    logits = model.compute_logits(hidden)
    assert torch.equal(logits, hidden @ model.language_model.tok_embeddings.weight.T)
    # A tied checkpoint that still stores lm_head.weight loads (the tensor is not used).
    extra = _rewrite(path, tmp_path / "extra", lambda t: t.update({"lm_head.weight": torch.zeros(3)}))
    load_model(extra)


@pytest.mark.parametrize("edit, match", [
    (lambda t: t.pop("model.layers.0.self_attn.k_proj.bias"),
     r"1 missing tensors: model\.layers\.0\.self_attn\.k_proj\.bias"),
    (lambda t: t.pop("visual.merger.ln_q.weight"), r"missing tensors: visual\.merger\.ln_q\.weight"),
    (lambda t: t.update({"model.layers.9.mlp.up_proj.weight": torch.zeros(2, 2)}),
     r"1 unexpected tensors: model\.layers\.9\.mlp\.up_proj\.weight"),
    (lambda t: t.update({"visual.blocks.0.attn.qkv.weight": torch.zeros(7, 160)}),
     r"mis-shaped tensors: visual\.blocks\.0\.attn\.qkv\.weight has shape \[7, 160\], expected \[480, 160\]"),
    (lambda t: t.update({"visual.patch_embed.proj.weight": torch.zeros(160, 1176)}),
     r"visual\.patch_embed\.proj\.weight has shape \[160, 1176\], expected \[160, 3, 2, 14, 14\]"),
    (lambda t: t.update({"model.language_model.norm.weight": t["model.norm.weight"].clone()}),
     r"tensor 'model\.norm\.weight' is stored twice"),
])
def test_checkpoint_errors_name_the_tensors(tmp_path, checkpoint, edit, match):
    bad = _rewrite(checkpoint, tmp_path / "bad", edit)
    with pytest.raises(CheckpointError, match=match):
        load_model(bad)


def test_all_problems_are_reported_at_once(tmp_path, checkpoint):
    def edit(tensors):
        for key in [k for k in tensors if k.startswith("model.layers.3.")]:
            del tensors[key]
        tensors["extra.weight"] = torch.zeros(1)
    with pytest.raises(CheckpointError) as info:
        load_model(_rewrite(checkpoint, tmp_path / "bad", edit))
    message = str(info.value)
    assert "12 missing tensors" in message and "(and 4 more)" in message
    assert "1 unexpected tensors: extra.weight" in message


def test_directory_errors(tmp_path, checkpoint):
    with pytest.raises(ValueError, match="does not exist"):
        load_model(tmp_path / "nowhere")
    shutil.copy(checkpoint / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError, match="no \\*.safetensors files"):
        load_model(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "gone.safetensors"}}))
    with pytest.raises(CheckpointError, match="gone.safetensors"):
        load_model(tmp_path)
    with pytest.raises(ValueError, match="dtype"):
        load_model(checkpoint, dtype=torch.int8)


def test_vision_mlps_are_aligned_on_cuda_only(reference, monkeypatch):
    """The loader pads the vision MLPs (432 units in the demo) to a multiple of 64 for CUDA; the CPU keeps the
    checkpoint's width, and UNIFIEDSERVE_VISION_MLP_ALIGN=0 keeps it on CUDA too (to measure the two)."""
    import copy

    from unifiedserve.model.loader import _align_vision

    model, config, _ = reference
    width = config.vision.intermediate_size
    assert width % 64 and model.visual.blocks[0].mlp.intermediate_size == width  # loaded on the CPU: as stored
    for device, env, expected in (("cpu", None, width), ("cuda", None, -(-width // 64) * 64),
                                  ("cuda:0", "0", width), ("cuda", "1", -(-width // 64) * 64)):
        if env is None:
            monkeypatch.delenv("UNIFIEDSERVE_VISION_MLP_ALIGN", raising=False)
        else:
            monkeypatch.setenv("UNIFIEDSERVE_VISION_MLP_ALIGN", env)
        copied = copy.deepcopy(model)  # _align_vision pads in place, on whatever device the tensors are
        _align_vision(copied, device, loaded=True)
        assert {b.mlp.intermediate_size for b in copied.visual.blocks} == {expected}, (device, env)
    copied = copy.deepcopy(model)
    _align_vision(copied, "cuda", loaded=False)  # a decode process's tower is never loaded: left alone
    assert copied.visual.blocks[0].mlp.intermediate_size == width

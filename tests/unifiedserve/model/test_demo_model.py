"""The demo checkpoint writer and the ``unifiedserve demo-model`` command."""

from __future__ import annotations

import json

import pytest

from unifiedserve.cli import main
from unifiedserve.model import ModelConfig, load_processor
from unifiedserve.model.demo import (
    decode_step_flops,
    encode_decode_flop_ratio,
    vision_slice_flops,
    write_demo_model,
)

FILES = {"config.json", "generation_config.json", "model.safetensors", "preprocessor_config.json",
         "tokenizer.json", "tokenizer_config.json"}


def test_deterministic_by_seed(tmp_path):
    a = write_demo_model(tmp_path / "a", seed=7)
    b = write_demo_model(tmp_path / "b", seed=7)
    c = write_demo_model(tmp_path / "c", seed=8)
    assert {p.name for p in a.iterdir()} == FILES
    for name in FILES:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()


def test_demo_config_keeps_the_serving_geometry(tmp_path):
    path = write_demo_model(tmp_path)
    config = ModelConfig.from_json(path)
    v, t = config.vision, config.text
    assert (v.patch_size, v.spatial_merge_size, v.window_size, v.temporal_patch_size) == (14, 2, 112, 2)
    assert v.fullatt_block_indexes and len(v.fullatt_block_indexes) < v.depth
    assert t.num_attention_heads > t.num_key_value_heads
    assert t.mrope_section == (8, 12, 12) and sum(t.mrope_section) == t.head_dim // 2
    processor = load_processor(path)
    assert config.image_token_id == processor.image_token_id
    assert t.vocab_size % 64 == 0 and t.vocab_size >= processor.tokenizer.get_vocab_size()
    generation = json.loads((path / "generation_config.json").read_text())
    # config.json's EOS (the tokenizer's) first, then the generation config's others, as in Qwen2.5-VL-Instruct
    assert config.eos_token_ids[0] == processor.eos_token_id
    assert set(config.eos_token_ids) == set(generation["eos_token_id"])


def test_rewriting_switches_between_single_file_and_shards(tmp_path):
    write_demo_model(tmp_path, num_shards=2)
    assert (tmp_path / "model.safetensors.index.json").exists()
    write_demo_model(tmp_path, num_shards=1)
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == ["model.safetensors"]
    assert not (tmp_path / "model.safetensors.index.json").exists()


def test_qwen2_5_vl_7b_flop_ratio():
    config = ModelConfig()
    assert vision_slice_flops(config.vision) == pytest.approx(1.93e12, rel=0.01)
    assert decode_step_flops(config.text) == pytest.approx(1.43e10, rel=0.01)
    assert 130 < encode_decode_flop_ratio() < 140


def test_cli_demo_model(tmp_path, capsys):
    assert main(["demo-model", str(tmp_path / "m"), "--shards", "2", "--seed", "3"]) == 0
    assert "wrote" in capsys.readouterr().out
    index = json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 2


def test_cli_reports_bad_arguments_in_one_line(tmp_path, capsys):
    assert main(["demo-model", str(tmp_path), "--shards", "0"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("unifiedserve: error: num_shards") and err.count("\n") == 1
    with pytest.raises(SystemExit) as info:
        main(["demo-model", "--help"])
    assert info.value.code == 0


def test_a_folder_holding_other_files_is_refused_and_left_as_it_was(tmp_path, capsys):
    """``demo-model .`` in a project, or a real checkpoint's folder: its weights would be deleted and a checkpoint's
    files scattered among its own. A folder demo-model wrote (whole or cut short) is replaced."""
    real = tmp_path / "real"
    real.mkdir()
    for name in ("model.safetensors", "README.md", "merges.txt", "vocab.json", "notes"):
        (real / name).write_text(name)
    with pytest.raises(ValueError, match=r"holds files a demo checkpoint does not \(README\.md, merges\.txt, notes "
                                         r"and 1 more\); give a new or empty folder"):
        write_demo_model(real)
    assert {p.name: p.read_text() for p in real.iterdir()} == {n: n for n in
                                                                ("model.safetensors", "README.md", "merges.txt",
                                                                 "vocab.json", "notes")}
    (tmp_path / "file").write_text("x")
    assert main(["demo-model", str(tmp_path / "file")]) == 1
    err = capsys.readouterr().err
    assert err == f"unifiedserve: error: {tmp_path / 'file'} is a file; give a folder for the checkpoint\n"
    assert main(["demo-model", str(tmp_path / "file" / "sub")]) == 1  # under a file: the system's reason, no [Errno]
    assert capsys.readouterr().err == f"unifiedserve: error: {tmp_path / 'file' / 'sub'}: Not a directory\n"

    cut = tmp_path / "cut"  # a write cut short: config.json not yet back, a shard and a part file left
    cut.mkdir()
    for name in ("tokenizer.json", "model-00001-of-00002.safetensors", ".tokenizer_config.json.123.part"):
        (cut / name).write_text("")
    write_demo_model(cut)
    assert {p.name for p in cut.iterdir()} == FILES | {".tokenizer_config.json.123.part"}
    (tmp_path / "empty").mkdir()
    assert {p.name for p in write_demo_model(tmp_path / "empty").iterdir()} == FILES


def test_config_json_is_written_last(tmp_path, monkeypatch):
    """Its presence means a whole checkpoint: LLM() and `serve` without --model write the demo model only when it is
    missing, so a process starting while another writes must not find config.json beside half the weights."""
    from unifiedserve.model import demo

    write_demo_model(tmp_path)  # a checkpoint already there: replaced
    seen = []
    real = demo._write_weights

    def watched(config, path, *args):
        seen.append((path / "config.json").exists())
        return real(config, path, *args)

    monkeypatch.setattr(demo, "_write_weights", watched)
    write_demo_model(tmp_path, seed=4)
    assert seen == [False] and (tmp_path / "config.json").is_file()
    assert not list(tmp_path.glob(".*.part"))


def test_llm_without_a_model_writes_the_default_demo_model_once(tmp_path, monkeypatch):
    """``LLM()`` looks for the default demo model under the home folder, not under a folder named '~' (before, it
    rewrote the demo model at every construction, under any other process reading it)."""
    from unifiedserve.engine import LLM
    from unifiedserve.model import demo

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    writes = []
    real = demo.write_demo_model
    monkeypatch.setattr(demo, "write_demo_model", lambda path, **kw: writes.append(path) or real(path, **kw))
    LLM()
    LLM()
    assert writes == [tmp_path / ".cache" / "unifiedserve" / "demo-model"]
    assert not (tmp_path / "~").exists()


def test_progress_follows_the_weights_to_their_last_byte(tmp_path, capsys, monkeypatch):
    """A 7B's weights take minutes on a CPU: write_demo_model reports bytes drawn and saved, and the CLI shows a bar
    on stderr for checkpoints of a GiB or more (the tiny one is below: nothing shown), unless --no-progress."""
    from unifiedserve import cli

    calls = []
    write_demo_model(tmp_path / "a", num_shards=2, progress=lambda done, total: calls.append((done, total)))
    total = calls[-1][1]
    weights = sum(f.stat().st_size for f in (tmp_path / "a").glob("*.safetensors"))
    assert {t for _, t in calls} == {total} and calls[-1][0] == total and 0.95 * weights < total <= weights
    assert all(a[0] <= b[0] for a, b in zip(calls, calls[1:])) and len(calls) > 4

    assert main(["demo-model", str(tmp_path / "b")]) == 0
    assert capsys.readouterr().err == ""  # below the bar's size
    monkeypatch.setattr(cli, "PROGRESS_MIN_BYTES", 0)
    assert main(["demo-model", str(tmp_path / "c")]) == 0
    assert "weights" in capsys.readouterr().err
    assert main(["demo-model", str(tmp_path / "d"), "--no-progress"]) == 0
    assert capsys.readouterr().err == ""


def test_a_disk_without_room_is_refused_before_the_previous_checkpoint_is_deleted(tmp_path, capsys, monkeypatch):
    """A 7B preset is 30 GB: on a small disk the write used to fail midway with safetensors' traceback, the old
    checkpoint already deleted. Now one line, and the old checkpoint is still there."""
    import shutil
    from collections import namedtuple

    import unifiedserve.model.demo as demo

    write_demo_model(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(demo.shutil, "disk_usage", lambda p: usage(10**6, 10**6 - 1000, 1000))
    assert main(["demo-model", str(tmp_path), "--preset", "qwen2.5-vl-3b", "--num-text-layers", "1",
                 "--num-vision-layers", "4"]) == 1
    err = capsys.readouterr().err
    assert "the weights need" in err and "GiB free" in err and err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    monkeypatch.setattr(demo.shutil, "disk_usage", shutil.disk_usage)
    assert main(["demo-model", str(tmp_path / "x"), "--preset", "qwen2.5-vl-3b", "--num-text-layers", "99"]) == 1
    assert "num_text_layers must be at most the preset's 36, got 99" in capsys.readouterr().err

"""The attention warm-up's command line: shapes from presets (no checkpoint) and from checkpoint folders."""

import pytest

from unifiedserve.attention import warmup
from unifiedserve.model.demo import write_demo_model


def test_presets_and_folders_give_their_shapes(tmp_path, monkeypatch, capsys):
    seen = []
    monkeypatch.setattr(warmup, "warm_up", lambda text, vision, dtype: seen.append(
        (text.num_attention_heads, text.num_key_value_heads, text.head_dim, vision.num_heads, dtype)) or {"llm": 0.0})
    folder = write_demo_model(tmp_path / "demo", seed=1)
    assert warmup.main(["--preset", "qwen2.5-vl-7b", "--preset", "tiny", "--model", str(folder)]) == 0
    import torch

    assert seen == [(28, 4, 128, 16, torch.bfloat16), (4, 2, 64, 2, torch.bfloat16), (4, 2, 64, 2, torch.bfloat16)]
    out = capsys.readouterr().out.strip()
    assert out.startswith("attention kernels warm: qwen2.5-vl-7b: llm 0.0 s; tiny: ") and str(folder) in out


def test_bad_input_is_one_error_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        warmup.main([])
    assert exit_info.value.code == 2 and "give at least one --model or --preset" in capsys.readouterr().err
    assert warmup.main(["--model", str(tmp_path / "missing")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warmup: error: ") and "config.json" in err[0]

"""bench/engine/bench_host.py: the host-time benchmark runs, times what it says, and leaves the engine as it was."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "engine"))

import bench_host  # noqa: E402


def test_bench_host_runs_and_restores_the_decoder(tmp_path, capsys):
    import unifiedserve.engine.runner as runner_module

    real = runner_module.run_decoder
    out = tmp_path / "host.json"
    assert bench_host.main(["--batches", "1,3", "--contexts", "64,3000", "--out", str(out)]) == 0
    assert runner_module.run_decoder is real  # the stand-in forward is gone again
    results = json.loads(out.read_text())
    assert set(results["metadata_ms"]) == {"1x64", "1x3000", "3x64", "3x3000"}
    assert set(results["step_ms"]) == {"1", "3"}
    assert all(0 < v < 1000 for part in results.values() for v in part.values())
    assert "step      batch   3 (no model work)" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--batches", "0"], ["--contexts", "a,b"], ["--batches", "5000"]])
def test_bench_host_rejects_bad_sizes(argv):
    with pytest.raises(SystemExit) as e:
        bench_host.main(argv)
    assert e.value.code == 2

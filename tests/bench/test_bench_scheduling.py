"""bench/serve/bench_scheduling.py: bad flags are one error line (exit 2) before any media is made or server run."""

from __future__ import annotations

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "serve"))

import bench_scheduling  # noqa: E402


@pytest.mark.parametrize("argv, needle", [
    (["--scale", "2"], "scale must be in (0, 1]"),
    (["--num-requests", "0"], "num_requests must be >= 1"),
    (["--goodput", "foo"], "--goodput takes ttft:MS"),
    (["--server-args=--scheduling-policy fcfs"], "must not set --scheduling-policy"),
])
def test_bad_flags_are_one_error_line(tmp_path, capsys, argv, needle):
    assert bench_scheduling.main([*argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("bench_scheduling.py: error: ") and needle in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()

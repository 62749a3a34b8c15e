"""launch/ray-cluster.sh: usage and one-line errors (no real cluster: `ray stop` would end every Ray
process of this user on a shared machine)."""

from __future__ import annotations

import os
import pathlib
import subprocess

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "launch" / "ray-cluster.sh"


def cluster(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=30)


def test_usage():
    bad = cluster("restart")
    assert bad.returncode == 2 and bad.stderr.startswith("usage: launch/ray-cluster.sh head")


@pytest.mark.parametrize("args, needle", [
    (["worker"], "worker needs the head's HOST:PORT"),
    (["worker", "nohost"], "worker needs the head's HOST:PORT"),
    (["head", "--port", "0"], "--port must be 1..65535"),
    (["head", "--port"], "--port needs a value"),
])
def test_bad_arguments_are_one_line(args, needle):
    run = cluster(*args)
    assert run.returncode == 1 and run.stderr.startswith(f"ray-cluster.sh: error: {needle}")
    assert len(run.stderr.strip().splitlines()) == 1 and run.stdout == ""


def test_ray_missing_says_how_to_install(tmp_path):
    for args in (["head"], ["worker", "10.0.0.1:6379"], ["stop"]):
        run = cluster(*args, RAY_BIN=str(tmp_path / "no-ray"))
        assert run.returncode == 1 and "pip install 'unifiedserve[ray]'" in run.stderr
        assert len(run.stderr.strip().splitlines()) == 1

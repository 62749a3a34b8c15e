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


def executable(path: pathlib.Path, body: str) -> pathlib.Path:
    path.write_text(f"#!/usr/bin/env bash\n{body}\n")
    path.chmod(0o755)
    return path


def script_beside(tmp_path: pathlib.Path, mps_body: str) -> str:
    """A copy of the script whose launch/mps.sh is a stand-in running ``mps_body``."""
    here = tmp_path / "launch"
    here.mkdir()
    (here / "ray-cluster.sh").write_text(SCRIPT.read_text())
    executable(here / "mps.sh", mps_body)
    return str(here / "ray-cluster.sh")


def test_stop_stops_mps_even_when_ray_is_missing_or_its_stop_fails(tmp_path):
    """A node's MPS daemon must not outlive `stop`: Ray missing, or `ray stop` failing, still reaches `mps.sh stop`
    (here a stand-in recording its call)."""
    script = script_beside(tmp_path, f"echo stopped >> {tmp_path / 'mps.calls'}")
    failing = executable(tmp_path / "ray", "echo 'ray: cannot stop' >&2\nexit 3")
    for ray_bin, needle in ((str(tmp_path / "no-ray"), "pip install 'unifiedserve[ray]'"),
                            (str(failing), "stop did not finish cleanly")):
        run = subprocess.run(["bash", script, "stop"], env={**os.environ, "RAY_BIN": ray_bin}, capture_output=True,
                             text=True, timeout=30)
        assert run.returncode == 1 and needle in run.stderr, run.stderr
    assert (tmp_path / "mps.calls").read_text().splitlines() == ["stopped", "stopped"]


def test_a_failed_ray_start_stops_the_mps_daemon_it_started(tmp_path):
    script = script_beside(tmp_path, f"echo \"$1\" >> {tmp_path / 'mps.calls'}")
    bins = tmp_path / "bin"
    bins.mkdir()
    executable(bins / "nvidia-smi", "echo 'GPU 0: fake'")
    ray = executable(bins / "ray", "echo 'ray: no' >&2; exit 4")
    run = subprocess.run(["bash", script, "head"], capture_output=True, text=True, timeout=30,
                         env={**os.environ, "PATH": f"{bins}:{os.environ['PATH']}", "RAY_BIN": str(ray)})
    assert run.returncode == 1 and "ray start failed (exit 4" in run.stderr, run.stderr
    assert (tmp_path / "mps.calls").read_text().split() == ["start", "check", "env", "stop"]

"""launch/mps.sh: arguments and errors everywhere; a real start/status/stop cycle where MPS exists."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "launch" / "mps.sh"
HAS_MPS = shutil.which("nvidia-cuda-mps-control") is not None


def mps(*args: str, folder: pathlib.Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "UNIFIEDSERVE_MPS_DIR": str(folder)}
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=60)


def test_usage_and_env(tmp_path):
    bad = mps("restart", folder=tmp_path)
    assert bad.returncode == 2 and "usage: launch/mps.sh start|stop|status|env" in bad.stderr
    env = mps("env", folder=tmp_path)
    assert env.returncode == 0
    assert env.stdout.strip() == (f"export CUDA_MPS_PIPE_DIRECTORY={tmp_path}/pipe "
                                  f"CUDA_MPS_LOG_DIRECTORY={tmp_path}/log")


def test_status_and_stop_when_not_running(tmp_path):
    status = mps("status", folder=tmp_path)
    assert status.returncode == 3 and "MPS not running" in status.stdout
    stop = mps("stop", folder=tmp_path)
    assert stop.returncode == 0 and not tmp_path.exists()


@pytest.mark.skipif(HAS_MPS, reason="this machine has MPS")
def test_start_without_mps_is_one_error_line(tmp_path):
    start = mps("start", folder=tmp_path)
    assert start.returncode == 1 and start.stdout == ""
    assert start.stderr.count("\n") == 1 and start.stderr.startswith("mps.sh: error: nvidia-cuda-mps-control not found")


@pytest.mark.skipif(not HAS_MPS, reason="nvidia-cuda-mps-control is not installed")
def test_start_status_stop_leaves_nothing(tmp_path):
    folder = tmp_path / "mps"
    try:
        assert mps("start", folder=folder).returncode == 0
        assert "already running" in mps("start", folder=folder).stdout
        assert mps("status", folder=folder).returncode == 0
    finally:
        stop = mps("stop", folder=folder)
    assert stop.returncode == 0 and "MPS stopped" in stop.stdout and not folder.exists()
    assert mps("status", folder=folder).returncode == 3

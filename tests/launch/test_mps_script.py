"""launch/mps.sh: arguments and errors everywhere; a real start/status/stop cycle where MPS exists."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess

import pytest

from fake_mps import fake_driver_env

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "launch" / "mps.sh"
HAS_MPS = shutil.which("nvidia-cuda-mps-control") is not None


def mps(*args: str, folder: pathlib.Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "UNIFIEDSERVE_MPS_DIR": str(folder)}
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=60)


def test_usage_and_env(tmp_path):
    bad = mps("restart", folder=tmp_path)
    assert bad.returncode == 2 and "usage: launch/mps.sh start|stop|status|check|env" in bad.stderr
    env = mps("env", folder=tmp_path)
    assert env.returncode == 0
    assert env.stdout.strip() == (f"export CUDA_MPS_PIPE_DIRECTORY={tmp_path}/pipe "
                                  f"CUDA_MPS_LOG_DIRECTORY={tmp_path}/log")


def test_status_and_stop_when_not_running(tmp_path):
    status = mps("status", folder=tmp_path)
    assert status.returncode == 3 and "MPS not running" in status.stdout
    check = mps("check", folder=tmp_path)
    assert check.returncode == 3 and "MPS not running" in check.stdout
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



def fake_mps(tmp_path: pathlib.Path, folder: pathlib.Path, *args: str, socket: bool) -> subprocess.CompletedProcess:
    env = {**os.environ, "UNIFIEDSERVE_MPS_DIR": str(folder), **fake_driver_env(tmp_path / "bin", socket=socket)}
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=60)


def fake_daemon_alive(pid: int) -> bool:
    """Running (a zombie left for init to reap counts as gone)."""
    try:
        return ") Z " not in pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False


def test_a_daemon_that_never_answers_is_stopped_and_its_folder_removed(tmp_path):
    """``start`` whose daemon does not answer in 5 s: one error line, and neither the daemon nor its folder
    (whose socket would pass for a live daemon) is left behind."""
    folder = tmp_path / "mps"
    start = fake_mps(tmp_path, folder, "start", socket=False)
    assert start.returncode == 1 and start.stdout == "", start.stdout
    assert start.stderr.count("\n") == 1 and "did not answer on its control pipe in 5 s (stopped" in start.stderr
    assert not folder.exists()
    # the daemon it started is gone (its pid file went with the folder: find it by name)
    names = [p for p in pathlib.Path("/proc").glob("[0-9]*") if _comm(p).startswith("nvidia-cuda-mps")
             and f"CUDA_MPS_PIPE_DIRECTORY={folder}/pipe".encode() in _environ(p)]
    assert names == []


def test_stop_kills_a_daemon_that_does_not_quit(tmp_path):
    """And ``check`` on a daemon no CUDA client can use (here: no driver at all) is one error line."""
    folder = tmp_path / "mps"
    pid = None
    try:
        start = fake_mps(tmp_path, folder, "start", socket=True)
        assert start.returncode == 0 and "MPS started" in start.stdout, start.stderr
        pid = int((folder / "pipe" / "fake.pid").read_text())
        if shutil.which("nvidia-smi") is None:  # (with a real driver, the client would try the fake's socket)
            check = fake_mps(tmp_path, folder, "check", socket=True)
            assert check.returncode == 1 and check.stdout == "" and check.stderr.count("\n") == 1, check.stderr
            assert check.stderr.startswith("mps.sh: error: a CUDA client could not run under the MPS daemon")
            assert "libcuda.so.1" in check.stderr
        stop = fake_mps(tmp_path, folder, "stop", socket=True)
        assert stop.returncode == 0 and "MPS killed (it did not quit in 10 s)" in stop.stdout, stop.stderr
        assert not folder.exists() and not fake_daemon_alive(pid)
    finally:
        if pid is not None and fake_daemon_alive(pid):
            os.kill(pid, 9)


def _comm(proc: pathlib.Path) -> str:
    try:
        return (proc / "comm").read_text().strip()
    except OSError:
        return ""


def _environ(proc: pathlib.Path) -> bytes:
    try:
        return (proc / "environ").read_bytes()
    except OSError:
        return b""

"""launch/serve-node.sh: usage, one-line errors, and a real start/status/stop cycle on the CPU demo model
that leaves no process, pid file or shared memory behind."""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "launch" / "serve-node.sh"
sys.path.insert(0, str(ROOT / "tests" / "unifiedserve" / "server"))

from serve_helpers import SMALL_POOLS, free_port, http  # noqa: E402


def node(*args: str, folder: pathlib.Path, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], env={**os.environ, "UNIFIEDSERVE_NODE_DIR": str(folder), **env},
                          capture_output=True, text=True, timeout=timeout)


def session_processes(pid: int) -> list[str]:
    """Processes still in the server's session (it is started with setsid: its pid is the session id)."""
    found = []
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):  # (not ps: the GPU machine's image may lack procps)
        try:
            fields = stat.read_text().rsplit(") ", 1)[1].split()  # after "pid (comm) ": state ppid pgrp session
        except (OSError, IndexError):
            continue
        if fields[3] == str(pid) and fields[0] != "Z":
            found.append(stat.parent.name)
    return found


def shm_folder(folder: pathlib.Path) -> pathlib.Path:
    cksum = subprocess.run(["cksum"], input=str(folder), capture_output=True, text=True).stdout.split()[0]
    return pathlib.Path(f"/dev/shm/unifiedserve-node-{os.getuid()}-{cksum}")


def up(url: str) -> bool:
    try:
        return http("GET", url, timeout=3)[0] == 200
    except OSError:  # not listening (yet, or any more)
        return False


def test_usage_status_and_stop_when_not_running(tmp_path):
    bad = node("restart", folder=tmp_path)
    assert bad.returncode == 2 and bad.stderr.startswith("usage: launch/serve-node.sh start")
    status = node("status", folder=tmp_path)
    assert status.returncode == 3 and "server not running" in status.stdout
    stop = node("stop", folder=tmp_path)
    assert stop.returncode == 0 and "server not running" in stop.stdout


@pytest.mark.parametrize("env, args, needle", [
    ({"UNIFIEDSERVE_BIN": "/nonexistent/unifiedserve"}, [], "'/nonexistent/unifiedserve' not found"),
    ({"UNIFIEDSERVE_START_TIMEOUT": "soon"}, [], "UNIFIEDSERVE_START_TIMEOUT must be a positive number"),
    ({}, ["--port", "http"], "--port must be a number"),
])
def test_bad_settings_are_one_line(tmp_path, env, args, needle):
    run = node("start", *args, folder=tmp_path, **env)
    assert run.returncode == 1 and run.stderr.startswith(f"serve-node.sh: error: {needle}"), run.stderr
    assert len(run.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "server.pid").exists()


def test_a_server_that_fails_to_start_is_reported_and_cleaned_up(tmp_path):
    run = node("start", "--model", str(tmp_path / "no-such-model"), "--port", str(free_port()), folder=tmp_path)
    assert run.returncode == 1 and "the server exited before it was ready" in run.stderr
    assert "error:" in run.stderr.splitlines()[-1]  # the server's own one-line reason follows
    assert not (tmp_path / "server.pid").exists() and not shm_folder(tmp_path).exists()


@pytest.mark.skipif(shutil.which("flock") is None, reason="no flock(1) here: starts are not serialised")
def test_a_start_while_another_is_starting_refuses_at_once(tmp_path):
    """Two starts at once would both find no server and start two; the second one is refused before it starts
    anything (here the first is stood in for by holding its lock)."""
    import fcntl

    folder = tmp_path / "node"
    folder.mkdir()
    with open(folder / "start.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        second = node("start", "--port", str(free_port()), folder=folder, timeout=30)
    assert second.returncode == 1 and second.stderr.count("\n") == 1
    assert f"another 'serve-node.sh start' is starting a server from {folder}" in second.stderr
    assert not (folder / "server.pid").exists() and not (folder / "server.log").exists()


def test_start_status_stop_leaves_nothing_behind(tmp_path):
    from unifiedserve.model.demo import write_demo_model

    demo_path = write_demo_model(tmp_path / "demo-model")
    port = free_port()
    folder = tmp_path / "node"
    stale = shm_folder(folder) / "unifiedserve-0123456789ab-kv"  # a pool file of a server killed while starting
    stale.parent.mkdir(parents=True, exist_ok=True)
    stale.write_bytes(b"\0" * 4096)
    pid = None
    try:  # start inside: a start cut short (a timeout) must still be stopped, or its server would outlive the test
        start = node("start", "--model", str(demo_path), "--port", str(port), *SMALL_POOLS, folder=folder, timeout=300)
        assert start.returncode == 0, start.stderr + (folder / "server.log").read_text()
        assert not stale.exists()
        assert "no NVIDIA GPU on this node: the server runs on the CPU" in start.stdout or "MPS" in start.stdout
        pid = int((folder / "server.pid").read_text())
        assert f"ready: http://127.0.0.1:{port}/health" in start.stdout
        assert http("GET", f"http://127.0.0.1:{port}/health")[0] == 200
        assert len(session_processes(pid)) >= 4  # api, vision, core, decode
        status = node("status", folder=folder)
        assert status.returncode == 0 and f"server running (pid {pid}), healthy" in status.stdout
        again = node("start", "--port", str(free_port()), folder=folder)
        assert again.returncode == 1 and f"a server already runs from {folder} (pid {pid})" in again.stderr
    finally:
        stop = node("stop", folder=folder)
    assert stop.returncode == 0 and f"server stopped (pid {pid})" in stop.stdout
    assert session_processes(pid) == []
    assert not (folder / "server.pid").exists() and not shm_folder(folder).exists()
    assert node("status", folder=folder).returncode == 3


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a real driver here: the fakes would meet it")
def test_a_node_whose_mps_daemon_is_not_usable_time_slices_the_gpu(tmp_path):
    """On a GPU node (faked: nvidia-smi lists one) whose MPS daemon starts but no CUDA client can use (faked: it
    answers, and there is no driver), the node stops that daemon, says so once and serves without MPS."""
    from fake_mps import fake_driver_env
    from unifiedserve.model.demo import write_demo_model

    demo_path = write_demo_model(tmp_path / "demo-model")
    port, folder = free_port(), tmp_path / "node"
    env = fake_driver_env(tmp_path / "bin", socket=True, gpu=True)
    try:
        start = node("start", "--model", str(demo_path), "--port", str(port), *SMALL_POOLS, folder=folder, timeout=300,
                     **env)
        assert start.returncode == 0, start.stderr + (folder / "server.log").read_text()
        assert "MPS started" in start.stdout and "a CUDA client could not run under the MPS daemon" in start.stderr
        assert "no MPS (its daemon is not usable, above): the server's processes time-slice the GPU" in start.stdout
        assert not (folder / "mps").exists() and not (folder / "mps.started").exists()
        assert http("GET", f"http://127.0.0.1:{port}/health")[0] == 200
    finally:
        stop = node("stop", folder=folder, **env)
    assert stop.returncode == 0 and "server stopped" in stop.stdout
    assert not shm_folder(folder).exists()


@contextlib.contextmanager
def restarting_node(tmp_path, serve_args: list[str], startup_s: float, **env: str):
    """A node started with --restart 1, yielded once it has run the 10 s a restart needs; stopped after,
    with nothing left behind. Yields ``(folder, port, health url, first api pid)``."""
    port, folder = free_port(), tmp_path / "node"
    health = f"http://127.0.0.1:{port}/health"
    session = None
    try:  # start inside: a start cut short must still be stopped (the server runs in its own session)
        start = node("start", "--restart", "1", "--port", str(port), *serve_args, folder=folder, timeout=startup_s,
                     **env)
        assert start.returncode == 0, start.stderr + (folder / "server.log").read_text()
        session = int((folder / "server.pid").read_text())
        first_api = int((folder / "api.pid").read_text())
        time.sleep(max(0.0, 11 - (time.time() - os.stat(folder / "api.pid").st_mtime)))  # restarts follow >= 10 s runs
        yield folder, port, health, first_api
    finally:
        stop = node("stop", folder=folder)
    assert stop.returncode == 0 and "server stopped" in stop.stdout
    if session is not None:
        assert session_processes(session) == []
    assert not shm_folder(folder).exists()


def wait_for_restart(folder: pathlib.Path, health: str, first_api: int, timeout: float) -> str:
    """Wait until a new server (another api pid) answers /health; returns the node's log."""
    deadline = time.monotonic() + timeout
    new_api = first_api
    while time.monotonic() < deadline:
        api = folder / "api.pid"
        new_api = int(api.read_text()) if api.exists() else first_api
        if new_api != first_api and up(health):
            break
        time.sleep(0.5)
    log = (folder / "server.log").read_text()
    assert new_api != first_api, log
    return log


@pytest.mark.slow
def test_restart_after_a_worker_dies(tmp_path):
    """--restart 1: a killed worker ends the server with an error; the node starts a new one, once."""
    from unifiedserve.model.demo import write_demo_model

    demo_path = write_demo_model(tmp_path / "demo-model")
    with restarting_node(tmp_path, ["--model", str(demo_path), *SMALL_POOLS], 300) as (folder, _, health, first_api):
        status, body = http("GET", health)
        assert status == 200
        os.kill(body["workers"]["decode"], signal.SIGKILL)
        log = wait_for_restart(folder, health, first_api, 120)
        assert "decode worker process exited unexpectedly" in log and "restart 1 of 1" in log
        status = node("status", folder=folder)
        assert status.returncode == 0 and "restarted 1 times" in status.stdout


def _fault_and_restart(tmp_path, serve_args: list[str], env: dict[str, str], startup_s: float, cuda: bool = False):
    """Start a node with --restart 1 and an injected fault in decode's 3rd step; the request in flight gets the
    server's error, the server exits with one, the node restarts it (the marker file stops a second fault), and
    the new server answers. ``cuda``: the fault must be a CUDA one, under MPS, and MPS must be restarted too."""
    import openai

    marker = tmp_path / "fault.fired"
    with restarting_node(tmp_path, serve_args, startup_s, UNIFIEDSERVE_INJECT_FAULT=f"decode:3:{marker}",
                         **env) as (folder, port, health, first_api):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        with pytest.raises(openai.InternalServerError):  # the server's own error for it, not a lost connection
            client.chat.completions.create(model=model, max_tokens=40,
                                           messages=[{"role": "user", "content": "Count to forty."}],
                                           extra_body={"ignore_eos": True})
        assert marker.exists()
        log = wait_for_restart(folder, health, first_api, startup_s)
        assert "injecting a fatal fault" in log and "decode worker process exited unexpectedly" in log, log[-3000:]
        assert "restart 1 of 1" in log
        if cuda:
            assert "device-side assert" in log, log[-3000:]  # a CUDA fault, not the host-side abort after it
            assert "no MPS daemon" not in log and "MPS started" in log and "MPS stopped" in log, log[-3000:]
        out = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=4,
                                             messages=[{"role": "user", "content": "Hello"}])
        assert out.choices[0].finish_reason in ("length", "stop")


@pytest.mark.slow
def test_injected_fault_fails_the_request_and_the_node_restarts(tmp_path):
    """The CPU stand-in of issue 14's fault test: decode aborts mid-request (UNIFIEDSERVE_INJECT_FAULT)."""
    from unifiedserve.model.demo import write_demo_model

    demo_path = write_demo_model(tmp_path / "demo-model")
    _fault_and_restart(tmp_path, ["--model", str(demo_path), *SMALL_POOLS], {}, startup_s=300)


@pytest.mark.cuda
@pytest.mark.skipif(shutil.which("nvidia-cuda-mps-control") is None, reason="nvidia-cuda-mps-control is not installed")
def test_cuda_fault_under_mps_fails_the_request_and_the_node_restarts(tmp_path):
    """Issue 14's fault test on the GPU: decode trips a device-side assert (a sticky CUDA error) under the
    node's MPS daemon; the in-flight request errors, the server exits, MPS and the server come back."""
    model = pathlib.Path(os.environ.get("UNIFIEDSERVE_FAULT_MODEL", "/tmp/qwen2.5-vl-7b"))
    if not (model / "config.json").exists():
        pytest.skip(f"no model at {model} (scripts/gpu_check.sh writes the 7B preset there)")
    _fault_and_restart(tmp_path, ["--device", "cuda", "--model", str(model), "--kv-cache-gb", "8"],
                       {}, startup_s=400, cuda=True)


def test_stop_kills_what_is_left_of_a_session_whose_leader_died(tmp_path):
    """The leader (the recorded pid) is gone but a process of its session still runs (a server holding the port and
    the GPU): `stop` kills it rather than saying "not running" and forgetting it."""
    leader = subprocess.run(["setsid", "bash", "-c", "echo $$; sleep 300 > /dev/null 2>&1 < /dev/null & exit 0"],
                            capture_output=True, text=True, timeout=10)
    sid = int(leader.stdout.split()[0])
    time.sleep(0.2)
    assert session_processes(sid), "the session's sleep should outlive its leader"
    (tmp_path / "server.pid").write_text(f"{sid}\n")
    stopped = node("stop", folder=tmp_path, timeout=30)
    assert stopped.returncode == 0, stopped.stderr
    assert "session leader is gone" in stopped.stdout and "server not running" in stopped.stdout
    assert session_processes(sid) == [] and not (tmp_path / "server.pid").exists()

"""``unifiedserve serve --ray`` flags: one error line and a non-zero exit before anything starts;
the plain server never imports Ray."""

from __future__ import annotations

import os
import socket
import threading
from types import SimpleNamespace
import subprocess
import sys
import time

import pytest

from unifiedserve.cli import main


def serve(*args: str, env=None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "unifiedserve.cli", "serve", "--device", "cpu", *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


def one_error_line(run: subprocess.CompletedProcess, needle: str) -> None:
    assert run.returncode != 0 and "Traceback" not in run.stderr, run.stderr
    lines = [line for line in run.stderr.strip().splitlines() if "error" in line]
    assert len(lines) == 1 and needle in lines[0], run.stderr
    assert "starting workers" not in run.stderr + run.stdout and "Started Serve" not in run.stderr


@pytest.mark.parametrize("args, needle", [
    (["--ray", "--replicas", "0"], "argument --replicas: must be at least 1"),
    (["--ray", "--max-replicas", "-1"], "argument --max-replicas"),
    (["--ray", "--affinity-load-bound", "0"], "argument --affinity-load-bound"),
])
def test_bad_counts_are_argparse_errors(args, needle, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", *args])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and needle in err and "Traceback" not in err


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once the socket is closed


@pytest.mark.parametrize("args, needle", [
    (["--replicas", "2"], "--replicas needs --ray"),
    (["--ray", "--ray-address", "not an address"], "expected HOST:PORT of the Ray head"),
    (["--ray", "--ray-address", "127.0.0.1:99999"], "expected HOST:PORT"),
    (["--ray", "--ray-address", f"127.0.0.1:{closed_port()}"], "no Ray head answers there"),
    (["--ray", "--replicas", "3", "--max-replicas", "2"], "outside --min-replicas/--max-replicas"),
    (["--ray", "--min-replicas", "3", "--max-replicas", "2"], "--min-replicas 3 is above --max-replicas 2"),
    (["--ray", "--replicas", "2", "--replica-cpus", str(os.cpu_count())], "Ray would never place the rest"),
    (["--ray", "--max-replicas", "4", "--replica-cpus", str(os.cpu_count())],
     f"--max-replicas 4 x --replica-cpus {os.cpu_count()} needs"),
])
def test_bad_ray_flags_fail_fast_with_one_line(args, needle):
    started = time.perf_counter()
    one_error_line(serve(*args), needle)
    assert time.perf_counter() - started < 15.0


def test_a_port_in_use_is_one_error_line_before_ray_starts():
    """A taken port is refused up front, not left to Serve's proxy inside a started Ray instance."""
    pytest.importorskip("ray.serve")  # without Ray the first error is that it is missing (test below)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.perf_counter()
        one_error_line(serve("--ray", "--port", str(port)), f"--port {port}: cannot listen on 127.0.0.1:{port}")
    assert time.perf_counter() - started < 30.0


def test_ray_missing_says_how_to_install_it(tmp_path):
    fake = tmp_path / "ray"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('No module named ray')\n")  # shadows the installed Ray
    run = serve("--ray", "--replicas", "2", env={**os.environ, "PYTHONPATH": str(tmp_path)})
    one_error_line(run, "pip install 'unifiedserve[ray]'")
    assert run.stderr.strip().splitlines()[-1].startswith("unifiedserve: error:")


def test_the_plain_server_never_imports_ray():
    code = ("import sys\n"
            "from unifiedserve.cli import build_parser\n"
            "from unifiedserve.server import api, serve, serve_setup\n"
            "from unifiedserve.ray_serve.launch import ray_requested\n"
            "args = build_parser().parse_args(['serve', '--port', '8123'])\n"
            "assert not ray_requested(args)\n"
            "serve_setup.request_limits(args); serve_setup.media_policy(args)\n"
            "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_help_lists_the_ray_flags(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    for flag in ("--ray", "--replicas", "--ray-address", "--min-replicas", "--max-replicas", "--affinity-load-bound"):
        assert flag in out


def test_more_replicas_than_cores_share_them():
    from unifiedserve.ray_serve.launch import check_ray_args

    cpus = os.cpu_count()
    args = SimpleNamespace(replicas=cpus + 1, min_replicas=None, max_replicas=None, ray_router=None, replica_cpus=None,
                           ray_address=None)
    check_ray_args(args)  # Ray places every replica of the default share
    assert 0 < args.replica_cpus < 1 and args.replicas * args.replica_cpus <= cpus
    args.replicas, args.replica_cpus = 1, None
    check_ray_args(args)
    assert args.replica_cpus == cpus
    args.replica_cpus, args.max_replicas = None, 2 * cpus  # autoscaling: every replica it may start has its share
    check_ray_args(args)
    assert args.replica_cpus * args.max_replicas <= cpus


@pytest.mark.parametrize("cpus, most", [(7, 25), (14, 50), (28, 100), (3, 7)])
def test_the_default_share_passes_its_own_check(monkeypatch, cpus, most):
    """25 x 0.28 is 7.000000000000001 in floating point: the check counts in Ray's 1e-4 units."""
    from unifiedserve.ray_serve import launch

    monkeypatch.setattr(launch.os, "cpu_count", lambda: cpus)
    args = SimpleNamespace(replicas=1, min_replicas=None, max_replicas=most, ray_router=None, replica_cpus=None,
                           ray_address=None)
    launch.check_ray_args(args)
    assert 0 < args.replica_cpus < 1


def fake_serve(*statuses):
    """A ``serve`` module whose application goes through ``statuses`` (the last one stays)."""
    from ray.serve.schema import ApplicationStatus, DeploymentStatus, ReplicaState

    pending = SimpleNamespace(status=DeploymentStatus.UPDATING, message="taken more than 30s to be scheduled",
                              replica_states={ReplicaState.STARTING: 1, ReplicaState.RUNNING: 1})
    queue = list(statuses)

    def status():
        name = queue.pop(0) if len(queue) > 1 else queue[0]
        app = SimpleNamespace(status=ApplicationStatus[name], message="replica failed to start 3 times",
                              deployments={"Replica": pending})
        return SimpleNamespace(applications={"unifiedserve": app})

    return SimpleNamespace(status=status)


def test_start_up_waits_for_running_and_says_why_it_waits(monkeypatch, caplog):
    pytest.importorskip("ray.serve")
    from unifiedserve.ray_serve import launch

    monkeypatch.setattr(launch, "START_POLL_S", 0.01)
    caplog.set_level("INFO", logger="unifiedserve")
    assert launch.wait_running(fake_serve("NOT_STARTED", "DEPLOYING", "DEPLOYING", "RUNNING"), threading.Event(),
                               progress_s=0)
    assert "Replica updating (1 starting, 1 running): taken more than 30s to be scheduled" in caplog.text
    with pytest.raises(RuntimeError, match="replica failed to start 3 times"):
        launch.wait_running(fake_serve("DEPLOYING", "DEPLOY_FAILED"), threading.Event())


def test_a_stop_while_replicas_cannot_be_placed_is_heard():
    """SIGINT/SIGTERM set the stop event: a start-up that would wait forever (no node has room) ends at once."""
    pytest.importorskip("ray.serve")
    from unifiedserve.ray_serve import launch

    stop = threading.Event()
    threading.Timer(0.2, stop.set).start()
    started = time.perf_counter()
    assert not launch.wait_running(fake_serve("DEPLOYING"), stop)
    assert time.perf_counter() - started < 0.2 + 2 * launch.START_POLL_S


@pytest.mark.parametrize("reply, ok", [(b"HTTP/1.1 400 Bad Request\r\n\r\n", False),
                                       (b"SSH-2.0-OpenSSH_9.2\r\n", False),
                                       (b"", False), (bytes([0, 0, 0, 4, 0, 0, 0, 0, 0]), True)])
def test_an_address_that_answers_but_is_not_a_ray_head_is_refused(reply, ok):
    """ray.init retried its GCS client for more than 10 minutes against a port that answered HTTP/1."""
    from unifiedserve.ray_serve.launch import check_address

    server = socket.create_server(("127.0.0.1", 0))
    heard = []

    def answer():
        conn, _ = server.accept()
        with conn:
            heard.append(conn.recv(24))
            conn.sendall(reply)

    threading.Thread(target=answer, daemon=True).start()
    address = f"127.0.0.1:{server.getsockname()[1]}"
    with server:
        if ok:  # a SETTINGS frame: HTTP/2, as Ray's GCS answers
            check_address(address)
        else:
            # (a server that closes at once may reset the connection first: then no head "answers")
            with pytest.raises(ValueError, match="something answers there but not a Ray head|no Ray head answers"):
                check_address(address)
    assert heard == [b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"]

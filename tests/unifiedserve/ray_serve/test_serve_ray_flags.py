"""``unifiedserve serve --ray`` flags: one error line and a non-zero exit before anything starts;
the plain server never imports Ray."""

from __future__ import annotations

import socket
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
    import os
    run = serve("--ray", "--replicas", "2", env={**os.environ, "PYTHONPATH": str(tmp_path)})
    one_error_line(run, "pip install 'unifiedserve[ray]'")
    assert run.stderr.strip().splitlines()[-1].startswith("unifiedserve: error:")


def test_the_plain_server_never_imports_ray():
    code = ("import sys\n"
            "from unifiedserve.cli import build_parser\n"
            "from unifiedserve.server import api, serve\n"
            "from unifiedserve.ray_serve.launch import ray_requested\n"
            "args = build_parser().parse_args(['serve', '--port', '8123'])\n"
            "assert not ray_requested(args)\n"
            "serve.request_limits(args); serve.media_policy(args)\n"
            "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_help_lists_the_ray_flags(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    for flag in ("--ray", "--replicas", "--ray-address", "--min-replicas", "--max-replicas", "--affinity-load-bound"):
        assert flag in out

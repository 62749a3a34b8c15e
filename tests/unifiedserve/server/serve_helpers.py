"""Run a real ``unifiedserve serve`` (all four processes) in a subprocess for the server tests."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

#: small pools: the demo model needs little, and CI machines are small
SMALL_POOLS = ["--kv-cache-gb", "0.125", "--patch-buffer-gb", "0.25", "--visual-buffer-gb", "0.0625"]


def tiny_clip(folder: Path) -> Path:
    """``folder/clip.mp4``: 4 s of 320x240 H.264 at 10 fps, GOP 10 (8 frames at the model's 2 fps)."""
    import synthetic_video

    return synthetic_video.make_video(folder / "clip.mp4", codec="h264", width=320, height=240, duration_s=4.0,
                                      fps=10.0, gop=10, seed=1)


QUESTION = "What happens in this video?"


def video_message(path, question=QUESTION, **options):
    """One user message: the video at ``path`` (``file://``) with ``video_url`` options, then the question."""
    return [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": f"file://{path}", **options}},
                                         {"type": "text", "text": question}]}]


def openai_client(server: "Server"):
    """The openai client the server tests use: the server's /v1, no retries (a retry would hide a failure)."""
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method: str, url: str, body=None, headers=None, timeout: float = 60.0):
    """``(status, parsed JSON or text)`` without raising on 4xx/5xx."""
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


class Server:
    """One server instance; ``stop()`` sends a signal and returns the exit code."""

    def __init__(self, *args: str, media_dir: Path, startup_timeout: float = 180.0, pools: list[str] = SMALL_POOLS):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = media_dir / f"server-{self.port}.log"
        self._log = open(self.log_path, "w")
        cmd = [sys.executable, "-m", "unifiedserve.cli", "serve", "--port", str(self.port),
               "--allowed-local-media-path", str(media_dir), *pools, *args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                status, body = http("GET", self.url + "/health", timeout=2)
                if status == 200:
                    self.workers = body["workers"]
                    break
            except OSError:
                pass
            time.sleep(0.3)
        else:
            self.stop()
            raise RuntimeError(f"server did not become healthy:\n{self.log()}")
        self.instance = re.search(r"instance (\w+)", self.log()).group(1)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def metrics(self) -> dict[str, float]:
        """Unlabelled-by-stage gauges and histogram counts, keyed by ``name{pool=...}`` or ``name``."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        values = {}
        for line in text.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            key, value = line.rsplit(" ", 1)
            key = re.sub(r'model_name="[^"]*"', "", key)
            key = re.sub(r",+}", "}", re.sub(r"{,+", "{", key)).replace(",,", ",").replace("{}", "")
            values[key] = float(value)
        return values

    def wait_idle(self, timeout: float = 30.0) -> dict[str, float]:
        """Wait until no request is running or waiting and every pool is back to full."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            busy = {k: v for k, v in m.items()
                    if (k.startswith("unifiedserve_pool_used") or k.startswith("unifiedserve_num_requests")) and v}
            if not busy:
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"still busy after {timeout} s: {busy}")
            time.sleep(0.2)

    def pids(self) -> list[int]:
        return [self.proc.pid, *self.workers.values()]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
            raise AssertionError(f"server did not stop within {timeout} s:\n{self.log()}")
        finally:
            self._log.close()
        return code


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped) counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def leftovers(instance: str) -> list[str]:
    """Shared-memory files and socket folders a server instance left behind."""
    found = [p for p in os.listdir("/dev/shm") if instance in p] if os.path.isdir("/dev/shm") else []
    tmp = Path(os.environ.get("TMPDIR", "/tmp"))
    found += [p.name for p in tmp.glob(f"unifiedserve-{instance}-*")]
    return found

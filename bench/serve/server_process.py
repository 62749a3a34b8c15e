"""Start a ``unifiedserve serve`` subprocess for a benchmark and stop it cleanly afterwards."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def server_device(server_args: str) -> str | None:
    """The ``--device`` a server's extra flags give (``--device cuda:1`` or ``--device=cuda``), None without one."""
    words = server_args.split()
    for i, w in enumerate(words):
        if w.startswith("--device="):
            return w.split("=", 1)[1]
        if w == "--device" and i + 1 < len(words):
            return words[i + 1]
    return None


def on_gpu(server_args: str) -> bool:
    """Whether a server with these extra flags runs on a GPU (``--device cuda`` or ``cuda:N``)."""
    return (server_device(server_args) or "").startswith("cuda")


def _label(labels: str, name: str) -> str | None:
    """The value of label ``name`` in a metric key's ``{...}`` part, None without it."""
    found = re.search(rf'{name}="([^"]*)"', labels)
    return found.group(1) if found else None


def histogram_totals(metrics: dict[str, float], name: str, label: str | None = None) -> dict[str, tuple[float, float]]:
    """``(sum, count)`` of the Prometheus histogram ``name`` in ``metrics`` (:meth:`ServerProcess.metrics`),
    per value of ``label`` (everything under ``""`` without one), summed over every other label (a
    Ray replica's, for one)."""
    out: dict[str, tuple[float, float]] = {}
    for key, value in metrics.items():
        base, _, labels = key.partition("{")
        field = base[len(name) + 1:] if base.startswith(name + "_") else None
        if field not in ("sum", "count"):
            continue
        group = _label(labels, label) if label else ""
        if group is None:
            continue
        s, c = out.get(group, (0.0, 0.0))
        out[group] = (s + value, c) if field == "sum" else (s, c + value)
    return out


def engine_counters(metrics: dict[str, float]) -> dict[str, dict[str, float]]:
    """The ``unifiedserve_engine_*`` gauges of :meth:`ServerProcess.metrics` per process:
    ``{process: {"iterations", "busy_seconds", "encode_seconds", "encode_tokens", "prefill_tokens", "decode_tokens"}}``,
    summed over other labels (a Ray replica's)."""
    out: dict[str, dict[str, float]] = {}
    for key, value in metrics.items():
        name, _, labels = key.partition("{")
        if not name.startswith("unifiedserve_engine_"):
            continue
        process, kind = _label(labels, "process"), _label(labels, "kind")
        field = name[len("unifiedserve_engine_"):]
        field = f"{kind}_tokens" if field == "tokens" and kind else field
        entry = out.setdefault(process or "", {})
        entry[field] = entry.get(field, 0.0) + value
    return out


def iteration_summary(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, dict]:
    """Per process, what its iterations did between two :func:`engine_counters` readings: how many, their mean
    wall time, and tokens per iteration by kind (encode: patch tokens; prefill: prompt tokens; decode: rows)."""
    out = {}
    for process, now in after.items():
        was = before.get(process, {})
        d = {k: v - was.get(k, 0.0) for k, v in now.items()}
        n = d.get("iterations", 0.0)
        if n <= 0:
            continue
        out[process] = {"iterations": int(n), "mean_ms": 1e3 * d.get("busy_seconds", 0.0) / n,
                        "encode_s": d.get("encode_seconds", 0.0),
                        **{f"{kind}_tokens_per_iteration": d.get(f"{kind}_tokens", 0.0) / n
                           for kind in ("encode", "prefill", "decode")}}
    return out


def memory_accounting(metrics: dict[str, float], device_used_bytes: float | None = None,
                      media_bytes: float | None = None) -> dict:
    """Issue 14's two memory claims from one :meth:`ServerProcess.metrics` reading: the LLM weights are held once
    (core and decode map the shared weights pool: ``weights_shared``, counted once in the pools) and patches, visual
    tokens and KV never cross between processes (what they send each other, ``unifiedserve_ipc_sent_bytes``, against
    ``media_bytes``, the patch bytes the requests made).

    ``device_used_bytes`` (NVML's used memory of the server's GPU, when known) adds ``unexplained_bytes``: used less
    the pools and each process's torch allocator peak, i.e. CUDA contexts, NVDEC surfaces, libraries' workspaces and
    the allocators' slack. A second copy of the weights would have to sit there (or in a process's
    ``weights_own``), so ``weights_once`` is ``unexplained < weights pool`` and no process holds the weights as its
    own."""
    pools: dict[str, float] = {}
    processes: dict[str, dict[str, float]] = {}
    ipc = 0.0
    for key, value in metrics.items():
        name, _, labels = key.partition("{")
        if name == "unifiedserve_pool_bytes" and (pool := _label(labels, "pool")):
            pools[pool] = pools.get(pool, 0.0) + value
        elif name == "unifiedserve_process_memory_bytes":
            process, kind = _label(labels, "process"), _label(labels, "kind")
            if process and kind:
                entry = processes.setdefault(process, {})
                entry[kind] = entry.get(kind, 0.0) + value
        elif name == "unifiedserve_ipc_sent_bytes":
            ipc += value
    weights = pools.get("weights", 0.0)
    out = {"pools_bytes": pools, "processes_bytes": processes, "ipc_sent_bytes": ipc,
           "shared_by": sorted(p for p, kinds in processes.items() if kinds.get("weights_shared", 0) > 0)}
    if media_bytes:
        out["ipc_over_media"] = ipc / media_bytes
    if device_used_bytes is not None:
        peaks = sum(kinds.get("device_peak", 0.0) for kinds in processes.values())
        unexplained = device_used_bytes - sum(pools.values()) - peaks
        own = max((kinds.get("weights_own", 0.0) for kinds in processes.values()), default=0.0)
        out.update(device_used_bytes=device_used_bytes, unexplained_bytes=unexplained,
                   weights_once=bool(weights) and unexplained < weights and own < weights / 2)
    return out


def nvml_used_bytes(index: int = 0) -> float | None:
    """Used memory of NVML GPU ``index`` (every process's, MPS's server included), or None without NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return float(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index)).used)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no nvidia-ml-py, no driver, no such GPU: the check says so
        return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerStartError(RuntimeError):
    """The server exited or did not answer in time; the message ends with its own error line, if it wrote one."""


def run_main(main, prog: str) -> int:
    """``main()``'s exit status, with a server that would not start said in one ``prog: error:`` line (exit 2)
    instead of a traceback: e.g. a bad ``--server-args`` flag, where the server's own error line says which."""
    try:
        return main()
    except ServerStartError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2


def _last_error_line(log_path: Path) -> str:
    try:
        lines = [line.strip() for line in log_path.read_text(errors="replace").splitlines() if "error" in line.lower()]
    except OSError:
        return ""
    return f": {lines[-1]}" if lines else ""


class ServerProcess:
    def __init__(self, args: list[str], log_path: Path, timeout: float = 600.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "unifiedserve.cli", "serve", "--port", str(self.port),
                                      *args], cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._log.flush()
                raise ServerStartError(f"the server exited ({self.proc.returncode}){_last_error_line(log_path)} "
                                       f"(log: {log_path})")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        self.health = json.loads(r.read())
                        return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise ServerStartError(f"the server did not start in {timeout:.0f} s (log: {log_path})")

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, value = line.rsplit(" ", 1)
                out[key] = float(value)
        return out

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

"""lower_ray_daemons: a local Ray instance's control-plane daemons go to nice 15, nothing else does
(children that only look like them are started here; no Ray needed)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from unifiedserve.ray_serve.launch import RAY_DAEMON_NICE, lower_ray_daemons

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc (Linux)")


def sleeper(*marker: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", *marker])


def test_only_the_daemons_among_the_descendants_are_lowered():
    agent, plain = sleeper("ray::DashboardAgent"), sleeper("ray::ServeReplica:unifiedserve:NodeReplica")
    # a daemon's grandchild is reached too: a shell whose child is a "GCS"
    shell = subprocess.Popen(["/bin/sh", "-c", '"$PY" -c "import time; time.sleep(60)" "$MARK"; true'],
                             env={**os.environ, "PY": sys.executable, "MARK": "/x/ray/gcs/gcs_server"})
    try:
        for _ in range(100):
            if _children_of(shell.pid):
                break
            time.sleep(0.05)
        gcs = _children_of(shell.pid)[0]
        lowered = lower_ray_daemons(os.getpid())
        assert lowered == sorted([agent.pid, gcs])
        assert os.getpriority(os.PRIO_PROCESS, agent.pid) == RAY_DAEMON_NICE
        assert os.getpriority(os.PRIO_PROCESS, gcs) == RAY_DAEMON_NICE
        assert os.getpriority(os.PRIO_PROCESS, plain.pid) == os.getpriority(os.PRIO_PROCESS, 0)
        assert os.getpriority(os.PRIO_PROCESS, shell.pid) == os.getpriority(os.PRIO_PROCESS, 0)
    finally:
        for p in (agent, plain, shell):
            p.kill()
            p.wait()


def _children_of(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    if int(f.read().rsplit(b")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, ValueError):
                pass
    return out

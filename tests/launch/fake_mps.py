"""A stand-in for the NVIDIA driver's MPS control binary (and ``nvidia-smi``), for the launch scripts' CPU tests."""

from __future__ import annotations

import os
import pathlib

FAKE_CONTROL = """#!/bin/bash
# A stand-in for nvidia-cuda-mps-control. -d: a daemon (this script, so its name is the real one's) that makes
# its control socket when FAKE_MPS_SOCKET=1 and ignores "quit"; a client: answers while that daemon lives.
pipe=$CUDA_MPS_PIPE_DIRECTORY
if [ "${1:-}" = -d ]; then "$0" --serve </dev/null >/dev/null 2>&1 & exit 0; fi
if [ "${1:-}" = --serve ]; then
  echo $$ > "$pipe/fake.pid"
  [ "${FAKE_MPS_SOCKET:-0}" = 1 ] && \
    python3 -c "import socket, sys; socket.socket(socket.AF_UNIX).bind(sys.argv[1])" "$pipe/control"
  trap '' TERM
  while :; do sleep 0.2; done
fi
read -r command
pid=$(cat "$pipe/fake.pid" 2>/dev/null)  # alive: not gone, and not a zombie nobody has reaped yet
[ "$command" = get_server_list ] && [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && ! grep -q ') Z ' "/proc/$pid/stat"
"""

FAKE_SMI = """#!/bin/bash
# nvidia-smi -L as on a one-GPU node; anything else fails
[ "${1:-}" = -L ] && echo "GPU 0: NVIDIA Fake (UUID: GPU-00000000-0000-0000-0000-000000000000)"
"""


def fake_driver_env(bin_dir: pathlib.Path, *, socket: bool, gpu: bool = False) -> dict[str, str]:
    """Write the fakes into ``bin_dir`` and return the environment that puts them first on PATH.

    ``socket``: the fake daemon makes its control socket (it answers, then ignores ``quit``); else it never
    answers. ``gpu``: a fake ``nvidia-smi`` lists one GPU too.
    """
    bin_dir.mkdir(parents=True, exist_ok=True)
    fakes = {"nvidia-cuda-mps-control": FAKE_CONTROL, **({"nvidia-smi": FAKE_SMI} if gpu else {})}
    for name, text in fakes.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_MPS_SOCKET": "1" if socket else "0"}

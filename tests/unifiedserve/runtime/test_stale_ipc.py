"""A server killed with kill -9 leaves its ZMQ folder; the next one removes it, and nothing of a live server."""

from __future__ import annotations

import os
import socket
import time

from unifiedserve.runtime.launcher import EMPTY_IPC_AGE_S, STALE_IPC_AGE_S, remove_stale_ipc_dirs


def folder(parent, name, sockets=(), listen=(), age_s=0.0):
    """A ZMQ folder with dead sockets (bound, then their process gone) and live ones; returns it and the listeners."""
    path = parent / name
    path.mkdir()
    listeners = []
    for sock_name in (*sockets, *listen):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(str(path / sock_name))
        if sock_name in listen:
            s.listen()
            listeners.append(s)
        else:
            s.close()  # the file stays; nobody accepts on it
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path, listeners


def test_only_the_folders_of_killed_servers_go(tmp_path):
    old = STALE_IPC_AGE_S + 10
    dead, _ = folder(tmp_path, "unifiedserve-0123456789ab-x1", ["api.sock", "core.sock"], age_s=old)
    live, listeners = folder(tmp_path, "unifiedserve-0123456789ac-x2", ["api.sock"], ["core.sock"], age_s=old)
    young, _ = folder(tmp_path, "unifiedserve-0123456789ad-x3", ["api.sock"])  # a server starting now
    empty_old, _ = folder(tmp_path, "unifiedserve-0123456789ae-x4", age_s=EMPTY_IPC_AGE_S + 10)
    empty_young, _ = folder(tmp_path, "unifiedserve-0123456789af-x5", age_s=old)
    other, _ = folder(tmp_path, "unifiedserve-not-ours", ["api.sock"], age_s=old)
    try:
        assert sorted(remove_stale_ipc_dirs(str(tmp_path))) == sorted([str(dead), str(empty_old)])
    finally:
        for s in listeners:
            s.close()
    assert not dead.exists() and not empty_old.exists()
    assert live.exists() and young.exists() and empty_young.exists() and other.exists()

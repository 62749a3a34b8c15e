"""A real uvicorn server on a loopback socket, run in a thread of the test process (for tests of HTTP
behaviour that need no workers)."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager

import uvicorn


@contextmanager
def uvicorn_in_thread(config: uvicorn.Config, startup_timeout: float = 10.0):
    """Serve ``config`` on 127.0.0.1 and a free port, which the context yields; stopped on exit."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(timeout=5)
        sock.close()

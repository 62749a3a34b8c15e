"""The api process's side of the runtime: sends requests to the workers, routes their replies.

One asyncio task reads the api inbox (a ZMQ PULL socket) and routes each message to the request
it belongs to; another watches the worker processes. When a worker dies every in-flight request
fails with a server error and :attr:`EngineClient.fatal` is set; the server then stops.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from unifiedserve.runtime import protocol
from unifiedserve.runtime.launcher import Runtime

log = logging.getLogger("unifiedserve")


class RequestError(Exception):
    """A request failed; ``status_code`` says whose fault (4xx: the client's, 5xx: ours)."""

    def __init__(self, message: str, status_code: int = 400):
        super().__init__(message)
        self.message = message
        self.status_code = status_code


@dataclass
class RequestStream:
    """Events of one request, in order: ``TokenOutput``s (re-ordered by index) or a ``RequestError``."""

    request_id: str
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    next_index: int = 0
    early: dict[int, protocol.TokenOutput] = field(default_factory=dict)
    probe: asyncio.Future | None = None  # while waiting for MediaProbed
    has_media: bool = False
    added: bool = False  # sent to core

    def push(self, out: protocol.TokenOutput) -> None:
        self.early[out.index] = out
        while self.next_index in self.early:
            self.queue.put_nowait(self.early.pop(self.next_index))
            self.next_index += 1

    def fail(self, error: RequestError) -> None:
        if self.probe is not None and not self.probe.done():
            self.probe.set_exception(error)
        self.queue.put_nowait(error)


class EngineClient:
    """The api's side of the runtime. ``worker_timeout``: seconds a worker may go without a message once every
    worker is up (each sends its stats at least every second, between its steps) before it counts as wedged and
    the runtime as dead; None never."""

    def __init__(self, runtime: Runtime, worker_timeout: float | None = None):
        self.runtime = runtime
        self.worker_timeout = worker_timeout
        self._last_heard: dict[str, float] = {}  # worker -> time.monotonic() of its last WorkerStats
        self.config = runtime.config
        self.ctx = zmq.asyncio.Context()
        self.streams: dict[str, RequestStream] = {}
        self.worker_info: dict[str, protocol.WorkerReady] = {}
        self.gauges: dict[str, dict[str, float]] = {}
        self.sent_bytes: dict[str, int] = {}  # worker -> bytes of the messages this process sent it
        self.fatal: str | None = None  # why the runtime is dead
        self.on_fatal = None  # callback
        self.on_stats = None  # callback(gauges of all workers)
        self._ready = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        """Bind the api inbox (before the workers start, so their first messages are not lost)."""
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.setsockopt(zmq.LINGER, 0)
        self.inbox.bind(self.config.address("api"))
        self._peers = {}
        for name in ("vision", "core"):
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.connect(self.config.address(name))
            self._peers[name] = sock
        self._tasks = [asyncio.create_task(self._receive(), name="api-inbox"),
                       asyncio.create_task(self._watch(), name="worker-watch")]

    async def wait_ready(self, timeout: float) -> dict[str, protocol.WorkerReady]:
        """Wait until every worker reported ready; raises ``RuntimeError`` if one dies or time runs out."""
        try:
            await asyncio.wait_for(self._ready.wait(), timeout)
        except asyncio.TimeoutError:
            missing = sorted(set(self.config.processes) - set(self.worker_info))
            raise RuntimeError(f"workers {', '.join(missing)} did not start within {timeout:.0f} s") from None
        if self.fatal:
            raise RuntimeError(self.fatal)
        return self.worker_info

    @property
    def healthy(self) -> bool:
        return self.fatal is None and self._ready.is_set()

    # -- requests ------------------------------------------------------------------------------------------
    def open(self, request_id: str) -> RequestStream:
        if self.fatal:
            raise RequestError(f"the server is not serving: {self.fatal}", 503)
        stream = self.streams[request_id] = RequestStream(request_id)
        return stream

    async def probe(self, stream: RequestStream, media: list[protocol.MediaRef],
                    probe_only: bool = False) -> protocol.MediaProbed:
        """The media's grids from vision. ``probe_only``: vision then forgets the request (nothing is decoded
        for it or held), so the stream is done once this returns (:meth:`finish` it)."""
        stream.has_media = True
        stream.probe = asyncio.get_running_loop().create_future()
        self._send("vision", protocol.ProbeMedia(stream.request_id, media, probe_only))
        return await stream.probe

    async def add(self, stream: RequestStream, message: protocol.AddRequest) -> None:
        stream.added = True
        self._send("core", message)

    def abort(self, request_id: str) -> None:
        """Forget the request here and free whatever it holds in the workers. Idempotent."""
        stream = self.streams.pop(request_id, None)
        if stream is None or self.fatal:
            return
        if stream.added:
            self._send("core", protocol.AbortRequest(request_id))  # core also cancels vision, or tells decode
        elif stream.has_media:
            self._send("vision", protocol.CancelMedia(request_id))

    def finish(self, request_id: str) -> None:
        """The request ended normally: nothing to free in the workers."""
        self.streams.pop(request_id, None)

    def _send(self, peer: str, message) -> None:
        # never blocks (no high-water mark); the returned future is done at once
        payload = protocol.encode(message)
        self.sent_bytes[peer] = self.sent_bytes.get(peer, 0) + len(payload)
        self._peers[peer].send(payload, copy=False)

    # -- routing ---------------------------------------------------------------------------------------------
    async def _receive(self) -> None:
        decoder = protocol.decoder(protocol.ToApi)
        while True:
            frame = await self.inbox.recv(copy=False)
            try:
                self._route(decoder.decode(frame.buffer))
            except Exception:  # a routing bug must not stop the inbox: log it and go on
                log.exception("api: failed to route a worker message")

    def _route(self, msg) -> None:
        if isinstance(msg, protocol.TokenOutputs):
            for out in msg.outputs:
                stream = self.streams.get(out.request_id)
                if stream is not None:
                    stream.push(out)
        elif isinstance(msg, protocol.MediaProbed):
            stream = self.streams.get(msg.request_id)
            if stream is not None and stream.probe is not None and not stream.probe.done():
                stream.probe.set_result(msg)
        elif isinstance(msg, (protocol.MediaFailed, protocol.RequestFailed)):
            stream = self.streams.get(msg.request_id)
            if stream is not None:
                code = getattr(msg, "status_code", 400)
                stream.fail(RequestError(msg.message, code))
        elif isinstance(msg, protocol.WorkerStats):
            self._last_heard[msg.name] = time.monotonic()
            self.gauges[msg.name] = msg.gauges
            if self.on_stats is not None:
                self.on_stats()
        elif isinstance(msg, protocol.WorkerReady):
            self.worker_info[msg.name] = msg
            if set(self.worker_info) >= set(self.config.processes):
                self._ready.set()

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            if self.runtime.stopping:
                return
            dead = self.runtime.dead_workers()
            if dead:  # every one found dead: a fatal fault under MPS reaches all clients of the GPU at once,
                # and which of them went first is not known here (the one that faulted may not be first listed)
                self._die("; ".join(f"the {name} worker process exited unexpectedly (exit code {code})"
                                    for name, code in dead.items()))
                return
            silent = self._silent_workers()
            if silent:  # alive but stuck: its requests would wait forever and /health would say ok
                self._die("; ".join(f"the {name} worker process has sent nothing for {s:.0f} s (--worker-timeout "
                                    f"{self.worker_timeout:g}): it is stuck" for name, s in silent.items()))
                return

    def _silent_workers(self) -> dict[str, float]:
        """Workers silent for longer than ``worker_timeout`` once all are up -> seconds since each was heard."""
        if self.worker_timeout is None or not self._ready.is_set() or self.fatal:
            return {}
        now = time.monotonic()  # (a worker not heard from since the watch began counts from now)
        silent = {name: now - self._last_heard.setdefault(name, now) for name in self.config.processes}
        return {name: seconds for name, seconds in silent.items() if seconds > self.worker_timeout}

    def fail_all(self, message: str, status_code: int) -> None:
        """End every in-flight request with an error (shutting down)."""
        for stream in list(self.streams.values()):
            stream.fail(RequestError(message, status_code))
        self.streams.clear()

    def _die(self, reason: str) -> None:
        log.error("%s; failing %d in-flight requests and stopping", reason, len(self.streams))
        self.fatal = reason
        for stream in list(self.streams.values()):
            stream.fail(RequestError(f"request failed: {reason}", 500))
        self.streams.clear()
        self._ready.set()  # wake wait_ready
        if self.on_fatal is not None:
            self.on_fatal()

    def all_gauges(self) -> dict[str, float]:
        merged: dict[str, float] = {}
        for gauges in self.gauges.values():
            merged.update(gauges)
        return merged

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        if getattr(self, "inbox", None) is not None:  # (a start that failed made none)
            self.inbox.close(linger=0)
        for sock in getattr(self, "_peers", {}).values():
            sock.close(linger=0)
        self.ctx.term()


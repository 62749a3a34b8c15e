"""What every worker process shares: start-up, its ZMQ inbox, its event loop, and dying cleanly.

A worker binds one PULL socket (its inbox) and connects PUSH sockets to the peers it talks to.
Its loop drains the inbox, then does one unit of work (a model step, a patch write); it blocks
on the inbox only when it has nothing to do. It ignores SIGINT (the launcher owns Ctrl-C and
sends :class:`~unifiedserve.runtime.protocol.Shutdown`), exits on SIGTERM, and exits when its
parent dies (``PR_SET_PDEATHSIG`` plus a ``getppid`` check), so no worker outlives its server.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import time
import traceback

import zmq

from unifiedserve.runtime import protocol
from unifiedserve.runtime.config import RuntimeConfig
from unifiedserve.runtime.gpu_placement import apply_process_env

log = logging.getLogger("unifiedserve")

IDLE_POLL_MS = 100  # how often an idle worker checks its parent

#: Testing hook: ``worker:steps[:marker]`` makes that worker die of a fatal fault after that many steps
#: of work (see :meth:`Worker.inject_fault`); with a marker path it fires once (the file records it).
FAULT_ENV = "UNIFIEDSERVE_INJECT_FAULT"


def parse_fault(value: str | None, worker: str) -> tuple[int, str | None] | None:
    """``(steps, marker)`` when ``value`` (the :data:`FAULT_ENV` setting) names ``worker``, else None.

    Raises:
        ValueError: a malformed setting (one clear line, at the worker's start).
    """
    if not value:
        return None
    name, _, rest = value.partition(":")
    steps, _, marker = rest.partition(":")
    if name not in ("vision", "core", "decode") or not steps.isdigit() or int(steps) < 1:
        raise ValueError(f"{FAULT_ENV} must be worker:steps[:marker] with worker vision, core or decode and "
                         f"steps >= 1; got {value!r}")
    return (int(steps), marker or None) if name == worker else None


def setup_logging(name: str) -> None:
    logging.basicConfig(level=os.environ.get("UNIFIEDSERVE_LOG_LEVEL", "INFO"),
                        format=f"%(asctime)s %(levelname)s [{name}] %(message)s", datefmt="%H:%M:%S",
                        stream=sys.stderr, force=True)


#: seconds between a worker's WorkerStats at most, changed or not: the api takes a worker silent for
#: --worker-timeout as wedged (a stuck device call, a stopped process) and stops the server
HEARTBEAT_S = 1.0

class Worker:
    """Base class of the vision, core and decode processes."""

    name = "worker"
    inbox_type = None  # the protocol union this worker receives

    def __init__(self, config: RuntimeConfig):
        self.config = config
        self.ctx = zmq.Context()
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.setsockopt(zmq.LINGER, 0)
        self.inbox.bind(config.address(self.name))
        self._peers: dict[str, zmq.Socket] = {}
        self._decoder = protocol.decoder(self.inbox_type)
        self.stopping = False
        self._parent = os.getppid()
        self._last_stats: dict[str, float] = {}
        self._sent_bytes: dict[str, int] = {}  # peer -> bytes of the messages sent to it (stats excluded)
        self._last_stats_time = 0.0
        self._last_sent_time = 0.0  # of the last WorkerStats: one goes out at least every HEARTBEAT_S
        self._fault = parse_fault(os.environ.get(FAULT_ENV), self.name)
        self._steps = 0
        self._early: list = []  # messages that came while setup waited for another (handled when the loop starts)

    # -- to override ------------------------------------------------------------------------
    def setup(self) -> dict[str, str]:
        """Load models, map pools. Returns what the launcher logs about this worker."""
        return {}

    def handle(self, message) -> None:
        raise NotImplementedError

    def has_work(self) -> bool:
        return False

    def step(self) -> None:
        """One unit of work; called when :meth:`has_work`."""

    def stats(self) -> dict[str, float]:
        """Gauges sent to the api process (metrics, leak checks) whenever they change."""
        return {}

    # -- plumbing ----------------------------------------------------------------------------
    def send(self, peer: str, message) -> None:
        sock = self._peers.get(peer)
        if sock is None:
            sock = self._peers[peer] = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.connect(self.config.address(peer))
        payload = protocol.encode(message)
        if not isinstance(message, protocol.WorkerStats):  # else the count would change with each report of it
            self._sent_bytes[peer] = self._sent_bytes.get(peer, 0) + len(payload)
        sock.send(payload, copy=False)

    def _drain(self, timeout_ms: int) -> None:
        if not self.inbox.poll(timeout_ms):
            return
        while True:
            try:
                frame = self.inbox.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            message = self._decoder.decode(frame.buffer)
            if isinstance(message, protocol.Shutdown):
                self.stopping = True
                return
            self.handle(message)

    def wait_for(self, kind: type, what: str) -> None:
        """Block until a ``kind`` message arrives: start-up order between workers. Messages that come first are
        kept for the loop; a ``Shutdown``, or the server gone, ends the worker. Logs once after 30 s."""
        start, said = time.monotonic(), False
        while True:
            if self.inbox.poll(1000):
                message = self._decoder.decode(self.inbox.recv(copy=False).buffer)
                if isinstance(message, kind):
                    return
                if isinstance(message, protocol.Shutdown):
                    raise SystemExit(0)
                self._early.append(message)
            if os.getppid() != self._parent:
                log.error("the server process is gone; exiting")
                raise SystemExit(0)
            if not said and time.monotonic() - start > 30:
                log.info("still waiting for %s (%.0f s)", what, time.monotonic() - start)
                said = True

    def _send_stats(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_stats_time < 0.05:
            return
        # what crossed to each peer: only control messages and indices do; patches, visual tokens and KV
        # stay in the shared pools (unifiedserve_ipc_sent_bytes)
        stats = {**self.stats(), **{f"ipc_to_{peer}_bytes": float(n) for peer, n in self._sent_bytes.items()}}
        if stats != self._last_stats or force or now - self._last_sent_time >= HEARTBEAT_S:
            self.send("api", protocol.WorkerStats(self.name, stats))  # unchanged: a heartbeat (--worker-timeout)
            self._last_stats, self._last_sent_time = stats, now
        self._last_stats_time = now

    def run(self) -> None:
        early, self._early = self._early, []
        for message in early:
            self.handle(message)
        while not self.stopping:
            busy = self.has_work()
            self._drain(0 if busy else IDLE_POLL_MS)
            if self.stopping:
                break
            if os.getppid() != self._parent:
                log.error("the server process is gone; exiting")
                break
            if self.has_work():
                self.step()
                self._steps += 1
                if self._fault is not None and self._steps >= self._fault[0]:
                    self.inject_fault()
            self._send_stats()
        self._send_stats(force=True)

    def inject_fault(self) -> None:
        """Die the way a fatal device fault kills a process (the ``UNIFIEDSERVE_INJECT_FAULT`` testing hook).

        On CUDA an out-of-bounds index trips a device-side assert: a sticky error that ends the CUDA
        context, and under MPS can end every client on the GPU (issue 14's fault). On the CPU the process
        aborts mid-step. Either way the server fails its in-flight requests, turns ``/health`` 503 and
        exits with an error, which ``launch/serve-node.sh --restart`` answers. With a marker file in the
        setting it fires only when the file does not exist yet, and creates it, so a restarted server runs.
        """
        steps, marker = self._fault
        self._fault = None
        if marker is not None:
            try:
                with open(marker, "x"):
                    pass
            except FileExistsError:
                return
        log.error("%s=%s: injecting a fatal fault after %d steps", FAULT_ENV, os.environ.get(FAULT_ENV), steps)
        import torch

        device = torch.device(self.config.engine.device)
        if device.type == "cuda":
            x = torch.zeros(1, device=device)
            x[torch.tensor([1 << 40], device=device)]  # noqa: B018 (the point is the out-of-bounds read)
            torch.cuda.synchronize(device)  # raises: device-side assert triggered
        os.abort()

    def close(self) -> None:
        for sock in [self.inbox, *self._peers.values()]:
            sock.close(linger=0)
        self.ctx.term()


def token_message(request_id: str, sampled, stages: protocol.StageTimes | None = None):
    """What api is told of one sampled token (an engine ``SampledToken``): a ``TokenOutput`` (with ``stages`` for a
    first token), or a ``RequestFailed`` when the request's grammar dead-ended and the token is no output."""
    if sampled.error is not None:  # a 500's message says it is the server's fault; a 400's names the field
        message = sampled.error if sampled.error_status >= 500 else f"response_format: {sampled.error}"
        return protocol.RequestFailed(request_id, message, sampled.error_status)
    return protocol.TokenOutput(request_id, sampled.index, sampled.token_id, sampled.finish_reason, stages,
                                *(sampled.logprobs if sampled.logprobs is not None else (None, None)))


class IterationCounters:
    """Cumulative work of a worker's engine iterations (steps that ran something), sent as gauges
    ``<process>_iterations``, ``_busy_seconds``, ``_encode_seconds`` and ``_{encode,prefill,decode}_tokens``:
    the mean iteration time and the tokens per iteration of any window are their differences
    (``bench/serve/ttft_breakdown.py`` prints them). ``busy`` is the host's wall time in those steps: on CUDA
    it includes waiting for the device only where a step reads results back."""

    KINDS = ("encode", "prefill", "decode")

    def __init__(self, process: str):
        self.process = process
        self.iterations = 0
        self.busy_s = 0.0
        self.encode_s = 0.0
        self.tokens = dict.fromkeys(self.KINDS, 0)

    def record(self, seconds: float, encode: int = 0, prefill: int = 0, decode: int = 0,
               encode_s: float = 0.0) -> None:
        self.iterations += 1
        self.busy_s += seconds
        self.encode_s += encode_s
        for kind, n in zip(self.KINDS, (encode, prefill, decode)):
            self.tokens[kind] += n

    def gauges(self) -> dict[str, float]:
        p = self.process
        return {f"{p}_iterations": float(self.iterations), f"{p}_busy_seconds": self.busy_s,
                f"{p}_encode_seconds": self.encode_s,
                **{f"{p}_{kind}_tokens": float(n) for kind, n in self.tokens.items()}}


def memory_info(weights: dict[str, float], device) -> dict[str, str]:
    """Start-up memory of a worker, for its log line: its :func:`weight_gauges` (own parameter bytes and
    those it maps from the shared weights pool, counted once for the server), and on CUDA what torch's
    allocator holds on ``device``."""
    info = {"weights": f"{weights['mem_weights_own_bytes'] / 2**20:.1f} MiB own + "
                       f"{weights['mem_weights_shared_bytes'] / 2**20:.1f} MiB mapped from the shared pool"}
    d = device_memory_gauges(device)
    if d:
        info["cuda_allocated"] = (f"{d['mem_device_allocated_bytes'] / 2**20:.0f} MiB "
                                  f"(peak {d['mem_device_peak_bytes'] / 2**20:.0f} MiB; the "
                                  f"IPC-mapped pools are not in it)")
    return info


def weight_gauges(model, weights_pool=None) -> dict[str, float]:
    """``mem_weights_{own,shared}_bytes`` of a process holding ``model`` (WorkerStats gauges; the
    server exports them per process as ``unifiedserve_process_memory_bytes``)."""
    from unifiedserve.model.loader import weight_bytes

    own, shared = weight_bytes(model, weights_pool)
    return {"mem_weights_own_bytes": float(own), "mem_weights_shared_bytes": float(shared)}


def device_memory_gauges(device) -> dict[str, float]:
    """On CUDA, what torch's allocator holds now and at its peak (``mem_device_{allocated,peak}_bytes``;
    the IPC-mapped pools are not in it); nothing on the CPU."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return {}
    return {"mem_device_allocated_bytes": float(torch.cuda.memory_allocated(device)),
            "mem_device_peak_bytes": float(torch.cuda.max_memory_allocated(device))}


def pool_barrier(device):
    """A call that returns once the work this process has queued on ``device`` so far is done; a no-op
    on the CPU.

    Shared pools cross processes with nothing ordering one process's CUDA stream after another's: a
    message that says "these rows are written" (vision's ``MediaReady``) or "these pages are yours
    to write" (core's ``WritePatches``: its encoder may still be reading them) must follow that
    work's end, not its launch. Kernels run on the current stream (the legacy default stream, which
    every thread of a worker shares), so waiting for it covers the writes and reads before the call.
    """
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return lambda: None
    return lambda: torch.cuda.current_stream(device).synchronize()


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: the getppid check in the loop still catches it
        pass


def _on_sigterm(signum, frame) -> None:
    raise SystemExit(0)


def worker_main(worker_cls: type[Worker], config: RuntimeConfig) -> None:
    """Entry point of a worker process (target of ``multiprocessing.Process``)."""
    apply_process_env(config.process_env.get(worker_cls.name, {}))  # before anything starts CUDA
    setup_logging(worker_cls.name)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_sigterm)
    _die_with_parent()
    cpus = config.cpu_affinity.get(worker_cls.name)
    if cpus:
        os.sched_setaffinity(0, cpus)
    nice = config.nice.get(worker_cls.name, 0)
    if nice > 0:
        os.nice(nice)
    threads = config.torch_threads.get(worker_cls.name)
    if threads:
        import torch

        torch.set_num_threads(threads)
    worker = None
    try:
        worker = worker_cls(config)
        info = worker.setup()
        # its gauges first (pools, weights per process): api reads them before it counts this worker ready, so the
        # server's /metrics is whole from its first answer (the first report used to wait for the first idle poll)
        worker._send_stats(force=True)
        worker.send("api", protocol.WorkerReady(worker_cls.name, os.getpid(), info))
        worker.run()
    except SystemExit:
        pass
    except BaseException:
        log.error("worker failed:\n%s", traceback.format_exc())
        os._exit(1)
    finally:
        if worker is not None:
            worker.close()

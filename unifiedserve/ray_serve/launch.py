"""``unifiedserve serve --ray``: flags, their checks, and the Ray/Serve start-up. Importing this
module does not import Ray; :func:`run_ray` does, and says how to install it when it is missing."""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import socket
import threading
import time
from pathlib import Path

from unifiedserve.ray_serve.routing import RoutingConfig

log = logging.getLogger("unifiedserve")

APP_NAME = "unifiedserve"
_ADDRESS_RE = re.compile(r"^(?:ray://)?(?P<host>\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.-]+):(?P<port>\d{1,5})$")
CONNECT_TIMEOUT_S = 5.0
CPU_UNITS = 10_000  # Ray counts fractional resources in 1e-4 units
CONTROL_LOOP_INTERVAL_S = 0.5  # Serve's controller loop on a local instance (Serve's default: 0.1)


def add_ray_arguments(p: argparse.ArgumentParser) -> None:
    from unifiedserve.server.serve_flags import _positive_int

    g = p.add_argument_group("replicas on Ray Serve (pip install 'unifiedserve[ray]')")
    g.add_argument("--ray", action="store_true",
                   help="serve with --replicas copies of this server (each its own vision, core and decode "
                        "processes) on Ray Serve behind one endpoint at --host/--port, routing each request to the "
                        "replica whose caches hold its media; starts a local Ray instance unless --ray-address")
    g.add_argument("--replicas", type=_positive_int, default=None, metavar="N",
                   help="--ray: replicas at start (default 1)")
    g.add_argument("--min-replicas", type=_positive_int, default=None, metavar="N",
                   help="--ray: autoscale between --min-replicas and --max-replicas on ongoing requests (default: no "
                        "autoscaling, --replicas fixed)")
    g.add_argument("--max-replicas", type=_positive_int, default=None, metavar="N", help="--ray: see --min-replicas")
    g.add_argument("--ray-address", default=os.environ.get("RAY_ADDRESS") or None, metavar="HOST:PORT",
                   help="--ray: join this Ray cluster (HOST:PORT of its head, ray://HOST:PORT, or auto) instead of "
                        "starting a local instance (default: $RAY_ADDRESS)")
    g.add_argument("--replica-cpus", type=_positive_int, default=None, metavar="N",
                   help="--ray: CPUs Ray reserves for each replica (default: this machine's cores / the most "
                        "replicas, --max-replicas or --replicas; a fraction of one when they outnumber the cores)")
    g.add_argument("--ray-router", choices=("media-affinity", "serve-default"), default=None,
                   help="--ray: media-affinity (default; see --affinity-load-bound) or serve-default, Serve's own "
                        "power-of-two-choices router, to compare against")
    g.add_argument("--affinity-load-bound", type=_positive_int, default=RoutingConfig.min_load_bound, metavar="N",
                   help=f"--ray: a video's replica keeps its requests while it runs fewer than N (or 1.25x the "
                        f"mean load, whichever is more); above, they go to the least-loaded replica "
                        f"(default {RoutingConfig.min_load_bound})")


_RAY_ONLY = ("replicas", "min_replicas", "max_replicas", "replica_cpus", "ray_router")


def ray_requested(args: argparse.Namespace) -> bool:
    """True with --ray. Raises ValueError for a Ray flag given without --ray (it would do nothing)."""
    if getattr(args, "ray", False):
        return True
    given = [name for name in _RAY_ONLY if getattr(args, name, None) is not None]
    if given:
        raise ValueError(f"--{given[0].replace('_', '-')} needs --ray")
    return False


def check_ray_args(args: argparse.Namespace) -> None:
    """Fill the defaults and check the Ray flags together (ValueError naming the flag); touches nothing."""
    if args.replicas is None:
        args.replicas = args.min_replicas or 1
    lo, hi = args.min_replicas, args.max_replicas
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"--min-replicas {lo} is above --max-replicas {hi}")
    if lo is not None and args.replicas < lo or hi is not None and args.replicas > hi:
        raise ValueError(f"--replicas {args.replicas} is outside --min-replicas/--max-replicas "
                         f"({lo or 1}..{hi or args.replicas})")
    if args.ray_router is None:
        args.ray_router = "media-affinity"
    cpus, most = os.cpu_count() or 1, most_replicas(args)
    if args.replica_cpus is None:  # more replicas than cores share them, in Ray's units of 1e-4 CPU (at least one)
        args.replica_cpus = cpus // most or max(cpus * CPU_UNITS // most, 1) / CPU_UNITS
    if args.ray_address is not None:
        check_address(args.ray_address)
    elif most * round(args.replica_cpus * CPU_UNITS) > cpus * CPU_UNITS:  # the local instance has this machine's
        # cores, no more (counted in Ray's units: 25 x 0.28 is 7.000000000000001 in floating point)
        flag = "--max-replicas" if most > args.replicas else "--replicas"
        raise ValueError(f"{flag} {most} x --replica-cpus {args.replica_cpus:g} needs {most * args.replica_cpus:g} "
                         f"CPUs and this machine has {cpus}: Ray would never place the rest; lower --replica-cpus "
                         f"or {flag}")


def most_replicas(args: argparse.Namespace) -> int:
    """The most replicas the flags let run at once (autoscaling's upper bound, else the fixed count)."""
    return max(args.replicas, args.max_replicas or 0)


def check_address(address: str) -> None:
    """``auto``, ``HOST:PORT`` or ``ray://HOST:PORT`` whose port answers within a few seconds.

    Raises:
        ValueError: malformed, or nothing listens there (one line saying which).
    """
    if address in ("auto", "local"):
        return
    m = _ADDRESS_RE.match(address)
    if not m or not 1 <= int(m["port"]) <= 65535:
        raise ValueError(f"--ray-address {address!r}: expected HOST:PORT of the Ray head (e.g. 10.0.0.1:6379), "
                         f"ray://HOST:PORT, or auto")
    host = m["host"].strip("[]")
    try:
        with socket.create_connection((host, int(m["port"])), timeout=CONNECT_TIMEOUT_S) as conn:
            grpc = speaks_grpc(conn)
    except OSError as e:
        raise ValueError(f"--ray-address {address}: no Ray head answers there ({e.strerror or e}); start one with "
                         f"launch/ray-cluster.sh head, or leave --ray-address out for a local instance") from None
    if not grpc:  # ray.init would retry its GCS client there for more than 10 minutes
        raise ValueError(f"--ray-address {address}: something answers there but not a Ray head (no gRPC); give the "
                         f"head's GCS port (`ray start --head --port`, 6379 by default) or ray://HOST:10001")


#: an HTTP/2 client's connection preface and an empty SETTINGS frame (RFC 9113 §3.4, §6.5)
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])


def speaks_grpc(conn: socket.socket) -> bool:
    """Whether the server on ``conn`` speaks HTTP/2, as Ray's GCS and Ray Client servers (gRPC) do: it answers the
    client preface with a SETTINGS frame (type 4). True without asking when the cluster uses TLS (RAY_USE_TLS)."""
    if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
        return True
    conn.sendall(_H2_PREFACE)
    head = b""
    while len(head) < 9:  # a frame header
        data = conn.recv(9 - len(head))
        if not data:
            break
        head += data
    return len(head) == 9 and head[3] == 4


def check_port_free(host: str, port: int) -> None:
    """Raises ValueError when ``host:port`` cannot be bound: one clear error before Ray starts, not a
    Serve proxy that fails to start inside it."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise ValueError(f"--port {port}: cannot listen on {host}:{port} ({e.strerror or e})") from None


#: seconds the ingress's streams get to send their last event after drain() (as the plain server's drain)
DRAIN_S = 1.0


def drain_ingress(handle) -> None:
    """End the streams in flight with an in-band 503 and [DONE] (``Ingress.drain``) before Serve stops, as the plain
    server ends its own. ``handle``: the application's (None: it never started). Bounded: a call that cannot reach
    the ingress (Ray's own processes already gone) is given up after a few seconds, and the stop goes on."""
    if handle is None:
        return
    done = threading.Event()

    def call():
        try:
            handle.drain.remote().result(timeout_s=5)
            done.set()
        except Exception as e:  # the ingress is gone
            log.debug("no ingress to drain: %s", e)

    threading.Thread(target=call, daemon=True, name="drain").start()
    if done.wait(6):
        time.sleep(DRAIN_S)


def describe_deployment(name: str, d) -> str:
    """``NodeReplica updating (1 starting, 1 running): <Serve's message>`` from a deployment's status."""
    replicas = ", ".join(f"{n} {getattr(state, 'value', state).lower()}" for state, n in d.replica_states.items())
    return f"{name} {d.status.value.lower()}" + (f" ({replicas})" if replicas else "") + (
        f": {d.message}" if d.message else "")


START_POLL_S = 0.5
START_PROGRESS_S = 15.0  # a start-up still waiting says why this often


def wait_running(serve, stop: threading.Event, progress_s: float = START_PROGRESS_S) -> bool:
    """Wait until the application runs (True) or ``stop`` is set first (False), saying every ``progress_s`` which
    deployments wait and Serve's reason (a replica no node has room for waits until one has).

    Raises:
        RuntimeError: Serve gave the deployment up (a replica that failed to start too often).
    """
    from ray.serve.schema import ApplicationStatus

    said = time.monotonic()
    while not stop.wait(START_POLL_S):
        app = serve.status().applications.get(APP_NAME)
        if app is None or app.status == ApplicationStatus.NOT_STARTED:
            continue
        if app.status == ApplicationStatus.RUNNING:
            return True
        if app.status == ApplicationStatus.DEPLOY_FAILED:
            raise RuntimeError(f"{app.message or 'a deployment failed'}")
        if time.monotonic() - said >= progress_s:
            said = time.monotonic()
            waiting = [describe_deployment(name, d) for name, d in app.deployments.items()
                       if d.status.value != "HEALTHY"]
            log.info("waiting for the replicas to start (Ctrl-C stops): %s", "; ".join(waiting) or app.status.value)
    return False


def run_ray(args: argparse.Namespace, limits) -> int:
    """Start (or join) Ray, deploy the replicas and the ingress, serve until SIGINT/SIGTERM.

    Raises:
        ValueError: a bad flag, Ray missing, or a cluster that cannot be joined (nothing started yet).
    """
    check_ray_args(args)
    if args.ray_address and "RAY_AUTH_MODE" not in os.environ and (
            os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")
            or (Path.home() / ".ray" / "auth_token").is_file()):
        # `ray start --head` (Ray >= 2.59) requires the cluster's token, which a client sends only in token mode
        # (read when Ray is imported): without it the join failed after 20 lines of InvalidAuthToken warnings
        os.environ["RAY_AUTH_MODE"] = "token"
    try:
        import ray
        from ray import serve
    except ImportError:
        raise ValueError("--ray needs Ray Serve, which is not installed: pip install 'unifiedserve[ray]'") from None
    from unifiedserve.ray_serve.app import build_application
    from unifiedserve.server.serve_setup import resolve_model

    if not args.ray_address:
        check_port_free(args.host, args.port)  # before anything slow (the demo model, Ray) starts
        # Serve's controller loop (default every 0.1 s) and the GCS calls it makes used ~50 ms of CPU a
        # second on an idle instance, taken from the replica's encode on a small node; every 0.5 s they
        # use ~20, and only the controller's reactions wait longer (health checks run every 2 s anyway).
        # Read by the processes of the instance ray.init starts; a cluster sets its own.
        os.environ.setdefault("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", str(CONTROL_LOOP_INTERVAL_S))
    # the demo model is written once here, not by every replica at the same time
    args.model = str(Path(resolve_model(args.model)).resolve())
    try:
        # "local": a new instance of our own, even when this machine already runs a cluster
        ray.init(address=args.ray_address or "local", include_dashboard=False, logging_level=logging.WARNING,
                 **({} if args.ray_address else {"num_cpus": os.cpu_count()}))
    except (ConnectionError, RuntimeError) as e:
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if args.ray_address:
            raise ValueError(f"--ray-address {args.ray_address}: cannot join the Ray cluster there ({why})") from None
        raise ValueError(f"--ray: could not start a local Ray instance ({why})") from None
    if args.ray_address and APP_NAME in serve.status().applications:
        # a second `serve --ray` on a shared cluster would replace the first one's replicas under its clients, and
        # its stop would take down the first one's endpoint
        ray.shutdown()
        raise ValueError(f"--ray-address {args.ray_address}: the cluster already serves a unifiedserve application "
                         f"(another `unifiedserve serve --ray`); stop that one first")
    # after ray.init, whose own SIGTERM handler would abort the process instead of a clean stop
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: stop.set())
    app = None  # the application's handle, once it runs (to drain it at the stop)
    try:
        have, most = (ray.cluster_resources().get("CPU", 0) if args.ray_address else None), most_replicas(args)
        if have is not None and most * args.replica_cpus > have:
            log.warning("%d replica(s) x --replica-cpus %g is more CPUs than the cluster has now (%g): the replicas "
                        "that do not fit wait for it to grow", most, args.replica_cpus, have)
        try:
            serve.start(http_options={"host": args.host, "port": args.port})
            application = build_application(args, router=args.ray_router)
            if hasattr(serve, "_run"):  # not serve.run, which waits for the replicas without end, deaf to signals
                app = serve._run(application, name=APP_NAME, route_prefix="/", _blocking=False)
                if not wait_running(serve, stop):
                    return 0  # stopped while the replicas were starting
            else:  # a Ray without it (2.60 has it): serve.run's own wait
                app = serve.run(application, name=APP_NAME, route_prefix="/", blocking=False)
        except RuntimeError as e:  # a replica that cannot start (Serve retried it), a port in use
            log.error("start-up failed: %s", str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
            return 1
        scaling = (f"autoscaling {args.min_replicas or 1}..{args.max_replicas or args.replicas}"
                   if args.min_replicas or args.max_replicas else "fixed")
        log.info("serving on http://%s:%d with %d replica(s) on Ray Serve (%s, %g CPU each, %s router; OpenAI API "
                 "at /v1)", args.host, args.port, args.replicas, scaling, args.replica_cpus, args.ray_router)
        stop.wait()
        return 0
    finally:
        log.info("stopping the replicas")
        try:
            drain_ingress(app)
            if args.ray_address:  # a cluster's Serve may serve other applications: only ours goes
                serve.delete(APP_NAME)
            else:
                serve.shutdown()
        finally:
            ray.shutdown()

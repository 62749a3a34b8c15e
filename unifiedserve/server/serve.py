"""``unifiedserve serve``: start the workers and pools, then the HTTP API; shut all of it down cleanly. What the
flags build (runtime, limits, API state) is :mod:`unifiedserve.server.serve_setup`.

Exit status: 0 after SIGINT/SIGTERM (clean shutdown), 1 when a worker process died or failed to
start, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket

from unifiedserve.runtime.worker import setup_logging
from unifiedserve.server.http_protocol import uvicorn_options
from unifiedserve.server.limits import BodyBudget, BodySizeLimit, RequestLimits
from unifiedserve.server.serve_setup import (build_runtime, build_state, check_api_key, check_model,
                                             generation_defaults, media_policy, request_limits, resolve_model,
                                             worker_timeout)

log = logging.getLogger("unifiedserve")

WORKER_DEATH_GRACE_S = 2.0  # /health reports unhealthy this long before the server exits
OPEN_FILES_TARGET = 65536  # the soft limit the server asks for (client connections are descriptors)


def run(args: argparse.Namespace) -> int:
    setup_logging("api")
    limits = request_limits(args)  # before anything is built or spawned
    media_policy(args)  # a bad --allowed-local-media-path is refused now, not after the workers start
    generation_defaults(args, args.model)  # and a bad generation config
    worker_timeout(args)
    check_api_key(args)
    from unifiedserve.ray_serve.launch import ray_requested, run_ray  # imports no Ray

    if ray_requested(args):  # replicas on Ray Serve (unifiedserve[ray]); only run_ray imports Ray
        check_model(resolve_model(args.model))  # one error line here, not one from each replica's workers
        return run_ray(args, limits)
    runtime = build_runtime(args)  # the flags' own contradictions first: nothing is spawned yet
    raise_open_file_limit()
    try:
        sock = bind_socket(args.host, args.port)  # a port in use is one error line, before any worker starts
    except BaseException:
        runtime.stop()  # its sockets' folder, made with it
        raise
    try:
        return asyncio.run(_serve(runtime, args, limits, sock))
    finally:
        sock.close()


def raise_open_file_limit(target: int = OPEN_FILES_TARGET) -> int:
    """Raise this process's soft limit on open files towards ``target`` (never past the hard limit), as vLLM
    does: each client connection is a descriptor, and Debian's default soft limit (1024) is reached by a few
    hundred streams plus the runtime's own. Returns the soft limit now in force."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError) as e:
            log.warning("could not raise the open-file limit from %d to %d (%s): at most about %d connections",
                        soft, wanted, e, soft)
    return soft


def bind_socket(host: str, port: int) -> socket.socket:
    """The server's listening address, bound now (it listens once the workers are ready: until then a client
    is refused, as before). Raises ``ValueError`` naming the flag when the host does not resolve or the
    address is taken."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise ValueError(f"--host {host}: {e.strerror}") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart reuses TIME_WAIT
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise ValueError(f"--host {host} --port {port}: cannot listen there: {e.strerror}") from None
    return sock


async def _serve(runtime, args, limits: RequestLimits, sock: socket.socket | None = None) -> int:
    import uvicorn

    from unifiedserve.server.api import build_app
    from unifiedserve.server.engine_client import EngineClient

    config = runtime.config
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    server: uvicorn.Server | None = None

    def on_signal(signum, frame):  # also what uvicorn re-raises after its own graceful exit
        runtime.stopping = True  # workers that exit from now on are not failures
        loop.call_soon_threadsafe(stop.set)
        if server is not None:
            server.should_exit = True
            loop.call_soon_threadsafe(_drain)

    def _drain():  # in-flight requests end now with a 503 instead of being cut off after the grace period
        if state is not None:
            state.draining = True
        client.fail_all("the server is shutting down", 503)

    state = None

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    client = EngineClient(runtime, worker_timeout(args))
    try:
        await client.start()
        runtime.create_pools()
        runtime.start()
        log.info("starting workers (vision, core, decode); instance %s, sockets in %s", runtime.instance,
                 runtime.ipc_dir)
        ready = asyncio.create_task(client.wait_ready(args.startup_timeout))
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait({ready, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not ready.done():
            ready.cancel()
            log.info("interrupted during start-up")
            return 0
        stopped.cancel()
        try:
            infos = ready.result()
        except RuntimeError as e:
            log.error("start-up failed: %s", e)
            return 1
        runtime.all_mapped()
        for name in config.processes:
            info = infos[name]
            log.info("%s (pid %d): %s", name, info.pid, ", ".join(f"{k}={v}" for k, v in info.info.items()))
        log.info("pools: KV cache %d blocks x %d tokens, patch buffer %d pages, visual-token buffer %d pages "
                 "(page = %d rows); max model len %d; policy %s", config.engine.num_kv_blocks, config.engine.block_size,
                 config.engine.num_patch_pages, config.engine.num_visual_pages, config.engine.page_size,
                 config.max_model_len,
                 config.policy)
        state = build_state(runtime, client, args, limits)
        metrics = state.metrics
        state.body_budget = BodyBudget(limits.inflight_request_bytes)  # behind --ray, the ingress holds its own
        app = BodySizeLimit(build_app(state), limits.max_request_bytes, state.body_budget, args.api_key)
        server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                               access_log=False, timeout_graceful_shutdown=5,
                                               **uvicorn_options()))
        uvicorn_handle_exit = server.handle_exit

        def handle_exit(sig, frame):  # uvicorn's own signal handler while it serves
            uvicorn_handle_exit(sig, frame)
            runtime.stopping = True
            loop.call_soon_threadsafe(_drain)

        server.handle_exit = handle_exit

        def on_fatal():
            metrics.healthy.set(0)
            loop.call_later(WORKER_DEATH_GRACE_S, setattr, server, "should_exit", True)

        client.on_fatal = on_fatal
        if client.fatal:  # a worker died before the callback was in place: its own call found none
            on_fatal()
        if stop.is_set():
            return 0
        log.info("serving %s on http://%s:%d (OpenAI API at /v1)", config.served_model_name, args.host, args.port)
        await server.serve(sockets=None if sock is None else [sock])
        if not server.started and not stop.is_set() and not client.fatal:
            log.error("the HTTP server could not start (is port %d free?)", args.port)
            return 1
        return 1 if client.fatal else 0
    finally:
        await client.close()
        runtime.stop()
        log.info("stopped")

"""The Ray Serve application: ``NodeReplica`` deployments, each owning one unifiedserve runtime
(vision, core and decode processes, the API's own ``ServerState``), behind one ``Ingress``.

The ingress computes the routing key of the request's first media (``route_key.py``: the API's own
media key for local and ``data:`` media, the URL's for downloads) and forwards the HTTP request
through a Serve handle; ``router.MediaAffinityRouter`` picks the replica; the replica
runs the request through the same FastAPI app ``unifiedserve serve`` serves (``server/api.py``), in
process, and streams the ASGI response back. So there is one API; the ingress only routes, adds
the ``x-unifiedserve-replica`` header, turns a replica's death into an OpenAI-style 503, and
aggregates ``/metrics``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
from dataclasses import dataclass

from prometheus_client.core import GaugeMetricFamily
from ray import serve
from ray.exceptions import RayError
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import RayServeException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from flashcodec._errors import first_line
from unifiedserve.ray_serve.metrics import ROUTE_COUNTS, ROUTERS, merge_replica_metrics
from unifiedserve.ray_serve.route_key import route_key
from unifiedserve.ray_serve.routing import RoutingConfig, RoutingHints
from unifiedserve.server.limits import (AUTH_ERROR, AUTH_HEADERS, BODY_METHODS, TOKEN_ID_ROUTES, BodyBudget,
                                       BodyRefused, LimitError, authorized, check_json_shape, read_body)
from unifiedserve.server.openai_protocol import error_body, error_headers

log = logging.getLogger("unifiedserve")

REPLICA_HEADER = "x-unifiedserve-replica"
#: POST routes keyed by their first media: a chat question, and /tokenize, whose probe then warms the probe
#: cache of the replica the same video's questions go to
MEDIA_ROUTED_PATHS = ("/v1/chat/completions", "/tokenize")
ROUTERS_BY_NAME = {"media-affinity": "unifiedserve.ray_serve.router.MediaAffinityRouter",
                   "serve-default": None}  # None: Serve's own power-of-two-choices router
#: what a call through a Serve handle raises when it cannot reach a replica: Ray's errors (the replica's actor died)
#: and Serve's own, which are not Ray's (no replica running, every replica's queue full): 503s, not a 500
REPLICA_ERRORS = (RayError, RayServeException)
MAX_ATTEMPTS = 3  # replicas tried for one request whose runtime refuses it (dead workers)
SCRAPE_TIMEOUT_S = 5.0
# a stopping replica checks for ongoing requests this often (Serve's default, 2 s, is also the least a
# stop waits with none: each deployment added 2 s to every `serve --ray` stop)
SHUTDOWN_POLL_S = 0.25
INLINE_KEY_BYTES = 64 * 1024  # bodies up to this size get their routing key on the event loop
# Ray starts its worker processes at nice 15 (RAY_worker_niceness), below everything else on the node,
# and a replica's vision, core and decode processes inherit it (vision and core then add their own +5:
# nice 19). Next to any other busy process they got a small fraction of a core: a text prompt's prefill
# took 92 ms instead of the plain server's 8. The ingress and the replicas serve at normal priority,
# as the plain server does. Ray's own actors (controller, proxy) keep Ray's priority: their background
# work (the controller's loop alone ~30 ms of CPU a second) then waits while the replica computes.
AT_NORMAL_PRIORITY = {"env_vars": {"RAY_worker_niceness": "0"}}


@dataclass(frozen=True)
class HttpCall:
    """One HTTP request, as the ingress received it (the body already read whole, within the limit)."""

    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes


def _error(message: str, status_code: int, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status_code), status_code=status_code,
                        headers=error_headers(status_code, headers))


def _refused(e: BodyRefused) -> Response:
    """A request refused before (or while) its body is read, as the plain server's middleware answers it: the
    connection closes, since the rest of the body is not drained."""
    return Response(e.json_bytes(), status_code=e.status_code, media_type="application/json",
                    headers={"connection": "close", **e.headers})


def replica_rank_metadata() -> dict:
    """``{"rank": n}`` from the replica context (Serve >= 2.50 ranks replicas 0..N-1 and gives a released
    rank to the next replica it starts), or ``{}`` where this Serve has no ranks."""
    rank = getattr(serve.get_replica_context(), "rank", None)
    value = getattr(rank, "rank", rank)
    return {"rank": value} if isinstance(value, int) and not isinstance(value, bool) else {}


class NodeReplica:
    """One node's runtime, started in the constructor and stopped with the replica."""

    async def __init__(self, args: argparse.Namespace):
        from unifiedserve.runtime.worker import setup_logging
        from unifiedserve.server.api import build_app
        from unifiedserve.server.engine_client import EngineClient
        from unifiedserve.server.serve_setup import build_runtime, build_state, request_limits, worker_timeout

        setup_logging("api")
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        limits = request_limits(args)
        self.runtime = build_runtime(args)
        self.client = EngineClient(self.runtime, worker_timeout(args))
        await self.client.start()
        try:
            self.runtime.create_pools()
            self.runtime.start()
            await self.client.wait_ready(args.startup_timeout)
            self.runtime.all_mapped()
            self.state = build_state(self.runtime, self.client, args, limits)
        except BaseException:
            await self._stop()
            raise
        self.client.on_fatal = lambda: self.state.metrics.healthy.set(0)
        self.app = build_app(self.state)  # bodies come read whole, within the limit, from the ingress
        log.info("replica %s (pid %d) serving %s", self.replica_id, os.getpid(), self.state.model_name)

    async def _stop(self) -> None:
        self.runtime.stopping = True
        self.client.fail_all("the replica is shutting down", 503)
        await self.client.close()
        self.runtime.stop()

    async def __del__(self):  # Serve awaits this when it stops the replica
        await self._stop()

    def record_replica_metadata(self) -> dict:
        """Published once to the routers when the replica is ready: its Serve rank, which a replacement
        replica inherits, so the hash ring keeps its points where the dead replica's were."""
        return replica_rank_metadata()

    def check_health(self) -> None:
        """Serve replaces a replica whose workers died (its in-flight requests already got a 503)."""
        if self.client.fatal:
            raise RuntimeError(f"replica {self.replica_id}: {self.client.fatal}")

    # health and metrics yield their one answer: every call goes through the ingress's one streaming
    # handle, so one router (the one that knows which replicas exist) places them all

    async def health(self, routing: RoutingHints = RoutingHints()):
        """This replica's process, its workers and whether they are all alive."""
        self._check_target(routing)
        workers = {name: info.pid for name, info in self.client.worker_info.items()}
        yield {"replica_id": self.replica_id, "pid": os.getpid(), "healthy": self.client.healthy,
               "workers": workers, **({"error": self.client.fatal} if self.client.fatal else {})}

    async def metrics(self, routing: RoutingHints = RoutingHints()):
        """(replica id, this replica's /metrics text)."""
        self._check_target(routing)
        from unifiedserve.server.api import render_metrics

        yield self.replica_id, render_metrics(self.state).decode()

    def _check_target(self, routing: RoutingHints) -> None:
        assert routing.replica_id in (None, self.replica_id), (routing.replica_id, self.replica_id)

    async def forward(self, call: HttpCall, routing: RoutingHints = RoutingHints()):
        """Run ``call`` through the API app; yields the response start (a dict), then body chunks (bytes).

        The start is ``{"replica_id", "status", "headers"}``, or ``{"replica_id", "unavailable": why}``
        when this replica's runtime is dead, so the ingress can try another replica. Cancelling the
        generator (the client went away) is a disconnect for the app, which then aborts the request.
        """
        self._check_target(routing)
        if self.client.fatal:
            yield {"replica_id": self.replica_id, "unavailable": self.client.fatal}
            return
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": call.method, "scheme": "http", "path": call.path, "raw_path": call.path.encode(),
                 "root_path": "", "query_string": call.query_string, "headers": call.headers,
                 "client": ("ray-ingress", 0), "server": (self.replica_id, 0)}
        sent: asyncio.Queue = asyncio.Queue()
        disconnected = asyncio.Event()
        body_given = False

        async def receive():
            nonlocal body_given
            if not body_given:
                body_given = True
                return {"type": "http.request", "body": call.body, "more_body": False}
            await disconnected.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            await sent.put(message)

        app_task = asyncio.create_task(self.app(scope, receive, send))
        app_task.add_done_callback(lambda _: sent.put_nowait(None))  # after everything it sent
        try:
            while True:
                message = await sent.get()
                if message is None:  # the app returned (or raised) without finishing its response
                    app_task.result()  # re-raises what the app raised
                    return
                if message["type"] == "http.response.start":
                    yield {"replica_id": self.replica_id, "status": message["status"],
                           "headers": list(message.get("headers", ()))}
                elif message["type"] == "http.response.body":
                    # what the app has sent already goes out as one item: each item of a handle stream
                    # costs the ingress, Ray and the proxy CPU, and the app can write faster than that
                    chunks, more = [message.get("body", b"")], message.get("more_body", False)
                    while more and not sent.empty():
                        message = sent.get_nowait()  # after the start, the app sends only body messages
                        if message is None:  # the app returned mid-body: what it sent is the end
                            app_task.result()
                            more = False
                            break
                        chunks.append(message.get("body", b""))
                        more = message.get("more_body", False)
                    body = b"".join(chunks)
                    if body:
                        yield body
                    if not more:
                        return
        finally:
            disconnected.set()
            if not app_task.done():
                try:
                    await asyncio.wait_for(app_task, timeout=5.0)
                except (asyncio.TimeoutError, Exception):
                    app_task.cancel()


def _position_limit(model: str) -> int:
    """The longest context the model's positions allow (its ``max_position_embeddings``); Qwen2.5-VL's where the
    ingress's node cannot read the checkpoint (the replicas' nodes hold it)."""
    from unifiedserve.model.config import ModelConfig

    try:
        return ModelConfig.from_json(os.path.join(model, "config.json")).text.max_position_embeddings
    except (OSError, ValueError):
        return ModelConfig().text.max_position_embeddings


class Ingress:
    """The one HTTP entry: media key -> handle call -> the replica's streamed response."""

    def __init__(self, replicas, args: argparse.Namespace):
        from unifiedserve.server.serve_setup import media_policy, request_limits

        self.replicas = replicas.options(stream=True)  # DeploymentHandle of NodeReplica; every method streams
        self.draining = asyncio.Event()  # set by drain(): streams in flight end with an in-band error
        self.policy = media_policy(args)
        self.limits = request_limits(args)
        # the bodies this ingress holds at once: read, keyed and handed to a replica (--max-inflight-request-mb)
        self.body_budget = BodyBudget(self.limits.inflight_request_bytes)
        # the key checked here before a body is read, as the plain server's middleware does (the replicas check it
        # again, for every route): a client without it takes no room in body_budget
        self.api_key = args.api_key
        from unifiedserve.runtime.launcher import served_name

        self.model_name = served_name(args.model, args.served_model_name)  # the replicas' media-key context
        # the JSON-shape bound before route_key parses a body (a replica checks again against its own context length,
        # which the model's position limit bounds)
        self.max_model_len = args.max_model_len or _position_limit(args.model)

    async def __call__(self, request: Request) -> Response:
        if request.url.path == "/metrics" and request.method == "GET":
            return Response(await self.metrics_text(), media_type="text/plain; version=0.0.4; charset=utf-8")
        if request.url.path == "/health" and request.method == "GET":
            return await self.health()
        keyed = request.method in BODY_METHODS or request.url.path.startswith("/v1/") \
            or request.url.path in ("/tokenize", "/detokenize")  # what the plain server's routes require it on
        if keyed and not authorized(request.headers.get("authorization"), self.api_key):
            # the connection closes, as the plain server's middleware closes it: the unread body is not drained
            return _refused(BodyRefused(AUTH_ERROR, 401, AUTH_HEADERS))
        body = await self._read_body(request)
        if isinstance(body, Response):
            return body
        try:
            return await self._route(request, body)
        finally:  # the replica has the body now (or the request failed): the ingress keeps none of it
            self.body_budget.give(len(body))

    async def _route(self, request: Request, body: bytes) -> Response:
        key = None
        if request.method == "POST" and request.url.path in MEDIA_ROUTED_PATHS:
            try:  # before route_key parses it here: 60 MB of empty content parts took 0.85 s and 674 MB to parse
                check_json_shape(body, self.max_model_len, token_ids=request.url.path in TOKEN_ID_ROUTES)
            except LimitError as e:
                return _error(str(e), e.status_code)
            # a body with inline media (data: payloads to hash) is keyed off the event loop; a small one
            # (URLs, local paths: a stat) costs less than the thread hop
            small = len(body) <= INLINE_KEY_BYTES
            key = self.route_key(body) if small else await asyncio.to_thread(self.route_key, body)
        call = HttpCall(request.method, request.url.path, request.scope.get("query_string", b""),
                        list(request.scope.get("headers", ())), body)
        exclude: tuple[str, ...] = ()
        for _ in range(MAX_ATTEMPTS):
            gen = self.replicas.forward.remote(call, routing=RoutingHints(key, None, exclude))
            try:
                start = await gen.__anext__()
            except REPLICA_ERRORS as e:
                log.warning("a replica failed before answering: %s", first_line(e))
                return _error("the replica serving this request failed; retry the request", 503)
            except StopAsyncIteration:
                return _error("the replica ended the request without a response", 502)
            if "unavailable" in start:
                exclude += (start["replica_id"],)
                continue
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in start["headers"]
                       if k.lower() not in (b"content-length", b"transfer-encoding")}
            headers[REPLICA_HEADER] = start["replica_id"]
            streamed = headers.get("content-type", "").startswith("text/event-stream")
            return StreamingResponse(self._relay(gen, start["replica_id"], streamed), status_code=start["status"],
                                     headers=headers)
        return _error("no replica can serve now (their workers died; Serve is replacing them)", 503)

    async def drain(self) -> int:
        """The server stops (``serve --ray``'s SIGINT/SIGTERM): every stream in flight ends now with an in-band
        503 and ``[DONE]``, as the plain server ends its own, instead of being cut mid-chunk when Serve stops.
        Returns at once."""
        self.draining.set()
        return 0

    async def _relay(self, gen, replica_id: str, streamed: bool):
        done = False
        stopping = asyncio.ensure_future(self.draining.wait())
        try:
            while True:
                chunk = asyncio.ensure_future(gen.__anext__())
                await asyncio.wait({chunk, stopping}, return_when=asyncio.FIRST_COMPLETED)
                if not chunk.done():  # draining: the stream ends here (the replica's work is cancelled below)
                    chunk.cancel()
                    if streamed:
                        yield f"data: {json.dumps(error_body('the server is shutting down', 503))}\n\n"
                        yield "data: [DONE]\n\n"
                    return
                try:
                    yield chunk.result()
                except StopAsyncIteration:
                    done = True
                    return
        except REPLICA_ERRORS as e:
            log.warning("replica %s failed mid-request: %s", replica_id, first_line(e))
            done = True
            if streamed:  # the status is sent already: say it in-band, as the API does for a dead worker
                message = f"the replica serving this request ({replica_id}) failed; retry the request"
                yield f"data: {json.dumps(error_body(message, 503))}\n\n"
                yield "data: [DONE]\n\n"
        finally:
            stopping.cancel()
            if not done:  # the client went away (or the server stops): stop the replica's work too
                gen.cancel()

    async def _read_body(self, request: Request) -> bytes | Response:
        """The body within ``--max-request-mb``, or the plain server's own refusal (``limits.read_body``)."""
        try:
            body = await read_body(request.scope, request.receive, self.limits.max_request_bytes, self.body_budget)
        except BodyRefused as e:
            return _refused(e)
        return Response(status_code=499) if body is None else body  # None: the client went away

    def route_key(self, body: bytes) -> str | None:
        """The routing key of a chat completion: its first media's key (``route_key.py``), or None."""
        return route_key(body, self.policy, self.limits, self.model_name)

    async def _each_replica(self, method: str) -> list:
        """``method``'s result from every replica this ingress routes to (those that answer in time).

        Before the first routed request, or with Serve's default router, there is no replica list:
        then one replica answers."""
        replica_ids = sorted({rid for router in list(ROUTERS) for rid in router.replica_ids()})
        # one at a time: calls made while serving one HTTP request share Serve's internal request id,
        # and the router matches a chosen replica to its request by that id
        results = []
        for hints in [RoutingHints(replica_id=rid) for rid in replica_ids] or [RoutingHints()]:
            try:
                call = getattr(self.replicas, method).remote(routing=hints)
                results.append(await asyncio.wait_for(call.__anext__(), SCRAPE_TIMEOUT_S))
            except (*REPLICA_ERRORS, asyncio.TimeoutError, StopAsyncIteration) as e:
                log.warning("replica %s did not answer %s: %s", hints.replica_id or "(any)", method,
                            first_line(e))
        return results

    async def metrics_text(self) -> bytes:
        """Every replica's metrics with a ``replica`` label, this ingress's routing counters and the request
        bodies it holds (``unifiedserve_ingress_request_body_bytes``: the replicas hold none of their own)."""
        texts = dict(await self._each_replica("metrics"))
        held = GaugeMetricFamily("unifiedserve_ingress_request_body_bytes", "Bytes of request bodies the ingress "
                                 "holds now: being read, or on their way to a replica (at most "
                                 "--max-inflight-request-mb).", value=self.body_budget.held)
        return merge_replica_metrics(texts, [*ROUTE_COUNTS.families(), held])

    async def health(self) -> JSONResponse:
        """200 while at least one replica has all its workers; each replica's pid and workers. When none answers in
        time (each runs --max-num-seqs requests, and Serve sends it no more: a health call waits like any other),
        Serve's own health checks say: 200 while it counts a replica running."""
        replicas = {h["replica_id"]: h for h in await self._each_replica("health")}
        ok = any(h["healthy"] for h in replicas.values())
        body = {"status": "ok" if ok else "unhealthy", "replicas": replicas}
        if not replicas:
            running = await asyncio.to_thread(running_replicas)
            ok, body["status"], body["running_replicas"] = running > 0, "ok" if running else "unhealthy", running
        return JSONResponse(body, status_code=200 if ok else 503)


def running_replicas(deployment: str = "NodeReplica") -> int:
    """Replicas of ``deployment`` in this application that Serve's health checks count as running."""
    app = serve.get_replica_context().app_name
    status = serve.status().applications.get(app)
    overview = status.deployments.get(deployment) if status is not None else None
    if overview is None:
        return 0
    return sum(n for state, n in overview.replica_states.items() if getattr(state, "value", state) == "RUNNING")


def build_application(args: argparse.Namespace, *, router: str = "media-affinity"):
    """The Serve application for ``args`` (``unifiedserve serve`` flags plus the Ray ones).

    Args:
        router: "media-affinity" (ours) or "serve-default" (Serve's power of two choices; for comparisons).
    """
    if router not in ROUTERS_BY_NAME:
        raise ValueError(f"router must be one of {', '.join(ROUTERS_BY_NAME)}, got {router!r}")
    routing = RoutingConfig(min_load_bound=args.affinity_load_bound)
    router_config = RequestRouterConfig() if ROUTERS_BY_NAME[router] is None else RequestRouterConfig(
        request_router_class=ROUTERS_BY_NAME[router],
        request_router_kwargs={"num_virtual_nodes": routing.num_virtual_nodes, "load_factor": routing.load_factor,
                               "min_load_bound": routing.min_load_bound})
    options = dict(ray_actor_options={"num_cpus": args.replica_cpus, "runtime_env": AT_NORMAL_PRIORITY},
                   max_ongoing_requests=args.max_num_seqs,
                   request_router_config=router_config, health_check_period_s=2.0, health_check_timeout_s=10.0,
                   graceful_shutdown_timeout_s=10.0, graceful_shutdown_wait_loop_s=SHUTDOWN_POLL_S)
    if args.min_replicas is not None or args.max_replicas is not None:
        options["autoscaling_config"] = {
            "min_replicas": args.min_replicas or 1, "max_replicas": args.max_replicas or args.replicas,
            "initial_replicas": args.replicas, "target_ongoing_requests": routing.min_load_bound}
    else:
        options["num_replicas"] = args.replicas
    replica = serve.deployment(NodeReplica, name="NodeReplica", **options)
    ingress = serve.deployment(Ingress, name="Ingress",
                               ray_actor_options={"num_cpus": 0, "runtime_env": AT_NORMAL_PRIORITY},
                               graceful_shutdown_wait_loop_s=SHUTDOWN_POLL_S,
                               max_ongoing_requests=max(1000, 4 * args.max_num_seqs))
    return ingress.bind(replica.bind(args), args)


__all__ = ["HttpCall", "Ingress", "NodeReplica", "REPLICA_HEADER", "build_application"]

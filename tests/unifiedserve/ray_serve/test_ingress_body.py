"""The Ray ingress refuses a request body exactly as the plain server does (``limits.read_body``):
same status, same OpenAI-style body, nothing read past a declared length (Ray imported, not started)."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("ray.serve")

from starlette.requests import Request  # noqa: E402

from unifiedserve.ray_serve.app import Ingress  # noqa: E402
from unifiedserve.server.limits import BodyBudget, BodySizeLimit, RequestLimits  # noqa: E402

LIMIT = 4096


def feeder(chunks: list[bytes]):
    """An ASGI ``receive`` giving ``chunks`` (the last one ends the body); counts the calls."""
    calls = []

    async def receive():
        calls.append(1)
        i = len(calls) - 1
        if i >= len(chunks):
            return {"type": "http.disconnect"}
        return {"type": "http.request", "body": chunks[i], "more_body": i + 1 < len(chunks)}

    return receive, calls


def scope(headers: list[tuple[bytes, bytes]]) -> dict:
    return {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": headers,
            "query_string": b""}


def plain_server(headers, chunks) -> tuple[int, bytes, int]:
    """(status, body, receive calls) of the plain server's middleware; the app must not be reached."""
    sent = []

    async def app(scope, receive, send):  # pragma: no cover - reached only by a body within the limit
        raise AssertionError("a refused body reached the app")

    async def send(message):
        sent.append(message)

    receive, calls = feeder(chunks)
    asyncio.run(BodySizeLimit(app, LIMIT)(scope(headers), receive, send))
    return sent[0]["status"], sent[1]["body"], len(calls)


def ray_ingress(headers, chunks, budget: BodyBudget | None = None):
    """What the ingress's body reading returns: the body (bytes) or its response, and the receive calls."""
    ingress = Ingress.__new__(Ingress)  # no Serve: only the limits are needed to read a body
    ingress.limits = RequestLimits(max_request_bytes=LIMIT)
    ingress.body_budget = BodyBudget(LIMIT) if budget is None else budget
    receive, calls = feeder(chunks)
    return asyncio.run(ingress._read_body(Request(scope(headers), receive))), len(calls)


@pytest.mark.parametrize("headers, chunks", [
    ([(b"content-length", str(300 * 2**20).encode())], [b"x" * 1024] * 8),  # declared: refused unread
    ([], [b"x" * 1024] * 8),                                               # chunked: refused past the limit
    ([(b"content-length", b"12abc")], [b"{}"]),                            # malformed length: 400
])
def test_the_ingress_refuses_a_body_as_the_plain_server_does(headers, chunks):
    status, body, plain_calls = plain_server(headers, chunks)
    response, ray_calls = ray_ingress(headers, chunks)
    assert (response.status_code, response.body) == (status, body)
    assert response.headers["content-type"] == "application/json" and status in (400, 413)
    assert ray_calls == plain_calls  # read as far as the plain server reads, no further
    if status == 413:
        assert b"--max-request-mb" in body


def test_the_ingress_refuses_a_body_with_no_room_as_the_plain_server_does(monkeypatch):
    """Bodies held at once (--max-inflight-request-mb): a chunk that finds no room in time is a 503 with
    Retry-After from either server, and what the refused body held is given back."""
    from unifiedserve.server import limits

    monkeypatch.setattr(limits, "BODY_ROOM_WAIT_S", 0.05)
    sent = []

    async def plain(budget):
        async def send(message):
            sent.append(message)

        async def app(scope, receive, send):  # pragma: no cover - a refused body never reaches it
            raise AssertionError("a refused body reached the app")

        receive, _ = feeder([b"x" * 1024] * 2)
        await BodySizeLimit(app, LIMIT, budget)(scope([]), receive, send)

    budget = BodyBudget(LIMIT)
    budget.held = LIMIT - 1500  # others' bodies: the second chunk does not fit
    asyncio.run(plain(budget))
    assert budget.held == LIMIT - 1500
    response, _ = ray_ingress([], [b"x" * 1024] * 2, budget)
    assert budget.held == LIMIT - 1500
    assert (response.status_code, response.body) == (sent[0]["status"], sent[1]["body"]) and response.status_code == 503
    assert response.headers["retry-after"] == "1" and (b"retry-after", b"1") in sent[0]["headers"]
    assert b"--max-inflight-request-mb" in response.body


@pytest.mark.parametrize("authorization", [None, b"Bearer wrong", b"Basic sekret", b"sekret"])
def test_without_the_api_key_no_body_is_read_and_none_takes_room(authorization):
    """--api-key: a body-carrying request without the key gets the same 401 from the plain server's middleware
    and the ingress before a byte of its body is read, so it holds no room that a client with the key needs."""
    headers = [(b"content-length", b"2")] + ([(b"authorization", authorization)] if authorization else [])
    sent = []

    async def app(scope, receive, send):  # pragma: no cover - an unauthorized request never reaches it
        raise AssertionError("an unauthorized request reached the app")

    async def send(message):
        sent.append(message)

    receive, plain_calls = feeder([b"{}"])
    budget = BodyBudget(LIMIT)
    asyncio.run(BodySizeLimit(app, LIMIT, budget, api_key="sekret")(scope(headers), receive, send))
    assert sent[0]["status"] == 401 and (b"www-authenticate", b"Bearer") in sent[0]["headers"]
    assert plain_calls == [] and budget.held == 0

    ingress = Ingress.__new__(Ingress)
    ingress.api_key, ingress.body_budget = "sekret", BodyBudget(LIMIT)
    ingress._read_body = lambda request: pytest.fail("the ingress read an unauthorized body")
    receive, ray_calls = feeder([b"{}"])
    response = asyncio.run(ingress(Request(scope(headers), receive)))
    assert response.status_code == 401 and json.loads(response.body) == json.loads(sent[1]["body"])
    assert response.headers["www-authenticate"] == "Bearer" and response.headers["connection"] == "close"
    assert ray_calls == [] and (b"connection", b"close") in sent[0]["headers"]
    assert json.loads(response.body)["error"]["type"] == "authentication_error"


def test_with_the_api_key_the_body_is_read_and_handed_on():
    headers = [(b"content-length", b"2"), (b"authorization", b"bearer  sekret ")]
    reached = []

    async def app(scope, receive, send):
        reached.append((await receive())["body"])

    receive, _ = feeder([b"{}"])
    asyncio.run(BodySizeLimit(app, LIMIT, BodyBudget(LIMIT), api_key="sekret")(scope(headers), receive, None))
    assert reached == [b"{}"]

    ingress = Ingress.__new__(Ingress)
    ingress.api_key, ingress.body_budget = "sekret", BodyBudget(LIMIT)
    ingress.limits = RequestLimits(max_request_bytes=LIMIT)

    async def route(request, body):
        reached.append(body)
        return "routed"

    ingress._route = route
    receive, _ = feeder([b"{}"])
    assert asyncio.run(ingress(Request(scope(headers), receive))) == "routed" and reached[-1] == b"{}"
    assert ingress.body_budget.held == 0


def test_a_body_within_the_limit_is_read_whole():
    response, _ = ray_ingress([(b"content-length", b"12")], [b'{"messages"', b":[]}"])
    assert response == b'{"messages":[]}'
    response, _ = ray_ingress([], [b"x" * 100])
    assert response == b"x" * 100


@pytest.mark.parametrize("path,keyed", [("/v1/chat/completions", True), ("/tokenize", True),
                                        ("/v1/completions", False)])
def test_chat_and_tokenize_are_routed_by_their_first_media(tmp_path, path, keyed):
    """A video's /tokenize goes where its questions go (its probe warms that replica's probe cache)."""
    from pathlib import Path

    from unifiedserve.server.media import MediaPolicy

    video = tmp_path / "clip.mp4"
    video.write_bytes(b"not decoded here: the key is the file's identity")
    body = json.dumps({"messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": f"file://{video}"}}]}]}).encode()
    hints = []

    class Replicas:
        class forward:  # noqa: N801 (the handle's method)
            @staticmethod
            def remote(call, routing):
                hints.append(routing)

                async def nothing():
                    return
                    yield

                return nothing()

    ingress = Ingress.__new__(Ingress)
    ingress.limits, ingress.model_name, ingress.max_model_len = RequestLimits(), "demo", 32768
    ingress.api_key = None
    ingress.body_budget = BodyBudget(len(body))
    ingress.policy = MediaPolicy(Path(tmp_path))
    ingress.replicas = Replicas
    receive, _ = feeder([body])
    request = Request({**scope([(b"content-length", str(len(body)).encode())]), "path": path}, receive)
    response = asyncio.run(ingress(request))
    assert response.status_code == 502  # the stand-in replica ended without answering
    assert (hints[0].key is not None) == keyed
    assert ingress.body_budget.held == 0  # given back once the replica has the request


def test_the_ingress_exports_the_bodies_it_holds():
    ingress = Ingress.__new__(Ingress)
    ingress.body_budget = BodyBudget(LIMIT)
    ingress.body_budget.held = 1234

    async def no_replicas(method):
        return []

    ingress._each_replica = no_replicas
    text = asyncio.run(ingress.metrics_text()).decode()
    assert "unifiedserve_ingress_request_body_bytes 1234.0" in text


def test_a_body_of_too_many_json_objects_is_refused_before_the_ingress_parses_it(tmp_path):
    """The ingress parses a chat body to find its media key; the JSON-shape bound the replicas apply comes first
    (60 MB of empty content parts took it 0.85 s and 674 MB to parse), with the model's position limit where the
    ingress cannot read the checkpoint."""
    from unifiedserve.ray_serve.app import _position_limit

    ingress = Ingress.__new__(Ingress)
    ingress.max_model_len = 100  # 4 x 100 + 65536 objects and arrays at most
    ingress.route_key = lambda body: pytest.fail("the body was parsed")
    parts = b'{"type":"text","text":""},' * 66_400
    body = b'{"messages":[{"role":"user","content":[' + parts + b'{"type":"text","text":""}]}]}'
    request = Request(scope([]), feeder([])[0])
    response = asyncio.run(ingress._route(request, body))
    assert response.status_code == 400 and b"66405 JSON objects and arrays" in response.body
    assert _position_limit(str(tmp_path)) == 128000  # no config.json here: Qwen2.5-VL's


def test_a_get_with_a_body_and_no_key_is_refused_before_the_body_is_read():
    """The plain server's routes require the key on every /v1 route, GET /v1/models too: the ingress refuses such a
    request without reading its body (it read 50 MB of a GET's body and forwarded it to a replica, which said 401);
    /health and /metrics stay open, as on the plain server."""
    ingress = Ingress.__new__(Ingress)
    ingress.api_key, ingress.body_budget = "sekret", BodyBudget(LIMIT)
    ingress._read_body = lambda request: pytest.fail("the ingress read an unauthorized body")
    get = {**scope([(b"content-length", b"50000000")]), "method": "GET", "path": "/v1/models"}
    receive, calls = feeder([b"x"])
    response = asyncio.run(ingress(Request(get, receive)))
    assert response.status_code == 401 and calls == []

    async def healthy():
        return "health"

    ingress.health = healthy
    assert asyncio.run(ingress(Request({**get, "path": "/health"}, feeder([])[0]))) == "health"


@pytest.mark.parametrize("running", [2, 0])
def test_health_asks_serve_when_no_replica_answers_in_time(monkeypatch, running):
    """Every replica busy with --max-num-seqs requests gets no health call from Serve (it waits like any request):
    /health said 503 with no replicas after 12 s under full load. Serve's own health checks then say."""
    from unifiedserve.ray_serve import app as app_module

    ingress = Ingress.__new__(Ingress)

    async def none_answer(method):
        return []

    ingress._each_replica = none_answer
    monkeypatch.setattr(app_module, "running_replicas", lambda: running)
    response = asyncio.run(ingress.health())
    body = json.loads(response.body)
    assert response.status_code == (200 if running else 503) and body["running_replicas"] == running
    assert body["status"] == ("ok" if running else "unhealthy")


def test_a_drain_ends_the_streams_in_flight_with_an_error_event_and_done():
    """serve --ray's stop: streams in flight end with an in-band 503 and [DONE], as the plain server ends its own
    (they were cut mid-chunk when Serve stopped), and the replica's work is cancelled."""

    class SlowStream:
        cancelled = False

        def __init__(self):
            self.sent = 0

        async def __anext__(self):
            if self.sent == 2:
                await asyncio.sleep(60)  # a long generation: the drain comes first
            self.sent += 1
            return f"data: {self.sent}\n\n"

        def cancel(self):
            self.cancelled = True

    async def run():
        ingress = Ingress.__new__(Ingress)
        ingress.draining = asyncio.Event()
        stream = SlowStream()
        out = []

        async def consume():
            async for chunk in ingress._relay(stream, "r1", streamed=True):
                out.append(chunk)

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.05)
        assert await ingress.drain() == 0
        await asyncio.wait_for(task, 5)
        return out, stream

    out, stream = asyncio.run(run())
    assert out[:2] == ["data: 1\n\n", "data: 2\n\n"] and out[-1] == "data: [DONE]\n\n"
    assert json.loads(out[2].removeprefix("data: "))["error"]["code"] == 503 and stream.cancelled


@pytest.mark.parametrize("error", ["unavailable", "actor died"])
def test_a_replica_serve_cannot_reach_is_a_503_not_a_500(error):
    """Serve's own errors (no replica running: DeploymentUnavailableError) are not Ray's; both are a 503."""
    from ray.exceptions import RayActorError
    from ray.serve.exceptions import DeploymentUnavailableError

    class Unreachable:
        async def __anext__(self):
            raise DeploymentUnavailableError("unifiedserve/NodeReplica") if error == "unavailable" else \
                RayActorError()

    class Replicas:
        class forward:
            @staticmethod
            def remote(call, routing):
                return Unreachable()

    ingress = Ingress.__new__(Ingress)
    ingress.replicas = Replicas()
    get = {"type": "http", "method": "GET", "path": "/v1/models", "headers": [], "query_string": b""}
    response = asyncio.run(ingress._route(Request(get, feeder([])[0]), b""))
    assert response.status_code == 503 and response.headers["retry-after"]
    assert json.loads(response.body)["error"]["code"] == 503

"""``NodeReplica.forward`` runs an HTTP call through an ASGI app in process: the response start,
then the body, with what the app already wrote sent as one item (Ray imported, not started)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve")

from unifiedserve.ray_serve.app import HttpCall, NodeReplica  # noqa: E402

CALL = HttpCall("POST", "/v1/chat/completions", b"", [(b"content-type", b"application/json")], b"{}")


class Replica(NodeReplica):
    def __del__(self):  # no runtime to stop
        pass


def replica(app) -> NodeReplica:
    node = Replica.__new__(Replica)  # no runtime: forward needs only the app
    node.app, node.replica_id, node.client = app, "r1", SimpleNamespace(fatal=None)
    return node


def run(node: NodeReplica) -> list:
    async def collect():
        return [item async for item in node.forward(CALL)]

    return asyncio.run(asyncio.wait_for(collect(), 5.0))  # a relay that hangs fails instead


def start(status=200):
    return {"type": "http.response.start", "status": status, "headers": [(b"content-type", b"text/event-stream")]}


def body(data: bytes, more: bool = True):
    return {"type": "http.response.body", "body": data, "more_body": more}


def test_what_the_app_wrote_at_once_is_one_item():
    async def app(scope, receive, send):
        assert (await receive())["body"] == b"{}"
        await send(start())
        for event in (b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"):
            await send(body(event))
        await send(body(b"", more=False))

    items = run(replica(app))
    assert items[0] == {"replica_id": "r1", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}
    assert items[1:] == [b"data: 1\n\ndata: 2\n\ndata: [DONE]\n\n"]


def test_chunks_written_apart_stay_apart_and_in_order():
    async def app(scope, receive, send):
        await send(start(400))
        await send(body(b"first "))
        await asyncio.sleep(0.05)  # the first chunk must go out before the app writes again
        await send(body(b"second"))
        await asyncio.sleep(0.05)
        await send(body(b" last", more=False))

    assert run(replica(app))[1:] == [b"first ", b"second", b" last"]


def test_a_dead_runtime_says_unavailable():
    node = replica(None)
    node.client = SimpleNamespace(fatal="the core process died")
    assert run(node) == [{"replica_id": "r1", "unavailable": "the core process died"}]


def test_an_app_that_returns_mid_body_ends_the_stream():
    async def app(scope, receive, send):
        await send(start())
        await send(body(b"partial"))  # more_body=True, then the app returns: no hang waiting for more

    assert run(replica(app))[1:] == [b"partial"]


def test_an_app_that_raises_before_its_response_re_raises():
    async def app(scope, receive, send):
        raise RuntimeError("app broke")

    with pytest.raises(RuntimeError, match="app broke"):
        run(replica(app))

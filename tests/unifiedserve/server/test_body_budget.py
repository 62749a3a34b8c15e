"""Request bodies together (``BodyBudget``, ``--max-inflight-request-mb``) and a body's pace (408): unit tests
of ``limits.read_body`` and ``BodySizeLimit``, then the same through a real uvicorn on loopback."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest
import uvicorn

from unifiedserve.server import limits
from unifiedserve.server.http_protocol import uvicorn_options
from unifiedserve.server.limits import BodyBudget, BodyRefused, BodySizeLimit, RequestLimits, read_body
from uvicorn_thread import uvicorn_in_thread

POST = {"type": "http", "method": "POST", "headers": []}


def feeder(chunks, pause_s: float = 0.0):
    """An ASGI ``receive`` giving ``chunks`` (the last ends the body), ``pause_s`` before each but the first;
    past the end, a disconnect."""
    state = {"i": 0}

    async def receive():
        i = state["i"]
        state["i"] += 1
        if i >= len(chunks):
            return {"type": "http.disconnect"}
        if i:
            await asyncio.sleep(pause_s)
        return {"type": "http.request", "body": chunks[i], "more_body": i + 1 < len(chunks)}

    return receive


def test_budget_takes_within_capacity_and_waits_for_room():
    async def run():
        budget = BodyBudget(10)
        assert await budget.take(6, 0) and budget.held == 6
        assert not await budget.take(5, 0.01) and budget.held == 6  # no room, nothing held
        assert not await budget.take(11, 5) and budget.held == 6  # never fits: refused at once
        asyncio.get_running_loop().call_later(0.05, budget.give, 6)
        t0 = time.monotonic()
        assert await budget.take(5, 5)  # woken when room was given back
        assert budget.held == 5 and time.monotonic() - t0 < 1
        with pytest.raises(ValueError):
            budget.give(6)

    asyncio.run(run())


def test_waiting_takes_are_served_in_order_and_a_cancelled_one_holds_nothing():
    async def run():
        budget = BodyBudget(10)
        assert await budget.take(8, 0)
        big = asyncio.ensure_future(budget.take(6, 5))
        await asyncio.sleep(0)
        small = asyncio.ensure_future(budget.take(2, 5))  # fits now, but the big one came first
        await asyncio.sleep(0.01)
        assert not small.done() and budget.held == 8
        budget.give(8)
        assert await big and await small and budget.held == 8
        late = asyncio.ensure_future(budget.take(5, 5))
        after = asyncio.ensure_future(budget.take(2, 5))
        await asyncio.sleep(0.01)
        late.cancel()  # the client went away while waiting: it leaves the queue, the take behind it goes on
        assert await after and budget.held == 10
        with pytest.raises(asyncio.CancelledError):
            await late
        budget.give(10)
        assert budget.held == 0 and not budget._waiting

    asyncio.run(run())


def test_a_declared_body_waits_for_room_unread():
    """Its Content-Length is taken before a byte is read: a body let in is never stopped halfway, and one
    waiting for room leaves its bytes in the socket."""
    async def run():
        budget = BodyBudget(100)
        assert await budget.take(60, 0)
        reads = []

        async def receive():
            reads.append(1)
            return {"type": "http.request", "body": b"x" * 50, "more_body": False}

        scope = {**POST, "headers": [(b"content-length", b"50")]}
        reading = asyncio.ensure_future(read_body(scope, receive, 1000, budget))
        await asyncio.sleep(0.05)
        assert reads == [] and budget.held == 60
        budget.give(60)
        assert await reading == b"x" * 50 and reads == [1] and budget.held == 50

    asyncio.run(run())


def test_a_read_body_is_held_until_the_caller_gives_it_back():
    async def run():
        budget = BodyBudget(100)
        body = await read_body(POST, feeder([b"ab", b"cde"]), 50, budget)
        assert body == b"abcde" and budget.held == 5  # the caller's now
        budget.give(len(body))
        with pytest.raises(BodyRefused) as refused:  # past the limit: what it held is given back
            await read_body(POST, feeder([b"x" * 30, b"x" * 30]), 50, budget)
        assert refused.value.status_code == 413 and budget.held == 0
        left = iter([{"type": "http.request", "body": b"x" * 30, "more_body": True}, {"type": "http.disconnect"}])

        async def leaves():
            return next(left)

        assert await read_body(POST, leaves, 50, budget) is None and budget.held == 0  # left mid-body

    asyncio.run(run())


def test_a_chunk_with_no_room_waits_then_503(monkeypatch):
    monkeypatch.setattr(limits, "BODY_ROOM_WAIT_S", 0.05)

    async def run():
        budget = BodyBudget(100)
        assert await budget.take(90, 0)  # other requests' bodies
        with pytest.raises(BodyRefused) as refused:
            await read_body(POST, feeder([b"x" * 5, b"x" * 20]), 1000, budget)
        assert refused.value.status_code == 503 and refused.value.headers == {"retry-after": "1"}
        assert "--max-inflight-request-mb" in str(refused.value) and budget.held == 90
        asyncio.get_running_loop().call_later(0.02, budget.give, 90)  # room comes back within the wait
        assert await read_body(POST, feeder([b"x" * 5, b"x" * 20]), 1000, budget) == b"x" * 25

    asyncio.run(run())


def test_a_body_must_keep_its_pace(monkeypatch):
    """Within BODY_GRACE_S plus a second per BODY_MIN_RATE bytes, else 408; a wait for room is not the
    client's time."""
    monkeypatch.setattr(limits, "BODY_GRACE_S", 0.2)
    monkeypatch.setattr(limits, "BODY_MIN_RATE", 1000.0)  # each byte buys 1 ms

    async def run():
        with pytest.raises(BodyRefused) as refused:  # stalled after its first chunk
            await read_body(POST, feeder([b"x" * 10, b"x"], pause_s=3), 10**6)
        assert refused.value.status_code == 408 and "too slowly: 10 bytes" in str(refused.value)
        # 0.1 s pauses, 0.5 s in all: within 0.2 s + 1 ms per byte only because each chunk buys 0.1 s
        assert len(await read_body(POST, feeder([b"x" * 100] * 6, pause_s=0.1), 10**6)) == 600
        with pytest.raises(BodyRefused) as refused:  # the same pauses with 10-byte chunks fall behind
            await read_body(POST, feeder([b"x" * 10] * 6, pause_s=0.1), 10**6)
        assert refused.value.status_code == 408
        budget = BodyBudget(100)
        assert await budget.take(95, 0)
        asyncio.get_running_loop().call_later(0.5, budget.give, 95)  # longer than the grace
        monkeypatch.setattr(limits, "BODY_ROOM_WAIT_S", 5.0)
        assert await read_body(POST, feeder([b"x" * 10, b"x" * 10]), 10**6, budget) == b"x" * 20

    asyncio.run(run())


def test_the_middleware_holds_a_body_until_its_app_returns():
    budget = BodyBudget(100)
    seen = []

    async def app(scope, receive, send):
        seen.append(((await receive())["body"], budget.held))
        if len(seen) == 2:
            raise RuntimeError("the app failed")

    async def send(message):  # pragma: no cover - the app answers nothing
        pass

    middleware = BodySizeLimit(app, 50, budget)
    asyncio.run(middleware(POST, feeder([b"abc", b"de"]), send))
    assert seen == [(b"abcde", 5)] and budget.held == 0
    with pytest.raises(RuntimeError):
        asyncio.run(middleware(POST, feeder([b"xyz"]), send))
    assert budget.held == 0  # given back however the app ended


@pytest.mark.parametrize("kwargs, ok", [(dict(), 2**30), (dict(max_request_bytes=2**29), 2**31),
                                        (dict(max_inflight_request_bytes=64 * 2**20), 64 * 2**20)])
def test_the_default_budget_holds_four_largest_bodies_or_1_gib(kwargs, ok):
    assert RequestLimits(**kwargs).inflight_request_bytes == ok


@pytest.mark.parametrize("value", [2**20, 0, True, 1.5e9])
def test_a_budget_below_one_body_is_refused(value):
    with pytest.raises(ValueError, match="--max-inflight-request-mb"):
        RequestLimits(max_request_bytes=2 * 2**20, max_inflight_request_bytes=value)


# --- through a real server --------------------------------------------------------------------------------

MIB = 2**20


async def echo_size(scope, receive, send):
    """Answers the body's size, after holding the request ``hold`` seconds (its query string)."""
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    await asyncio.sleep(float(scope["query_string"] or 0))
    out = json.dumps({"size": len(body)}).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json"),
                                                                   (b"content-length", str(len(out)).encode())]})
    await send({"type": "http.response.body", "body": out})


def post(port: int, size: int, hold: float = 0.0, pause_at: int | None = None, pause_s: float = 0.0):
    """(status, headers text, body) of one POST of ``size`` bytes, pausing ``pause_s`` after ``pause_at``."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        conn.sendall(b"POST /?%g HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % (hold, size))
        body = b"x" * size
        cut = size if pause_at is None else pause_at
        try:
            conn.sendall(body[:cut])
            time.sleep(pause_s)
            conn.sendall(body[cut:])
        except OSError:
            pass  # answered (and closed) before the whole body went
        data = b""
        while b"\r\n\r\n" not in data or len(data) < data.index(b"\r\n\r\n") + 4 + _length(data):
            chunk = conn.recv(65536)
            if not chunk:
                break
            data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), head.decode().lower(), rest


def _length(data: bytes) -> int:
    head = data.split(b"\r\n\r\n")[0].decode().lower()
    for line in head.split("\r\n"):
        if line.startswith("content-length:"):
            return int(line.split(":")[1])
    return 0


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setattr(limits, "BODY_ROOM_WAIT_S", 1.0)
    monkeypatch.setattr(limits, "BODY_GRACE_S", 2.0)
    monkeypatch.setattr(limits, "BODY_MIN_RATE", 4.0 * MIB)  # 1.5 MiB buys 0.375 s more
    budget = BodyBudget(2 * MIB)
    config = uvicorn.Config(BodySizeLimit(echo_size, 2 * MIB, budget), log_level="warning", **uvicorn_options())
    with uvicorn_in_thread(config) as port:
        yield port, budget


def test_bodies_over_the_budget_wait_for_room(server):
    """Two 1.5 MiB bodies against 2 MiB held at once: the second waits for the first's request to end (0.5 s
    here, within the 1-s wait), then is served whole."""
    port, budget = server
    results = {}
    first = threading.Thread(target=lambda: results.setdefault("first", post(port, 3 * MIB // 2, hold=0.5)))
    first.start()
    deadline = time.monotonic() + 5
    while budget.held < 3 * MIB // 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert budget.held == 3 * MIB // 2
    status, _, body = post(port, 3 * MIB // 2)
    first.join()
    assert status == 200 and json.loads(body) == {"size": 3 * MIB // 2}
    assert results["first"][0] == 200 and budget.held == 0


def test_no_room_in_time_is_a_503_and_a_stalled_body_a_408(server):
    """A stalled 1.5 MiB body holds its length; the next body finds no room within the wait (503 with
    Retry-After), and the stalled one is cut at its pace deadline (408); the budget is empty after."""
    port, budget = server
    results = {}
    stalled = threading.Thread(target=lambda: results.setdefault(
        "stalled", post(port, 3 * MIB // 2 + 10, pause_at=3 * MIB // 2, pause_s=4)))
    stalled.start()
    deadline = time.monotonic() + 5
    while budget.held < 3 * MIB // 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    status, head, body = post(port, MIB)
    assert status == 503 and "retry-after: 1" in head and "connection: close" in head
    assert "--max-inflight-request-mb" in json.loads(body)["error"]["message"]
    stalled.join()
    status, _, body = results["stalled"]
    assert status == 408 and "too slowly" in json.loads(body)["error"]["message"]
    assert budget.held == 0
    assert post(port, MIB)[0] == 200  # and the server serves on

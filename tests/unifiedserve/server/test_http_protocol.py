"""Below the app: malformed HTTP framing gets a 400 and an oversized head a 431, each with OpenAI's error
body, from either of uvicorn's HTTP/1.1 parsers; the server keeps serving well-formed requests (a real
uvicorn server on a loopback socket)."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest
import uvicorn

from unifiedserve.server import http_protocol as protocol_module
from uvicorn_thread import uvicorn_in_thread
from unifiedserve.server.http_protocol import (MAX_HEAD_BYTES, MAX_REASON_CHARS, error_response, http_protocol,
                                               uvicorn_options)

BROKEN = {
    "request line": b"\x00\x01 not HTTP at all\r\n\r\n",
    "header line": b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n",
    "chunk size": b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                  b"zz\r\n{}\r\n0\r\n\r\n",
    "two lengths": b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n"
                   b"\r\n{}",
}


async def app(scope, receive, send):
    """``fine`` (after a second for ``/slow``), or for a POST the number of body bytes it read."""
    if scope["type"] != "http":
        return
    if scope["path"] == "/slow":
        await asyncio.sleep(1.0)
    if scope["method"] == "POST":
        size, more = 0, True
        while more:
            message = await receive()
            size, more = size + len(message.get("body", b"")), message.get("more_body", False)
        text = str(size).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(text)).encode())]})
        await send({"type": "http.response.body", "body": text})
        return
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/plain"), (b"content-length", b"4")]})
    await send({"type": "http.response.body", "body": b"fine"})


def read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes."""
    answer = b""
    while part := sock.recv(65536):
        answer += part
    return answer


def exchange(port: int, request: bytes) -> tuple[int, dict[bytes, bytes], bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        sock.shutdown(socket.SHUT_WR)
        answer = read_all(sock)
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    headers = dict(line.lower().split(b": ", 1) for line in lines[1:])
    return int(lines[0].split(b" ", 2)[1]), headers, body


@pytest.fixture(params=[("h11", "asyncio"), ("httptools", "asyncio"), ("httptools", "uvloop")],
                ids=lambda p: "-".join(p))
def server(request):
    implementation, loop = request.param
    if implementation == "httptools":
        pytest.importorskip("httptools")
    if loop == "uvloop":
        pytest.importorskip("uvloop")
    with uvicorn_in_thread(uvicorn.Config(app, log_level="critical", loop=loop,
                                          **uvicorn_options(implementation))) as port:
        yield port


@pytest.mark.parametrize("broken", sorted(BROKEN))
def test_malformed_framing_gets_an_openai_error_and_the_server_goes_on(server, broken):
    status, headers, body = exchange(server, BROKEN[broken])
    assert status == 400
    assert headers[b"content-type"] == b"application/json"
    assert headers[b"connection"] == b"close"
    assert int(headers[b"content-length"]) == len(body)
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == 400 and error["param"] is None
    assert error["message"].startswith("malformed HTTP request")
    assert error["message"] != "malformed HTTP request", "the parser's reason is kept"
    status, _, body = exchange(server, b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert (status, body) == (200, b"fine")


def test_the_reason_is_printable_and_short():
    reason = "illegal header line: bytearray(b'\\x00abc')"
    body = json.loads(error_response(400, reason).partition(b"\r\n\r\n")[2])
    assert body["error"]["message"] == "malformed HTTP request: illegal header line"
    long = error_response(400, "x\x00\x07y" * 500).partition(b"\r\n\r\n")[2]
    message = json.loads(long)["error"]["message"]
    assert message == "malformed HTTP request: " + ("xy" * 500)[:MAX_REASON_CHARS]
    assert json.loads(error_response(400, None).partition(b"\r\n\r\n")[2])["error"]["message"] == (
        "malformed HTTP request")


def test_uvicorns_default_headers_are_kept():
    response = error_response(400, "x", [(b"server", b"uvicorn"), (b"date", b"today")])
    head = response.partition(b"\r\n\r\n")[0].split(b"\r\n")
    assert head[0] == b"HTTP/1.1 400 Bad Request"
    assert b"server: uvicorn" in head and b"date: today" in head


def test_auto_picks_httptools_when_installed_and_a_bad_name_is_refused():
    pytest.importorskip("httptools")
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    assert issubclass(http_protocol(), HttpToolsProtocol)
    with pytest.raises(ValueError, match="unknown HTTP implementation"):
        http_protocol("h2")


def headers_of(total: int) -> bytes:
    """Header lines of about ``total`` bytes (each under 8 KiB)."""
    line = b"x-filler: " + b"a" * 4000 + b"\r\n"
    return line * (total // len(line))


def test_a_head_within_the_cap_is_served(server):
    head = b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + headers_of(MAX_HEAD_BYTES - 8192)
    assert len(head) < MAX_HEAD_BYTES
    status, _, body = exchange(server, head + b"\r\n")
    assert (status, body) == (200, b"fine")


@pytest.mark.parametrize("size", [MAX_HEAD_BYTES + 1, 3_000_000])
def test_a_body_does_not_count_as_head(server, size):
    """A body's reads, the last one (which ends the message) included, are not head: a 3 MB body once got a
    431 on asyncio's loop, whose last read ended the body."""
    head = b"POST / HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % size
    status, _, body = exchange(server, head + b"x" * size)
    assert (status, body) == (200, str(size).encode())


def test_a_head_past_the_cap_gets_431_and_the_server_goes_on(server):
    with socket.create_connection(("127.0.0.1", server), timeout=10) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n" + headers_of(MAX_HEAD_BYTES - 4096))
        time.sleep(0.2)  # read by the server before the rest comes: nothing unread when it closes
        sock.sendall(headers_of(8192))
        answer = read_all(sock)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431 ")
    error = json.loads(body)["error"]
    assert error["code"] == 431 and error["message"].startswith("request headers too large")
    status, _, body = exchange(server, b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert (status, body) == (200, b"fine")


def test_endless_headers_are_cut_off_not_kept(server):
    """uvicorn's httptools protocol alone keeps every byte (it took 200 MB and answered 200); here the
    connection ends long before 32 MB are sent."""
    sent, answer = 0, b""
    with socket.create_connection(("127.0.0.1", server), timeout=10) as sock:
        try:
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
            while sent < 32 * 2**20:
                sock.sendall(headers_of(2**20))
                sent += 2**20
            sock.sendall(b"\r\n")
            answer = sock.recv(65536)
        except OSError:  # reset: the server closed with our bytes unread
            pass
    assert sent < 32 * 2**20 or answer.startswith(b"HTTP/1.1 431 ")
    assert not answer.startswith(b"HTTP/1.1 200")


def test_a_head_that_never_ends_is_timed_out(server, monkeypatch):
    monkeypatch.setattr(protocol_module, "HEAD_TIMEOUT_S", 0.3)  # read when a connection or request starts
    with socket.create_connection(("127.0.0.1", server), timeout=10) as silent, \
            socket.create_connection(("127.0.0.1", server), timeout=10) as partial:
        partial.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
        t0 = time.monotonic()
        assert read_all(silent) == b"", "nothing asked, nothing answered: just closed"
        head, _, body = read_all(partial).partition(b"\r\n\r\n")
        assert time.monotonic() - t0 < 5
    assert head.startswith(b"HTTP/1.1 408 ")
    assert json.loads(body)["error"]["message"] == (
        "request timed out: the request's headers did not end within 0.3 s")
    status, _, body = exchange(server, b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert (status, body) == (200, b"fine")


def test_the_head_timeout_spares_slow_answers_and_idle_keep_alive(server, monkeypatch):
    """Only a head is timed: an answer that takes longer, and the pause between two requests of a kept-alive
    connection (uvicorn's own keep-alive timeout, 5 s, governs that), are not cut."""
    monkeypatch.setattr(protocol_module, "HEAD_TIMEOUT_S", 0.3)
    with socket.create_connection(("127.0.0.1", server), timeout=10) as sock:
        for path in (b"/slow", b"/"):
            sock.sendall(b"GET %s HTTP/1.1\r\nHost: x\r\n\r\n" % path)
            answer = b""
            while not answer.endswith(b"fine"):
                part = sock.recv(65536)
                assert part, f"closed before answering {path}"
                answer += part
            assert answer.startswith(b"HTTP/1.1 200 ")
            time.sleep(0.8)

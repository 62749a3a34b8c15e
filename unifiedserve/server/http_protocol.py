"""The HTTP/1.1 protocol the server runs: uvicorn's, with a cap on a request's head and OpenAI-style errors
for requests that never reach the app.

Two things happen below the ASGI app, in uvicorn's protocol classes:

- **Malformed framing** (a bad request line, an illegal header, a broken chunked body): uvicorn answers with
  a plain-text ``400 Invalid HTTP request received.``. An OpenAI client expects every error as
  ``{"error": {...}}``, so the protocol here sends OpenAI's error object instead, with the parser's own
  reason, and still closes the connection.
- **The request's head** (request line and headers): with httptools, which uvicorn prefers when it is
  installed, uvicorn keeps every header byte a client sends: 200 MB of headers took the API process from
  48 MB to 244 MB of memory and were then served. h11 stops at its buffer limit. Here both stop at
  :data:`MAX_HEAD_BYTES` with ``431 Request Header Fields Too Large`` before more is kept.
- **A head that never ends**: uvicorn times out only idle keep-alive connections, so a connection that sends
  nothing, or half a head, holds its socket and file descriptor forever (a few hundred such clients use up a
  default 1024-descriptor limit and nobody else connects). Here a head must be whole within
  :data:`HEAD_TIMEOUT_S` of its first byte (of the connection, for the first request): after that, ``408``
  when part of it came, else the connection is just closed (as nginx's ``client_header_timeout``).

uvicorn calls ``send_400_response(msg)`` from inside the ``except`` that caught the parser's error (both
implementations, uvicorn 0.29 .. 0.54); that method and httptools' parser callbacks are what is overridden.
"""

from __future__ import annotations

import asyncio
import json
import sys

from unifiedserve.server.openai_protocol import error_body

#: a request's line and headers together (nginx's default is 4 x 8 KiB buffers; a request's media and text
#: travel in its body, which ``BodySizeLimit`` caps)
MAX_HEAD_BYTES = 64 * 1024
#: seconds from a connection's start, or a request's first byte, to the end of its headers
HEAD_TIMEOUT_S = 30.0
MAX_REASON_CHARS = 200  # the parser's reason can echo request bytes; keep the error short
_STATUS = {400: (b"Bad Request", "malformed HTTP request"),
           408: (b"Request Timeout", "request timed out"),
           431: (b"Request Header Fields Too Large", "request headers too large")}


def error_response(status: int, reason: str | None, default_headers=()) -> bytes:
    """The whole HTTP/1.1 response to a request refused below the app: status, headers and OpenAI's error
    body, whose message is ``malformed HTTP request`` (400), ``request timed out`` (408) or ``request headers
    too large`` (431), then the parser's ``reason`` (printable ASCII kept, capped at :data:`MAX_REASON_CHARS`).
    ``default_headers`` are uvicorn's ``(name, value)`` byte pairs (``server``, ``date``)."""
    phrase, message = _STATUS[status]
    reason = (reason or "").split(": bytearray(")[0]  # h11 appends the offending bytes' repr
    reason = "".join(c for c in reason if " " <= c <= "~").strip()[:MAX_REASON_CHARS]
    if reason:
        message += f": {reason}"
    body = json.dumps(error_body(message, status)).encode()
    head = [b"HTTP/1.1 %d %s\r\n" % (status, phrase)]
    head += [name + b": " + value + b"\r\n" for name, value in default_headers]
    head += [b"content-type: application/json\r\n", b"content-length: %d\r\n" % len(body),
             b"connection: close\r\n", b"\r\n"]
    return b"".join(head) + body


class _Refusals:
    """What both implementations share: answer below the app and close; time a request's head out.

    A subclass says whether a head is open (:meth:`_head_open`)."""

    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop
    _head_timer: asyncio.TimerHandle | None = None
    _bytes_seen = False

    def _head_open(self) -> bool:
        raise NotImplementedError

    def _refuse(self, status: int, reason: str | None) -> None:
        headers = getattr(getattr(self, "server_state", None), "default_headers", ())
        self.transport.write(error_response(status, reason, headers))
        self.transport.close()

    def send_400_response(self, msg: str) -> None:  # noqa: ARG002 (uvicorn's fixed text)
        error = sys.exc_info()[1]  # called from the except that caught the parser's error
        status = getattr(error, "error_status_hint", 400)  # h11: 431 when its buffer limit is passed
        self._refuse(status if status in _STATUS else 400, str(error) if error is not None else None)

    def connection_made(self, transport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self._head_timed_out)

    def data_received(self, data: bytes) -> None:
        self._bytes_seen = True
        super().data_received(data)  # type: ignore[misc]
        if self.transport.is_closing():
            return
        if not self._head_open():
            self._disarm()
        elif self._head_timer is None:  # a new request's first bytes
            self._head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self._head_timed_out)

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)  # type: ignore[misc]

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or not self._head_open():
            return
        if self._bytes_seen:
            self._refuse(408, f"the request's headers did not end within {HEAD_TIMEOUT_S:g} s")
        else:  # nothing was asked: nothing to answer
            self.transport.close()


def _h11_protocol() -> type[asyncio.Protocol]:
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class JSONErrorH11Protocol(_Refusals, H11Protocol):
        """h11 keeps at most ``h11_max_incomplete_event_size`` bytes of an unfinished head (set to
        :data:`MAX_HEAD_BYTES` by :func:`uvicorn_options`) and raises; ``send_400_response`` answers."""

        def _head_open(self) -> bool:
            return self.conn.their_state is h11.IDLE  # no request line and headers parsed yet

    return JSONErrorH11Protocol


def _httptools_protocol() -> type[asyncio.Protocol]:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class JSONErrorHttpToolsProtocol(_Refusals, HttpToolsProtocol):
        """Counts the bytes of the reads that begin and end inside a request's head (httptools buffers a
        header until it is whole, and uvicorn keeps them all): past :data:`MAX_HEAD_BYTES`, 431 and close. A
        read that ends a body or a head is not counted, so at most two reads (256 KiB each) more than the cap
        are held."""

        _head_bytes = 0
        _in_head = True  # from a message's first byte (or the connection's start) to the end of its headers

        def _head_open(self) -> bool:
            return self._in_head

        def data_received(self, data: bytes) -> None:
            was_in_head = self._in_head
            super().data_received(data)
            if was_in_head and self._in_head and not self.transport.is_closing():
                self._head_bytes += len(data)
                if self._head_bytes > MAX_HEAD_BYTES:
                    self._refuse(431, f"over {MAX_HEAD_BYTES} bytes before the end of the headers")

        def on_message_begin(self) -> None:
            self._in_head, self._head_bytes = True, 0
            super().on_message_begin()

        def on_headers_complete(self) -> None:
            self._in_head = False
            super().on_headers_complete()

    return JSONErrorHttpToolsProtocol


def http_protocol(implementation: str = "auto") -> type[asyncio.Protocol]:
    """uvicorn's HTTP/1.1 protocol class (``auto``: httptools if installed, else ``h11``, as uvicorn's
    own ``auto``) with the behaviour above; the value for ``uvicorn.Config(http=...)``."""
    if implementation not in ("auto", "h11", "httptools"):
        raise ValueError(f"unknown HTTP implementation {implementation!r} (auto, h11 or httptools)")
    if implementation == "h11":
        return _h11_protocol()
    try:
        return _httptools_protocol()
    except ImportError:
        if implementation == "httptools":
            raise
        return _h11_protocol()


def uvicorn_options(implementation: str = "auto") -> dict:
    """The ``uvicorn.Config`` keywords that install this protocol and its head cap."""
    return {"http": http_protocol(implementation), "h11_max_incomplete_event_size": MAX_HEAD_BYTES}

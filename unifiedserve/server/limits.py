"""What one request may ask for, checked before any memory is spent on it.

Everything a client can size has a server-wide cap (each a ``unifiedserve serve`` flag):

- **pixels per frame or image** (``--max-pixels``): ``min_pixels <= max_pixels <= ceiling``. The
  default is Qwen2.5-VL's own largest image budget (16384 patches of 28x28, qwen-vl-utils
  ``MAX_PIXELS``); a frame above it would only cost memory the model was never trained on.
- **frames per video** (``--max-frames``): default 768, qwen-vl-utils' ``FPS_MAX_FRAMES``.
- **source picture size**: a video whose stored pictures exceed flashcodec's ``MAX_SOURCE_PIXELS``
  (the largest any H.264/HEVC level allows, 8K fits) is refused at its probe, before a frame is
  decoded at that size (images: PIL's decompression-bomb limit).
- **media parts per request** (``--max-media-per-request``), as vLLM's ``--limit-mm-per-prompt``.
- **choices per request** (``--max-n``): each of OpenAI's ``n`` choices is one sequence in the engine,
  with KV blocks of its own for its output.
- **visual tokens**: known from the probe before any frame is decoded; a request whose prompt
  would exceed ``--max-model-len`` is refused before its placeholders are even expanded.
- **request body** (``--max-request-mb``): a streamed limit, answered with 413 before the body
  is read whole (see :class:`BodySizeLimit`). With ``--api-key``, a body's request must carry the key before
  a byte of it is read (401 otherwise): a client without it cannot take room among the bodies held at once.
- **request bodies together** (``--max-inflight-request-mb``): one cap per body does not bound their sum,
  which is ``connections x --max-request-mb`` (32 clients sending 60 MB each at once took the api process
  from 276 MB to 2.35 GB; with the default 1 GiB here, 1.54 GB, and 64 clients 1.59 GB). A
  :class:`BodyBudget` counts the bytes of every body being read or held by its request, its declared
  length taken before it is read; a body that does not fit waits for room (nothing of it read), first
  come first served, then 503.
- **a body's pace**: a body must arrive within :data:`BODY_GRACE_S` plus one second per
  :data:`BODY_MIN_RATE` bytes received (Apache's ``mod_reqtimeout`` rule), else 408: a body sent a byte at a
  time cannot hold its connection, and the room it was given, for ever.
- **text**: at most :data:`MAX_CHARS_PER_TOKEN` characters per token of ``--max-model-len``, counted
  before the chat template is rendered or tokenized (tokenizing megabytes of text costs the api
  process about a hundred times their size in memory, for a prompt that could never fit); and no
  more messages than the template's :data:`MIN_TOKENS_PER_MESSAGE` per message lets fit, nor more
  content parts than tokens (150,000 empty messages are 5 MB of JSON but 750,000 tokens of template,
  and rendering them took the api process seconds).
- **a body's JSON shape**: at most :data:`MAX_JSON_CONTAINERS_PER_TOKEN` objects and arrays, and
  :data:`MAX_CHARS_PER_TOKEN` commas, per token of ``--max-model-len`` (plus room for a JSON schema, and on the
  routes that take them a prompt of token ids), counted in the raw bytes before they are parsed
  (:func:`check_json_shape`): parsing and validating a 60-MB body of 2.4 M empty content parts held the api
  process's event loop, and so every other request's stream, for 20 s, and took it from 0.3 to 2.3 GB, before
  the count of parts could refuse it.
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import json
from dataclasses import dataclass

from flashcodec.plan.sampling import MAX_FRAME_PIXELS
from unifiedserve.engine.params import MAX_JSON_SCHEMA_BYTES
from unifiedserve.server.openai_protocol import MAX_PROMPT_TOKEN_IDS

#: qwen-vl-utils' MAX_PIXELS (16384 * 28 * 28) and FPS_MAX_FRAMES.
QWEN_MAX_PIXELS = 16384 * 28 * 28
QWEN_MAX_FRAMES = 768


#: Characters of message text allowed per token of --max-model-len. BPE tokens average about four
#: characters; 32 leaves room for long runs (whitespace, repeated symbols) while refusing text that
#: could not fit the context however it tokenized.
MAX_CHARS_PER_TOKEN = 32


#: Tokens the chat template adds around every message at the least: Qwen2.5-VL's ChatML writes
#: ``<|im_start|>``, the role, a newline, then after the content ``<|im_end|>`` and a newline (five).
MIN_TOKENS_PER_MESSAGE = 4


#: JSON objects and arrays a request body may hold per token of --max-model-len: every message and content part is
#: one (an image or video part two) and costs tokens, and text may hold braces, which a run of them tokenizes
#: several to a token; a JSON schema's (:data:`MAX_JSON_SCHEMA_BYTES`) come on top. Parsing and validating a body
#: of that many empty content parts (4 MB) still holds the event loop: 0.9-1.0 s at 32768 tokens on this project's
#: 2-core CPU machine, against 20 s for the 60 MB that nothing refused before.
MAX_JSON_CONTAINERS_PER_TOKEN = 4


#: the routes whose body may list token ids (a prompt's, or ids to detokenize)
TOKEN_ID_ROUTES = ("/v1/completions", "/tokenize", "/detokenize")


def check_json_shape(body: bytes, max_model_len: int, token_ids: bool = False) -> None:
    """Refuse a body holding more JSON objects and arrays, or more values, than any request a server of
    ``max_model_len`` tokens accepts could, counted in the raw bytes (braces, brackets and commas inside strings
    too: the bounds leave room for them) before anything is parsed. ``token_ids``: the route takes a list of token
    ids (``/v1/completions``, ``/tokenize``, ``/detokenize``), whose commas the values' bound allows too."""
    # a count is at most the body's length: a body no longer than a bound is not counted against it
    limit = MAX_JSON_CONTAINERS_PER_TOKEN * max_model_len + MAX_JSON_SCHEMA_BYTES
    containers = body.count(b"{") + body.count(b"[") if len(body) > limit else 0
    if containers > limit:
        raise LimitError(f"the request body holds {containers} JSON objects and arrays; a request to this server "
                         f"holds at most {limit} ({MAX_JSON_CONTAINERS_PER_TOKEN} per token of --max-model-len "
                         f"{max_model_len}, and a JSON schema's)")
    limit = MAX_CHARS_PER_TOKEN * max_model_len + MAX_JSON_SCHEMA_BYTES + (MAX_PROMPT_TOKEN_IDS if token_ids else 0)
    commas = body.count(b",") if len(body) > limit else 0  # values after an object's or array's first: nearly all
    if commas > limit:
        raise LimitError(f"the request body holds {commas} JSON values; a request to this server holds at most "
                         f"{limit} (its text{', a prompt of token ids' if token_ids else ''} and a JSON schema)")


def check_message_sizes(num_chars: int, num_messages: int, num_parts: int, max_model_len: int) -> None:
    """Refuse messages that cannot fit ``max_model_len`` tokens, before they are rendered or tokenized: too
    many characters of text, too many messages for the template's tokens around each, or more content
    parts than tokens."""
    limit = MAX_CHARS_PER_TOKEN * max_model_len
    if num_chars > limit:
        raise LimitError(f"the messages hold {num_chars} characters of text; this server accepts at most {limit} "
                         f"({MAX_CHARS_PER_TOKEN} per token of its {max_model_len}-token context, --max-model-len)",
                         "messages")
    if num_messages * MIN_TOKENS_PER_MESSAGE > max_model_len:
        raise LimitError(f"the request has {num_messages} messages; the chat template adds at least "
                         f"{MIN_TOKENS_PER_MESSAGE} tokens to each, so at most "
                         f"{max_model_len // MIN_TOKENS_PER_MESSAGE} "
                         f"fit this server's {max_model_len}-token context (--max-model-len)", "messages")
    if num_parts > max_model_len:
        raise LimitError(f"the messages have {num_parts} content parts; this server accepts at most {max_model_len} "
                         f"(one per token of its context, --max-model-len)", "messages")


class LimitError(ValueError):
    """A request over one of the server's caps; ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None, status_code: int = 400):
        super().__init__(message)
        self.param = param
        self.status_code = status_code


@dataclass(frozen=True)
class RequestLimits:
    max_pixels: int = QWEN_MAX_PIXELS  # per frame or image
    max_frames: int = QWEN_MAX_FRAMES  # per video
    max_media_per_request: int = 16
    max_request_bytes: int = 64 * 2**20
    max_n: int = 16  # choices per request
    #: bytes of request bodies held at once (None: the larger of 1 GiB and 4 bodies of --max-request-mb)
    max_inflight_request_bytes: int | None = None

    def __post_init__(self) -> None:
        for name, flag in (("max_pixels", "--max-pixels"), ("max_frames", "--max-frames"),
                           ("max_media_per_request", "--max-media-per-request"), ("max_n", "--max-n"),
                           ("max_request_bytes", "--max-request-mb")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{flag} must be a positive number, got {value!r}")
        if self.max_frames < 2:
            raise ValueError(f"--max-frames must be at least 2 (one temporal patch), got {self.max_frames}")
        if self.max_pixels > MAX_FRAME_PIXELS:  # flashcodec decodes no larger frame or image
            raise ValueError(f"--max-pixels must be at most {MAX_FRAME_PIXELS} (8192x4352), got {self.max_pixels}")
        inflight = self.max_inflight_request_bytes
        if inflight is not None and (isinstance(inflight, bool) or not isinstance(inflight, int)
                                     or inflight < self.max_request_bytes):
            raise ValueError(f"--max-inflight-request-mb must be at least --max-request-mb (one whole body), "
                             f"got {inflight!r} bytes for {self.max_request_bytes}")

    @property
    def inflight_request_bytes(self) -> int:
        """The :class:`BodyBudget`'s capacity: the flag's, or the larger of 1 GiB and four largest bodies."""
        if self.max_inflight_request_bytes is not None:
            return self.max_inflight_request_bytes
        return max(2**30, 4 * self.max_request_bytes)

    def check_pixels(self, min_pixels: int | None, max_pixels: int | None, where: str) -> None:
        """``min_pixels <= max_pixels <= --max-pixels`` for one image or video part."""
        for name, value in (("min_pixels", min_pixels), ("max_pixels", max_pixels)):
            if value is not None and value > self.max_pixels:
                raise LimitError(f"{where}.{name} is {value}, over this server's limit of {self.max_pixels} "
                                 f"pixels per frame (--max-pixels)", f"{where}.{name}")
        if min_pixels is not None and max_pixels is not None and min_pixels > max_pixels:
            raise LimitError(f"{where}.min_pixels ({min_pixels}) is larger than max_pixels ({max_pixels})",
                             f"{where}.min_pixels")

    def check_frames(self, max_frames: int | None, where: str) -> int:
        """The frame cap to send to vision: the client's ``max_frames`` if within the server's, else 400."""
        if max_frames is not None and max_frames > self.max_frames:
            raise LimitError(f"{where}.max_frames is {max_frames}, over this server's limit of {self.max_frames} "
                             f"frames per video (--max-frames)", f"{where}.max_frames")
        return self.max_frames if max_frames is None else max_frames

    def check_media_count(self, count: int) -> None:
        if count > self.max_media_per_request:
            raise LimitError(f"the request has {count} image/video parts, over this server's limit of "
                             f"{self.max_media_per_request} (--max-media-per-request)", "messages")


#: seconds any request body may take, before :data:`BODY_MIN_RATE` applies (Apache's mod_reqtimeout: 20)
BODY_GRACE_S = 30.0
#: bytes a second a body must average past its grace: each byte received extends its deadline by 1/rate
#: (Apache's MinRate is 500; media bodies are larger)
BODY_MIN_RATE = 64 * 1024
#: seconds a body's next chunk waits for room in the :class:`BodyBudget` before the request gets 503
BODY_ROOM_WAIT_S = 30.0


class BodyRefused(Exception):
    """A request body :func:`read_body` refuses: over the limit (413), a malformed ``Content-Length`` (400),
    too slow (408), or no room among the bodies held at once (503, with ``Retry-After``)."""

    def __init__(self, message: str, status_code: int, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status_code = status_code
        self.headers = headers or {}

    def json_bytes(self) -> bytes:
        """The OpenAI-style error body both servers answer with (the plain one and the Ray ingress)."""
        from unifiedserve.server.openai_protocol import error_body

        return json.dumps(error_body(str(self), self.status_code)).encode()


class BodyBudget:
    """The bytes of request bodies one process holds at once: those being read, and those whose request has
    not finished (its handler keeps the body, or what was parsed from it, until then).

    :func:`read_body` takes a body's declared ``Content-Length`` before reading it (a body without one: each
    chunk as it arrives). Takes that do not fit wait, first come first served, until others give bytes back,
    for at most their ``wait_s``. One event loop uses it (no locks).
    """

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"a body budget needs a positive capacity, got {capacity}")
        self.capacity = capacity
        self.held = 0
        self._waiting: collections.deque[tuple[int, asyncio.Future]] = collections.deque()

    async def take(self, num_bytes: int, wait_s: float) -> bool:
        """Hold ``num_bytes`` more; False when they did not fit within ``wait_s`` seconds (nothing held)."""
        if num_bytes > self.capacity:
            return False
        if not self._waiting and self.held + num_bytes <= self.capacity:
            self.held += num_bytes
            return True
        entry = (num_bytes, asyncio.get_running_loop().create_future())
        self._waiting.append(entry)
        try:
            await asyncio.wait([entry[1]], timeout=wait_s)
        except BaseException:  # cancelled while waiting: hold nothing
            self._leave(entry)
            raise
        if entry[1].done():
            return True
        self._leave(entry)
        return False

    def give(self, num_bytes: int) -> None:
        """Give back bytes :meth:`take` held; the waiting takes that now fit get them, in order."""
        if not 0 <= num_bytes <= self.held:
            raise ValueError(f"giving back {num_bytes} bytes of a budget that holds {self.held}")
        self.held -= num_bytes
        self._grant()

    def _grant(self) -> None:
        while self._waiting and self.held + self._waiting[0][0] <= self.capacity:
            num_bytes, granted = self._waiting.popleft()
            self.held += num_bytes
            granted.set_result(None)

    def _leave(self, entry: tuple[int, asyncio.Future]) -> None:
        """A take that stopped waiting: give back what it was granted meanwhile, or leave the queue."""
        if entry[1].done():
            self.give(entry[0])
        else:
            self._waiting.remove(entry)
            entry[1].cancel()
            self._grant()  # the takes it held up may fit


async def read_body(scope, receive, limit: int, budget: BodyBudget | None = None) -> bytes | None:
    """The whole request body of an ASGI ``http`` request, at most ``limit`` bytes; None if the client left.

    A declared ``Content-Length`` over the limit is refused before one byte is read; a chunked body
    is counted as it arrives and refused the moment it passes the limit. The body must arrive within
    :data:`BODY_GRACE_S` seconds plus one second per :data:`BODY_MIN_RATE` bytes it has sent. With a
    ``budget``, a body's declared ``Content-Length`` is held in it before a byte is read (without one, each
    chunk as it arrives), so a body let in is never stopped halfway for room; time spent waiting for room
    does not count against the client's pace. The caller then owns ``len(body)`` bytes of the budget and
    gives them back when the request ends. A refused or abandoned body gives back what it held here.

    Raises:
        BodyRefused: over ``limit`` (413, naming ``--max-request-mb``), a malformed ``Content-Length``
        (400), too slow (408), or no room in ``budget`` within :data:`BODY_ROOM_WAIT_S` (503).
    """
    declared = dict(scope.get("headers") or ()).get(b"content-length")
    if declared is not None:
        try:
            num_declared = int(declared)
        except ValueError:
            raise BodyRefused("malformed Content-Length header", 400) from None
        if num_declared > limit:
            raise _too_large(limit, f"{num_declared} bytes")
    loop = asyncio.get_running_loop()
    held = 0  # bytes of budget this body holds: its declared length, or what came so far
    if budget is not None and declared is not None and num_declared > 0:
        if not await budget.take(num_declared, BODY_ROOM_WAIT_S):
            raise _no_room(budget)
        held = num_declared
    start = loop.time()
    chunks, size = [], 0
    try:
        while True:
            # the pace rule: grace, plus a second per BODY_MIN_RATE bytes; a wait for room moved `start`
            remaining = start + BODY_GRACE_S + size / BODY_MIN_RATE - loop.time()
            try:
                if remaining <= 0:
                    raise asyncio.TimeoutError
                message = await asyncio.wait_for(receive(), remaining)
            except asyncio.TimeoutError:
                raise BodyRefused(f"the request body came too slowly: {size} bytes in {loop.time() - start:.0f} s; "
                                  f"a body must arrive within {BODY_GRACE_S:g} s plus one second per "
                                  f"{BODY_MIN_RATE / 1024:g} KiB", 408) from None
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _too_large(limit, f"{size} bytes so far (chunked)")
            if budget is not None and size > held:  # no declared length: each chunk as it comes
                waited_from = loop.time()
                if not await budget.take(size - held, BODY_ROOM_WAIT_S):
                    raise _no_room(budget)
                held = size
                start += loop.time() - waited_from
            chunks.append(chunk)
            if not message.get("more_body", False):
                held -= min(held, size)  # len(body) bytes are the caller's now (any rest is given back below)
                return b"".join(chunks)
    finally:
        if held:
            budget.give(held)


def _no_room(budget: BodyBudget) -> BodyRefused:
    return BodyRefused(f"the server is holding {budget.capacity} bytes of request bodies already "
                       f"(--max-inflight-request-mb); retry the request", 503, {"retry-after": "1"})


#: the 401's message (the plain server, its middleware and the Ray ingress)
AUTH_ERROR = "invalid or missing API key (Authorization: Bearer <key>)"
#: the 401's challenge (RFC 7235: a 401 names the scheme it wants)
AUTH_HEADERS = {"www-authenticate": "Bearer"}
#: the methods whose request bodies the middleware and the ingress read
BODY_METHODS = ("POST", "PUT", "PATCH")


def authorized(authorization: str | None, api_key: str | None) -> bool:
    """No ``api_key``, or an ``Authorization`` header value of ``Bearer <key>``; the scheme is case-insensitive
    (RFC 7235), the key compared in constant time."""
    if not api_key:
        return True
    scheme, _, token = (authorization or "").strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


def scope_header(scope, name: bytes) -> str | None:
    """The first value of header ``name`` (lower case) of an ASGI ``http`` scope, or None."""
    for key, value in scope.get("headers") or ():
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def _too_large(limit: int, size: str) -> BodyRefused:
    return BodyRefused(f"the request body is {size}, over this server's limit of {limit} bytes "
                       f"(--max-request-mb); send large media as file:// or http(s) URLs", 413)


class BodySizeLimit:
    """ASGI middleware: a request body over ``limit`` bytes gets 413 before it is read whole (:func:`read_body`).

    Bodies within the limit are buffered here (at most ``limit`` bytes) and replayed to the app,
    whose later ``receive`` calls go straight to the server, so disconnect detection is unchanged.
    With a ``budget``, a body is held in it from its first chunk until the app returns (for a streamed
    answer, its last event). With an ``api_key``, a request without it gets 401 before its body is read: no
    room in the budget, no reading, for a client that could not be served anyway (the app checks the key of
    every route again). Pure ASGI (not BaseHTTPMiddleware, which hides client disconnects).
    """

    def __init__(self, app, limit: int, budget: BodyBudget | None = None, api_key: str | None = None):
        self.app, self.limit, self.budget, self.api_key = app, limit, budget, api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in BODY_METHODS:
            return await self.app(scope, receive, send)
        if not authorized(scope_header(scope, b"authorization"), self.api_key):
            return await self._reply(send, BodyRefused(AUTH_ERROR, 401, AUTH_HEADERS))
        try:
            body = await read_body(scope, receive, self.limit, self.budget)
        except BodyRefused as e:
            return await self._reply(send, e)
        if body is None:
            return
        try:
            return await self._call(scope, receive, send, body)
        finally:
            if self.budget is not None:
                self.budget.give(len(body))

    async def _call(self, scope, receive, send, body: bytes):
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)

    async def _reply(self, send, refused: BodyRefused) -> None:
        body = refused.json_bytes()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        headers += [(name.encode(), value.encode()) for name, value in refused.headers.items()]
        await send({"type": "http.response.start", "status": refused.status_code, "headers": headers})
        await send({"type": "http.response.body", "body": body})

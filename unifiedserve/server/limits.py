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
  is read whole (see :class:`BodySizeLimit`).
- **text**: at most :data:`MAX_CHARS_PER_TOKEN` characters per token of ``--max-model-len``, counted
  before the chat template is rendered or tokenized (tokenizing megabytes of text costs the api
  process about a hundred times their size in memory, for a prompt that could never fit); and no
  more messages than the template's :data:`MIN_TOKENS_PER_MESSAGE` per message lets fit, nor more
  content parts than tokens (150,000 empty messages are 5 MB of JSON but 750,000 tokens of template,
  and rendering them took the api process seconds).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

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
                         f"{MIN_TOKENS_PER_MESSAGE} tokens to each, so at most {max_model_len // MIN_TOKENS_PER_MESSAGE} "
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

    def __post_init__(self) -> None:
        for name, flag in (("max_pixels", "--max-pixels"), ("max_frames", "--max-frames"),
                           ("max_media_per_request", "--max-media-per-request"), ("max_n", "--max-n"),
                           ("max_request_bytes", "--max-request-mb")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{flag} must be a positive number, got {value!r}")
        if self.max_frames < 2:
            raise ValueError(f"--max-frames must be at least 2 (one temporal patch), got {self.max_frames}")

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


class BodyRefused(Exception):
    """A request body :func:`read_body` refuses: over the limit (413) or a malformed ``Content-Length`` (400)."""

    def __init__(self, message: str, status_code: int):
        super().__init__(message)
        self.status_code = status_code

    def json_bytes(self) -> bytes:
        """The OpenAI-style error body both servers answer with (the plain one and the Ray ingress)."""
        from unifiedserve.server.openai_protocol import error_body

        return json.dumps(error_body(str(self), self.status_code)).encode()


async def read_body(scope, receive, limit: int) -> bytes | None:
    """The whole request body of an ASGI ``http`` request, at most ``limit`` bytes; None if the client left.

    A declared ``Content-Length`` over the limit is refused before one byte is read; a chunked body
    is counted as it arrives and refused the moment it passes the limit.

    Raises:
        BodyRefused: over ``limit`` (413, naming ``--max-request-mb``), or a malformed ``Content-Length`` (400).
    """
    declared = dict(scope.get("headers") or ()).get(b"content-length")
    if declared is not None:
        try:
            num_declared = int(declared)
        except ValueError:
            raise BodyRefused("malformed Content-Length header", 400) from None
        if num_declared > limit:
            raise _too_large(limit, f"{num_declared} bytes")
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _too_large(limit, f"{size} bytes so far (chunked)")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _too_large(limit: int, size: str) -> BodyRefused:
    return BodyRefused(f"the request body is {size}, over this server's limit of {limit} bytes "
                       f"(--max-request-mb); send large media as file:// or http(s) URLs", 413)


class BodySizeLimit:
    """ASGI middleware: a request body over ``limit`` bytes gets 413 before it is read whole (:func:`read_body`).

    Bodies within the limit are buffered here (at most ``limit`` bytes) and replayed to the app,
    whose later ``receive`` calls go straight to the server, so disconnect detection is unchanged.
    Pure ASGI (not BaseHTTPMiddleware, which hides client disconnects).
    """

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        try:
            body = await read_body(scope, receive, self.limit)
        except BodyRefused as e:
            return await self._reply(send, e)
        if body is None:
            return
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
        await send({"type": "http.response.start", "status": refused.status_code,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

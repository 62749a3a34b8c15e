"""The OpenAI-compatible HTTP API (FastAPI), run in the api process.

``POST /v1/chat/completions`` turns a chat request into a runtime request: media URLs are
resolved under the server's media policy, the chat template is rendered and tokenized here,
vision probes the media (so the prompt length is known), and core gets the expanded prompt.
Tokens come back from core (the first) and decode (the rest); they are detokenized here, with
stop strings, and streamed as server-sent events or returned in one response.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hmac
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

import msgspec
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from unifiedserve.engine.output import text_output
from unifiedserve.engine.params import SamplingParams, check_logit_bias_ids, outside_vocabulary
from unifiedserve.engine.structured import check_response_format
from unifiedserve.model.generation import GenerationDefaults
from unifiedserve.model.processor import IMAGE_PAD, VIDEO_PAD
from unifiedserve.runtime import protocol
from unifiedserve.server.engine_client import EngineClient, RequestError, RequestStream
from unifiedserve.server.limits import (MAX_CHARS_PER_TOKEN, BodyBudget, LimitError, RequestLimits,
                                        check_message_sizes)
from unifiedserve.server.media import MediaError, MediaPolicy, check_declared_type, describe, resolve_media
from unifiedserve.server.media_key import media_key
from unifiedserve.server.metrics import Metrics
from unifiedserve.server.openai_protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, ImagePart,
                                                 SamplingRequest, TextPart, TokenizeRequest, VideoPart, error_body)

log = logging.getLogger("unifiedserve")

DISCONNECT_POLL_S = 0.25  # how often a waiting request checks that its client is still there


@dataclass
class ServerState:
    client: EngineClient
    processor: Any
    metrics: Metrics
    media_policy: MediaPolicy
    model_name: str
    max_model_len: int
    default_max_tokens: int
    eos_token_ids: tuple[int, ...]
    policy: str
    api_key: str | None = None
    limits: RequestLimits = RequestLimits()
    draining: bool = False
    #: defaults for the sampling fields a request leaves out (the checkpoint's generation_config.json)
    generation: GenerationDefaults = GenerationDefaults()
    #: the width of the model's logits: ``logit_bias`` ids must be below it (None: not checked here; core does)
    vocab_size: int | None = None
    #: the request bodies held at once (``--max-inflight-request-mb``), which ``BodySizeLimit`` fills
    body_budget: BodyBudget | None = None


def _given(value, default, neutral):
    """A request's own value, else the model's generation-config default, else the API's."""
    if value is not None:
        return value
    return neutral if default is None else default


def _error(message: str, status_code: int, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status_code, param), status_code=status_code)


class _Disconnected(Exception):
    pass


async def _wait(awaitable, request: Request):
    """Await while checking, at most every ``DISCONNECT_POLL_S``, that the client is still connected.

    Raises ``_Disconnected`` when it is gone. The check also runs when results keep arriving.
    """
    scope = request.scope
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            due = scope.get("unifiedserve.next_check", 0.0) - time.monotonic()
            if due > 0:
                done, _ = await asyncio.wait({task}, timeout=due)
                if done:
                    return task.result()
            scope["unifiedserve.next_check"] = time.monotonic() + DISCONNECT_POLL_S
            if await request.is_disconnected():
                raise _Disconnected()
            if task.done():
                return task.result()
    finally:
        if not task.done():
            task.cancel()


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="UnifiedServe", version="0.1.0",
                  description="OpenAI-compatible long-video question answering (Qwen2.5-VL family).")
    app.state.server = state

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        # the deepest error is the informative one (a union reports each branch it tried)
        first = max(exc.errors(), key=lambda e: len(e.get("loc", ())), default={})
        if first.get("type") == "json_invalid":  # its loc is ("body", character offset): not a field
            detail = (first.get("ctx") or {}).get("error", "")
            return _error(f"invalid request: the body is not valid JSON{': ' + detail if detail else ''}", 400)
        content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if tuple(first.get("loc", ())) == ("body",) and content_type != "application/json":
            return _error(f"invalid request: the body must be a JSON object sent with Content-Type: application/json "
                          f"(got {content_type or 'no Content-Type'})", 400)
        # pydantic's loc holds union/validator tags such as "function-after[...]": not field names
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body" and "[" not in str(x))
        msg = ("unknown field, not supported by this server" if first.get("type") == "extra_forbidden"
               else str(first.get("msg", "malformed JSON body")).removeprefix("Value error, "))
        return _error(f"invalid request: {where}: {msg}" if where else f"invalid request: {msg}", 400, where or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return _error(str(exc.detail), exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return _error(f"internal server error: {type(exc).__name__}", 500)

    async def _auth(request: Request) -> None:  # a dependency, not middleware: that would hide disconnects
        if state.api_key and not _authorized(request.headers.get("authorization", ""), state.api_key):
            raise StarletteHTTPException(401, "invalid or missing API key (Authorization: Bearer <key>)")

    @app.get("/health")
    async def health():
        if state.client.healthy and not state.draining:
            workers = {name: info.pid for name, info in state.client.worker_info.items()}
            return {"status": "ok", "policy": state.policy, "workers": workers}
        return JSONResponse({"status": "unhealthy", "policy": state.policy,
                             "error": state.client.fatal or "shutting down"}, status_code=503)

    @app.get("/v1/models", dependencies=[Depends(_auth)])
    async def models():
        return {"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": int(time.time()), "owned_by": "unifiedserve",
            "max_model_len": state.max_model_len, "policy": state.policy}]}

    @app.get("/metrics")
    async def metrics():
        return Response(render_metrics(state), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/chat/completions", dependencies=[Depends(_auth)])
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await _chat(state, body, request)

    @app.post("/v1/completions", dependencies=[Depends(_auth)])
    async def completions(body: CompletionRequest, request: Request):
        return await _completion(state, body, request)

    @app.post("/tokenize", dependencies=[Depends(_auth)])
    async def tokenize(body: TokenizeRequest, request: Request):
        return await _tokenize(state, body, request)

    @app.post("/detokenize", dependencies=[Depends(_auth)])
    async def detokenize(body: DetokenizeRequest):
        return await _detokenize(state, body)

    return app


def _authorized(header: str, api_key: str) -> bool:
    """``Authorization: Bearer <key>``; the scheme is case-insensitive (RFC 7235), the key compared in constant time."""
    scheme, _, token = header.strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


def render_metrics(state: ServerState) -> bytes:
    """The server's /metrics text, its worker gauges refreshed first."""
    state.metrics.update_workers(state.client.all_gauges(), _num_in_api(state.client))
    state.metrics.update_processes(state.client.gauges, state.client.sent_bytes)
    if state.body_budget is not None:
        state.metrics.request_body_bytes.set(state.body_budget.held)
    return state.metrics.render()


def _num_in_api(client: EngineClient) -> int:
    return sum(1 for s in client.streams.values() if not s.added)


def _other_model(state: ServerState, model: str | None) -> JSONResponse | None:
    """A 404 for a request naming a model this server does not serve."""
    if model is None or model == state.model_name:
        return None
    return _error(f"the model {model!r} does not exist; this server serves {state.model_name!r}", 404, "model")


def _outside_vocabulary(ids: list[int], state: ServerState) -> str | None:
    """What is wrong with token ids outside the model's vocabulary (:func:`outside_vocabulary`), or None."""
    vocab = state.vocab_size if state.vocab_size is not None else state.processor.tokenizer.get_vocab_size()
    return outside_vocabulary(ids, vocab)


def _refuse_early(state: ServerState, body: SamplingRequest, num_prompts: int = 1) -> JSONResponse | None:
    """What refuses a request before any work: the server not serving, another model, too many choices (``n``
    for each of ``num_prompts`` prompts), a ``logit_bias`` id outside the vocabulary."""
    if (why := _not_serving(state)) is not None:
        return _error(why, 503)
    if (wrong := _other_model(state, body.model)) is not None:
        return wrong
    if body.n * num_prompts > state.limits.max_n:
        if num_prompts == 1:
            return _error(f"n is {body.n}; this server returns at most {state.limits.max_n} choices per request "
                          f"(--max-n)", 400, "n")
        return _error(f"a batch of {num_prompts} prompts with n={body.n} asks for {body.n * num_prompts} choices; "
                      f"this server returns at most {state.limits.max_n} choices per request (--max-n): send "
                      f"smaller batches", 400, "prompt")
    if state.vocab_size is not None:
        try:
            check_logit_bias_ids(body.logit_bias_pairs(), state.vocab_size)  # before any media work (core checks again)
        except ValueError as e:
            return _error(str(e), 400, "logit_bias")
    return None


async def _chat(state: ServerState, body: ChatCompletionRequest, request: Request):
    refused = _refuse_early(state, body)
    if refused is not None:
        return refused
    response_format = body.response_format.sampling_fields() if body.response_format is not None else {}
    if response_format.get("response_format", "text") != "text":
        try:  # compile the grammar before any media work: a bad schema is refused at once
            await run_in_threadpool(check_response_format, SamplingParams(**response_format))
        except ValueError as e:
            return _error(f"invalid response_format: {e}", 400, "response_format")
    arrival = time.time()
    try:
        prompt_ids, media = await _chat_prompt(state, body)
    except LimitError as e:
        return _error(str(e), e.status_code, e.param)
    except (MediaError, ValueError) as e:
        return _error(str(e), 400, "messages")
    return await _respond(state, body, request, _CHAT, arrival, [_Prompt(prompt_ids, media)],
                          (body.top_logprobs or 0) if body.logprobs else None, response_format)


async def _chat_prompt(state: ServerState, body: ChatCompletionRequest | TokenizeRequest,
                       add_generation_prompt: bool = True,
                       add_special_tokens: bool = False) -> tuple[list[int], list[protocol.MediaRef]]:
    """The messages' token ids (one placeholder per media) and their media, keyed; sizes checked first.

    Raises:
        LimitError, MediaError, ValueError: as :func:`check_message_sizes`, :func:`convert_messages`,
            :func:`with_media_keys` and :func:`_prompt_ids` raise them.
    """
    check_message_sizes(*_message_sizes(body), state.max_model_len)
    messages, media = await run_in_threadpool(convert_messages, body, state.media_policy, state.limits)
    media = await run_in_threadpool(with_media_keys, media, state.model_name)
    # off the event loop: a long prompt's template and tokenizer take long enough to stall other streams
    ids = await run_in_threadpool(_prompt_ids, state.processor, messages, media, add_generation_prompt,
                                  add_special_tokens)
    return ids, media


def _expanded(state: ServerState, prompt_ids: list[int], plans: list[protocol.MediaPlan]) -> list[int]:
    """``prompt_ids`` with each media's placeholder expanded to its visual tokens (from the probed grids)."""
    return state.processor.expand_vision_tokens(prompt_ids, [p.grid_thw for p in plans if p.kind == "image"],
                                                [p.grid_thw for p in plans if p.kind == "video"])


def _not_serving(state: ServerState) -> str | None:
    """Why the server takes no work now (a worker died, or it is shutting down), or None."""
    if state.draining or state.client.fatal:
        return f"the server is not serving: {state.client.fatal or 'shutting down'}"
    return None


async def _completion(state: ServerState, body: CompletionRequest, request: Request):
    refused = _refuse_early(state, body, len(body.prompts))
    if refused is not None:
        return refused
    arrival = time.time()
    try:
        prompts = await run_in_threadpool(completion_prompts, state, body)
    except LimitError as e:
        return _error(str(e), e.status_code, e.param)
    except ValueError as e:
        return _error(str(e), 400, "prompt")
    return await _respond(state, body, request, _TEXT, arrival, prompts, body.logprobs, {})


def completion_prompts(state: ServerState, body: CompletionRequest) -> list[_Prompt]:
    """A completion's prompts (one, or a batch's) as token ids, with their text for ``echo``."""
    prompts = body.prompts
    if len(prompts) == 1:
        return [completion_prompt(state, prompts[0], body.echo)]
    return [completion_prompt(state, prompt, body.echo, f"prompt[{i}]") for i, prompt in enumerate(prompts)]


def completion_prompt(state: ServerState, prompt: str | list[int], echo: bool, name: str = "the prompt") -> _Prompt:
    """One completion prompt as token ids, and its text if ``echo``. ``name``: what errors call it.

    Raises:
        LimitError: a text longer than the context could hold, or more ids than fit it (before tokenizing).
        ValueError: an id outside the vocabulary, or an image/video placeholder (this endpoint takes no media).
    """
    processor, max_len = state.processor, state.max_model_len
    if isinstance(prompt, str):
        _check_prompt_chars(prompt, max_len, name)
        ids, text = processor.tokenize(prompt), prompt
    else:
        ids = prompt
        if len(ids) >= max_len:
            raise LimitError(f"{name} has {len(ids)} token ids; this server's context holds {max_len} tokens "
                             f"(--max-model-len), the completion's included", "prompt")
        problem = _outside_vocabulary(ids, state)
        if problem is not None:
            raise ValueError(f"{name} has {problem}")
        text = processor.decode(ids, skip_special_tokens=False) if echo else ""
    if not ids:
        raise ValueError(f"{name} has no tokens")
    for token_id, kind in ((processor.image_token_id, "image"), (processor.video_token_id, "video")):
        if token_id in ids:
            raise ValueError(f"{name} holds the {kind} placeholder token ({token_id}); /v1/completions takes text "
                             f"only: send media to /v1/chat/completions")
    return _Prompt(ids, echo=text if echo else "")


def _check_prompt_chars(prompt: str, max_len: int, name: str = "the prompt") -> None:
    """Refuse a text prompt too long for the context at any tokenization, before it is tokenized."""
    if len(prompt) > MAX_CHARS_PER_TOKEN * max_len:
        raise LimitError(f"{name} holds {len(prompt)} characters; this server accepts at most "
                         f"{MAX_CHARS_PER_TOKEN * max_len} ({MAX_CHARS_PER_TOKEN} per token of its {max_len}-token "
                         f"context, --max-model-len)", "prompt")


async def _tokenize(state: ServerState, body: TokenizeRequest, request: Request):
    """vLLM's ``/tokenize``: the ids the model would see. A prompt is tokenized as ``/v1/completions`` does;
    messages are rendered as ``/v1/chat/completions`` renders them, and each image or video placeholder is
    expanded to its visual tokens from the media's probe (vision scans a video's packets and decodes nothing
    for it; the probe is cached, so a question sent next skips the scan). A count over ``--max-model-len``
    is a 400 that gives the count (the same bound the generation endpoints apply)."""
    if (wrong := _other_model(state, body.model)) is not None:
        return wrong
    processor = state.processor
    try:
        if body.prompt is not None:
            _check_prompt_chars(body.prompt, state.max_model_len)
            ids = await run_in_threadpool(processor.tokenize, body.prompt, body.add_special_tokens)
        else:
            ids, media = await _chat_prompt(state, body, body.add_generation_prompt, body.add_special_tokens)
            if media:
                plans = await _probe_only(state, media, request)
                _check_visual_tokens(state, plans, len(ids))
                ids = _expanded(state, ids, plans)
    except LimitError as e:
        return _error(str(e), e.status_code, e.param)
    except RequestError as e:
        return _error(e.message, e.status_code)
    except (MediaError, ValueError) as e:
        return _error(str(e), 400, "prompt" if body.prompt is not None else "messages")
    except _Disconnected:
        return Response(status_code=499)
    token_strs = [processor.tokenizer.id_to_token(i) for i in ids] if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids, "token_strs": token_strs}


async def _probe_only(state: ServerState, media: list[protocol.MediaRef],
                      request: Request) -> list[protocol.MediaPlan]:
    """The media's grids, probed by vision for no request: nothing is decoded past the probe or held."""
    client = state.client
    if (why := _not_serving(state)) is not None:
        raise RequestError(why, 503)
    request_id = f"tokenize-{uuid.uuid4().hex}"
    stream = client.open(request_id)
    probed = None
    try:
        probed = await _wait(client.probe(stream, media, probe_only=True), request)
        return probed.plans
    finally:
        if probed is not None:
            client.finish(request_id)  # vision forgot it when it answered
        else:
            client.abort(request_id)  # failed (vision forgot it too) or abandoned: cancel its probe


async def _detokenize(state: ServerState, body: DetokenizeRequest):
    """vLLM's ``/detokenize``: the text of the ids, special tokens kept."""
    if (wrong := _other_model(state, body.model)) is not None:
        return wrong
    problem = _outside_vocabulary(body.tokens, state)
    if problem is not None:
        return _error(problem[0].upper() + problem[1:], 400, "tokens")
    text = await run_in_threadpool(state.processor.decode, body.tokens, False)
    return {"prompt": text}


@dataclass
class _Prompt:
    """One prompt of a response: its token ids (each media's one placeholder not yet expanded), its media, and
    the text a completion's choices begin with (``echo``)."""

    ids: list[int]
    media: list[protocol.MediaRef] = dataclasses.field(default_factory=list)
    echo: str = ""


@dataclass
class _Admitted:
    """A prompt made ready for the engine: its first choice's stream opened, its media probed, its length and
    parameters checked."""

    index: int  # the prompt's, in the request
    request_id: str  # its first choice's engine request
    stream: RequestStream
    prompt: _Prompt
    ids: list[int]  # expanded
    plans: list[protocol.MediaPlan]
    probe_s: float
    probed_at: float  # time.time() the probe answered (0: no media)
    params: SamplingParams
    stop_ids: frozenset[int]


def _choice_id(response_id: str, index: int) -> str:
    """Choice ``index``'s engine request id: the response's id for choice 0, ``{id}-{index}`` for the others."""
    return response_id if index == 0 else f"{response_id}-{index}"


async def _respond(state: ServerState, body: SamplingRequest, request: Request, shape: "_Shape", arrival: float,
                   prompts: list[_Prompt], logprobs: int | None, response_format: dict[str, Any]):
    """Everything after the prompts: probe the media, add one engine request per choice of each prompt (a batch's
    prompt ``p`` has choices ``p * n`` to ``p * n + n - 1``), answer (streamed or whole) in ``shape``'s format.
    Every prompt is checked against the context before any is added, so a batch is refused whole."""
    response_id = f"{shape.id_prefix}-{uuid.uuid4().hex}"
    client = state.client
    opened: list[str] = []  # the engine requests of this response: one per choice

    def open_stream(request_id: str) -> RequestStream:
        stream = client.open(request_id)
        opened.append(request_id)
        return stream

    started = False
    try:
        admitted = []
        for index, prompt in enumerate(prompts):
            name = shape.prompt_name if len(prompts) == 1 else f"{shape.prompt_name}[{index}]"
            request_id = _choice_id(response_id, index * body.n)
            admitted.append(await _admit(state, body, request, open_stream(request_id), request_id, index, prompt,
                                         name, logprobs, response_format))
        groups = await _wait(_all_or_none([functools.partial(_start, state, body, a, open_stream, response_id,
                                                             arrival, shape) for a in admitted]), request)
        gens = [g for group in groups for g in group]
        started = True
        if body.stream:
            options = body.stream_options
            events = _sse(state, gens, bool(options and options.include_usage),
                          bool(options and options.continuous_usage_stats))
            return StreamingResponse(events, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await _complete(state, gens, request)
    except _Disconnected:  # the client went away: nobody reads this
        return Response(status_code=499)
    except RequestError as e:
        return _error(e.message, e.status_code)
    except ValueError as e:  # sampling parameters
        return _error(str(e), 400)
    finally:
        if not started:
            for rid in opened:
                client.abort(rid)


async def _admit(state: ServerState, body: SamplingRequest, request: Request, stream: RequestStream,
                 request_id: str, index: int, prompt: _Prompt, name: str, logprobs: int | None,
                 response_format: dict[str, Any]) -> _Admitted:
    """Probe ``prompt``'s media and check it against the context; its sampling parameters.

    Raises:
        RequestError: over the context (400), or vision's error.
        ValueError: a sampling parameter the engine refuses.
    """
    probe_s = probed_at = 0.0
    plans: list[protocol.MediaPlan] = []
    if prompt.media:
        t0 = time.time()
        probed = await _wait(state.client.probe(stream, prompt.media), request)
        probed_at = time.time()
        plans, probe_s = probed.plans, probed_at - t0
    _check_visual_tokens(state, plans, len(prompt.ids), name)  # before expanding: a huge grid costs nothing yet
    ids = _expanded(state, prompt.ids, plans)
    prompt_len = len(ids)
    max_tokens = body.completion_limit
    room = state.max_model_len - prompt_len
    defaults = state.generation
    if max_tokens is None:
        max_tokens = min(state.default_max_tokens, defaults.max_tokens or room, room)
    if room < 1 or prompt_len + max_tokens > state.max_model_len:
        raise RequestError(
            f"this model's maximum context length is {state.max_model_len} tokens, but the request needs "
            f"{prompt_len + max(max_tokens, 1)}: {prompt_len} in the {name}"
            f"{' (visual tokens included)' if plans else ''} and {max(max_tokens, 1)} for the completion; "
            + ("shorten the prompt or video (e.g. lower fps, max_frames or max_pixels in video_url)" if plans
               else "shorten the prompt") + " or lower max_tokens", 400)
    params = SamplingParams(
        max_tokens=max_tokens, temperature=_given(body.temperature, defaults.temperature, 1.0),
        top_p=_given(body.top_p, defaults.top_p, 1.0), top_k=max(0, _given(body.top_k, defaults.top_k, 0)),
        seed=body.seed, stop=tuple([body.stop] if isinstance(body.stop, str) else body.stop or ()),
        stop_token_ids=tuple(body.stop_token_ids or ()), min_tokens=body.min_tokens,
        include_stop_str_in_output=body.include_stop_str_in_output, skip_special_tokens=body.skip_special_tokens,
        ignore_eos=body.ignore_eos, logprobs=logprobs,
        presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=_given(body.repetition_penalty, defaults.repetition_penalty, 1.0),
        min_p=_given(body.min_p, defaults.min_p, 0.0), logit_bias=body.logit_bias_pairs(), **response_format)
    return _Admitted(index, request_id, stream, prompt, ids, plans, probe_s, probed_at, params,
                     params.stop_ids(state.eos_token_ids))


async def _all_or_none(calls: list) -> list:
    """Run every coroutine function at once; the first to fail cancels the others (their engine requests are
    aborted by the caller, which holds every request they opened)."""
    if len(calls) == 1:  # no task for the common case
        return [await calls[0]()]
    tasks = [asyncio.ensure_future(call()) for call in calls]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()
            elif not task.cancelled():
                task.exception()  # a second failure is not reported (gather raised the first), nor logged as lost


async def _start(state: ServerState, body: SamplingRequest, a: _Admitted, open_stream, response_id: str,
                 arrival: float, shape: "_Shape") -> list["_Generation"]:
    """Add an admitted prompt's choices to the engine: the first, then, once it has its first token, the others."""
    client, n, keys = state.client, body.n, [ref.key for ref in a.prompt.media]
    base = a.index * n  # the prompt's first choice's index
    await client.add(a.stream, protocol.AddRequest(a.request_id, a.ids, a.plans, a.params, sorted(a.stop_ids), keys))
    first = await a.stream.queue.get()
    if isinstance(first, RequestError):
        raise first
    common = dict(prompt_len=len(a.ids), arrival=arrival, probe_s=a.probe_s, probed_at=a.probed_at,
                  response_id=response_id, shape=shape,
                  echo=a.prompt.echo, prompt_index=a.index)
    gens = [_Generation(state, a.request_id, a.stream, a.params, a.stop_ids, index=base, first=first, **common)]
    # the other choices come once the first has its first token: the prompt's KV blocks (and the media's
    # tokens) are in the prefix and media caches by then, so each prefills only the prompt's last partial block
    children = [(_choice_id(response_id, base + i), i) for i in range(1, n)]
    streams = [open_stream(child_id) for child_id, _ in children]
    child_plans: list[list[protocol.MediaPlan]] = [[] for _ in children]
    if a.prompt.media:  # every choice's probe at once (each a round trip to vision, answered from its probe cache)
        answers = await asyncio.gather(*(client.probe(child, a.prompt.media) for child in streams))
        child_plans = [answer.plans for answer in answers]
        if any([p.grid_thw for p in c] != [p.grid_thw for p in a.plans] for c in child_plans):
            raise RequestError("a media part changed while the request's choices were being added", 409)
    for (child_id, i), child, c_plans in zip(children, streams, child_plans):
        child_params = _choice_params(a.params, i)
        await client.add(child, protocol.AddRequest(child_id, a.ids, c_plans, child_params, sorted(a.stop_ids), keys))
        gens.append(_Generation(state, child_id, child, child_params, a.stop_ids, index=base + i, **common))
    return gens


def _choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice ``index``'s parameters: a seeded request's choice ``i`` is seeded ``seed + i`` (vLLM's rule, so
    choices differ and each is reproducible), wrapped into the 64-bit range the API accepts."""
    if params.seed is None or index == 0:
        return params
    seed = params.seed + index
    return dataclasses.replace(params, seed=seed - 2**64 if seed >= 2**64 else seed)


def _prompt_ids(processor: Any, messages: list[dict], media: list[protocol.MediaRef],
                add_generation_prompt: bool = True, add_special_tokens: bool = False) -> list[int]:
    """The rendered chat's token ids, with one image (video) placeholder per image (video) part of ``media``.

    Raises:
        ValueError: the message text itself holds a placeholder token (before any media is probed).
    """
    ids = processor.tokenize(processor.render_chat(messages, add_generation_prompt), add_special_tokens)
    for token_id, kind, text, article in ((processor.image_token_id, "image", IMAGE_PAD, "an"),
                                          (processor.video_token_id, "video", VIDEO_PAD, "a")):
        if ids.count(token_id) != sum(ref.kind == kind for ref in media):
            raise ValueError(f"the message text holds {text}, the special token that stands for {article} {kind} "
                             f"part; send each {kind} as {article} {kind}_url part")
    return ids


def _message_sizes(body: ChatCompletionRequest) -> tuple[int, int, int]:
    """``(characters of text, messages, content parts)`` of the messages (string contents and text parts count
    their characters), in one pass: what :func:`check_message_sizes` bounds before rendering."""
    chars = parts = 0
    for m in body.messages:
        if isinstance(m.content, str):
            chars += len(m.content)
        elif isinstance(m.content, list):
            parts += len(m.content)
            chars += sum(len(part.text) for part in m.content if isinstance(part, TextPart))
    return chars, len(body.messages), parts


def with_media_keys(media: list[protocol.MediaRef], context: str) -> list[protocol.MediaRef]:
    """Each media with its identity (``server/media_key.py``): the caches and the router use it.

    Raises:
        MediaError: a local file vanished since it was resolved.
    """
    out = []
    for ref in media:
        try:
            out.append(msgspec.structs.replace(ref, key=media_key(ref, context)))
        except OSError:
            raise MediaError(f"media {ref.shown or len(out)} cannot be read") from None
    return out


def _check_visual_tokens(state: ServerState, plans: list[protocol.MediaPlan], num_text_tokens: int,
                         prompt_name: str = "messages") -> None:
    """Refuse a prompt over ``--max-model-len`` from the probed grids, before any placeholder exists."""
    merge = state.processor.merge_size ** 2
    num_visual = sum(t * h * w // merge for t, h, w in (p.grid_thw for p in plans))
    prompt_len = num_text_tokens - len(plans) + num_visual  # each media's one placeholder becomes its tokens
    if prompt_len >= state.max_model_len:
        advice = ("lower fps, max_frames or max_pixels in video_url/image_url" if plans
                  else f"shorten the {prompt_name}")
        raise RequestError(
            f"this model's maximum context length is {state.max_model_len} tokens, but the {prompt_name} alone "
            f"need{'' if prompt_name.endswith('s') else 's'} "
            f"{prompt_len}" + (f" ({num_visual} visual tokens)" if plans else "") + f"; {advice}", 400)


def convert_messages(body: ChatCompletionRequest, policy: MediaPolicy, limits: RequestLimits = RequestLimits()):
    """OpenAI messages -> template messages (``{"type": "image"|"video"}`` parts) and media references.

    Raises:
        LimitError: a part asks for more pixels or frames than the server allows, or there are too
            many media parts (checked before any media is resolved).
        MediaError, ValueError: a media URL the policy refuses, or media outside user messages.
    """
    limits.check_media_count(sum(1 for m in body.messages if isinstance(m.content, list)
                                 for part in m.content if not isinstance(part, TextPart)))
    messages, media = [], []
    for m, message in enumerate(body.messages):
        if message.content is None or isinstance(message.content, str):
            messages.append({"role": message.role, "content": message.content or ""})
            continue
        parts = []
        for j, part in enumerate(message.content):
            if isinstance(part, TextPart):
                parts.append({"type": "text", "text": part.text})
                continue
            if message.role != "user":
                raise ValueError(f"images and videos are only allowed in user messages, not in {message.role!r}")
            where = f"messages[{m}].content[{j}]"
            if isinstance(part, ImagePart):
                u = part.image_url
                limits.check_pixels(u.min_pixels, u.max_pixels, f"{where}.image_url")
                found = resolve_media(u.url, policy)
                check_declared_type(found, "image", f"{where}.image_url")
                media.append(protocol.MediaRef("image", found.path, found.data, min_pixels=u.min_pixels,
                                               max_pixels=u.max_pixels, shown=describe(u.url),
                                               pixel_ceiling=limits.max_pixels))
                parts.append({"type": "image"})
            elif isinstance(part, VideoPart):
                v = part.video_url
                limits.check_pixels(v.min_pixels, v.max_pixels, f"{where}.video_url")
                max_frames = limits.check_frames(v.max_frames, f"{where}.video_url")
                found = resolve_media(v.url, policy)
                check_declared_type(found, "video", f"{where}.video_url")
                media.append(protocol.MediaRef("video", found.path, found.data, fps=v.fps, max_frames=max_frames,
                                               min_pixels=v.min_pixels, max_pixels=v.max_pixels,
                                               shown=describe(v.url), pixel_ceiling=limits.max_pixels))
                parts.append({"type": "video"})
        messages.append({"role": message.role, "content": parts})
    return messages, media


@dataclass(frozen=True)
class _Shape:
    """How a response looks: a chat completion's (messages and deltas) or a completion's (OpenAI's legacy
    ``text_completion``: text, and logprobs as parallel lists)."""

    id_prefix: str
    object: str  # the whole response's
    chunk_object: str  # a streamed event's
    prompt_name: str  # what errors call the prompt
    chat: bool


_CHAT = _Shape("chatcmpl", "chat.completion", "chat.completion.chunk", "messages", True)
_TEXT = _Shape("cmpl", "text_completion", "text_completion", "prompt", False)


def _legacy_logprobs(entries: list[dict], offset: int) -> dict:
    """Chat ``logprobs.content`` entries as a completion's ``logprobs`` (OpenAI's legacy format, as vLLM fills
    it): the tokens, their log-probabilities, each token's top tokens with the sampled one among them, and each
    token's offset in the choice's text (``offset`` is the first's: the echoed prompt's length, or 0)."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{**{t["token"]: t["logprob"] for t in e["top_logprobs"]}, e["token"]: e["logprob"]}
                             for e in entries], "text_offset": offsets}


class _Generation:
    """One choice of an admitted request (one engine request): detokenization, stop strings, metrics, its part
    of the response. Choice 0's engine request id is the response's id; choice ``i > 0``'s is ``{id}-{i}``.
    ``echo``: the prompt's text, which a completion's choice begins with. ``prompt_index``: its prompt's, in a
    batch; ``first``: the choice's first output, read before the response starts (each prompt's first choice)."""

    def __init__(self, state: ServerState, request_id: str, stream: RequestStream, params: SamplingParams,
                 stop_ids: frozenset[int], prompt_len: int, arrival: float, probe_s: float, probed_at: float = 0.0,
                 index: int = 0,
                 response_id: str | None = None, first: protocol.TokenOutput | None = None, shape: _Shape = _CHAT,
                 echo: str = "", prompt_index: int = 0):
        self.state, self.request_id, self.stream, self.params = state, request_id, stream, params
        self.shape, self.echo, self.prompt_index = shape, echo, prompt_index
        self.leads = first is not None  # its prompt's first choice: the one whose first token is the prompt's TTFT
        self._offset = len(echo)  # a streamed completion's text offset of its next token (legacy logprobs)
        self.index, self.response_id = index, response_id or request_id
        self._first = first  # already read from the stream (choice 0's, before the response starts)
        self.stop_ids = stop_ids
        self.prompt_len, self.arrival, self.probe_s, self.probed_at = prompt_len, arrival, probe_s, probed_at
        self.output = text_output(state.processor, params)
        self.num_tokens = 0
        self.finish_reason: str | None = None
        self.last_time = 0.0
        self.created = int(arrival)
        self.logprobs: list[dict] | None = [] if params.logprobs is not None else None  # OpenAI's content entries

    def consume(self, out: protocol.TokenOutput) -> str:
        """One token in; returns the new text. Sets ``finish_reason`` when the request ends."""
        now, metrics = time.time(), self.state.metrics
        if out.index == 0:
            if self.leads:  # the prompt's first token; its other choices' prefill mostly hit the cache
                metrics.ttft.observe(now - self.arrival)
                self._stage_metrics(out.stages, now)
        else:
            metrics.itl.observe(now - self.last_time)
        self.last_time = now
        self.num_tokens += 1
        metrics.generation_tokens.inc()
        is_stop_token = out.finish_reason == "stop" and out.token_id in self.stop_ids
        text = self.output.add(out.token_id, out.index, is_stop_token)
        if self.logprobs is not None and out.logprob is not None and (not is_stop_token or self.output.include_stop):
            # a stop token's logprob is output with its text only
            self.logprobs.append(self._logprob_entry(out.token_id, out.logprob, out.top_logprobs or []))
        if self.output.stopped:
            self.finish_reason = "stop"
        elif out.finish_reason is not None:
            self.finish_reason = out.finish_reason
        if self.finish_reason is not None:
            text += self.output.finish()  # what was held back as a possible stop string's start
        return text

    def _new_logprobs(self, sent: int) -> list[dict] | None:
        return None if self.logprobs is None else self.logprobs[sent:]

    def _logprob_entry(self, token_id: int, logprob: float, top: list[tuple[int, float]]) -> dict:
        """OpenAI's ``logprobs.content`` item: the token's text, its UTF-8 bytes, its and the top tokens' logprobs."""
        def piece(tid: int, lp: float) -> dict:
            raw = self.state.processor.token_bytes(tid)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:  # part of a character: shown as its bytes, as OpenAI does
                text = "".join(f"\\x{b:02x}" for b in raw)
            return {"token": text, "logprob": lp, "bytes": list(raw)}

        return {**piece(token_id, logprob), "top_logprobs": [piece(t, lp) for t, lp in top]}

    def _stage_metrics(self, st: protocol.StageTimes | None, first_token: float) -> None:
        stage = self.state.metrics.stage
        stage["probe"].observe(self.probe_s)
        times = {"probed": self.probed_at, "first_token": first_token}
        if st is not None:
            times.update(decode_start=st.video_decode_start, added=st.added, admitted=st.admitted,
                         first_part_decoded=st.first_part_decoded, first_part_written=st.first_part_written,
                         first_part_ready=st.first_part_ready, media_ready=st.media_ready,
                         encode_start=st.encode_start, prefill_start=st.prefill_start)
        for name, at in times.items():
            if at:  # 0: never reached
                self.state.metrics.milestone[name].observe(max(0.0, at - self.arrival))
        if st is None:
            return
        stage["video_decode"].observe(st.video_decode_s)
        if st.admitted:
            stage["queue"].observe(max(0.0, st.admitted - st.added))
        if st.encode_start:
            stage["encode"].observe(st.encode_end - st.encode_start)
            if st.video_decode_start:
                self.state.metrics.first_encode_lag.observe(max(0.0, st.encode_start - st.video_decode_start))
        if st.prefill_start:
            stage["prefill"].observe(st.prefill_end - st.prefill_start)

    def _release(self) -> None:
        """The choice is done: count its finish reason and let the workers go."""
        self.state.metrics.finished(self.finish_reason or "abort")
        if self.output.stopped:  # a stop string ended it here: the workers may still be generating
            self.state.client.abort(self.request_id)
        else:
            self.state.client.finish(self.request_id)

    async def _next(self) -> protocol.TokenOutput:
        if self._first is not None:
            item, self._first = self._first, None
            return item
        item = await self.stream.queue.get()
        if isinstance(item, RequestError):
            raise item
        return item

    async def run(self) -> None:
        """Consume the choice's tokens until it ends (a whole response)."""
        while self.finish_reason is None:
            self.consume(await self._next())

    def choice(self) -> dict:
        """The choice in a whole response."""
        if not self.shape.chat:
            return {"index": self.index, "text": self.echo + self.output.text,
                    "logprobs": None if self.logprobs is None else _legacy_logprobs(self.logprobs, len(self.echo)),
                    "finish_reason": self.finish_reason}
        return {"index": self.index, "message": {"role": "assistant", "content": self.output.text},
                "logprobs": None if self.logprobs is None else {"content": self.logprobs},
                "finish_reason": self.finish_reason}

    def _chunk(self, delta: dict | None, finish_reason: str | None = None, usage: dict | None = None,
               logprobs: list[dict] | None = None) -> str:
        """One event: ``delta`` is a chat delta (a completion's takes its ``content`` as its text); None: the
        usage event, with no choice."""
        if delta is None:
            choices = []
        elif self.shape.chat:
            choices = [{"index": self.index, "delta": delta,
                        "logprobs": None if logprobs is None else {"content": logprobs}, "finish_reason": finish_reason}]
        else:
            legacy = None
            if logprobs is not None:
                legacy = _legacy_logprobs(logprobs, self._offset)
                self._offset += sum(len(e["token"]) for e in logprobs)
            choices = [{"index": self.index, "text": delta.get("content", ""), "logprobs": legacy,
                        "finish_reason": finish_reason}]
        body = {"id": self.response_id, "object": self.shape.chunk_object, "created": self.created,
                "model": self.state.model_name, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def _usage(gens: list[_Generation]) -> dict[str, int]:
    """The choices' usage: each prompt once (as OpenAI and vLLM count it; a batch's prompts summed), every
    choice's tokens."""
    prompt = sum({g.prompt_index: g.prompt_len for g in gens}.values())
    completion = sum(g.num_tokens for g in gens)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _finished(state: ServerState, gens: list[_Generation]) -> None:
    metrics = state.metrics
    metrics.e2e.observe(time.time() - gens[0].arrival)
    metrics.prompt_tokens.inc(_usage(gens)["prompt_tokens"])
    for g in gens:
        g._release()


def _abort(state: ServerState, gens: list[_Generation]) -> None:
    for g in gens:
        state.client.abort(g.request_id)


async def _run_all(gens: list[_Generation]) -> None:
    """Every choice to its end; the first error (a worker's) cancels the rest."""
    await _all_or_none([g.run for g in gens])


async def _complete(state: ServerState, gens: list[_Generation], request: Request) -> JSONResponse:
    """The whole response, once every choice has ended."""
    try:
        await _wait(_run_all(gens), request)
    except (_Disconnected, RequestError):
        _abort(state, gens)
        raise
    _finished(state, gens)
    first = gens[0]
    return JSONResponse({"id": first.response_id, "object": first.shape.object, "created": first.created,
                         "model": state.model_name, "choices": [g.choice() for g in gens], "usage": _usage(gens)})


async def _arrivals(gens: list[_Generation]):
    """``(choice, token output)`` as they arrive, until every choice has ended (the caller consumes each
    output before the next is awaited, which is how a choice's end is seen)."""
    if len(gens) == 1:  # no task per token for the common case
        g = gens[0]
        while g.finish_reason is None:
            yield g, await g._next()
        return
    pending: dict[asyncio.Future, _Generation] = {asyncio.ensure_future(g._next()): g for g in gens}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=lambda t: pending[t].index):
                g = pending.pop(task)
                yield g, task.result()
                if g.finish_reason is None:
                    pending[asyncio.ensure_future(g._next())] = g
    finally:
        for task in pending:
            task.cancel()


async def _sse(state: ServerState, gens: list[_Generation], include_usage: bool, continuous_usage: bool = False):
    """The response as server-sent events: each choice's role, one event per arrival of its tokens (tagged
    with the choice's index; choices interleave as their tokens come; tokens that arrive together share an
    event, and a last token with no visible text rides on the finish event), each choice's finish event, the
    usage, ``[DONE]``.
    ``continuous_usage`` (vLLM's ``continuous_usage_stats``): each choice's events carry its usage so far."""
    done = False

    def so_far(g: _Generation) -> dict[str, int] | None:
        return _usage([g]) if continuous_usage else None

    try:
        for g in gens:
            if g.shape.chat:
                yield g._chunk({"role": "assistant", "content": ""}, usage=so_far(g))
            elif g.echo:
                yield g._chunk({"content": g.echo}, usage=so_far(g))
        sent = [0] * len(gens)  # logprob entries already streamed, per choice
        async for g, out in _arrivals(gens):
            text = g.consume(out)
            if text or g.finish_reason is None:  # an event per arrival, even with no visible text yet
                yield g._chunk({"content": text}, usage=so_far(g), logprobs=g._new_logprobs(sent[g.index]))
                sent[g.index] = len(g.logprobs or ())
            if g.finish_reason is not None:
                yield g._chunk({}, g.finish_reason, usage=so_far(g),
                               logprobs=g._new_logprobs(sent[g.index]) or None)
        if include_usage:
            yield gens[0]._chunk(None, usage=_usage(gens))
        yield "data: [DONE]\n\n"
        done = True
        _finished(state, gens)
    except RequestError as e:  # a worker died mid-stream: tell the client in-band, then end
        yield f"data: {json.dumps(error_body(e.message, e.status_code))}\n\n"
        done = True
        _abort(state, gens)  # the other choices' requests
    finally:
        if not done:  # the client went away (the generator was closed or cancelled)
            for _ in gens:
                state.metrics.finished("abort")
            _abort(state, gens)

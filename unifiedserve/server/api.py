"""The OpenAI-compatible HTTP API (FastAPI), run in the api process.

``POST /v1/chat/completions`` turns a chat request into a runtime request: media URLs are
resolved under the server's media policy, the chat template is rendered and tokenized here
(:mod:`unifiedserve.server.prompts`), vision probes the media (so the prompt length is known), and core
gets the expanded prompt, one engine request per choice (:mod:`unifiedserve.server.choices`). Tokens come
back from core (the first) and decode (the rest); they are detokenized here, with stop strings, and streamed
as server-sent events or returned in one response (:mod:`unifiedserve.server.responses`).
"""

from __future__ import annotations

import functools
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.routing import APIRoute
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from unifiedserve.engine.params import SamplingParams, check_logit_bias_ids, outside_vocabulary
from unifiedserve.engine.structured import check_response_format
from unifiedserve.model.generation import GenerationDefaults
from unifiedserve.runtime import protocol
from unifiedserve.server.choices import add_choices, admit, choice_id
from unifiedserve.server.engine_client import EngineClient, RequestError, RequestStream
from unifiedserve.server.limits import (AUTH_ERROR, AUTH_HEADERS, TOKEN_ID_ROUTES, BodyBudget, LimitError,
                                       RequestLimits, authorized, check_json_shape)
from unifiedserve.server.media import MediaError, MediaPolicy
from unifiedserve.server.metrics import Metrics
from unifiedserve.server.openai_protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                                 SamplingRequest, TokenizeRequest, error_body, error_headers)
from unifiedserve.server.prompts import (Prompt, chat_prompt, check_prompt_chars, check_visual_tokens,
                                         completion_prompts, expanded_ids, ids_outside_vocabulary)
from unifiedserve.server.responses import CHAT, TEXT, Disconnected, Shape, all_or_none, complete, sse, wait_connected

log = logging.getLogger("unifiedserve")


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


def _error(message: str, status_code: int, param: str | None = None,
           headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status_code, param), status_code=status_code,
                        headers=error_headers(status_code, headers))


class _ShapedJsonRoute(APIRoute):
    """A route whose request body is refused (400) before FastAPI parses and validates it, when it holds more JSON
    objects, arrays or values than any request this server accepts (:func:`limits.check_json_shape`): that work
    runs on the event loop, where every other request's stream waits for it."""

    def get_route_handler(self):
        handler = super().get_route_handler()
        if "POST" not in (self.methods or ()):  # no JSON body to look at (/health, /metrics, /v1/models)
            return handler

        async def shaped(request: Request) -> Response:
            state = request.app.state.server
            # the key first, before the body is looked at: FastAPI parses the body before the _auth dependency
            # (which checks the key again, as for every route)
            if not _authorized(request, state.api_key):
                return _unauthorized()
            try:
                check_json_shape(await request.body(), state.max_model_len,
                                 token_ids=request.url.path in TOKEN_ID_ROUTES)
            except LimitError as e:
                return _error(str(e), e.status_code, e.param)
            return await handler(request)

        return shaped


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="UnifiedServe", version="0.1.0",
                  description="OpenAI-compatible long-video question answering (Qwen2.5-VL family).")
    app.router.route_class = _ShapedJsonRoute  # before the routes below are added
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
        return _error(str(exc.detail), exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return _error(f"internal server error: {type(exc).__name__}", 500)

    async def _auth(request: Request) -> None:  # a dependency, not middleware: that would hide disconnects
        if not _authorized(request, state.api_key):
            raise StarletteHTTPException(401, AUTH_ERROR, AUTH_HEADERS)

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


def _authorized(request: Request, api_key: str | None) -> bool:
    return authorized(request.headers.get("authorization"), api_key)


def _unauthorized() -> JSONResponse:
    return _error(AUTH_ERROR, 401, headers=AUTH_HEADERS)


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


def _refuse_early(state: ServerState, body: SamplingRequest, num_prompts: int = 1) -> JSONResponse | None:
    """What refuses a request before any work: the server not serving, another model, too many choices (``n``
    for each of ``num_prompts`` prompts), a ``logit_bias`` or ``stop_token_ids`` id outside the vocabulary."""
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
        # a stop id the model cannot sample would never match: refused, as logit_bias's are
        if (problem := outside_vocabulary(body.stop_token_ids or (), state.vocab_size)) is not None:
            return _error(f"stop_token_ids names {problem}", 400, "stop_token_ids")
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
        prompt_ids, media = await chat_prompt(state, body)
    except LimitError as e:
        return _error(str(e), e.status_code, e.param)
    except (MediaError, ValueError) as e:
        return _error(str(e), 400, "messages")
    return await _respond(state, body, request, CHAT, arrival, [Prompt(prompt_ids, media)],
                          (body.top_logprobs or 0) if body.logprobs else None, response_format)


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
    return await _respond(state, body, request, TEXT, arrival, prompts, body.logprobs, {})


async def _tokenize(state: ServerState, body: TokenizeRequest, request: Request):
    """vLLM's ``/tokenize``: the ids the model would see. A prompt is tokenized as ``/v1/completions`` does;
    messages are rendered as ``/v1/chat/completions`` renders them, and each image or video placeholder is
    expanded to its visual tokens from the media's probe (vision scans a video's packets and decodes nothing
    for it; the probe is cached, so a question sent next skips the scan). A count that leaves no room for a
    completion (``--max-model-len`` or more) is a 400 that gives the count (the generation endpoints' bound)."""
    if (wrong := _other_model(state, body.model)) is not None:
        return wrong
    processor = state.processor
    try:
        if body.prompt is not None:
            check_prompt_chars(body.prompt, state.max_model_len)
            ids = await run_in_threadpool(processor.tokenize, body.prompt, body.add_special_tokens)
            check_visual_tokens(state, [], len(ids), "prompt")  # the same bound with or without media
        else:
            ids, media = await chat_prompt(state, body, body.add_generation_prompt, body.add_special_tokens)
            plans = await _probe_only(state, media, request) if media else []
            check_visual_tokens(state, plans, len(ids))
            if plans:
                ids = expanded_ids(state, ids, plans)
    except LimitError as e:
        return _error(str(e), e.status_code, e.param)
    except RequestError as e:
        return _error(e.message, e.status_code)
    except (MediaError, ValueError) as e:
        return _error(str(e), 400, "prompt" if body.prompt is not None else "messages")
    except Disconnected:
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
        probed = await wait_connected(client.probe(stream, media, probe_only=True), request)
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
    problem = ids_outside_vocabulary(body.tokens, state)
    if problem is not None:
        return _error(problem[0].upper() + problem[1:], 400, "tokens")
    text = await run_in_threadpool(state.processor.decode, body.tokens, False)
    return {"prompt": text}


async def _respond(state: ServerState, body: SamplingRequest, request: Request, shape: Shape, arrival: float,
                   prompts: list[Prompt], logprobs: int | None, response_format: dict[str, Any]):
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
            request_id = choice_id(response_id, index * body.n)
            admitted.append(await admit(state, body, request, open_stream(request_id), request_id, index, prompt,
                                        name, logprobs, response_format))
        starts = [functools.partial(add_choices, state, body, a, open_stream, response_id, arrival, shape)
                  for a in admitted]
        groups = await wait_connected(all_or_none(starts), request)
        gens = [g for group in groups for g in group]
        started = True
        if body.stream:
            options = body.stream_options
            events = sse(state, gens, bool(options and options.include_usage),
                          bool(options and options.continuous_usage_stats))
            return StreamingResponse(events, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await complete(state, gens, request)
    except Disconnected:  # the client went away: nobody reads this
        return Response(status_code=499)
    except RequestError as e:
        return _error(e.message, e.status_code)
    except ValueError as e:  # sampling parameters
        return _error(str(e), 400)
    finally:
        if not started:
            for rid in opened:
                client.abort(rid)

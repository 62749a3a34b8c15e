"""Answers, for the API (:mod:`unifiedserve.server.api`): each choice of an admitted request as a
:class:`Generation` (detokenization, stop strings, logprobs, metrics), the whole response or its server-sent
events in a chat completion's or a completion's shape, and the wait that notices a client gone away.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import JSONResponse

from unifiedserve.engine.output import text_output
from unifiedserve.engine.params import SamplingParams
from unifiedserve.runtime import protocol
from unifiedserve.server.engine_client import RequestError, RequestStream
from unifiedserve.server.openai_protocol import error_body

if TYPE_CHECKING:
    from unifiedserve.server.api import ServerState


DISCONNECT_POLL_S = 0.25  # how often a waiting request checks that its client is still there


class Disconnected(Exception):
    """The client went away while its request was waiting (:func:`wait_connected`): nobody reads the answer."""


async def wait_connected(awaitable, request: Request):
    """Await while checking, at most every ``DISCONNECT_POLL_S``, that the client is still connected.

    Raises ``Disconnected`` when it is gone. The check also runs when results keep arriving.
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
                raise Disconnected()
            if task.done():
                return task.result()
    finally:
        if not task.done():
            task.cancel()


async def all_or_none(calls: list) -> list:
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


@dataclass(frozen=True)
class Shape:
    """How a response looks: a chat completion's (messages and deltas) or a completion's (OpenAI's legacy
    ``text_completion``: text, and logprobs as parallel lists)."""

    id_prefix: str
    object: str  # the whole response's
    chunk_object: str  # a streamed event's
    prompt_name: str  # what errors call the prompt
    chat: bool


CHAT = Shape("chatcmpl", "chat.completion", "chat.completion.chunk", "messages", True)
TEXT = Shape("cmpl", "text_completion", "text_completion", "prompt", False)


def _legacy_logprobs(entries: list[dict], offsets: list[int], text_len: int) -> dict:
    """Chat ``logprobs.content`` entries as a completion's ``logprobs`` (OpenAI's legacy format, as vLLM fills
    it): the tokens, their log-probabilities, each token's top tokens with the sampled one among them, and each
    token's ``offsets``: where its text begins in the choice's text (echoed prompt included), at most
    ``text_len``, the text's length so far (a stop string spanning tokens cuts text the later ones began in)."""
    offsets = [min(o, text_len) for o in offsets]
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{**{t["token"]: t["logprob"] for t in e["top_logprobs"]}, e["token"]: e["logprob"]}
                             for e in entries], "text_offset": offsets}


class Generation:
    """One choice of an admitted request (one engine request): detokenization, stop strings, metrics, its part
    of the response. Choice 0's engine request id is the response's id; choice ``i > 0``'s is ``{id}-{i}``.
    ``echo``: the prompt's text, which a completion's choice begins with. ``prompt_index``: its prompt's, in a
    batch; ``first``: the choice's first output, read before the response starts (each prompt's first choice)."""

    def __init__(self, state: ServerState, request_id: str, stream: RequestStream, params: SamplingParams,
                 stop_ids: frozenset[int], prompt_len: int, arrival: float, probe_s: float, probed_at: float = 0.0,
                 index: int = 0,
                 response_id: str | None = None, first: protocol.TokenOutput | None = None, shape: Shape = CHAT,
                 echo: str = "", prompt_index: int = 0):
        self.state, self.request_id, self.stream, self.params = state, request_id, stream, params
        self.shape, self.echo, self.prompt_index = shape, echo, prompt_index
        self.leads = first is not None  # its prompt's first choice: the one whose first token is the prompt's TTFT
        #: each logprob entry's token: where its text begins in the choice's text, echo included (legacy logprobs'
        #: text_offset). Counted in the text itself, not in the tokens' display strings: a token that is part of a
        #: character (shown as its bytes, "\\x91") or a special token the text skips adds less, or nothing
        self._text_offsets: list[int] = []
        self._legacy_sent = 0  # entries a streamed completion has sent
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
        offset = len(self.echo) + len(self.output.text)  # where this token's text begins
        text = self.output.add(out.token_id, out.index, is_stop_token)
        if self.logprobs is not None and out.logprob is not None and (not is_stop_token or self.output.include_stop):
            # a stop token's logprob is output with its text only
            self.logprobs.append(self._logprob_entry(out.token_id, out.logprob, out.top_logprobs or []))
            self._text_offsets.append(offset)
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
                    "logprobs": None if self.logprobs is None else _legacy_logprobs(
                        self.logprobs, self._text_offsets, len(self.echo) + len(self.output.text)),
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
                        "logprobs": None if logprobs is None else {"content": logprobs},
                        "finish_reason": finish_reason}]
        else:
            legacy = None
            if logprobs is not None:
                sent, self._legacy_sent = self._legacy_sent, self._legacy_sent + len(logprobs)
                legacy = _legacy_logprobs(logprobs, self._text_offsets[sent:self._legacy_sent],
                                          len(self.echo) + len(self.output.text))
            choices = [{"index": self.index, "text": delta.get("content", ""), "logprobs": legacy,
                        "finish_reason": finish_reason}]
        body = {"id": self.response_id, "object": self.shape.chunk_object, "created": self.created,
                "model": self.state.model_name, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def _usage(gens: list[Generation]) -> dict[str, int]:
    """The choices' usage: each prompt once (as OpenAI and vLLM count it; a batch's prompts summed), every
    choice's tokens."""
    prompt = sum({g.prompt_index: g.prompt_len for g in gens}.values())
    completion = sum(g.num_tokens for g in gens)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _finished(state: ServerState, gens: list[Generation]) -> None:
    metrics = state.metrics
    metrics.e2e.observe(time.time() - gens[0].arrival)
    metrics.prompt_tokens.inc(_usage(gens)["prompt_tokens"])
    for g in gens:
        g._release()


def _abort(state: ServerState, gens: list[Generation]) -> None:
    for g in gens:
        state.client.abort(g.request_id)


async def _run_all(gens: list[Generation]) -> None:
    """Every choice to its end; the first error (a worker's) cancels the rest."""
    await all_or_none([g.run for g in gens])


async def complete(state: ServerState, gens: list[Generation], request: Request) -> JSONResponse:
    """The whole response, once every choice has ended."""
    try:
        await wait_connected(_run_all(gens), request)
    except (Disconnected, RequestError):
        _abort(state, gens)
        raise
    _finished(state, gens)
    first = gens[0]
    return JSONResponse({"id": first.response_id, "object": first.shape.object, "created": first.created,
                         "model": state.model_name, "choices": [g.choice() for g in gens], "usage": _usage(gens)})


async def _arrivals(gens: list[Generation]):
    """``(choice, token output)`` as they arrive, until every choice has ended (the caller consumes each
    output before the next is awaited, which is how a choice's end is seen)."""
    if len(gens) == 1:  # no task per token for the common case
        g = gens[0]
        while g.finish_reason is None:
            yield g, await g._next()
        return
    pending: dict[asyncio.Future, Generation] = {asyncio.ensure_future(g._next()): g for g in gens}
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


async def sse(state: ServerState, gens: list[Generation], include_usage: bool, continuous_usage: bool = False):
    """The response as server-sent events: each choice's role, one event per arrival of its tokens (tagged
    with the choice's index; choices interleave as their tokens come; tokens that arrive together share an
    event, and a last token with no visible text rides on the finish event), each choice's finish event, the
    usage, ``[DONE]``.
    ``continuous_usage`` (vLLM's ``continuous_usage_stats``): each choice's events carry its usage so far."""
    done = False

    def so_far(g: Generation) -> dict[str, int] | None:
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
    except RequestError as e:  # a worker died mid-stream: tell the client in-band, then end as every stream does
        yield f"data: {json.dumps(error_body(e.message, e.status_code))}\n\n"
        yield "data: [DONE]\n\n"  # as vLLM: a client reading up to [DONE] is not left waiting for it
        done = True
        _abort(state, gens)  # the other choices' requests
    finally:
        if not done:  # the client went away (the generator was closed or cancelled)
            for _ in gens:
                state.metrics.finished("abort")
            _abort(state, gens)

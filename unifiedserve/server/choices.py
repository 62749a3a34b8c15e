"""A generation request's prompts into engine requests, for the API (:mod:`unifiedserve.server.api`): each prompt's
media probed and its length checked against the context, its sampling parameters (the request's own, else the
checkpoint's generation defaults), then one engine request per choice (``n``) added to the engine, the first before
the others. The endpoint that drives them (opens the streams, answers, turns errors into HTTP) stays in
:mod:`unifiedserve.server.api`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import Request

from unifiedserve.engine.params import SamplingParams
from unifiedserve.runtime import protocol
from unifiedserve.server.engine_client import RequestError, RequestStream
from unifiedserve.server.openai_protocol import SamplingRequest
from unifiedserve.server.prompts import Prompt, check_visual_tokens, expanded_ids
from unifiedserve.server.responses import Generation, Shape, wait_connected

if TYPE_CHECKING:
    from unifiedserve.server.api import ServerState


@dataclass
class Admitted:
    """A prompt made ready for the engine: its first choice's stream opened, its media probed, its length and
    parameters checked."""

    index: int  # the prompt's, in the request
    request_id: str  # its first choice's engine request
    stream: RequestStream
    prompt: Prompt
    ids: list[int]  # expanded
    plans: list[protocol.MediaPlan]
    probe_s: float
    probed_at: float  # time.time() the probe answered (0: no media)
    params: SamplingParams
    stop_ids: frozenset[int]


def choice_id(response_id: str, index: int) -> str:
    """Choice ``index``'s engine request id: the response's id for choice 0, ``{id}-{index}`` for the others."""
    return response_id if index == 0 else f"{response_id}-{index}"


async def admit(state: ServerState, body: SamplingRequest, request: Request, stream: RequestStream,
                request_id: str, index: int, prompt: Prompt, name: str, logprobs: int | None,
                response_format: dict[str, Any]) -> Admitted:
    """Probe ``prompt``'s media and check it against the context; its sampling parameters.

    Raises:
        RequestError: over the context (400), or vision's error.
        ValueError: a sampling parameter the engine refuses.
    """
    probe_s = probed_at = 0.0
    plans: list[protocol.MediaPlan] = []
    if prompt.media:
        t0 = time.time()
        probed = await wait_connected(state.client.probe(stream, prompt.media), request)
        probed_at = time.time()
        plans, probe_s = probed.plans, probed_at - t0
    check_visual_tokens(state, plans, len(prompt.ids), name)  # before expanding: a huge grid costs nothing yet
    ids = expanded_ids(state, prompt.ids, plans)
    prompt_len = len(ids)
    max_tokens = body.completion_limit
    room = state.max_model_len - prompt_len
    defaults = state.generation
    if max_tokens is None:
        max_tokens = min(state.default_max_tokens, defaults.max_tokens or room, room)
        if body.min_tokens > max_tokens > 0:  # say where the limit came from: the client sent none
            raise RequestError(f"min_tokens ({body.min_tokens}) exceeds this request's default completion length, "
                               f"{max_tokens} tokens (the least of the server's --default-max-tokens, the model's "
                               f"generation config and the context's room); send max_tokens", 400)
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
    return Admitted(index, request_id, stream, prompt, ids, plans, probe_s, probed_at, params,
                    params.stop_ids(state.eos_token_ids))


async def add_choices(state: ServerState, body: SamplingRequest, a: Admitted, open_stream, response_id: str,
                      arrival: float, shape: Shape) -> list[Generation]:
    """Add an admitted prompt's choices to the engine: the first, then, once it has its first token, the others.

    Returns:
        one :class:`Generation` per choice, the first choice's first.

    Raises:
        RequestError: the first choice's error (as the engine reported it), or 409 when a media part changed
            while the other choices were being added.
    """
    client, n, keys = state.client, body.n, [ref.key for ref in a.prompt.media]
    base = a.index * n  # the prompt's first choice's index
    await client.add(a.stream, protocol.AddRequest(a.request_id, a.ids, a.plans, a.params, sorted(a.stop_ids), keys))
    first = await a.stream.queue.get()
    if isinstance(first, RequestError):
        raise first
    common = dict(prompt_len=len(a.ids), arrival=arrival, probe_s=a.probe_s, probed_at=a.probed_at,
                  response_id=response_id, shape=shape,
                  echo=a.prompt.echo, prompt_index=a.index)
    gens = [Generation(state, a.request_id, a.stream, a.params, a.stop_ids, index=base, first=first, **common)]
    # the other choices come once the first has its first token: the prompt's KV blocks (and the media's
    # tokens) are in the prefix and media caches by then, so each prefills only the prompt's last partial block
    children = [(choice_id(response_id, base + i), i) for i in range(1, n)]
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
        gens.append(Generation(state, child_id, child, child_params, a.stop_ids, index=base + i, **common))
    return gens


def _choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice ``index``'s parameters: a seeded request's choice ``i`` is seeded ``seed + i`` (vLLM's rule, so
    choices differ and each is reproducible), wrapped into the 64-bit range the API accepts."""
    if params.seed is None or index == 0:
        return params
    seed = params.seed + index
    return dataclasses.replace(params, seed=seed - 2**64 if seed >= 2**64 else seed)


def _given(value, default, neutral):
    """A request's own value, else the model's generation-config default, else the API's."""
    if value is not None:
        return value
    return neutral if default is None else default

"""Decode-step helpers of bench_engine.py: requests started to their first token, decode steps timed one by one,
the cost of response_format json_schema and of penalties per step, and the async-step profile (``step_trace``)."""

from __future__ import annotations

import json
import time

import torch

import step_trace  # bench/engine is on the path here

#: --json-schema without a file: strings, numbers, an enum and arrays, long enough to keep a batch decoding
BENCH_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 48},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "rating": {"type": "number"},
        "genre": {"enum": ["drama", "comedy", "documentary", "thriller"]},
        "cast": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 6},
        "scenes": {"type": "array", "items": {"type": "object", "properties": {
            "start_s": {"type": "number"}, "caption": {"type": "string", "maxLength": 64}},
            "required": ["start_s", "caption"], "additionalProperties": False}, "maxItems": 8},
    },
    "required": ["title", "year", "rating", "genre", "cast", "scenes"],
    "additionalProperties": False,
}


def _start(engine, prompts: list[list[int]], params) -> None:
    """Add ``prompts`` (token ids) under ``params`` and step until every request has its first token (prefill: not
    timed by any caller)."""
    for ids in prompts:
        engine.add_request(ids, [], params)
    while any(not r.output_token_ids for r in engine.scheduler.requests.values()):
        engine.step()


def _trace_async_steps(engine, prompts: list[list[int]], new_tokens: int, steps: int, device: torch.device) -> dict:
    """``steps`` async decode steps of ``prompts`` under the profiler (``step_trace``), once every request has its
    first token and three steps have run overlapped; the requests then finish unprofiled. The engine's async setting
    is given back."""
    from unifiedserve.engine import SamplingParams

    was = engine.core.async_scheduling
    engine.core.async_scheduling = True
    try:
        _start(engine, prompts, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
        for _ in range(3):
            engine.step()
        summary = step_trace.profile_steps(engine.step, device, steps)
        while engine.has_unfinished:
            engine.step()
    finally:
        engine.core.async_scheduling = was
    return summary


def _timed_steps(engine, prompts, params) -> tuple[list[float], list]:
    """Run ``prompts`` (token ids) under ``params`` to the end; return the seconds of each decode step in which
    every request got a token, and the finished outputs."""
    _start(engine, prompts, params)
    times, finished = [], []
    while engine.has_unfinished:
        start = time.perf_counter()
        outs = engine.step()  # ends with the sampled ids on the host: synchronized
        elapsed = time.perf_counter() - start
        if len(outs) == len(prompts) and not any(o.finished for o in outs):
            times.append(elapsed)
        finished += [o for o in outs if o.finished]
    return times, finished


def _median_ms(times: list[float]) -> float:
    return sorted(times)[len(times) // 2] * 1e3


def _penalty_overhead(engine, batches: list[int], prompt, prompt_tokens: int, new_tokens: int) -> dict:
    """Median decode step with presence, frequency and repetition penalties on every request vs the same requests
    without (greedy, same prompts; steps where the whole batch runs).

    Raises:
        ValueError: no step of a batch ran with the whole batch (too few --new-tokens).
    """
    from unifiedserve.engine import SamplingParams

    plain = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    penalized = SamplingParams(max_tokens=new_tokens, ignore_eos=True, presence_penalty=0.5, frequency_penalty=0.5,
                               repetition_penalty=1.1)
    out = {}
    for batch in batches:
        prompts = [prompt(prompt_tokens) for _ in range(batch)]
        _timed_steps(engine, prompts[:1], penalized)  # warm-up: the count table
        plain_s, _ = _timed_steps(engine, prompts, plain)
        penalized_s, _ = _timed_steps(engine, prompts, penalized)
        if not (plain_s and penalized_s):
            raise ValueError(f"batch {batch}: no decode step with the whole batch running; raise --new-tokens")
        plain_ms, penalized_ms = _median_ms(plain_s), _median_ms(penalized_s)
        out[batch] = {"plain_step_ms": plain_ms, "penalized_step_ms": penalized_ms, "ratio": penalized_ms / plain_ms,
                      "overhead_per_token_ms": (penalized_ms - plain_ms) / batch, "steps_timed": len(penalized_s)}
    return out


def _json_schema_overhead(engine, schema: dict, batches: list[int], prompt, prompt_tokens: int,
                          new_tokens: int) -> dict:
    """Median decode step with every request under ``schema`` vs the same requests unconstrained.

    Both runs are greedy with the same prompts. Only steps in which every request of the batch gets
    a token count (a constrained request may close its JSON early, which would shrink the batch).

    Raises:
        ValueError: the schema does not compile, or a constrained output does not parse and validate.
    """
    import jsonschema

    from unifiedserve.engine import SamplingParams
    from unifiedserve.engine.structured import Grammar, check_response_format

    plain = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    constrained = SamplingParams(max_tokens=new_tokens, ignore_eos=True, response_format="json_schema",
                                 json_schema=json.dumps(schema))
    check_response_format(constrained)
    out = {}
    for batch in batches:
        prompts = [prompt(prompt_tokens) for _ in range(batch)]
        _timed_steps(engine, prompts[:1], constrained)  # warm-up: tokenizer info, grammar compile
        plain_s, _ = _timed_steps(engine, prompts, plain)
        json_s, finished = _timed_steps(engine, prompts, constrained)
        for o in finished:  # every output follows the grammar (replaying it raises otherwise) ...
            Grammar(constrained, engine.model_dir, engine.eos_token_ids, o.token_ids)
            if o.finish_reason == "stop":  # ... and a closed one is valid JSON under the schema
                try:
                    jsonschema.validate(json.loads(o.text), schema)
                except (ValueError, jsonschema.ValidationError) as e:
                    raise ValueError(f"constrained output {o.text!r} does not validate: {e}") from None
        if not json_s:
            raise ValueError(f"batch {batch}: no step with the whole batch under the schema; raise --new-tokens")
        plain_ms, json_ms = _median_ms(plain_s), _median_ms(json_s)
        out[batch] = {"plain_step_ms": plain_ms, "json_step_ms": json_ms, "ratio": json_ms / plain_ms,
                      "overhead_per_token_ms": (json_ms - plain_ms) / batch, "steps_timed": len(json_s),
                      "num_closed": sum(o.finish_reason == "stop" for o in finished)}
    return out

"""The engine core: one step's schedule, run and output processing, written once.

The in-process :class:`~unifiedserve.engine.LLM`, the core process (first tokens, and every token under
``--policy monolithic``) and the decode process all drive one :meth:`EngineCore.step`; they differ in
which phases their scheduler schedules (everything; encode and prefill with hand-off; decode rows of
adopted requests only) and in transport (return a ``RequestOutput``, send ``TokenOutputs``, hand off,
release blocks). Detokenization and stop strings live with whoever shows text (``engine/output.py``:
the ``LLM`` here, the api process in the server).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from unifiedserve.engine.params import SamplingParams, finish_reason
from unifiedserve.engine.request import Request
from unifiedserve.engine.sampling import SamplerState, TokenLogprobs, sample, token_logprobs


@dataclass
class SequenceState:
    """What sampling needs of one request, wherever it runs."""

    params: SamplingParams
    sampler: SamplerState
    stop_ids: frozenset[int]
    #: the request's output so far; a step appends to this very list (it may be a ``Request``'s)
    output_token_ids: list[int] = field(default_factory=list)


class SampledToken(NamedTuple):
    """One row's result: the token, its index in the output, why the request ends (None: it goes on),
    and its log-probabilities when the request asked for them."""

    token_id: int
    index: int
    finish_reason: str | None
    logprobs: TokenLogprobs | None
    is_stop_token: bool = False  # one of the request's stop ids (not part of the text)

    @property
    def is_text(self) -> bool:
        """Whether the token is shown: a stop token is not; a grammar's closing token is."""
        return not self.is_stop_token


def process_logits(logits: torch.Tensor, seqs: list[SequenceState]) -> list[SampledToken]:
    """Sample one token per row of ``logits`` ``[B, vocab]`` for ``seqs`` (one per row), append it to each
    sequence's output and say whether the sequence ends (stop id, ``max_tokens``, closed grammar)."""
    params = [s.params for s in seqs]
    tokens = sample(logits, params, [s.sampler for s in seqs])
    results = []
    for seq, token, lp in zip(seqs, tokens, token_logprobs(logits, tokens, params)):
        seq.output_token_ids.append(token)
        reason = finish_reason(token, len(seq.output_token_ids), seq.stop_ids, seq.params.max_tokens,
                               seq.sampler.is_complete)
        results.append(SampledToken(token, len(seq.output_token_ids) - 1, reason, lp, token in seq.stop_ids))
    return results


class EngineCore:
    """The scheduler, the model runner and output processing behind one :meth:`step`.

    ``schedule → execute → commit → process_logits``, the same for the in-process
    :class:`~unifiedserve.engine.LLM`, the core process and the decode process; they differ only in
    what they do around a step (the core process sends patch pages to vision before the step runs,
    hands prefilled requests to the decode process after it) and in where inputs come from (pixels
    given here, written by the vision process, or a hand-off: :meth:`adopt`). The runner alone owns
    device tensors.
    """

    def __init__(self, scheduler, runner):
        self.scheduler = scheduler
        self.runner = runner
        self.seqs: dict[str, SequenceState] = {}

    def add(self, request, vision, seq: SequenceState) -> None:
        """Queue ``request`` (its media as ``VisionInput`` with pixels, or ``MediaGrid`` written elsewhere)."""
        self.scheduler.add(request)
        self.runner.add_request(request, vision)
        self.seqs[request.request_id] = seq

    def adopt(self, request_id: str, seq: SequenceState, num_prompt_tokens: int, mrope_delta: int,
              block_table: list[int]) -> None:
        """Decode a request another engine core prefilled and handed off (its :meth:`hand_off`).

        ``seq.output_token_ids`` holds its first token. Its KV is in ``block_table`` of the shared KV
        cache; the blocks stay the lender's (:meth:`finish` here frees none of them).
        """
        # the prompt (ids, positions) stays with the lender: the runner here knows only its length
        request = Request(request_id, [], seq.params, output_token_ids=seq.output_token_ids)
        self.scheduler.adopt(request)
        self.runner.adopt(request_id, num_prompt_tokens, mrope_delta, block_table)
        self.seqs[request_id] = seq

    def step(self, before_execute=None):
        """One iteration. Returns ``(the scheduler's output, [(request id, SampledToken)])``.

        ``before_execute(out)`` runs after scheduling, before the model (e.g. to hand pages out).
        An empty output ran nothing.
        """
        out = self.scheduler.schedule()
        if out.is_empty:
            return out, []
        if before_execute is not None:
            before_execute(out)
        logits = self.runner.execute(out, self.scheduler.requests)
        self.scheduler.commit(out)
        if not logits:
            return out, []
        ids = list(logits)
        rows = torch.stack([logits[r] for r in ids])  # [B, vocab]
        return out, list(zip(ids, process_logits(rows, [self.seqs[r] for r in ids])))

    def finish(self, request_id: str, reason: str) -> None:
        """End a request here (finished or aborted): free its blocks, pages and tensors."""
        self.scheduler.finish(request_id, reason)
        self.runner.release(request_id)
        self.seqs.pop(request_id, None)

    def hand_off(self, request_id: str):
        """A prefilled request leaves to decode elsewhere; its KV blocks stay held until ``release``.

        Returns ``(request, its SequenceState, block table, M-RoPE delta)``.
        """
        table, delta = self.runner.block_table(request_id), self.runner.mrope_delta(request_id)
        request = self.scheduler.hand_off(request_id)
        self.runner.release(request_id)
        return request, self.seqs.pop(request_id), table, delta

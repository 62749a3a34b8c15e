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

from unifiedserve.engine.params import SamplingParams, check_logit_bias_ids, finish_reason
from unifiedserve.engine.penalties import PenaltyTable
from unifiedserve.engine.request import Request
from unifiedserve.engine.sampling import (SamplerState, TokenLogprobs, logprob_tensors, logprobs_of, sample,
                                          sample_tensor, token_logprobs)


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
    #: with finish reason ``"error"``: why the request cannot go on (its token is then no output)
    error: str | None = None
    error_status: int = 400  # the HTTP status of ``error`` (:attr:`SamplerState.error_status`)

    @property
    def is_text(self) -> bool:
        """Whether the token is shown: a stop token is not, nor one sampled at a grammar's dead end; a grammar's
        closing token is."""
        return not self.is_stop_token and self.error is None


def process_logits(logits: torch.Tensor, seqs: list[SequenceState]) -> list[SampledToken]:
    """Sample one token per row of ``logits`` ``[B, vocab]`` for ``seqs`` (one per row), append it to each
    sequence's output and say whether the sequence ends (stop id, ``max_tokens``, closed grammar)."""
    params = [s.params for s in seqs]
    tokens = sample(logits, params, [s.sampler for s in seqs], suppressed(seqs))
    return record_tokens(tokens, seqs, token_logprobs(logits, tokens, params))


def suppressed(seqs: list[SequenceState], unrecorded: list[bool] | None = None) -> list | None:
    """Per row, the stop ids its next token may not be (``min_tokens`` not reached), else None; None when no row
    has any. ``unrecorded``: per row, whether a token was sampled for it that its output does not hold yet."""
    if not any(s.params.min_tokens for s in seqs):
        return None
    return [s.stop_ids if s.params.suppresses_stop(len(s.output_token_ids) + bool(unrecorded and unrecorded[i]))
            else None for i, s in enumerate(seqs)]


def record_tokens(tokens: list[int], seqs: list[SequenceState],
                  logprobs: list[TokenLogprobs | None]) -> list[SampledToken]:
    """Append each row's sampled token to its sequence: its index, why the sequence ends, its logprobs."""
    results = []
    for seq, token, lp in zip(seqs, tokens, logprobs):
        error = seq.sampler.error
        if error is not None:  # its grammar allowed no token: what was sampled is not output
            results.append(SampledToken(token, len(seq.output_token_ids), "error", None, False, error,
                                        seq.sampler.error_status))
            continue
        seq.output_token_ids.append(token)
        reason = finish_reason(token, len(seq.output_token_ids), seq.stop_ids, seq.params.max_tokens,
                               seq.sampler.is_complete)
        results.append(SampledToken(token, len(seq.output_token_ids) - 1, reason, lp, token in seq.stop_ids))
    return results


@dataclass
class PendingStep:
    """A decode step launched but not yet read back (async scheduling).

    Its sampled ids stay on the device, where the next step reads them, and are copied to pinned host
    memory right behind the sampler with an event recorded after the copy: reading them back waits for
    that event, not for the stream, which by then also holds the next step.
    """

    request_ids: list[str]  # row order
    tokens: torch.Tensor  # int64 [B] on the device
    host: tuple[torch.Tensor, ...]  # the ids [B] and, when rows ask, logprob_tensors' three, on the host
    params: list[SamplingParams] | None = None  # per row, when some row asks for logprobs
    ready: torch.cuda.Event | None = None  # None on the CPU: the copies are done

    @classmethod
    def launch(cls, request_ids: list[str], tokens: torch.Tensor, logits: torch.Tensor,
               params: list[SamplingParams]) -> "PendingStep":
        """Start the copies to the host (the ids; the logprobs of the rows that ask) without waiting for them."""
        asks = any(p.logprobs is not None for p in params)
        found = (tokens, *logprob_tensors(logits, tokens, params)) if asks else (tokens,)
        if tokens.device.type != "cuda":
            return cls(request_ids, tokens, found, params if asks else None)
        host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True) for t in found)
        ready = torch.cuda.Event()
        ready.record()
        return cls(request_ids, tokens, host, params if asks else None, ready)

    def results(self) -> tuple[list[int], list[TokenLogprobs | None]]:
        """The sampled ids and each row's logprobs (None where not asked) on the host; waits for the copies only."""
        if self.ready is not None:
            self.ready.synchronize()
        tokens = self.host[0].tolist()
        if self.params is None:
            return tokens, [None] * len(tokens)
        return tokens, logprobs_of(self.params, *(t.tolist() for t in self.host[1:]))

    @property
    def rows(self) -> dict[str, int]:
        return {rid: i for i, rid in enumerate(self.request_ids)}


class EngineCore:
    """The scheduler, the model runner and output processing behind one :meth:`step`.

    ``schedule → execute → commit → process_logits``, the same for the in-process
    :class:`~unifiedserve.engine.LLM`, the core process and the decode process; they differ only in
    what they do around a step (the core process sends patch pages to vision before the step runs,
    hands prefilled requests to the decode process after it) and in where inputs come from (pixels
    given here, written by the vision process, or a hand-off: :meth:`adopt`). The runner alone owns
    device tensors.
    """

    def __init__(self, scheduler, runner, async_scheduling: bool = False):
        self.scheduler = scheduler
        self.runner = runner
        self.seqs: dict[str, SequenceState] = {}
        #: launch a pure-decode step before reading the previous one's tokens back (see :meth:`step`)
        self.async_scheduling = async_scheduling
        self._pending: PendingStep | None = None
        self._ended: set[str] = set()  # read back with a finish reason; the caller's finish() is next
        self._penalties: PenaltyTable | None = None  # made when the first request with penalties comes

    @property
    def penalties(self) -> PenaltyTable:
        """The token counts of this core's requests with penalties, on the runner's device."""
        if self._penalties is None:
            self._penalties = PenaltyTable(self.runner.model.config.text.vocab_size, self.runner.device)
        return self._penalties

    def add(self, request, vision, seq: SequenceState) -> None:
        """Queue ``request`` (its media as ``VisionInput`` with pixels, or ``MediaGrid`` written elsewhere).

        Raises:
            ValueError: its ``logit_bias`` names a token outside the vocabulary, it can never run here
                (:meth:`Scheduler.check`), or its media do not match its prompt (nothing is queued).
        """
        self._enqueue(seq, request.prompt_token_ids if seq.params.penalizes_prompt else (),
                      lambda: self.scheduler.add(request))
        try:
            self.runner.add_request(request, vision)  # e.g. ValueError: media that do not match the prompt
        except BaseException:  # nothing of it stays queued: every later step would meet a request without tensors
            self.scheduler.finish(request.request_id, "abort")
            self.runner.release(request.request_id)
            self._drop_penalty(seq)
            raise
        self.seqs[request.request_id] = seq

    def adopt(self, request_id: str, seq: SequenceState, num_prompt_tokens: int, mrope_delta: int,
              block_table: list[int], prompt_token_ids=()) -> None:
        """Decode a request another engine core prefilled and handed off (its :meth:`hand_off`).

        ``seq.output_token_ids`` holds its first token. Its KV is in ``block_table`` of the shared KV
        cache; the blocks stay the lender's (:meth:`finish` here frees none of them). ``prompt_token_ids``:
        the prompt's distinct tokens, for a repetition penalty (the prompt itself stays with the lender).
        """
        # the prompt (ids, positions) stays with the lender: the runner here knows only its length
        request = Request(request_id, [], seq.params, output_token_ids=seq.output_token_ids)
        self._enqueue(seq, prompt_token_ids, lambda: self.scheduler.adopt(request))
        self.runner.adopt(request_id, num_prompt_tokens, mrope_delta, block_table)
        self.seqs[request_id] = seq

    def _enqueue(self, seq: SequenceState, prompt_token_ids, schedule) -> None:
        """What :meth:`add` and :meth:`adopt` share: check the request's ``logit_bias`` ids, give it its penalty
        row (``prompt_token_ids`` marked as seen), then ``schedule()``; a refusal gives the row back.

        Raises:
            ValueError: a ``logit_bias`` id outside the vocabulary, or what ``schedule()`` raises.
        """
        check_logit_bias_ids(seq.params.logit_bias, self.runner.model.config.text.vocab_size)
        if seq.params.has_penalties:
            seq.sampler.penalty = self.penalties.open(prompt_token_ids, seq.output_token_ids)
        try:
            schedule()
        except BaseException:
            self._drop_penalty(seq)
            raise

    def step(self, before_execute=None):
        """One iteration. Returns ``(the scheduler's output, [(request id, SampledToken)])``.

        ``before_execute(out)`` runs after scheduling, before the model (e.g. to hand pages out).
        An empty output ran nothing (it may still carry a pending step's tokens).

        With ``async_scheduling``, a step that only decodes (nothing waiting, every running request past
        its prompt) is launched with each row's last token
        taken on the device from the previous step's samples, and only then is the previous step read back
        (its ids and asked-for logprobs, copied to the host behind its sampler, then stop checks): the host work of
        one step overlaps the kernels of the next, and its tokens come out one call later. When a row samples under a
        grammar, the read-back comes between the forward's launch and the sampling, since the grammar's mask
        needs the previous token: the host's grammar work then overlaps the forward only. A request that ended in
        the step read back has had one more row computed for it in the step just launched (its last token
        fed, the K/V slot inside its blocks); that row is dropped. Tokens are those of the synchronous
        step, seeded ones included.
        """
        flushed = []
        overlap = self.async_scheduling and self._only_decoding()
        if self._pending is not None and not overlap:
            flushed = self._read_back()  # the host must know every token before a step of another kind
        out = self.scheduler.schedule()
        self._drop_ended(out)
        if out.is_empty:
            return out, flushed
        if before_execute is not None:
            before_execute(out)
        if overlap and not (out.admitted or out.encode or out.prefill):
            logits = self.runner.execute(out, self.scheduler.requests, self._pending)
            self.scheduler.commit(out)
            ids, rows = logits.request_ids, logits.rows  # [B, vocab]
            params = [self.seqs[r].params for r in ids]
            samplers = [self.seqs[r].sampler for r in ids]
            previous = None
            if any(s.grammar is not None for s in samplers):
                # a grammar's mask needs the token before: read the previous step back first (its grammars
                # advance), while the forward just launched runs; a row whose request ended there is dropped,
                # so its finished grammar masks nothing
                previous = self._read_back()
                samplers = [SamplerState(s.generator) if r in self._ended else s for r, s in zip(ids, samplers)]
            suppress = None
            if any(p.min_tokens for p in params):  # nothing more per step for the common request
                # a row's token from the step not read back yet counts towards its min_tokens
                waiting = self._pending.rows if self._pending is not None else {}
                suppress = suppressed([self.seqs[r] for r in ids], [r in waiting for r in ids])
            tokens = sample_tensor(rows, params, samplers, suppress)
            launched = PendingStep.launch(ids, tokens, rows, params)  # copies queued before the next step
            if previous is None:
                previous = self._read_back()
            self._pending = launched
            return out, flushed + previous
        if self._pending is not None:  # not only decode rows after all: read back first, drop who ended
            flushed += self._read_back()
            self._drop_ended(out)
        logits = self.runner.execute(out, self.scheduler.requests)
        self.scheduler.commit(out)
        if not logits:
            return out, flushed
        ids, rows = logits.request_ids, logits.rows  # [B, vocab]
        return out, flushed + self._note_ended(list(zip(ids, process_logits(rows, [self.seqs[r] for r in ids]))))

    def _drop_ended(self, out) -> None:
        """No decode row for a request read back as ended (its caller's finish() has not run yet)."""
        if self._ended:
            out.decode = [r for r in out.decode if r not in self._ended]

    def _only_decoding(self) -> bool:
        """Whether the next step can only be decode rows: the async condition."""
        s = self.scheduler
        return not s.waiting and bool(s.running) and all(r.is_prefill_done and r.output_token_ids for r in s.running)

    def _read_back(self) -> list[tuple[str, SampledToken]]:
        """The pending step's tokens, to the host and into their sequences (rows of ended requests dropped)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return []
        tokens, logprobs = pending.results()
        live = [i for i, r in enumerate(pending.request_ids) if r in self.seqs and r not in self._ended]
        if not live:
            return []
        ids = [pending.request_ids[i] for i in live]
        seqs = [self.seqs[r] for r in ids]
        for i, seq in zip(live, seqs):  # as sample() does on the synchronous path, before the stop checks
            if seq.sampler.grammar is not None:
                seq.sampler.grammar.accept(tokens[i])
        results = record_tokens([tokens[i] for i in live], seqs, [logprobs[i] for i in live])
        return self._note_ended(list(zip(ids, results)))

    def _note_ended(self, results: list[tuple[str, SampledToken]]) -> list[tuple[str, SampledToken]]:
        if self.async_scheduling:
            self._ended.update(r for r, t in results if t.finish_reason is not None)
        return results

    def writes_pending(self, request_id: str) -> bool:
        """Whether a step launched and not yet read back computes a row of ``request_id`` (async scheduling):
        its K/V write into the request's blocks may still land. Blocks that another process frees (the
        decode process lends them back to core) must wait until it has: core's next writes into them are
        not ordered after this process's stream."""
        return self._pending is not None and request_id in self._pending.request_ids

    def finish(self, request_id: str, reason: str) -> None:
        """End a request here (finished or aborted): free its blocks, pages and tensors.

        A pending step may still write the K/V of a row of it: on the device's stream, before anything a
        later step writes into the freed blocks.
        """
        self.scheduler.finish(request_id, reason)
        self.runner.release(request_id)
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            self._drop_penalty(seq)
        self._ended.discard(request_id)

    def hand_off(self, request_id: str):
        """A prefilled request leaves to decode elsewhere; its KV blocks stay held until ``release``.

        Returns ``(request, its SequenceState, block table, M-RoPE delta)``.
        """
        table, delta = self.runner.block_table(request_id), self.runner.mrope_delta(request_id)
        request = self.scheduler.hand_off(request_id)
        self.runner.release(request_id)
        self._ended.discard(request_id)
        seq = self.seqs.pop(request_id)
        self._drop_penalty(seq)  # the adopter counts from the hand-off (the prompt's ids, the first token)
        return request, seq, table, delta

    @staticmethod
    def _drop_penalty(seq: SequenceState) -> None:
        if seq.sampler.penalty is not None:
            seq.sampler.penalty.release()
            seq.sampler.penalty = None

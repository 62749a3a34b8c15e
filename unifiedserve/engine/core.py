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
from unifiedserve.engine.sampling import SamplerState, TokenLogprobs, sample, sample_tensor, token_logprobs


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
    tokens = sample(logits, [s.params for s in seqs], [s.sampler for s in seqs])
    return record_tokens(logits, tokens, seqs)


def record_tokens(logits: torch.Tensor | None, tokens: list[int], seqs: list[SequenceState]) -> list[SampledToken]:
    """Append each row's sampled token to its sequence: its index, why the sequence ends, its logprobs
    (``logits`` may be None when no row asks for them)."""
    results = []
    for seq, token, lp in zip(seqs, tokens, token_logprobs(logits, tokens, [s.params for s in seqs])):
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
    host_tokens: torch.Tensor  # int64 [B] on the host (pinned on CUDA), filled when ``ready`` completes
    ready: torch.cuda.Event | None = None  # None on the CPU: the copy is done

    @classmethod
    def launch(cls, request_ids: list[str], tokens: torch.Tensor) -> "PendingStep":
        """Start the copy of ``tokens`` to the host without waiting for it."""
        if tokens.device.type != "cuda":
            return cls(request_ids, tokens, tokens)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return cls(request_ids, tokens, host, ready)

    def token_ids(self) -> list[int]:
        """The sampled ids on the host (waits for the copy only)."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.host_tokens.tolist()

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
        An empty output ran nothing (it may still carry a pending step's tokens).

        With ``async_scheduling``, a step that only decodes (nothing waiting, every running request past
        its prompt, none under a grammar or asking for logprobs) is launched with each row's last token
        taken on the device from the previous step's samples, and only then is the previous step read back
        (its ids, copied to the host behind its sampler, then stop checks): the host work of one step
        overlaps the kernels of the next, and its tokens come out one call later. A request that ended in
        the step read back has had one more row computed for it in the step just launched (its last token
        fed, the K/V slot inside its blocks); that row is dropped. Tokens are those of the synchronous
        step, seeded ones included.
        """
        flushed = []
        overlap = self.async_scheduling and self._only_decoding()
        if self._pending is not None and not overlap:
            flushed = self._read_back()  # the host must know every token before a step of another kind
        out = self.scheduler.schedule()
        if self._ended:
            out.decode = [r for r in out.decode if r not in self._ended]
        if out.is_empty:
            return out, flushed
        if before_execute is not None:
            before_execute(out)
        if overlap and not (out.admitted or out.encode or out.prefill):
            logits = self.runner.execute(out, self.scheduler.requests, self._pending)
            self.scheduler.commit(out)
            ids = list(logits)
            rows = torch.stack([logits[r] for r in ids])  # [B, vocab]
            seqs = [self.seqs[r] for r in ids]
            tokens = sample_tensor(rows, [s.params for s in seqs], [s.sampler for s in seqs])  # stays on the device
            launched = PendingStep.launch(ids, tokens)  # the copy is queued before anything of the next step
            previous = self._read_back()
            self._pending = launched
            return out, flushed + previous
        if self._pending is not None:  # not only decode rows after all: read back first, drop who ended
            flushed += self._read_back()
            out.decode = [r for r in out.decode if r not in self._ended]
        logits = self.runner.execute(out, self.scheduler.requests)
        self.scheduler.commit(out)
        if not logits:
            return out, flushed
        ids = list(logits)
        rows = torch.stack([logits[r] for r in ids])  # [B, vocab]
        return out, flushed + self._note_ended(list(zip(ids, process_logits(rows, [self.seqs[r] for r in ids]))))

    def _only_decoding(self) -> bool:
        """Whether the next step can only be decode rows, none under a grammar (whose mask needs the previous
        token on the host) or asking for logprobs (read back with the step: the async condition)."""
        s = self.scheduler
        if s.waiting or not s.running or not all(r.is_prefill_done and r.output_token_ids for r in s.running):
            return False
        return all(self.seqs[r].sampler.grammar is None and self.seqs[r].params.logprobs is None
                   for r in s.next_decode_rows())

    def _read_back(self) -> list[tuple[str, SampledToken]]:
        """The pending step's tokens, to the host and into their sequences (rows of ended requests dropped)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return []
        tokens = pending.token_ids()
        live = [i for i, r in enumerate(pending.request_ids) if r in self.seqs and r not in self._ended]
        if not live:
            return []
        ids = [pending.request_ids[i] for i in live]
        seqs = [self.seqs[r] for r in ids]
        assert all(seq.params.logprobs is None for seq in seqs), "an async step never holds a logprobs row"
        results = record_tokens(None, [tokens[i] for i in live], seqs)  # no logprobs: no logits needed
        return self._note_ended(list(zip(ids, results)))

    def _note_ended(self, results: list[tuple[str, SampledToken]]) -> list[tuple[str, SampledToken]]:
        if self.async_scheduling:
            self._ended.update(r for r, t in results if t.finish_reason is not None)
        return results

    def finish(self, request_id: str, reason: str) -> None:
        """End a request here (finished or aborted): free its blocks, pages and tensors.

        A pending step may still write the K/V of a row of it: on the device's stream, before anything a
        later step writes into the freed blocks.
        """
        self.scheduler.finish(request_id, reason)
        self.runner.release(request_id)
        self.seqs.pop(request_id, None)
        self._ended.discard(request_id)

    def hand_off(self, request_id: str):
        """A prefilled request leaves to decode elsewhere; its KV blocks stay held until ``release``.

        Returns ``(request, its SequenceState, block table, M-RoPE delta)``.
        """
        table, delta = self.runner.block_table(request_id), self.runner.mrope_delta(request_id)
        request = self.scheduler.hand_off(request_id)
        self.runner.release(request_id)
        self._ended.discard(request_id)
        return request, self.seqs.pop(request_id), table, delta

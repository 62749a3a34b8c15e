"""A step's output processing, written once: sample, log-probabilities, append, stop check.

The in-process :class:`~unifiedserve.engine.LLM`, the core process (first tokens, and every token under
``--policy monolithic``) and the decode process all end a model step the same way: one
:func:`process_logits` call over the rows that sample. What they do next differs only in transport
(return a ``RequestOutput``, send ``TokenOutputs``, hand off, release blocks); detokenization and stop
strings live with whoever shows text (``engine/output.py``: the ``LLM`` here, the api process in the
server).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from unifiedserve.engine.params import SamplingParams, finish_reason
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

"""The sampler: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from unifiedserve.engine.params import SamplingParams


@dataclass
class SamplerState:
    """Per-request random state; seeded requests are reproducible whatever else is in the batch."""

    generator: torch.Generator = field(default_factory=torch.Generator)

    @classmethod
    def for_params(cls, params: SamplingParams) -> "SamplerState":
        g = torch.Generator()
        if params.seed is not None:
            g.manual_seed(params.seed)
        else:
            g.seed()
        return cls(g)


def sample(logits: torch.Tensor, params: list[SamplingParams], states: list[SamplerState]) -> list[int]:
    """Pick one token per row. logits: [B, vocab] (any float dtype; computed in fp32)."""
    logits = logits.float()
    tokens = logits.argmax(dim=-1).tolist()  # greedy rows keep these
    for row, (p, state) in enumerate(zip(params, states)):
        if p.is_greedy:
            continue
        row_logits = logits[row] / p.temperature  # [vocab]
        if p.top_k and p.top_k < row_logits.shape[0]:
            kth = torch.topk(row_logits, p.top_k).values[-1]
            row_logits = row_logits.masked_fill(row_logits < kth, float("-inf"))
        probs = torch.softmax(row_logits, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # keep the smallest prefix whose mass reaches top_p (always at least one token)
            drop = sorted_probs.cumsum(0) - sorted_probs >= p.top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        tokens[row] = int(torch.multinomial(probs, 1, generator=state.generator))
    return tokens

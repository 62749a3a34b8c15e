"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. ``temperature == 0`` means greedy."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings; the matched text is not returned
    ignore_eos: bool = False  # keep going past the model's end-of-sequence token (benchmarks)

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be a non-negative integer (0 = off), got {self.top_k!r}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


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

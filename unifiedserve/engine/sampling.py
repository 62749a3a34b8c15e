"""The sampler: logit bias, greedy, temperature, min-p, top-k, top-p, per-request seeds, batched on the logits' device.

One call filters the whole batch at once (per-row temperature, top-k and top-p as tensors) and
ends with a single copy of the chosen ids to the host. A random row draws its token with its own
generator (on the logits' device) by the exponential race: ``argmax(probs / q)`` with
``q ~ Exp(1)`` per vocabulary entry, which is exactly how torch's ``multinomial`` draws one sample,
so a seeded request gives the tokens torch's ``multinomial`` would, and the same ones whatever
else is in the batch.

A request with a ``response_format`` grammar (its ``SamplerState.grammar``) has the tokens the
grammar forbids masked before any of that, and :func:`sample` advances the grammar with the chosen
token (``unifiedserve.engine.structured``). A request with presence, frequency or repetition penalties
(its ``SamplerState.penalty``, a row of token counts on the device: ``unifiedserve.engine.penalties``) has
them applied first, and the chosen token counted.

The order is vLLM's: a request's ``logit_bias`` (and, until it has ``min_tokens`` output tokens, -inf on its
stop ids) is added to the raw logits, then the penalties, the grammar's mask, and for a random row
temperature, ``min_p`` (relative to the most likely token), top-k and top-p. Log-probabilities are always
those of the raw logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from unifiedserve.engine.params import SamplingParams
from unifiedserve.engine.penalties import PenaltyBatch, PenaltyRow, apply_penalties, count_tokens
from unifiedserve.engine.structured import Grammar, apply_grammars
from unifiedserve.memory.transfer import to_device


@dataclass
class SamplerState:
    """Per-request random state; seeded requests are reproducible whatever else is in the batch.

    The generator lives on the device the logits are on (``for_params(..., device=)``). ``grammar``
    (``structured.grammar_for``) constrains the request's tokens to its ``response_format``; it is
    not part of :meth:`to_bytes`: the receiving process rebuilds it from the params.
    """

    generator: torch.Generator = field(default_factory=torch.Generator)
    grammar: Grammar | None = None
    #: the request's token counts when it has penalties (the engine core gives the row: ``EngineCore.add``)
    penalty: PenaltyRow | None = None
    #: the request's ``logit_bias`` as a float64 ``[k, 2]`` array of (id, bias), made at its first step
    #: (:meth:`bias_array`): converting the pairs every step cost ~0.25 ms per 1024 of them on the host
    _bias: np.ndarray | None = field(default=None, repr=False)
    _ban: np.ndarray | None = field(default=None, repr=False)  # likewise, the stop ids at -inf (``min_tokens``)

    def bias_array(self, params: SamplingParams) -> np.ndarray:
        """``params.logit_bias`` (this request's) as a float64 ``[k, 2]`` array, converted once."""
        if self._bias is None:
            self._bias = np.asarray(params.logit_bias, dtype=np.float64).reshape(-1, 2)
        return self._bias

    def ban_array(self, stop_ids, vocab_size: int) -> np.ndarray:
        """This request's ``stop_ids`` (those inside the vocabulary: no other can be sampled) as ``(id, -inf)``
        pairs, a float64 ``[k, 2]`` array made once."""
        if self._ban is None:
            ids = sorted(t for t in stop_ids if 0 <= t < vocab_size)
            self._ban = np.array([(t, -np.inf) for t in ids], dtype=np.float64).reshape(-1, 2)
        return self._ban

    @classmethod
    def for_params(cls, params: SamplingParams, device: str | torch.device = "cpu",
                   grammar: Grammar | None = None) -> "SamplerState":
        """A fresh state: seeded from ``params.seed``, else from a non-deterministic seed."""
        g = torch.Generator(device=device)
        if params.seed is not None:
            g.manual_seed(generator_seed(params.seed, g.device))
        else:
            g.seed()
        return cls(g, grammar)

    @classmethod
    def from_bytes(cls, state: bytes, device: str | torch.device = "cpu",
                   grammar: Grammar | None = None) -> "SamplerState":
        """Rebuild a state serialized with :meth:`to_bytes` (a hand-off between processes)."""
        g = torch.Generator(device=device)
        g.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
        return cls(g, grammar)

    def to_bytes(self) -> bytes:
        return bytes(self.generator.get_state().numpy())

    @property
    def is_complete(self) -> bool:
        """The request's grammar admits no further token (it ends with ``"stop"``)."""
        return self.grammar is not None and self.grammar.is_complete

    @property
    def error(self) -> str | None:
        """Why the request's grammar admitted no token at the last step although its value is open (it then
        ends with ``"error"``), else None."""
        return None if self.grammar is None else self.grammar.dead_end

    @property
    def error_status(self) -> int:
        """The HTTP status of :attr:`error`: 400 for a schema that dead-ends, 500 for a token sampled against the
        grammar's mask."""
        return 400 if self.grammar is None else self.grammar.dead_end_status


def generator_seed(seed: int, device: torch.device) -> int:
    """The seed a generator on ``device`` is given for a request's 64-bit ``seed`` (negative ones taken modulo 2**64).

    torch's CPU generator (mt19937) keeps only a seed's low 32 bits, so 5 and 5 + 2**32, or 0 and -2**63, drew the
    same numbers. There a seed of 2**32 or more is first mixed into 32 bits (splitmix64's finaliser); smaller seeds
    keep their draws. CUDA's Philox generator takes all 64 bits as they are.
    """
    s = seed % 2**64
    if device.type != "cpu" or s < 2**32:
        return s
    s = ((s ^ (s >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    s = ((s ^ (s >> 27)) * 0x94D049BB133111EB) % 2**64
    return (s ^ (s >> 31)) & 0xFFFFFFFF


def sample_tensor(logits: torch.Tensor, params: list[SamplingParams], states: list[SamplerState],
                  suppress: list | None = None) -> torch.Tensor:
    """Pick one token per row without leaving the device (rows with a grammar among the tokens it allows).

    Args:
        logits: ``[B, vocab]`` (any float dtype; computed in fp32).
        params, states: one per row; a random row's generator must be on ``logits.device``.
        suppress: one per row, the stop ids its token may not be this step (its ``min_tokens`` is not
            reached: ``SamplingParams.suppresses_stop``), or None; None for the whole batch: no row.

    Returns:
        int64 ``[B]`` on ``logits.device``.

    Raises:
        ValueError: ``params``/``states`` lengths differ from the rows.
    """
    if len(params) != logits.shape[0] or len(states) != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} rows of logits but {len(params)} params and {len(states)} states")
    shifts: dict[int, np.ndarray] = {}  # row -> its (id, shift) pairs: logit_bias, then -inf on banned stop ids
    for i, p in enumerate(params):
        parts = [states[i].bias_array(p)] if p.logit_bias else []
        if suppress is not None and suppress[i]:
            parts.append(states[i].ban_array(suppress[i], logits.shape[-1]))
        if parts:
            shifts[i] = parts[0] if len(parts) == 1 else np.concatenate(parts)
    penalized = [i for i, s in enumerate(states) if s.penalty is not None]
    if not (shifts or penalized) and all(p.is_greedy and s.grammar is None for p, s in zip(params, states)):
        # every row greedy and unshifted: bf16/fp16 -> fp32 is exact, so the raw logits' argmax is the fp32 one
        # (same values, same first index among ties) without a [B, vocab] conversion kernel per step (issue 13)
        return logits.argmax(dim=-1)
    logits = logits.float()
    if shifts:  # a new tensor: the caller's logits stay raw for logprobs
        logits = apply_logit_bias(logits, list(shifts), list(shifts.values()))
    batch = PenaltyBatch.of(penalized, [states[i].penalty for i in penalized], logits.device) if penalized else None
    if batch is not None:  # a new tensor: the caller's logits stay raw for logprobs
        logits = apply_penalties(logits, batch, [params[i] for i in penalized])
    if any(s.grammar is not None for s in states):
        logits = apply_grammars(logits, [s.grammar for s in states])  # a masked copy
    tokens = _choose(logits, params, states)
    if batch is not None:
        count_tokens(tokens, batch)
    return tokens


def apply_logit_bias(logits: torch.Tensor, rows: list[int], pairs: list[np.ndarray]) -> torch.Tensor:
    """``logits`` (fp32 ``[B, vocab]``) plus the bias of ``rows`` (``pairs`` one float64 ``[k, 2]`` array of
    (id, bias) per entry: :meth:`SamplerState.bias_array`, and ``ban_array``'s -inf), as a new tensor: every row's
    pairs go to the device in one copy, and one scatter adds them."""
    vocab = logits.shape[-1]
    flat = np.concatenate([r * vocab + a[:, 0] for r, a in zip(rows, pairs)])  # exact in float64 below 2**53
    packed = to_device(torch.from_numpy(np.stack([flat, np.concatenate([a[:, 1] for a in pairs])])), logits.device)
    return logits.reshape(-1).index_add(0, packed[0].long(), packed[1].float()).view_as(logits)


def _choose(logits: torch.Tensor, params: list[SamplingParams], states: list[SamplerState]) -> torch.Tensor:
    """One token per row of the final fp32 logits: greedy, or each random row's own draw."""
    greedy = logits.argmax(dim=-1)  # [B]
    random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
    if not random_rows:
        return greedy
    device = logits.device
    vocab = logits.shape[-1]
    sub = [params[i] for i in random_rows]
    rows = to_device(torch.tensor(random_rows, dtype=torch.int64), device)  # queued: no host wait
    # per-row knobs as one host-built tensor copied once: [R] each
    knobs = torch.tensor([[p.temperature, p.top_k if p.top_k and p.top_k < vocab else vocab, p.top_p, p.min_p]
                          for p in sub], dtype=torch.float64)
    knobs = to_device(knobs, device)
    temperature, top_k, top_p = knobs[:, 0:1].float(), knobs[:, 1:2].long(), knobs[:, 2:3].float()
    scaled = logits[rows] / temperature  # [R, vocab]
    if any(p.min_p > 0 for p in sub):
        # p_i >= min_p * p_max  <=>  scaled_i >= max(scaled) + log(min_p): no softmax needed; min_p 0 keeps all
        floor = scaled.max(dim=-1, keepdim=True).values + knobs[:, 3:4].float().log()
        scaled = scaled.masked_fill(scaled < floor, float("-inf"))
    if any(p.top_k and p.top_k < vocab for p in sub):
        ordered = scaled.sort(dim=-1, descending=True).values  # [R, vocab]
        kth = ordered.gather(1, top_k - 1)  # [R, 1]: the k-th largest logit (the smallest kept)
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)  # [R, vocab]
    if any(p.top_p < 1.0 for p in sub):
        sorted_probs, order = probs.sort(dim=-1, descending=True)  # [R, vocab]
        # keep the smallest prefix whose mass reaches top_p (always at least one token); rows
        # without top_p keep everything, even where rounding lets the cumsum pass 1.0
        drop = (sorted_probs.cumsum(-1) - sorted_probs >= top_p) & (top_p < 1.0)
        drop[:, 0] = False  # a top_p below float32's range (1e-300) is 0 there, and 0 >= 0 would drop the first too
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs.masked_fill(drop, 0.0))
    race = torch.empty_like(probs)  # [R, vocab]: Exp(1) noise, each row from its own generator
    for r, i in enumerate(random_rows):
        race[r].exponential_(1.0, generator=states[i].generator)
    chosen = (probs / race).argmax(dim=-1)  # [R]
    return greedy.index_copy(0, rows, chosen)


def sample(logits: torch.Tensor, params: list[SamplingParams], states: list[SamplerState],
           suppress: list | None = None) -> list[int]:
    """Pick one token per row: :func:`sample_tensor`, then the step's one copy of ids to the host;
    each row's grammar advances past its token.

    Args:
        logits: ``[B, vocab]``; params, states, suppress: one per row (as :func:`sample_tensor`).

    Returns:
        ``B`` token ids.
    """
    tokens = sample_tensor(logits, params, states, suppress).tolist()
    for state, token in zip(states, tokens):
        if state.grammar is not None:
            state.grammar.accept(token)
    return tokens


class TokenLogprobs(NamedTuple):
    """One output token's log-probability and the ``k`` most likely tokens' (``top``, best first)."""

    logprob: float
    top: list[tuple[int, float]]


def token_logprobs(logits: torch.Tensor, token_ids: list[int],
                   params: list[SamplingParams]) -> list[TokenLogprobs | None]:
    """Log-probabilities of the sampled tokens under the model's distribution, for rows that ask.

    The distribution is the log-softmax of the raw logits (before temperature, top-k and top-p), as
    OpenAI and vLLM report it. Rows whose ``params.logprobs`` is None get None; the work (one
    log-softmax and one top-k over the asking rows, one copy to the host) is skipped when none ask.

    Args:
        logits: ``[B, vocab]``; token_ids: the ``B`` sampled ids; params: one per row.
    """
    if not any(p.logprobs is not None for p in params):
        return [None] * len(params)
    found = logprob_tensors(logits, torch.tensor(token_ids, dtype=torch.int64, device=logits.device), params)
    return logprobs_of(params, *(t.tolist() for t in found))


def logprob_tensors(logits: torch.Tensor, tokens: torch.Tensor,
                    params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The device half of :func:`token_logprobs` (no host sync): for the rows that ask, in row order, the
    sampled token's log-probability ``[A]``, and the ``k`` best ``[A, k]`` values and ids (``k`` the most
    any row asks; ``[A, 0]`` when none asks for alternatives).

    Args:
        logits: ``[B, vocab]``; tokens: int64 ``[B]`` on the logits' device; params: one per row.
    """
    asking = [i for i, p in enumerate(params) if p.logprobs is not None]
    rows = to_device(torch.tensor(asking, dtype=torch.int64), logits.device)
    logprobs = torch.log_softmax(logits[rows].float(), dim=-1)  # [A, vocab]
    chosen = logprobs.gather(1, tokens[rows].unsqueeze(1))[:, 0]  # [A]
    k = max((params[i].logprobs for i in asking), default=0)
    top = logprobs.topk(k, dim=-1)  # values, indices: [A, k]
    return chosen, top.values, top.indices


def logprobs_of(params: list[SamplingParams], chosen: list[float], top_values: list[list[float]],
                top_ids: list[list[int]]) -> list[TokenLogprobs | None]:
    """The host half of :func:`token_logprobs`: :func:`logprob_tensors`' results as lists -> one entry per row."""
    out: list[TokenLogprobs | None] = [None] * len(params)
    asking = [i for i, p in enumerate(params) if p.logprobs is not None]
    for a, i in enumerate(asking):
        n = params[i].logprobs
        out[i] = TokenLogprobs(chosen[a], list(zip(top_ids[a][:n], top_values[a][:n])) if n else [])
    return out

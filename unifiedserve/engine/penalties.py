"""Presence, frequency and repetition penalties: per-request token counts kept on the sampler's device.

A request whose :class:`~unifiedserve.engine.params.SamplingParams` ask for a penalty holds one row of a
:class:`PenaltyTable`: how often each vocabulary entry occurred in its output so far (``int32 [vocab]``) and,
for ``repetition_penalty``, which entries occur in its prompt (``bool [vocab]``). The engine core owns the
table (one per process) and gives a request its row when it arrives or is adopted, and takes it back when
the request ends or leaves. A step gathers the rows of its penalized requests in one indexing kernel,
rewrites their logits, and adds the sampled tokens to the counts with one accumulating scatter: no host
sync, so a CUDA-graph or async-scheduled step keeps its pace, and nothing per token is copied up.

The arithmetic is vLLM's and transformers' (``RepetitionPenaltyLogitsProcessor``), in this order:

* ``repetition_penalty`` r over the prompt and the output: a seen token's logit ``l`` becomes ``l / r``
  when ``l > 0``, else ``l * r``;
* then OpenAI's penalties over the output only: ``l -= frequency_penalty * count + presence_penalty * (count > 0)``.

Log-probabilities are still reported from the raw logits (OpenAI's and vLLM's default).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from unifiedserve.engine.params import SamplingParams
from unifiedserve.memory.transfer import to_device

__all__ = ["PenaltyBatch", "PenaltyRow", "PenaltyTable", "apply_penalties", "count_tokens"]


class PenaltyRow:
    """One request's row of a :class:`PenaltyTable` (given back with :meth:`release`)."""

    __slots__ = ("table", "index")

    def __init__(self, table: "PenaltyTable", index: int):
        self.table, self.index = table, index

    def release(self) -> None:
        """Give the row back (idempotent); work already queued on the device that reads it stays ordered before
        the next owner's, which is queued on the same stream."""
        if self.index >= 0:
            self.table._free.append(self.index)
            self.index = -1


class PenaltyTable:
    """Token counts of the penalized requests of one engine core, one row each, on ``device``.

    Rows are allocated on first use and the table doubles when full (a rare copy); ``capacity`` bounds it
    (the most requests one process holds at once), so its memory is at most ``capacity * vocab * 5`` bytes.
    """

    def __init__(self, vocab_size: int, device: str | torch.device = "cpu", capacity: int | None = None):
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.vocab_size = int(vocab_size)
        self.device = torch.device(device)
        self.capacity = capacity
        self.counts = torch.zeros((0, self.vocab_size), dtype=torch.int32, device=self.device)
        self.in_prompt = torch.zeros((0, self.vocab_size), dtype=torch.bool, device=self.device)
        self._free: list[int] = []

    @property
    def rows(self) -> int:
        return self.counts.shape[0]

    @property
    def num_in_use(self) -> int:
        return self.rows - len(self._free)

    @property
    def nbytes(self) -> int:
        return self.counts.numel() * 4 + self.in_prompt.numel()

    def reserve(self, rows: int) -> None:
        """Allocate room for ``rows`` rows now (e.g. inside a memory profile's window)."""
        if rows > self.rows:
            self._grow(rows)

    def open(self, prompt_token_ids: Sequence[int] = (), output_token_ids: Sequence[int] = ()) -> PenaltyRow:
        """A row for a new request: ``prompt_token_ids`` marked as seen (pass them only for a repetition
        penalty), ``output_token_ids`` (tokens it already has, e.g. the first one of a handed-off request) counted.

        Raises:
            ValueError: a token id is outside the vocabulary, or the table is at its capacity.
        """
        prompt = _ids(prompt_token_ids, self.vocab_size, "prompt")
        output = _ids(output_token_ids, self.vocab_size, "output")
        if not self._free:
            if self.capacity is not None and self.rows >= self.capacity:
                raise ValueError(f"all {self.capacity} penalty rows are in use")
            self._grow(max(8, 2 * self.rows) if self.capacity is None else min(self.capacity, max(8, 2 * self.rows)))
        index = self._free.pop()
        self.counts[index].zero_()
        self.in_prompt[index].zero_()
        if prompt is not None:
            self.in_prompt[index].index_fill_(0, to_device(prompt, self.device), True)
        if output is not None:
            ids = to_device(output, self.device)
            self.counts[index].index_add_(0, ids, torch.ones(ids.shape, dtype=torch.int32, device=self.device))
        return PenaltyRow(self, index)

    def _grow(self, rows: int) -> None:
        old = self.rows
        counts = torch.zeros((rows, self.vocab_size), dtype=torch.int32, device=self.device)
        in_prompt = torch.zeros((rows, self.vocab_size), dtype=torch.bool, device=self.device)
        counts[:old] = self.counts
        in_prompt[:old] = self.in_prompt
        self.counts, self.in_prompt = counts, in_prompt
        self._free.extend(range(rows - 1, old - 1, -1))  # lowest index first out of pop()


def _ids(token_ids: Sequence[int], vocab_size: int, what: str) -> torch.Tensor | None:
    if len(token_ids) == 0:
        return None
    ids = torch.as_tensor(list(token_ids), dtype=torch.int64)
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(f"a {what} token id is outside the vocabulary (0..{vocab_size - 1})")
    return ids


class PenaltyBatch(NamedTuple):
    """The penalized rows of one step, their indices on the device once for both :func:`apply_penalties` and
    :func:`count_tokens`."""

    table: PenaltyTable
    picked: torch.Tensor  # int64 [P]: the batch rows that carry penalties
    index: torch.Tensor  # int64 [P]: their rows of ``table``

    @classmethod
    def of(cls, rows: Sequence[int], penalty_rows: Sequence[PenaltyRow], device: torch.device) -> "PenaltyBatch":
        """``rows`` of the batch, ``penalty_rows`` one per entry (all of one table), indices queued to ``device``."""
        return cls(penalty_rows[0].table, to_device(torch.tensor(list(rows), dtype=torch.int64), device),
                   to_device(torch.tensor([r.index for r in penalty_rows], dtype=torch.int64), device))


def apply_penalties(logits: torch.Tensor, batch: PenaltyBatch, params: Sequence[SamplingParams]) -> torch.Tensor:
    """``logits`` (fp32 ``[B, vocab]``) with the penalties of ``batch``'s rows applied (``params`` one per row
    of it); a new tensor (the caller's logits stay raw, for log-probabilities)."""
    table, picked, index = batch
    knobs = to_device(torch.tensor([[p.repetition_penalty, p.frequency_penalty, p.presence_penalty] for p in params],
                                   dtype=torch.float32), logits.device)
    sub = logits.index_select(0, picked)  # [P, vocab]
    counts = table.counts.index_select(0, index)  # [P, vocab] int32
    in_output = counts > 0
    if any(p.repetition_penalty != 1 for p in params):
        seen = in_output | table.in_prompt.index_select(0, index)
        r = knobs[:, 0:1]
        sub = torch.where(seen, torch.where(sub > 0, sub / r, sub * r), sub)
    if any(p.frequency_penalty != 0 or p.presence_penalty != 0 for p in params):
        sub = sub - knobs[:, 1:2] * counts - knobs[:, 2:3] * in_output
    return logits.index_copy(0, picked, sub)


def count_tokens(tokens: torch.Tensor, batch: PenaltyBatch) -> None:
    """Count the tokens just sampled (``tokens``: int64 ``[B]`` on the device) for ``batch``'s rows."""
    table, picked, index = batch
    flat = index * table.vocab_size + tokens.index_select(0, picked)  # into the table's rows, as one vector
    table.counts.view(-1).index_add_(0, flat, torch.ones(index.shape, dtype=torch.int32, device=tokens.device))

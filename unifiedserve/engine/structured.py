"""Grammar-constrained decoding for ``response_format``: the output is JSON that follows a schema.

A request whose ``SamplingParams.response_format`` is ``"json_object"`` or ``"json_schema"`` gets a
:class:`Grammar`, an llguidance matcher over the model's tokenizer. Before each sampling step the
grammar says which tokens may come next (a bitmask, one bit per vocabulary entry) and the sampler
sets the others' logits to -inf (:func:`apply_grammars`; greedy and random rows alike, while
logprobs stay the model's own); the chosen token then advances the matcher. The request's stop
tokens (EOS unless ``ignore_eos``) are allowed only where the grammar may end, and once the grammar
admits nothing more the request ends with ``"stop"`` (``Grammar.is_complete``).

Whichever process samples a request holds its grammar: the in-process ``LLM``, core (token 0, and
every token under the monolithic policy) and decode, which rebuilds it from the hand-off's params
and replays the tokens so far. Matcher state never crosses a process boundary.

JSON comes out compact (no whitespace between tokens): where whitespace is free, a weak model can
spend its whole budget on blanks and never close the object.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Iterable, Sequence

import llguidance
import numpy as np
import torch

from unifiedserve.engine.params import SamplingParams
from unifiedserve.memory.transfer import to_device

log = logging.getLogger(__name__)

#: ``response_format: {"type": "json_object"}``: any JSON object.
JSON_OBJECT_SCHEMA = '{"type": "object"}'


@functools.lru_cache(maxsize=64)
def compile_grammar(response_format: str, json_schema: str | None = None, strict: bool = False) -> str:
    """The llguidance grammar for a response format (cached: requests tend to share a schema).

    Args:
        response_format: ``"json_object"`` or ``"json_schema"``.
        json_schema: the schema as JSON text (``"json_schema"`` only).
        strict: refuse schema keywords the grammar cannot enforce; otherwise they are not enforced.

    Raises:
        ValueError: the schema is invalid, unsatisfiable or (``strict``) uses an unsupported keyword;
            the message says which.
    """
    if response_format not in ("json_object", "json_schema"):
        raise ValueError(f"no grammar for response_format {response_format!r}")
    schema = JSON_OBJECT_SCHEMA if response_format == "json_object" else json_schema
    if schema is None:
        raise ValueError('response_format "json_schema" needs a schema')
    options = {"whitespace_flexible": False, "lenient": not strict}
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
    except ValueError as e:
        raise ValueError(f"invalid JSON schema: {e}") from None
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ValueError(f"invalid JSON schema: {messages[0]}")
    return grammar


def check_response_format(params: SamplingParams) -> None:
    """Compile ``params``' grammar (nothing for ``"text"``), so a bad schema fails before any work.

    Raises:
        ValueError: as :func:`compile_grammar`.
    """
    if params.response_format != "text":
        compile_grammar(params.response_format, params.json_schema, params.strict_schema)


@functools.lru_cache(maxsize=4)
def tokenizer_info(model_dir: str) -> llguidance.LLTokenizer:
    """llguidance's view of a checkpoint's tokenizer, built once per process (it indexes the vocabulary).

    Its vocabulary is the model's (``vocab_size`` in config.json, which may exceed the tokenizer's:
    padding rows are never allowed), so a mask row lines up with a row of logits.
    """
    from unifiedserve.model.config import ModelConfig

    path = Path(model_dir).expanduser()
    config = ModelConfig.from_json(path)
    return llguidance.LLTokenizer((path / "tokenizer.json").read_text(), n_vocab=config.text.vocab_size,
                                  eos_token=list(config.eos_token_ids))


class Grammar:
    """One request's matcher: which tokens may come next, and whether the output is complete.

    Args:
        params: the request's sampling params (``response_format`` other than ``"text"``).
        model_dir: the checkpoint directory (its tokenizer).
        stop_ids: the request's stop token ids; allowed only where the grammar may end.
        tokens: output tokens sampled so far (elsewhere), replayed into the matcher.

    Raises:
        ValueError: the schema does not compile (see :func:`compile_grammar`), or ``tokens`` are not
            a prefix the grammar allows.
    """

    def __init__(self, params: SamplingParams, model_dir: str | Path, stop_ids: Iterable[int],
                 tokens: Sequence[int] = ()):
        tokenizer = tokenizer_info(str(model_dir))
        grammar = compile_grammar(params.response_format, params.json_schema, params.strict_schema)
        self._matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if self._matcher.is_error():
            raise ValueError(f"invalid JSON schema: {self._matcher.get_error()}")
        self.vocab_size = tokenizer.vocab_size
        #: why no token may follow although the value is not closed (a schema that dead-ends mid-value, e.g. a
        #: required property whose $ref only refers to itself); set by :meth:`fill_bitmask`, None while fine
        self.dead_end: str | None = None
        #: the HTTP status the request fails with at a dead end: 400 for the schema's, 500 when the sampler chose
        #: a token the mask forbade (:meth:`accept`: a fault of the server's, e.g. non-finite logits)
        self.dead_end_status = 400
        self._num_accepted = 0
        self._stop_ids = sorted({int(t) for t in stop_ids if 0 <= t < self.vocab_size})
        self._eos_ids = [t for t in tokenizer.eos_tokens if 0 <= t < self.vocab_size]
        for token in tokens:
            self.accept(token)
            if self._matcher.is_error():
                raise ValueError(f"the tokens so far do not follow the grammar: {self._matcher.get_error()}")
        # A schema whose every branch refers back to itself ({"$ref": "#"} alone, or through anyOf) compiles,
        # but admits no first token: llguidance only says so once a mask is computed. Compute one now, so it
        # is the client's error at admission (400), not a sampled token the grammar then rejects.
        if not self._matcher.is_stopped():
            probe = np.zeros((self.vocab_size + 31) // 32, dtype=np.uint32)
            self._matcher.unsafe_compute_mask_ptr(probe.ctypes.data, probe.nbytes)
            if self._matcher.is_error():
                raise ValueError(f"invalid JSON schema: it admits no value (e.g. a $ref that only refers to itself; "
                                 f"{self._error_line() or 'no token fits'})")

    def _error_line(self) -> str:
        """The first line of the matcher's error, or ''."""
        return (self._matcher.get_error().splitlines() or [""])[0]

    @property
    def is_complete(self) -> bool:
        """No token may follow (the JSON value is closed); also true if the matcher failed."""
        return self._matcher.is_stopped()

    def fill_bitmask(self, words: np.ndarray) -> None:
        """Write the allowed next tokens into ``words`` (uint32 ``[ceil(vocab / 32)]``, bit ``t % 32`` of
        word ``t // 32`` for token ``t``)."""
        assert words.dtype == np.uint32 and words.flags["C_CONTIGUOUS"], "a contiguous uint32 row"
        self._matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        # llguidance sets its EOS bits where the grammar may end; the request's stop ids replace them
        # (they are the model's EOS unless ignore_eos, plus stop_token_ids)
        for t in self._eos_ids:
            words[t >> 5] &= np.uint32(0xFFFFFFFF ^ (1 << (t & 31)))
        if self._matcher.is_accepting():
            for t in self._stop_ids:
                words[t >> 5] |= np.uint32(1 << (t & 31))
        if self.dead_end is None and (self._matcher.is_error() or not words.any()):
            self.dead_end = (f"the JSON schema admits no continuation after {self._num_accepted} output tokens "
                             f"(e.g. a required property whose $ref only refers to itself)")

    def accept(self, token: int) -> None:
        """Advance past a sampled token. A stop token ends the request, so the matcher never sees it."""
        if token in self._stop_ids or self.dead_end is not None:
            return  # a dead end's sampled token is no output (the request fails with the reason)
        self._num_accepted += 1
        if not self._matcher.consume_token(token):  # the mask made this impossible: a bug, not a client error
            log.error("grammar rejected token %d: %s", token, self._error_line())
            # the request fails rather than return output that breaks its grammar
            self.dead_end = (f"internal error: token {token} was sampled against the grammar's mask after "
                             f"{self._num_accepted - 1} output tokens")
            self.dead_end_status = 500


def apply_grammars(logits: torch.Tensor, grammars: Sequence[Grammar | None]) -> torch.Tensor:
    """``logits`` with every token a row's grammar forbids at -inf.

    Args:
        logits: ``[B, vocab]`` float, on any device; not modified (logprobs are taken from it).
        grammars: one per row; rows with None are returned unchanged.

    Returns:
        ``logits`` itself when no row has a grammar, else a masked copy.
    """
    rows = [i for i, g in enumerate(grammars) if g is not None]
    if not rows:
        return logits
    vocab = logits.shape[-1]
    words = np.zeros((len(rows), (vocab + 31) // 32), dtype=np.uint32)  # [R, W]: the host-side bitmask
    for r, i in enumerate(rows):
        grammars[i].fill_bitmask(words[r])
    device = logits.device
    bits = to_device(torch.from_numpy(words.view(np.int32)), device)  # [R, W], queued: no host wait
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    allowed = ((bits.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab]  # [R, vocab]
    index = to_device(torch.tensor(rows, dtype=torch.int64), device)
    masked = logits.clone()
    masked[index] = logits[index].masked_fill(~allowed, float("-inf"))
    return masked


def grammar_for(params: SamplingParams, model_dir: str | Path, stop_ids: Iterable[int],
                tokens: Sequence[int] = ()) -> Grammar | None:
    """The request's :class:`Grammar`, or None for ``response_format="text"``. Raises as :class:`Grammar`."""
    return None if params.response_format == "text" else Grammar(params, model_dir, stop_ids, tokens)

"""Sampling parameters (pure Python; the scheduler imports this without torch)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass


#: Most alternatives a request may ask for per token (OpenAI's limit for top_logprobs).
MAX_LOGPROBS = 20
#: ``response_format`` kinds: free text, any JSON object, JSON valid against ``json_schema``.
RESPONSE_FORMATS = ("text", "json_object", "json_schema")
#: Largest JSON schema a request may carry (its JSON text, UTF-8); compiling a grammar grows with it.
MAX_JSON_SCHEMA_BYTES = 64 * 1024
#: OpenAI's range for ``presence_penalty`` and ``frequency_penalty``.
MAX_ABS_PENALTY = 2.0
#: Largest ``repetition_penalty`` (vLLM's bound; 1.0 is off, Qwen2.5-VL's generation config asks 1.05).
MAX_REPETITION_PENALTY = 2.0
#: Smallest ``repetition_penalty``: the penalty divides a seen token's positive logit, and in float32 a divisor
#: much smaller than this turns the logit into inf (1e-300 is 0 in float32); values below 1 favour repetition,
#: so 0.01 already makes every seen token with a positive logit win.
MIN_REPETITION_PENALTY = 0.01
#: A temperature below this is greedy, as in vLLM (``_SAMPLING_EPS``): dividing the logits by it in float32
#: overflows (1e-40 is a float32 subnormal, 1e-300 is 0), and the limit of sampling as the temperature goes to 0
#: is the argmax.
SAMPLING_EPS = 1e-5
#: OpenAI's range for a ``logit_bias`` value (-100 bans a token in effect, 100 all but forces it).
MAX_ABS_LOGIT_BIAS = 100.0
#: Most ``logit_bias`` entries a request may carry: each is added to the logits at every step of the request
#: (OpenAI's API takes at most 300; tokenizers name whole families of tokens, so this allows more).
MAX_LOGIT_BIAS_ENTRIES = 1024


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. ``temperature`` 0 (below :data:`SAMPLING_EPS`) means greedy."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings; the matched text is not returned (unless include_stop_str_in_output)
    #: vLLM's ``include_stop_str_in_output``: the matched stop string ends the text, and a stop token's text
    #: (empty for a special token such as EOS unless ``skip_special_tokens`` is off) is part of it
    include_stop_str_in_output: bool = False
    #: vLLM's ``min_tokens``: no stop token (EOS included) is sampled, and no stop string ends the output, before
    #: this many output tokens; ``max_tokens`` and a closed grammar still end it
    min_tokens: int = 0
    #: leave special tokens (``<|im_end|>``, ``<|vision_start|>``, ...) out of the text, as vLLM and transformers do
    skip_special_tokens: bool = True
    ignore_eos: bool = False  # keep going past the model's end-of-sequence token (benchmarks)
    #: None: no log-probabilities; k >= 0: each output token's log-probability under the model's
    #: distribution (log-softmax of the raw logits) and the k most likely tokens' (OpenAI's top_logprobs)
    logprobs: int | None = None
    #: "text", or a grammar the output must follow (see ``unifiedserve.engine.structured``)
    response_format: str = "text"
    json_schema: str | None = None  # "json_schema": the schema as JSON text
    #: "json_schema": refuse schema keywords the grammar cannot enforce (else they are not enforced)
    strict_schema: bool = False
    #: OpenAI's penalties, over the tokens generated so far (not the prompt), as vLLM and OpenAI apply them:
    #: ``logit -= presence_penalty * (count > 0) + frequency_penalty * count``
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    #: transformers' (and vLLM's) repetition penalty over the prompt and the output: a token seen in either
    #: has its logit divided by it when positive, multiplied by it when negative; 1.0 is off
    repetition_penalty: float = 1.0
    #: vLLM's ``min_p`` (a random request keeps the tokens whose probability, after temperature, is at least
    #: ``min_p`` times the most likely token's); 0 is off
    min_p: float = 0.0
    #: OpenAI's ``logit_bias``: ``(token id, bias)`` pairs (or a ``{token id: bias}`` dict, stored as pairs in
    #: id order) added to the raw logits before the penalties and every filter; greedy requests too
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be a non-negative integer (0 = off), got {self.top_k!r}")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be a non-negative integer, got {self.min_tokens!r}")
        problem = min_tokens_problem(self.min_tokens, self.max_tokens, self.response_format)
        if problem is not None:
            raise ValueError(problem)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (_is_number(value) and -MAX_ABS_PENALTY <= value <= MAX_ABS_PENALTY):
                raise ValueError(f"{name} must be in [-{MAX_ABS_PENALTY:g}, {MAX_ABS_PENALTY:g}], got {value!r}")
        if not (_is_number(self.repetition_penalty)
                and MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY):
            raise ValueError(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}] "
                             "(1 = off), "
                             f"got {self.repetition_penalty!r}")
        if not (_is_number(self.min_p) and 0 <= self.min_p <= 1):
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p!r}")
        object.__setattr__(self, "logit_bias", _logit_bias_pairs(self.logit_bias))
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in 0..{MAX_LOGPROBS}, got {self.logprobs!r}")
        self._check_response_format()

    def _check_response_format(self) -> None:
        if self.response_format not in RESPONSE_FORMATS:
            raise ValueError(f"response_format must be one of {', '.join(RESPONSE_FORMATS)}, "
                             f"got {self.response_format!r}")
        if (self.json_schema is not None) != (self.response_format == "json_schema"):
            raise ValueError('json_schema is given exactly when response_format is "json_schema"')
        if self.strict_schema and self.json_schema is None:
            raise ValueError('strict_schema applies to response_format "json_schema" only')
        if self.json_schema is None:
            return
        size = len(self.json_schema.encode("utf-8", "surrogatepass"))
        if size > MAX_JSON_SCHEMA_BYTES:
            raise ValueError(f"the JSON schema is {size} bytes; at most {MAX_JSON_SCHEMA_BYTES} are accepted")
        try:
            schema = json.loads(self.json_schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"a JSON schema is an object (or true/false), got {type(schema).__name__}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        """Whether any penalty changes the logits (the sampler then keeps token counts for the request)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def penalizes_prompt(self) -> bool:
        """Whether the prompt's tokens are penalized too (``repetition_penalty`` only)."""
        return self.repetition_penalty != 1

    def suppresses_stop(self, num_output_tokens: int) -> bool:
        """Whether the stop ids are banned from the next token (``min_tokens`` not reached with
        ``num_output_tokens`` already out)."""
        return num_output_tokens < self.min_tokens

    def stop_ids(self, eos_token_ids) -> frozenset[int]:
        """Token ids that end the output: ``stop_token_ids``, plus the model's EOS unless ``ignore_eos``."""
        return frozenset(self.stop_token_ids) | (frozenset() if self.ignore_eos else frozenset(eos_token_ids))


def min_tokens_problem(min_tokens: int, max_tokens: int | None, response_format: str = "text") -> str | None:
    """Why ``min_tokens`` cannot go with ``max_tokens`` (None: not known yet) and ``response_format``, or None."""
    if max_tokens is not None and min_tokens > max_tokens:
        return f"min_tokens ({min_tokens}) must not exceed max_tokens ({max_tokens})"
    if min_tokens and response_format != "text":
        # a grammar decides where its value ends; forbidding the stop tokens there leaves no token at all
        return "min_tokens cannot be combined with a response_format: the grammar decides where the output ends"
    return None


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _logit_bias_pairs(bias) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as ``(id, float bias)`` pairs in id order, each id once; raises ValueError when malformed."""
    pairs = list(bias.items()) if isinstance(bias, dict) else list(bias)
    if len(pairs) > MAX_LOGIT_BIAS_ENTRIES:
        raise ValueError(f"logit_bias has {len(pairs)} entries; at most {MAX_LOGIT_BIAS_ENTRIES} are accepted")
    out: dict[int, float] = {}
    for pair in pairs:
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            raise ValueError(f"a logit_bias entry is a (token id, bias) pair, got {pair!r}")
        token, value = pair
        if not isinstance(token, int) or isinstance(token, bool) or token < 0:
            raise ValueError(f"a logit_bias token id is a non-negative integer, got {token!r}")
        if not (_is_number(value) and math.isfinite(value) and abs(value) <= MAX_ABS_LOGIT_BIAS):
            raise ValueError(f"the logit_bias of token {token} must be in [-{MAX_ABS_LOGIT_BIAS:g}, "
                             f"{MAX_ABS_LOGIT_BIAS:g}], got {value!r}")
        if token in out:
            raise ValueError(f"logit_bias names token {token} twice")
        out[token] = float(value)
    return tuple(sorted(out.items()))


def outside_vocabulary(ids, vocab_size: int) -> str | None:
    """``"token id(s) a, b ... outside the vocabulary (ids 0..N)"`` for the ``ids`` at or past ``vocab_size`` (the
    model's logits' width; the first five named), or None when there are none."""
    bad = sorted({token for token in ids if token >= vocab_size})
    if not bad:
        return None
    return (f"token id{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad[:5]))}{' ...' if len(bad) > 5 else ''} "
            f"outside the vocabulary (ids 0..{vocab_size - 1})")


def check_logit_bias_ids(logit_bias, vocab_size: int) -> None:
    """Raise ValueError when a ``logit_bias`` token id (``(id, bias)`` pairs, as ``SamplingParams`` keeps them)
    is outside the model's vocabulary (its logits' width)."""
    problem = outside_vocabulary([token for token, _ in logit_bias], vocab_size)
    if problem is not None:
        raise ValueError(f"logit_bias names {problem}")


def finish_reason(token_id: int, num_output_tokens: int, stop_ids, max_tokens: int,
                  is_complete: bool = False) -> str | None:
    """``"stop"`` / ``"length"`` when the output's latest token ends it (``num_output_tokens`` counts it), else None.

    ``is_complete``: the request's grammar (``response_format``) admits no further token, which is a
    ``"stop"`` too; unlike a stop token, that last token is part of the output.
    """
    if token_id in stop_ids or is_complete:
        return "stop"
    return "length" if num_output_tokens >= max_tokens else None

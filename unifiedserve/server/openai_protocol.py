"""The OpenAI chat-completions and completions request schemas this server accepts (pydantic), and error bodies.

Every field either works or is refused: an OpenAI field this server does not implement gets a 400
naming it (unless it carries its neutral value, e.g. ``tools: []``), and so does any other
unknown field. Types are strict, as OpenAI's API checks them: ``"max_tokens": "2"``, ``true`` for a
number or ``"yes"`` for a boolean are refused, not coerced (an integer is a valid number). Text must
be valid Unicode (a lone surrogate such as ``"\\ud800"`` in JSON is refused).
``response_format`` ``json_object`` and ``json_schema`` are enforced by grammar-constrained decoding
(``unifiedserve.engine.structured``).
"""

from __future__ import annotations

import json
import typing
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from unifiedserve.engine.params import (MAX_ABS_LOGIT_BIAS, MAX_LOGIT_BIAS_ENTRIES, MAX_REPETITION_PENALTY,
                                       MIN_REPETITION_PENALTY, min_tokens_problem)


def _valid_unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"text is not valid Unicode (a lone surrogate at position {e.start})") from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]

#: Stop strings per request and characters per stop string. OpenAI takes up to 4 strings; every one is
#: looked for after each generated token, so their number bounds that work.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024


class _Model(BaseModel):
    # an unknown field is refused, never silently ignored; values are never coerced from another JSON type
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        """A ``null`` sent for an optional field that takes no null means its default, as in OpenAI's API, whose
        optional fields are nullable (``"stream": null`` is no stream, ``"n": null`` one choice). A field that
        takes null keeps it (a completion's ``"max_tokens": null`` is the server's default length, as vLLM reads
        it, not the field's 16); a required field's null stays an error."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        nulls = [k for k, v in data.items() if v is None and k in fields and not fields[k].is_required()
                 and not _takes_none(fields[k].annotation)]
        return {k: v for k, v in data.items() if k not in nulls} if nulls else data


def _takes_none(annotation: Any) -> bool:
    return annotation is type(None) or type(None) in typing.get_args(annotation)


class TextPart(_Model):
    type: Literal["text"]
    text: Text


class ImageURL(_Model):
    url: Text
    detail: Literal["auto"] | None = None  # low/high are OpenAI's sizing; here sizing is min/max_pixels
    min_pixels: Annotated[int, Field(gt=0)] | None = None
    max_pixels: Annotated[int, Field(gt=0)] | None = None


class ImagePart(_Model):
    type: Literal["image_url"]
    image_url: ImageURL


class VideoURL(_Model):
    url: Text
    fps: Annotated[float, Field(gt=0, le=120)] | None = None
    max_frames: Annotated[int, Field(ge=2)] | None = None
    min_pixels: Annotated[int, Field(gt=0)] | None = None
    max_pixels: Annotated[int, Field(gt=0)] | None = None


class VideoPart(_Model):
    type: Literal["video_url"]
    video_url: VideoURL


ContentPart = Annotated[Union[TextPart, ImagePart, VideoPart], Field(discriminator="type")]


class ChatMessage(_Model):
    role: Literal["system", "user", "assistant", "developer"]
    content: Text | list[ContentPart] | None = None


class StreamOptions(_Model):
    include_usage: bool = False  # a last event with the response's usage (OpenAI)
    #: vLLM's: every choice's event also carries that choice's usage so far (needs include_usage, as in vLLM)
    continuous_usage_stats: bool = False

    @model_validator(mode="after")
    def _continuous_needs_usage(self) -> "StreamOptions":
        if self.continuous_usage_stats and not self.include_usage:
            raise ValueError("continuous_usage_stats needs include_usage: true")
        return self


class TextFormat(_Model):
    type: Literal["text"]

    def sampling_fields(self) -> dict[str, Any]:
        """The ``SamplingParams`` fields this format sets."""
        return {}


class JSONObjectFormat(_Model):
    type: Literal["json_object"]  # any JSON object

    def sampling_fields(self) -> dict[str, Any]:
        return {"response_format": "json_object"}


class JSONSchemaSpec(_Model):
    # no "description": it is a hint for the model's prompt, which this server does not write
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]  # identifies it only
    schema_: Annotated[dict[str, Any], Field(alias="schema")]
    #: true: a schema keyword the grammar cannot enforce is refused (400); false/absent: it is not enforced
    strict: bool | None = None


class JSONSchemaFormat(_Model):
    type: Literal["json_schema"]
    json_schema: JSONSchemaSpec

    def sampling_fields(self) -> dict[str, Any]:
        # ASCII JSON text: a lone surrogate stays an escape, for the grammar compiler to refuse
        return {"response_format": "json_schema", "json_schema": json.dumps(self.json_schema.schema_),
                "strict_schema": bool(self.json_schema.strict)}


ResponseFormat = Annotated[Union[TextFormat, JSONObjectFormat, JSONSchemaFormat], Field(discriminator="type")]


def _stop_not_empty(text: str) -> str:
    if not text:  # before any media work (SamplingParams refuses it too, after the probe)
        raise ValueError("stop strings must not be empty")
    return text


StopText = Annotated[Text, Field(max_length=MAX_STOP_CHARS), AfterValidator(_stop_not_empty)]


def _token_id_key(key: str) -> str:
    if not (0 < len(key) <= 10 and key.isascii() and key.isdigit()):
        raise ValueError(f"a logit_bias key is a token id in decimal (e.g. \"50256\"), got {key[:20]!r}")
    return key


#: a ``logit_bias`` key: a token id in decimal, as OpenAI's API takes it
TokenIdText = Annotated[str, AfterValidator(_token_id_key)]


class SamplingRequest(_Model):
    """The fields chat completions and completions share: how to sample, when to stop, how many choices."""

    # extra fields are checked by _refuse_unsupported, for a message that names the field
    model_config = ConfigDict(extra="allow", strict=True)
    #: fields accepted only with their neutral value (the value that asks for nothing), of the same JSON type
    #: (``false`` is not a neutral ``presence_penalty``)
    _neutral: ClassVar[dict[str, tuple]] = {}

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=2**31 - 1)] | None = None  # -1 or 0: off; above the vocabulary: off
    # over the tokens generated so far: logit -= presence_penalty * (count > 0) + frequency_penalty * count
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    # vLLM extension (transformers' repetition penalty, over prompt and output; 1 = off)
    repetition_penalty: Annotated[float, Field(ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)] | None = None
    # vLLM extension: a random request keeps the tokens at least min_p times as likely as the most likely one
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    # {"token id": bias}, added to the logits before sampling (greedy too)
    logit_bias: Annotated[dict[TokenIdText, Annotated[float, Field(ge=-MAX_ABS_LOGIT_BIAS, le=MAX_ABS_LOGIT_BIAS)]],
                          Field(max_length=MAX_LOGIT_BIAS_ENTRIES)] | None = None
    seed: Annotated[int, Field(ge=-2**63, le=2**64 - 1)] | None = None  # a 64-bit integer (signed or not)
    stop: StopText | Annotated[list[StopText], Field(max_length=MAX_STOP_STRINGS)] | None = None
    n: Annotated[int, Field(ge=1)] = 1  # choices: the server's --max-n caps it
    ignore_eos: bool = False  # vLLM extension: keep generating past EOS (benchmarks)
    # vLLM extension: token ids that end a choice as EOS does (the token is not part of the text)
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0, le=2**31 - 1)]],
                              Field(max_length=MAX_STOP_STRINGS)] | None = None
    # vLLM extension: no stop token (EOS included) and no stop string ends a choice before this many tokens
    min_tokens: Annotated[int, Field(ge=0)] = 0
    # vLLM extension: the matched stop string (or stop token's text) ends the content instead of being cut
    include_stop_str_in_output: bool = False
    # vLLM extension: false keeps special tokens (<|im_end|>, ...) in the content
    skip_special_tokens: bool = True
    # OpenAI's end-user id, for its abuse monitoring, which this server does not do: accepted when well-formed (OpenAI's
    # type and size) because common clients send it, and changes nothing
    user: Annotated[Text, Field(max_length=512)] | None = None

    @field_validator("logit_bias")
    @classmethod
    def _each_token_once(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        if bias and len({int(k) for k in bias}) < len(bias):
            raise ValueError("logit_bias names a token id twice (e.g. \"7\" and \"07\")")
        return bias

    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as ``SamplingParams`` takes it."""
        return tuple((int(k), v) for k, v in (self.logit_bias or {}).items())

    @property
    def completion_limit(self) -> int | None:
        """The ``max_tokens`` the client sent (None: the server's default)."""
        return self.max_tokens

    @property
    def _response_format_kind(self) -> str:
        return "text"

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> "SamplingRequest":
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options needs stream: true")
        problem = min_tokens_problem(self.min_tokens, self.completion_limit, self._response_format_kind)
        if problem is not None:
            raise ValueError(problem)
        self._check()
        for name, value in (self.model_extra or {}).items():
            if name in self._neutral:
                if any(value == neutral and type(value) is type(neutral) for neutral in self._neutral[name]):
                    continue
                raise ValueError(f"{name} is not supported by this server")
            raise ValueError(f"unknown field {name!r}")
        return self

    def _check(self) -> None:
        """The subclass's own checks (raise ValueError)."""


class ChatCompletionRequest(SamplingRequest):
    _neutral: ClassVar[dict[str, tuple]] = {
        "tools": (None, []), "tool_choice": (None, "none"),
        "parallel_tool_calls": (None, False, True),
        "functions": (None, []), "function_call": (None, "none"),
    }

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False  # each output token's log-probability (log-softmax of the model's raw logits)
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None  # and the k most likely tokens'
    response_format: ResponseFormat | None = None  # the output follows a grammar (see engine.structured)
    # OpenAI's fields about storing completions and processing tiers: this server stores none and has one tier, so
    # only their neutral values are taken (store false, metadata empty, service_tier "auto" or "default")
    metadata: Annotated[dict[Annotated[Text, Field(max_length=64)], Annotated[Text, Field(max_length=512)]],
                        Field(max_length=16)] | None = None
    store: bool | None = None
    service_tier: Annotated[Text, Field(max_length=64)] | None = None

    @property
    def completion_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def _response_format_kind(self) -> str:
        return "text" if self.response_format is None else self.response_format.type

    def _check(self) -> None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.store:
            raise ValueError("store: true keeps the completion for later, which this server does not do; send false "
                             "or leave it out")
        if self.metadata:
            raise ValueError("metadata is kept with stored completions (store: true), which this server does not keep; "
                             "leave it out")
        if self.service_tier not in (None, "auto", "default"):
            raise ValueError(f"service_tier {self.service_tier!r} is not offered: this server has one processing tier "
                             f"(\"auto\" or \"default\")")
        if None not in (self.max_tokens, self.max_completion_tokens) and self.max_tokens != self.max_completion_tokens:
            raise ValueError(f"max_tokens ({self.max_tokens}) and max_completion_tokens ({self.max_completion_tokens}) "
                             f"disagree; send one of them")


#: Most token ids a ``/v1/completions`` prompt may list before its length is checked against the context (the
#: body's byte cap bounds it too); a longer list is refused by the schema.
MAX_PROMPT_TOKEN_IDS = 1 << 20

_PromptIds = Annotated[list[Annotated[int, Field(ge=0, le=2**31 - 1)]],
                      Field(min_length=1, max_length=MAX_PROMPT_TOKEN_IDS)]


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions`` (OpenAI's legacy completions, as vLLM serves them): a text prompt or its token ids,
    or a batch of them, continued without a chat template. A batch's choices are numbered as OpenAI's and vLLM's
    are: prompt ``p``'s choice ``i`` has index ``p * n + i``. ``max_tokens`` defaults to 16, as OpenAI's and
    vLLM's."""

    _neutral: ClassVar[dict[str, tuple]] = {"suffix": (None,), "best_of": (None, 1)}

    prompt: Text | _PromptIds | Annotated[list[Text | _PromptIds], Field(min_length=2)]
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    echo: bool = False  # the prompt's text before the completion's
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None  # each token's log-probability and the k best

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, prompt: Any) -> Any:
        # said here, not as a failed union's every branch
        if not isinstance(prompt, list):
            return prompt
        if not prompt:
            raise ValueError("prompt is empty")
        batch = all(isinstance(p, (str, list)) for p in prompt)
        if not batch and any(isinstance(p, (str, list)) for p in prompt):
            raise ValueError("prompt mixes token ids with strings or lists: send a string, a list of token ids, or a "
                             "batch (a list of strings or of token-id lists)")
        one = batch and len(prompt) == 1  # a one-prompt batch is that prompt
        for i, ids in enumerate(prompt if batch else [prompt]):
            where = f"prompt[{i}]" if batch and not one else "prompt"
            if isinstance(ids, list) and not ids:
                raise ValueError(f"{where} is empty")
            if isinstance(ids, list) and len(ids) > MAX_PROMPT_TOKEN_IDS:
                raise ValueError(f"{where} has {len(ids)} token ids; at most {MAX_PROMPT_TOKEN_IDS} are accepted")
        return prompt[0] if one else prompt

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts, one or a batch's."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)

    def _check(self) -> None:
        prompts = self.prompts
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str) and not prompt:
                raise ValueError("prompt is empty" if len(prompts) == 1 else f"prompt[{i}] is empty")
        if self.echo and self.logprobs is not None:
            raise ValueError("echo with logprobs asks for the prompt's log-probabilities, which this server does not "
                             "compute; send one of them")
        best_of = (self.model_extra or {}).get("best_of")
        if best_of == 1 and self.n > 1:  # OpenAI's and vLLM's rule: best_of candidates must cover the n returned
            raise ValueError(f"best_of (1) must be at least n ({self.n}); leave best_of out")


TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]


class TokenizeRequest(_Model):
    """vLLM's ``POST /tokenize``: the token ids the model would see for a ``prompt`` (as ``/v1/completions``
    reads it) or for chat ``messages`` (as ``/v1/chat/completions`` renders them, each image and video
    expanded to its visual tokens, counted from the media's probe, which decodes nothing).

    ``add_special_tokens`` (off by default, as the generation endpoints tokenize) adds what the tokenizer's
    post-processor adds; Qwen's tokenizers add nothing either way. ``return_token_strs`` adds each token's
    string (its vocabulary entry)."""

    model: str | None = None
    prompt: Text | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_generation_prompt: bool = True  # messages only: end with the assistant's turn opening
    add_special_tokens: bool = False
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send either prompt or messages")
        if self.prompt is not None and "add_generation_prompt" in self.model_fields_set:
            raise ValueError("add_generation_prompt applies to messages, not to a prompt")
        return self


class DetokenizeRequest(_Model):
    """vLLM's ``POST /detokenize``: the text of token ids (special tokens kept, as vLLM's)."""

    model: str | None = None
    tokens: Annotated[list[TokenId], Field(max_length=MAX_PROMPT_TOKEN_IDS)]


#: seconds a client should wait before retrying a request refused with 503 (the server busy, short of memory for
#: the media now, shutting down or restarting): the ``Retry-After`` every 503 carries, which the ``openai`` client
#: honours between its retries.
RETRY_AFTER_S = 1


def error_headers(status_code: int, headers: dict[str, str] | None = None) -> dict[str, str] | None:
    """``headers`` for an error response, with ``Retry-After`` added to a 503's (``headers`` may set its own)."""
    if status_code != 503:
        return headers
    return {"retry-after": str(RETRY_AFTER_S), **(headers or {})}


def error_body(message: str, status_code: int, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    kind = ("invalid_request_error" if status_code < 500 and status_code not in (401, 404)
            else "authentication_error" if status_code == 401
            else "not_found_error" if status_code == 404 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status_code}}

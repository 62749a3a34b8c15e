"""Text side of a Qwen2.5-VL checkpoint: chat template, tokenizer, placeholders, detokenizer.

Reads three files of a checkpoint directory, without transformers:

* ``tokenizer.json`` with the ``tokenizers`` library;
* ``tokenizer_config.json``: the Jinja chat template and special tokens;
* ``preprocessor_config.json``: patch geometry and normalisation
  (:class:`flashcodec.patches.PatchSpec`) and the image pixel budget.

A prompt is built in three steps::

    text = processor.render_chat(messages)                  # one <|image_pad|> / <|video_pad|> per media
    ids = processor.tokenize(text)
    ids = processor.expand_vision_tokens(ids, image_grids, video_grids)   # one pad per visual token
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from flashcodec._errors import first_line
from flashcodec.patches import PatchSpec
from flashcodec.plan.sampling import IMAGE_MAX_PIXELS, IMAGE_MIN_PIXELS, smart_resize

__all__ = ["IncrementalDecoder", "Processor", "load_processor"]

IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character -> byte: printable Latin-1 bytes stand for themselves,
    the others for ``chr(256 + n)`` in byte order (the table ``tokenizers``' ByteLevel uses)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


_BYTE_OF_CHAR = _byte_level_alphabet()


class Processor:
    """Chat template, tokenizer and placeholder expansion of one checkpoint."""

    def __init__(self, tokenizer: Tokenizer, chat_template: str | None, patch_spec: PatchSpec,
                 image_min_pixels: int = IMAGE_MIN_PIXELS, image_max_pixels: int = IMAGE_MAX_PIXELS,
                 eos_token: str | None = None, pad_token: str | None = None):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.patch_spec = patch_spec
        self.image_min_pixels = int(image_min_pixels)
        self.image_max_pixels = int(image_max_pixels)
        self.eos_token = eos_token
        self.pad_token = pad_token
        self.image_token_id = self._special_id(IMAGE_PAD)
        self.video_token_id = self._special_id(VIDEO_PAD)
        self._template = None
        #: ids that decode to no text when special tokens are skipped: the special tokens, and ids past the
        #: tokenizer's vocabulary (the model's padding rows)
        self._special_ids = frozenset(i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)
        #: the tokenizer's ids (added tokens included); a model's embedding may have more rows (padding)
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    def _special_id(self, token: str) -> int:
        token_id = self.tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(f"the tokenizer has no {token} token; is this a Qwen2-VL / Qwen2.5-VL tokenizer?")
        return token_id

    @property
    def merge_size(self) -> int:
        return self.patch_spec.merge_size

    @property
    def eos_token_id(self) -> int | None:
        return None if self.eos_token is None else self.tokenizer.token_to_id(self.eos_token)

    def image_size(self, height: int, width: int) -> tuple[int, int]:
        """Model input ``(height, width)`` of an image: multiples of 28 within the pixel budget."""
        return smart_resize(height, width, factor=self.patch_spec.factor,
                            min_pixels=self.image_min_pixels, max_pixels=self.image_max_pixels)

    def render_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
        """Render OpenAI/Hugging Face style messages with the checkpoint's chat template.

        ``content`` is a string or a list of parts ``{"type": "text", "text": ...}``,
        ``{"type": "image"}``, ``{"type": "video"}``; each image/video part becomes one
        ``<|vision_start|><|image_pad|><|vision_end|>`` (or ``<|video_pad|>``) in the text.

        Raises:
            ValueError: the checkpoint has no chat template, or its template refuses the messages (its
                ``raise_exception``) or fails on them.
        """
        if self.chat_template is None:
            raise ValueError("the checkpoint has no chat template (chat_template.jinja, chat_template.json or "
                             "tokenizer_config.json); pass a prompt string instead")
        from jinja2 import TemplateError

        if self._template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            # what transformers gives templates (chat_template_utils): {% break %} / {% continue %}, a tojson that
            # writes non-ASCII and <, >, & as they are (jinja's own escapes them for HTML), raise_exception (many
            # templates call it) and strftime_now (dated system prompts)
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = _strftime_now
            try:
                self._template = env.from_string(self.chat_template)
            except TemplateError as e:
                raise ValueError(f"the checkpoint's chat template does not compile: {e}") from None
        try:
            return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                         eos_token=self.eos_token, pad_token=self.pad_token)
        except (TemplateError, TypeError) as e:  # it refused these messages (raise_exception), or failed on them
            raise ValueError(f"the chat template refused the messages: {e}") from None

    def tokenize(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; special tokens written in the text map to their ids. ``add_special_tokens``
        adds what the tokenizer's post-processor adds (Qwen's add nothing; the chat template writes its own)."""
        # the batch call: it lets go of the GIL while it works, the single one holds it (1 MB of text: 0.66 s in
        # which no other thread ran, the server's event loop and every stream on it included; batched, 0.02 s)
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def expand_vision_tokens(self, ids: Sequence[int], image_grid_thws: Sequence[Sequence[int]] = (),
                             video_grid_thws: Sequence[Sequence[int]] = (), merge_size: int | None = None) -> list[int]:
        """Replace the i-th single image (video) pad by ``t*h*w / merge**2`` copies for the i-th grid.

        Raises:
            ValueError: the number of pads differs from the number of grids.
        """
        merge = self.merge_size if merge_size is None else merge_size
        grids = {self.image_token_id: list(image_grid_thws), self.video_token_id: list(video_grid_thws)}
        seen = {self.image_token_id: 0, self.video_token_id: 0}
        out: list[int] = []
        for token in ids:
            if token not in grids:
                out.append(token)
                continue
            k = seen[token]
            if k >= len(grids[token]):
                kind = "image" if token == self.image_token_id else "video"
                raise ValueError(f"the prompt has more {kind} placeholders than the "
                                 f"{len(grids[token])} {kind} grids given")
            t, h, w = grids[token][k]
            out.extend([token] * (t * h * w // merge**2))
            seen[token] = k + 1
        for token, count in seen.items():
            if count != len(grids[token]):
                kind = "image" if token == self.image_token_id else "video"
                raise ValueError(f"{len(grids[token])} {kind} grids given but the prompt has "
                                 f"{count} {kind} placeholders")
        return out

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (a byte-level BPE token may be part of a UTF-8 character).

        Byte-level vocabularies (Qwen's, the demo's) spell each byte with one printable character
        (GPT-2's byte-to-unicode table); special tokens and other vocabularies give their text.
        """
        token = self.tokenizer.id_to_token(token_id)
        if token is None:
            return b""
        try:
            return bytes(_BYTE_OF_CHAR[ch] for ch in token)
        except KeyError:
            return token.encode("utf-8")

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (through the batch call, which lets go of the GIL: see :meth:`tokenize`)."""
        return self.tokenizer.decode_batch([list(ids)], skip_special_tokens=skip_special_tokens)[0]

    def incremental_decoder(self, skip_special_tokens: bool = True) -> IncrementalDecoder:
        """A streaming detokenizer for one sequence's generated tokens."""
        return IncrementalDecoder(self.tokenizer, skip_special_tokens, self._special_ids, self.vocab_size)


#: Tokens an :class:`IncrementalDecoder` holds back as the inside of a character before it emits them as decoded
#: (a UTF-8 character has at most 4 bytes, and a byte-level token at least one)
MAX_PENDING = 16


class IncrementalDecoder:
    """Turns generated tokens into text pieces as they arrive.

    Byte-level BPE tokens may end inside a UTF-8 character; such text is held back (it decodes
    to U+FFFD) until a later token completes it. Concatenating every piece returned by
    :meth:`step` and :meth:`flush` gives ``decode(all_ids)``, with one exception below.

    The work per token is bounded: each step decodes the pending tokens again, so tokens that add no text
    would make a long output quadratic (32k forced special tokens: seconds of the server's event loop).
    Tokens that decode to nothing (``special_ids`` when skipped; ids past ``vocab_size``) are dropped at once,
    which changes no text; and after :data:`MAX_PENDING` tokens that still end inside a character (bytes that
    never complete one, a client's ``logit_bias`` can force them) or add no text, the pending text is emitted as
    decoded, its U+FFFD included: only there may the pieces differ from ``decode(all_ids)``, and only if the
    tokens after them would have completed a character begun among them.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True,
                 special_ids: frozenset[int] = frozenset(),
                 vocab_size: int | None = None):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._silent = special_ids if skip_special_tokens else frozenset()
        self._vocab_size = vocab_size
        self._ids: list[int] = []
        # ids[prefix:read] were emitted already and are decoded again only as context for the next
        # tokens (a byte-level token's text can depend on its neighbours); ids[read:] are pending.
        self._prefix = 0
        self._read = 0

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def step(self, token_id: int) -> str:
        """Add one token; return the new text it completes (possibly empty)."""
        if token_id in self._silent or (self._vocab_size is not None and token_id >= self._vocab_size):
            return ""  # no text, now or as a neighbour's context
        self._ids.append(token_id)
        emitted = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        if (len(text) <= len(emitted) or text.endswith("\ufffd")) and len(self._ids) - self._read < MAX_PENDING:
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(emitted):]

    def flush(self) -> str:
        """Text held back at the end of the sequence (an incomplete character decodes to U+FFFD)."""
        emitted = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return text[len(emitted):]


def _raise_exception(message: str) -> None:
    """The chat template's ``raise_exception(message)``: its refusal of the messages (a ``TemplateError``, as in
    transformers), which the renderer turns into a ``ValueError`` (the server's 400)."""
    from jinja2 import TemplateError

    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    """The template's ``tojson``: plain JSON, as transformers' (no HTML escaping)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    """The template's ``strftime_now(format)``: the local time now, formatted."""
    from datetime import datetime

    return datetime.now().strftime(format)


def load_processor(path: str | Path) -> Processor:
    """Read the tokenizer, chat template and preprocessor config of a local checkpoint directory.

    Raises:
        ValueError: ``tokenizer.json`` is missing or a config file is not valid JSON.
    """
    path = Path(path).expanduser()
    tokenizer_file = path / "tokenizer.json"
    if not tokenizer_file.exists():
        raise ValueError(f"{tokenizer_file} not found; the processor needs a tokenizers-format tokenizer.json")
    try:
        tokenizer = Tokenizer.from_file(str(tokenizer_file))
    except Exception as e:  # tokenizers raises a plain Exception for a file it cannot parse
        raise ValueError(f"{tokenizer_file} is not a tokenizers-format tokenizer ({first_line(e)})") from None
    tok_cfg = _read_json(path / "tokenizer_config.json")
    pre_cfg = _read_json(path / "preprocessor_config.json")
    size = pre_cfg.get("size") or {}
    if not isinstance(size, dict):
        raise ValueError(f"{path / 'preprocessor_config.json'}: its size must be a JSON object, got {size!r}")
    try:
        return _processor(tokenizer, tok_cfg, pre_cfg, size, path)
    except (TypeError, AttributeError) as e:  # a value of the wrong type in one of the configs
        raise ValueError(f"{path}: tokenizer_config.json or preprocessor_config.json holds a value of the wrong "
                         f"type ({first_line(e)})") from None


def _processor(tokenizer: Tokenizer, tok_cfg: dict, pre_cfg: dict, size: dict, path: Path) -> Processor:
    return Processor(
        tokenizer,
        chat_template=_read_template(path) or tok_cfg.get("chat_template"),
        patch_spec=PatchSpec.from_preprocessor_config(pre_cfg),
        image_min_pixels=pre_cfg.get("min_pixels", size.get("shortest_edge", IMAGE_MIN_PIXELS)),
        image_max_pixels=pre_cfg.get("max_pixels", size.get("longest_edge", IMAGE_MAX_PIXELS)),
        eos_token=_token_text(tok_cfg.get("eos_token")),
        pad_token=_token_text(tok_cfg.get("pad_token")),
    )


def _read_json(file: Path) -> dict[str, Any]:
    if not file.exists():
        return {}
    try:
        value = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, IsADirectoryError) as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{file} must hold a JSON object")
    return value


def _read_template(path: Path) -> str | None:
    """The processor's chat template (``chat_template.jinja``, else ``chat_template.json``), which comes before the
    tokenizer config's: transformers' processor (``ProcessorMixin.apply_chat_template``) and vLLM for a multimodal
    model use it, and a fine-tuned checkpoint may have changed only that one."""
    jinja = path / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text()
    return _read_json(path / "chat_template.json").get("chat_template")


def _token_text(token: Any) -> str | None:
    """``"<|im_end|>"`` or ``{"content": "<|im_end|>", ...}`` (older tokenizer configs)."""
    if isinstance(token, Mapping):
        return token.get("content")
    return token

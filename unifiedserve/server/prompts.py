"""Requests into prompts, for the API (:mod:`unifiedserve.server.api`): OpenAI chat messages into template
messages and media references (each media keyed by its identity), rendered and tokenized with one placeholder
per media part; completion prompts (text or token ids) into token ids; the size checks that refuse a prompt
before any media is decoded (characters, token ids, visual tokens from the probed grids).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.concurrency import run_in_threadpool

from unifiedserve.engine.params import outside_vocabulary
from unifiedserve.model.processor import IMAGE_PAD, VIDEO_PAD
from unifiedserve.runtime import protocol
from unifiedserve.server.engine_client import RequestError
from unifiedserve.server.limits import MAX_CHARS_PER_TOKEN, LimitError, RequestLimits, check_message_sizes
from unifiedserve.server.media import MediaError, MediaPolicy, check_declared_type, describe, resolve_media
from unifiedserve.server.media_key import media_key
from unifiedserve.server.openai_protocol import (ChatCompletionRequest, CompletionRequest, ImagePart, TextPart,
                                                 TokenizeRequest, VideoPart)

if TYPE_CHECKING:
    from unifiedserve.server.api import ServerState


@dataclass
class Prompt:
    """One prompt of a response: its token ids (each media's one placeholder not yet expanded), its media, and
    the text a completion's choices begin with (``echo``)."""

    ids: list[int]
    media: list[protocol.MediaRef] = dataclasses.field(default_factory=list)
    echo: str = ""


def ids_outside_vocabulary(ids: list[int], state: ServerState) -> str | None:
    """What is wrong with prompt (or /detokenize) token ids outside the vocabulary (:func:`outside_vocabulary`), or
    None. The tokenizer's vocabulary bounds them where it is the smaller: the model's embedding rows past it are
    padding (Qwen2.5-VL: 151,665 tokens, 152,064 rows) that no text has, and were never trained as input (vLLM
    refuses prompt ids past the tokenizer's too)."""
    vocab = state.processor.vocab_size
    if state.vocab_size is not None:
        vocab = min(vocab, state.vocab_size)
    return outside_vocabulary(ids, vocab)


async def chat_prompt(state: ServerState, body: ChatCompletionRequest | TokenizeRequest,
                       add_generation_prompt: bool = True,
                       add_special_tokens: bool = False) -> tuple[list[int], list[protocol.MediaRef]]:
    """The messages' token ids (one placeholder per media) and their media, keyed; sizes checked first.

    Raises:
        LimitError, MediaError, ValueError: as :func:`check_message_sizes`, :func:`convert_messages`,
            :func:`with_media_keys` and :func:`_prompt_ids` raise them.
    """
    check_message_sizes(*_message_sizes(body), state.max_model_len)
    messages, media = await run_in_threadpool(convert_messages, body, state.media_policy, state.limits)
    media = await run_in_threadpool(with_media_keys, media, state.model_name)
    # off the event loop: a long prompt's template and tokenizer take long enough to stall other streams
    ids = await run_in_threadpool(_prompt_ids, state.processor, messages, media, add_generation_prompt,
                                  add_special_tokens)
    return ids, media


def expanded_ids(state: ServerState, prompt_ids: list[int], plans: list[protocol.MediaPlan]) -> list[int]:
    """``prompt_ids`` with each media's placeholder expanded to its visual tokens (from the probed grids)."""
    return state.processor.expand_vision_tokens(prompt_ids, [p.grid_thw for p in plans if p.kind == "image"],
                                                [p.grid_thw for p in plans if p.kind == "video"])


def completion_prompts(state: ServerState, body: CompletionRequest) -> list[Prompt]:
    """A completion's prompts (one, or a batch's) as token ids, with their text for ``echo``."""
    prompts = body.prompts
    if len(prompts) == 1:
        return [completion_prompt(state, prompts[0], body.echo)]
    return [completion_prompt(state, prompt, body.echo, f"prompt[{i}]") for i, prompt in enumerate(prompts)]


def completion_prompt(state: ServerState, prompt: str | list[int], echo: bool, name: str = "the prompt") -> Prompt:
    """One completion prompt as token ids, and its text if ``echo``. ``name``: what errors call it.

    Raises:
        LimitError: a text longer than the context could hold, or more ids than fit it (before tokenizing).
        ValueError: an id outside the vocabulary, or an image/video placeholder (this endpoint takes no media).
    """
    processor, max_len = state.processor, state.max_model_len
    if isinstance(prompt, str):
        check_prompt_chars(prompt, max_len, name)
        ids, text = processor.tokenize(prompt), prompt
    else:
        ids = prompt
        if len(ids) >= max_len:
            raise LimitError(f"{name} has {len(ids)} token ids; this server's context holds {max_len} tokens "
                             f"(--max-model-len), the completion's included", "prompt")
        problem = ids_outside_vocabulary(ids, state)
        if problem is not None:
            raise ValueError(f"{name} has {problem}")
        text = processor.decode(ids, skip_special_tokens=False) if echo else ""
    if not ids:
        raise ValueError(f"{name} has no tokens")
    for token_id, kind in ((processor.image_token_id, "image"), (processor.video_token_id, "video")):
        if token_id in ids:
            raise ValueError(f"{name} holds the {kind} placeholder token ({token_id}); /v1/completions takes text "
                             f"only: send media to /v1/chat/completions")
    return Prompt(ids, echo=text if echo else "")


def check_prompt_chars(prompt: str, max_len: int, name: str = "the prompt") -> None:
    """Refuse a text prompt too long for the context at any tokenization, before it is tokenized."""
    if len(prompt) > MAX_CHARS_PER_TOKEN * max_len:
        raise LimitError(f"{name} holds {len(prompt)} characters; this server accepts at most "
                         f"{MAX_CHARS_PER_TOKEN * max_len} ({MAX_CHARS_PER_TOKEN} per token of its {max_len}-token "
                         f"context, --max-model-len)", "prompt")


def _prompt_ids(processor: Any, messages: list[dict], media: list[protocol.MediaRef],
                add_generation_prompt: bool = True, add_special_tokens: bool = False) -> list[int]:
    """The rendered chat's token ids, with one image (video) placeholder per image (video) part of ``media``.

    Raises:
        ValueError: the message text itself holds a placeholder token (before any media is probed).
    """
    ids = processor.tokenize(processor.render_chat(messages, add_generation_prompt), add_special_tokens)
    for token_id, kind, text, article in ((processor.image_token_id, "image", IMAGE_PAD, "an"),
                                          (processor.video_token_id, "video", VIDEO_PAD, "a")):
        if ids.count(token_id) != sum(ref.kind == kind for ref in media):
            raise ValueError(f"the message text holds {text}, the special token that stands for {article} {kind} "
                             f"part; send each {kind} as {article} {kind}_url part")
    return ids


def _message_sizes(body: ChatCompletionRequest) -> tuple[int, int, int]:
    """``(characters of text, messages, content parts)`` of the messages (string contents and text parts count
    their characters), in one pass: what :func:`check_message_sizes` bounds before rendering."""
    chars = parts = 0
    for m in body.messages:
        if isinstance(m.content, str):
            chars += len(m.content)
        elif isinstance(m.content, list):
            parts += len(m.content)
            chars += sum(len(part.text) for part in m.content if isinstance(part, TextPart))
    return chars, len(body.messages), parts


def with_media_keys(media: list[protocol.MediaRef], context: str) -> list[protocol.MediaRef]:
    """Each media with its identity (``server/media_key.py``): the caches and the router use it.

    Raises:
        MediaError: a local file vanished since it was resolved.
    """
    out = []
    for ref in media:
        try:
            out.append(msgspec.structs.replace(ref, key=media_key(ref, context)))
        except OSError:
            raise MediaError(f"media {ref.shown or len(out)} cannot be read") from None
    return out


def check_visual_tokens(state: ServerState, plans: list[protocol.MediaPlan], num_text_tokens: int,
                         prompt_name: str = "messages") -> None:
    """Refuse a prompt over ``--max-model-len`` from the probed grids, before any placeholder exists."""
    merge = state.processor.merge_size ** 2
    num_visual = sum(t * h * w // merge for t, h, w in (p.grid_thw for p in plans))
    prompt_len = num_text_tokens - len(plans) + num_visual  # each media's one placeholder becomes its tokens
    if prompt_len >= state.max_model_len:
        advice = ("lower fps, max_frames or max_pixels in video_url/image_url" if plans
                  else f"shorten the {prompt_name}")
        raise RequestError(
            f"this model's maximum context length is {state.max_model_len} tokens, but the {prompt_name} alone "
            f"need{'' if prompt_name.endswith('s') else 's'} "
            f"{prompt_len}" + (f" ({num_visual} visual tokens)" if plans else "") + f"; {advice}", 400)


def convert_messages(body: ChatCompletionRequest, policy: MediaPolicy, limits: RequestLimits = RequestLimits()):
    """OpenAI messages -> template messages (``{"type": "image"|"video"}`` parts) and media references.

    Raises:
        LimitError: a part asks for more pixels or frames than the server allows, or there are too
            many media parts (checked before any media is resolved).
        MediaError, ValueError: a media URL the policy refuses, or media outside user messages.
    """
    limits.check_media_count(sum(1 for m in body.messages if isinstance(m.content, list)
                                 for part in m.content if not isinstance(part, TextPart)))
    messages, media = [], []
    for m, message in enumerate(body.messages):
        # OpenAI's "developer" role is its newer name for the system instructions; Qwen2.5-VL was trained with
        # "system" (its chat template also writes its default system prompt when the first message is not one), so
        # the template gets "system": the role the model knows, not a turn it never saw
        role = "system" if message.role == "developer" else message.role
        if message.content is None or isinstance(message.content, str):
            messages.append({"role": role, "content": message.content or ""})
            continue
        parts = []
        for j, part in enumerate(message.content):
            if isinstance(part, TextPart):
                parts.append({"type": "text", "text": part.text})
                continue
            if message.role != "user":
                raise ValueError(f"images and videos are only allowed in user messages, not in {message.role!r}")
            where = f"messages[{m}].content[{j}]"
            if isinstance(part, ImagePart):
                u = part.image_url
                limits.check_pixels(u.min_pixels, u.max_pixels, f"{where}.image_url")
                found = resolve_media(u.url, policy)
                check_declared_type(found, "image", f"{where}.image_url")
                media.append(protocol.MediaRef("image", found.path, found.data, min_pixels=u.min_pixels,
                                               max_pixels=u.max_pixels, shown=describe(u.url),
                                               pixel_ceiling=limits.max_pixels))
                parts.append({"type": "image"})
            elif isinstance(part, VideoPart):
                v = part.video_url
                limits.check_pixels(v.min_pixels, v.max_pixels, f"{where}.video_url")
                max_frames = limits.check_frames(v.max_frames, f"{where}.video_url")
                found = resolve_media(v.url, policy)
                check_declared_type(found, "video", f"{where}.video_url")
                media.append(protocol.MediaRef("video", found.path, found.data, fps=v.fps, max_frames=max_frames,
                                               min_pixels=v.min_pixels, max_pixels=v.max_pixels,
                                               shown=describe(v.url), pixel_ceiling=limits.max_pixels))
                parts.append({"type": "video"})
        messages.append({"role": role, "content": parts})
    return messages, media

"""Every message the runtime's processes exchange, one tagged union per destination.

Messages are small msgspec structs sent as msgpack over ZMQ ``ipc://`` sockets. They carry ids,
token ids, page and block ids and timings, never tensors: tensors live in the shared pools.

Who sends what (see docs/architecture.md for the order in a request's life)::

    api    -> vision : ProbeMedia, CancelMedia, Shutdown
    vision -> api    : MediaProbed, MediaFailed, WorkerReady, WorkerStats
    api    -> core   : AddRequest, AbortRequest, Shutdown
    core   -> vision : WritePatches, CancelMedia
    vision -> core   : MediaReady
    core   -> decode : WeightsLoaded (once, at start-up), Handoff, AbortRequest, Shutdown
    decode -> core   : ReleaseBlocks
    core   -> api    : TokenOutputs, RequestFailed, WorkerReady, WorkerStats
    decode -> api    : TokenOutputs, WorkerReady, WorkerStats
"""

from __future__ import annotations

from typing import Union

import msgspec

from unifiedserve.engine.params import SamplingParams


class MediaRef(msgspec.Struct, frozen=True):
    """An image or video to fetch pixels from: a local path or the bytes themselves, plus options."""

    kind: str  # "image" | "video"
    path: str | None = None
    data: bytes | None = None
    fps: float | None = None  # videos: sampling rate (default: the model's, 2 fps)
    max_frames: int | None = None
    min_pixels: int | None = None
    max_pixels: int | None = None
    shown: str | None = None  # how the client named it (its URL, shortened): errors say this, never ``path``
    pixel_ceiling: int | None = None  # the server's --max-pixels: defaults above it are lowered to it
    key: str = ""  # media identity (server/media_key.py); "" = unknown, never cached


class MediaPlan(msgspec.Struct, frozen=True):
    """What probing found: the patch grid (so token counts are known before decoding)."""

    kind: str
    grid_thw: tuple[int, int, int]
    second_per_grid_t: float = 1.0
    num_frames: int = 1  # frames sampled (videos)
    duration_s: float = 0.0


class StageTimes(msgspec.Struct):
    """Wall-clock timestamps (``time.time()``) of one request's way to its first token."""

    added: float = 0.0  # core received it
    admitted: float = 0.0  # its patch pages were allocated
    media_ready: float = 0.0  # the last media's patches were written
    video_decode_s: float = 0.0  # video/image decoding time (vision, FlashCodec), summed over its media
    video_decode_start: float = 0.0  # vision started decoding its first media (0: no media decoded)
    # the first MediaReady core received (the first streamed part, or a whole media): when FlashCodec handed
    # vision its rows, when vision had written them into the pages, when core had the message
    first_part_decoded: float = 0.0
    first_part_written: float = 0.0
    first_part_ready: float = 0.0
    encode_start: float = 0.0
    encode_end: float = 0.0
    prefill_start: float = 0.0
    prefill_end: float = 0.0


# -- to vision ---------------------------------------------------------------------------------
class ProbeMedia(msgspec.Struct, tag=True):
    request_id: str
    media: list[MediaRef]
    #: answer the grids and forget the request: nothing is decoded past what the probe itself needs (a
    #: video's demux scan, an image's decode), nothing is held (``/tokenize``)
    probe_only: bool = False


class WritePatches(msgspec.Struct, tag=True):
    """Core admitted the request: write its patches (all media, in order) into these pages from row 0.

    Vision writes each media as it is decoded (a video slice by slice under streaming ingest;
    what was decoded before this message is written on its arrival) and announces it with
    ``MediaReady``. Skipped media are cancelled, never written and never announced.
    """

    request_id: str
    pages: list[int]
    #: media whose tokens core already has (prefix or media cache): do not decode or write them; the
    #: other media's patches go into ``pages`` one after another, in order, as if these were absent
    skip_media: list[int] = []


class CancelMedia(msgspec.Struct, tag=True):
    """Forget the request: drop its decoded pixels and never write its pages again."""

    request_id: str


# -- to core -------------------------------------------------------------------------------------
class AddRequest(msgspec.Struct, tag=True):
    request_id: str
    prompt_token_ids: list[int]  # vision placeholders expanded
    media: list[MediaPlan]
    params: SamplingParams
    stop_token_ids: list[int]  # params.stop_token_ids plus EOS unless ignore_eos
    media_keys: list[str] = []  # one per media (MediaRef.key); "" = not cacheable


class AbortRequest(msgspec.Struct, tag=True):
    request_id: str


class MediaReady(msgspec.Struct, tag=True):
    """Patches of media ``media_index`` are written: all of them, or (streaming ingest) the first
    ``num_rows`` patch rows, a whole number of the media's encode items.

    Per media, vision sends zero or more partial messages, in order and with ``num_rows`` growing
    (streaming ingest: each new prefix of whole temporal slices, ``grid_h * grid_w`` rows each),
    then exactly one final message with ``num_rows=None``; whole-video hand-off (and every image)
    sends only the final one. A media core asked to skip gets none.
    """

    request_id: str
    media_index: int
    video_decode_s: float  # seconds decoding this media: so far in a partial message, all of it in the final one
    num_rows: int | None = None  # rows written from the media's first row; None: the whole media (the last message)
    decode_start: float = 0.0  # when vision started decoding this media (time.time())
    decoded_at: float = 0.0  # when FlashCodec handed vision the newest rows announced here (time.time())
    written_at: float = 0.0  # when they had landed in the pages (time.time(), after the pool barrier)


class ReleaseBlocks(msgspec.Struct, tag=True):
    """Decode is done with these requests: free their KV blocks.

    ``output_token_ids[i]``, where given, are request ``i``'s outputs: with prefix caching, core caches the
    full blocks they filled before freeing them."""

    request_ids: list[str]
    output_token_ids: list[list[int]] = []


# -- to decode -----------------------------------------------------------------------------------
class Handoff(msgspec.Struct, tag=True):
    """A prefilled request, ready to decode on the shared KV cache."""

    request_id: str
    block_table: list[int]  # covers prompt + max_tokens: decode never allocates
    prompt_len: int
    mrope_delta: int
    first_token: int
    params: SamplingParams
    stop_token_ids: list[int]
    sampler_state: bytes  # the request's torch.Generator state after sampling the first token
    #: the prompt's distinct token ids when the request has a repetition penalty (decode keeps no prompt)
    penalty_prompt_ids: list[int] = []


class WeightsLoaded(msgspec.Struct, tag=True):
    """Core's, once at start-up: the LLM's weights are in the shared pool (decode maps them and waits for this
    before it runs anything on them)."""


# -- to api --------------------------------------------------------------------------------------
class MediaProbed(msgspec.Struct, tag=True):
    request_id: str
    plans: list[MediaPlan]
    probe_s: float


class MediaFailed(msgspec.Struct, tag=True):
    """The media cannot be used (not a video, corrupt, unsupported, too long): a client error; or, 503, the vision
    process has no memory for it now."""

    request_id: str
    message: str
    status_code: int = 400


class TokenOutput(msgspec.Struct):
    request_id: str
    index: int  # position in the output: 0 is the first token (sampled by core)
    token_id: int
    finish_reason: str | None = None  # "stop" | "length" when this token ends the request
    stages: StageTimes | None = None  # with the first token
    logprob: float | None = None  # when the request asked for logprobs: log-softmax of the raw logits
    top_logprobs: list[tuple[int, float]] | None = None  # its k most likely (token id, logprob), best first


class TokenOutputs(msgspec.Struct, tag=True):
    outputs: list[TokenOutput]


class RequestFailed(msgspec.Struct, tag=True):
    request_id: str
    message: str
    status_code: int = 400


class WorkerReady(msgspec.Struct, tag=True):
    name: str
    pid: int
    info: dict[str, str]  # device, threads, model, budgets: logged by the launcher


class WorkerStats(msgspec.Struct, tag=True):
    name: str
    gauges: dict[str, float]  # e.g. kv_blocks_used, patch_pages_used, num_waiting


class Shutdown(msgspec.Struct, tag=True):
    pass


ToVision = Union[ProbeMedia, WritePatches, CancelMedia, Shutdown]
ToCore = Union[AddRequest, AbortRequest, MediaReady, ReleaseBlocks, Shutdown]
ToDecode = Union[Handoff, AbortRequest, WeightsLoaded, Shutdown]
ToApi = Union[MediaProbed, MediaFailed, TokenOutputs, RequestFailed, WorkerReady, WorkerStats]

_encoder = msgspec.msgpack.Encoder()


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def decoder(union) -> msgspec.msgpack.Decoder:
    """A decoder for one destination's union (``ToVision``, ``ToCore``, ``ToDecode``, ``ToApi``)."""
    return msgspec.msgpack.Decoder(union)

"""A request as the engine sees it: prompt token ids, its vision inputs, and progress counters."""

from __future__ import annotations

import bisect
import enum
from dataclasses import dataclass, field

from unifiedserve.engine.params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # not admitted: holds no KV blocks or pages
    RUNNING = "running"  # admitted: encoding and/or prefilling, then decoding
    FINISHED = "finished"


@dataclass(frozen=True)
class EncodeItem:
    """One unit of vision encoding: a whole image, or one temporal slice of a video.

    Vision attention never crosses these units in Qwen2.5-VL, so encoding them separately is exact.
    """

    media_index: int  # which image/video of the request
    num_patch_tokens: int  # rows of 1176 patch values it reads
    num_visual_tokens: int  # rows of visual tokens it writes (patch tokens / merge^2)
    grid_thw: tuple[int, int, int]  # the unit's own grid: (1, h, w) for a video slice


@dataclass
class Request:
    """Progress of one request. Counters only; tensors live in the model runner."""

    request_id: str
    prompt_token_ids: list[int]  # placeholders already expanded to one token per visual token
    params: SamplingParams
    encode_items: list[EncodeItem] = field(default_factory=list)
    #: sorted prompt positions of the visual tokens, in encode order
    visual_positions: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed_tokens: int = 0  # prompt tokens prefilled so far
    num_scheduled_items: int = 0  # items handed to the encoder; the runner encodes them before prefill
    output_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    #: media whose patches are written; only their encode items may be scheduled
    ready_media: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        visual = sum(item.num_visual_tokens for item in self.encode_items)
        if visual != len(self.visual_positions):
            raise ValueError(f"request {self.request_id}: {len(self.visual_positions)} visual placeholders in the "
                             f"prompt but its media produce {visual} visual tokens")

    @property
    def num_media(self) -> int:
        return 1 + max((item.media_index for item in self.encode_items), default=-1)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_patch_tokens(self) -> int:
        return sum(item.num_patch_tokens for item in self.encode_items)

    @property
    def num_visual_tokens(self) -> int:
        return len(self.visual_positions)

    @property
    def is_prefill_done(self) -> bool:
        return self.num_computed_tokens >= self.prompt_len

    def visual_tokens_before(self, position: int) -> int:
        """How many visual tokens sit at prompt positions < ``position``."""
        return bisect.bisect_left(self.visual_positions, position)

    @property
    def max_total_tokens(self) -> int:
        return self.prompt_len + self.params.max_tokens

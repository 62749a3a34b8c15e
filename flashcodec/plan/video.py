"""A request's complete decode plan: which frames, at what size, decoded by whom."""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Sequence

from flashcodec.plan.sampling import FRAME_FACTOR, SamplingOptions, sample_frame_indices, video_target_size
from flashcodec.plan.segments import GopTable, RankPlan, decode_floor_cost, plan_distribution


@dataclass(frozen=True)
class VideoPlan:
    """Everything needed to decode a request, known before any frame is decoded.

    ``frame_indices`` are display-order indices; the output holds them in order, followed by
    ``num_pad_frames`` copies of the last one so the count is a multiple of the temporal patch size.
    """

    frame_indices: tuple[int, ...]
    sample_fps: float
    height: int  # output size of every frame (display orientation), multiples of 28
    width: int
    ranks: tuple[RankPlan, ...]

    @property
    def num_frames(self) -> int:
        return len(self.frame_indices)

    @property
    def num_pad_frames(self) -> int:
        return sum(r.num_pad_frames for r in self.ranks)

    @property
    def num_output_frames(self) -> int:
        return self.num_frames + self.num_pad_frames

    @property
    def decode_cost(self) -> int:
        """Frames the plan decodes (what the decoders actually work through)."""
        return sum(r.cost for r in self.ranks)

    def grid_thw(self, patch_size: int = 14, temporal_patch_size: int = FRAME_FACTOR) -> tuple[int, int, int]:
        return (self.num_output_frames // temporal_patch_size, self.height // patch_size, self.width // patch_size)

    def num_patch_tokens(self, patch_size: int = 14) -> int:
        t, h, w = self.grid_thw(patch_size)
        return t * h * w

    def num_visual_tokens(self, patch_size: int = 14, merge_size: int = 2) -> int:
        return self.num_patch_tokens(patch_size) // (merge_size * merge_size)


def gop_table(info) -> GopTable:
    return GopTable(info.decode_positions.tolist(), info.keyframe_positions.tolist())


def plan_video(
    info,
    options: SamplingOptions = SamplingOptions(),
    *,
    num_ranks: int = 1,
    decoders_per_rank: int | Sequence[int] = 1,
    frame_indices: list[int] | None = None,
    rank_speeds: Sequence[float] | None = None,
    slot_speeds: Sequence[float] | None = None,
) -> VideoPlan:
    """Plan a request from a probe's ``VideoInfo``: Qwen frame selection, size, GOP segments.

    ``frame_indices`` overrides the Qwen sampling (e.g. a benchmark's uniform sparse sampling);
    ``sample_fps`` is then derived from the indices' span. ``decoders_per_rank`` (one number or
    one per rank), ``rank_speeds`` (relative throughput; 0 for a rank that cannot decode this
    video) and ``slot_speeds`` (one decoder's throughput while it runs) are passed to
    :func:`~flashcodec.plan.segments.plan_distribution`.

    Raises:
        NoFramesError: the video has fewer than two frames (Qwen sampling).
        ValueError: ``frame_indices`` empty, holding anything but whole numbers, more of them than the video has
            frames, or one out of range; options the video cannot satisfy.
    """
    if frame_indices is None:
        indices, sample_fps = sample_frame_indices(info.num_frames, info.average_fps, options)
    else:
        indices = sorted(_frame_index(i) for i in frame_indices)
        if not indices:
            raise ValueError("frame_indices is empty")
        if len(indices) > info.num_frames:  # repeats: each is an output frame (10,000 of frame 0 took 3.4 GB)
            raise ValueError(f"frame_indices lists {len(indices)} frames; the video has {info.num_frames}")
        sample_fps = len(indices) / max(info.num_frames, 1) * info.average_fps
    height, width = video_target_size(info.display_height, info.display_width, len(indices), options)
    ranks = plan_distribution(
        indices, gop_table(info), num_ranks=num_ranks, decoders_per_rank=decoders_per_rank,
        temporal_patch_size=FRAME_FACTOR, rank_speeds=rank_speeds,
        slot_speeds=slot_speeds,
    )
    return VideoPlan(tuple(indices), sample_fps, height, width, tuple(ranks))


def _frame_index(value) -> int:
    """A frame index as an int: an integer (Python's, numpy's, a 0-d tensor's: ``__index__``) or a whole float
    (``np.linspace(...).round()``); 3.7, "3" and True are refused, where ``int()`` truncated or parsed them."""
    if not isinstance(value, (bool, str, bytes)):
        try:
            return operator.index(value)
        except TypeError:
            pass
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = math.nan
        if number.is_integer():
            return int(number)
    raise ValueError(f"frame_indices holds {value!r}; a frame index is a whole number")


def floor_cost(info, frame_indices) -> int:
    """Frames that must be decoded for ``frame_indices`` (the benchmark's decode floor)."""
    return decode_floor_cost(frame_indices, gop_table(info))

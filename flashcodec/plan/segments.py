"""GOP segments, their distribution over ranks x decoders, and temporal-patch alignment.

Pure bookkeeping over integer frame positions; no media, no torch. Vocabulary:

- *display index*: a frame's position in presentation order (what users and models count);
- *decode position*: the position of the frame's packet in decode (bitstream) order;
- *GOP segment*: packets ``[start_position, stop_position]`` that one decoder decodes in order,
  starting at a keyframe and stopping at the segment's last target frame;
- *rank*: a device (the CPU, or one GPU); each rank has several decoders (threads or NVDEC engines).
"""

from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class GopTable:
    """The two facts planning needs from a probe."""

    #: decode position of each display index (a permutation of ``range(num_frames)``).
    decode_positions: Sequence[int]
    #: decode positions of keyframes, ascending; the first is 0.
    keyframe_positions: Sequence[int]

    def __post_init__(self) -> None:
        if not self.keyframe_positions or self.keyframe_positions[0] != 0:
            raise ValueError("keyframe_positions must start at decode position 0")

    @property
    def num_frames(self) -> int:
        return len(self.decode_positions)

    def gop_of_position(self, position: int) -> int:
        return bisect.bisect_right(self.keyframe_positions, position) - 1

    def first_display_index_of_gop(self, gop: int) -> int:
        """Display index of the GOP's keyframe: frames shown before it are open-GOP leading frames."""
        return self._keyframe_display[gop]

    @property
    def _keyframe_display(self) -> list[int]:
        cached = self.__dict__.get("_kd")
        if cached is None:
            inverse = [0] * self.num_frames
            for display, position in enumerate(self.decode_positions):
                inverse[position] = display
            cached = [inverse[p] for p in self.keyframe_positions]
            object.__setattr__(self, "_kd", cached)
        return cached


@dataclass(frozen=True)
class GopSegment:
    """Decode packets ``start_position..stop_position`` (inclusive) and keep ``target_indices``."""

    start_position: int
    stop_position: int
    target_indices: tuple[int, ...]  # display indices, ascending, unique

    @property
    def cost(self) -> int:
        """Decode cost: the number of frames that must be decoded."""
        return self.stop_position - self.start_position + 1


@dataclass(frozen=True)
class RankPlan:
    """One rank's share: the frames it outputs, and its segments split into decoder lanes."""

    rank: int
    frame_indices: tuple[int, ...]  # display indices it outputs, in order (may repeat)
    num_pad_frames: int  # copies of the last frame appended to make the count even
    lanes: tuple[tuple[GopSegment, ...], ...]  # one ordered list of segments per decoder

    @property
    def num_output_frames(self) -> int:
        return len(self.frame_indices) + self.num_pad_frames

    @property
    def segments(self) -> list[GopSegment]:
        return sorted((s for lane in self.lanes for s in lane), key=lambda s: s.start_position)

    @property
    def cost(self) -> int:
        return sum(s.cost for lane in self.lanes for s in lane)


def build_segments(targets: Sequence[int], table: GopTable) -> list[GopSegment]:
    """Group target frames into GOP segments, ordered by start position.

    A target is decoded from the keyframe of the GOP that holds its packet; an open-GOP leading
    frame (shown before its GOP's keyframe) needs the previous GOP too, so it starts there. GOPs
    that hold no target are never part of a segment, except as that previous GOP.
    """
    by_start: dict[int, list[int]] = {}
    for display in sorted(set(targets)):
        if not 0 <= display < table.num_frames:
            raise ValueError(f"frame index {display} is out of range for {table.num_frames} frames")
        gop = table.gop_of_position(table.decode_positions[display])
        if display < table.first_display_index_of_gop(gop) and gop > 0:
            gop -= 1
        by_start.setdefault(table.keyframe_positions[gop], []).append(display)
    return [
        GopSegment(start, max(table.decode_positions[d] for d in members), tuple(members))
        for start, members in sorted(by_start.items())
    ]


def partition_contiguous(costs: Sequence[int], num_parts: int,
                         weights: Sequence[float] | None = None) -> list[range]:
    """Split ``costs`` into ``num_parts`` contiguous ranges of near-equal (or weighted) total cost.

    With ``weights``, part ``i`` aims at ``total * weights[i] / sum(weights)`` (a rank twice as
    fast gets twice the work). Each cut is placed at the prefix sum nearest to its ideal position,
    so every part's cost is within one item's cost of its share. Parts may be empty; a part of
    weight 0 is always empty.
    """
    if num_parts < 1:
        raise ValueError("num_parts must be at least 1")
    if weights is None:
        weights = [1.0] * num_parts
    if len(weights) != num_parts or any(w < 0 for w in weights) or not sum(weights) > 0:
        raise ValueError(f"weights must be {num_parts} non-negative numbers with a positive sum, got {weights}")
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    total, weight_sum = prefix[-1], sum(weights)
    cuts, share = [0], 0.0
    for part in range(1, num_parts):
        share += weights[part - 1]
        if share >= weight_sum:  # every later part has weight 0: they stay empty
            cuts.append(len(costs))
            continue
        ideal = total * share / weight_sum
        i = bisect.bisect_left(prefix, ideal, lo=cuts[-1])
        if i > cuts[-1] and (i == len(prefix) or ideal - prefix[i - 1] <= prefix[i] - ideal):
            i -= 1
        cuts.append(min(max(i, cuts[-1]), len(costs)))
    cuts.append(len(costs))
    return [range(a, b) for a, b in zip(cuts, cuts[1:])]


class _RankClock:
    """A rank's estimated finish time as segments are added to its share, in order.

    Two bounds, the larger wins: the *work bound* (every frame of the share at the rank's
    throughput ``speed``) and the *list schedule* of the segments over the rank's ``slots``
    decoders, each segment going to the decoder that frees first and running at ``slot_speed``.
    ``slot_speed`` is a decoder's speed while it runs: a CPU thread has a core, so the rank's speed
    over its threads; NVDEC sessions share engines (two per engine by default), and one left
    running alone has an engine to itself, so more than the speed over the sessions. The list
    schedule is what a speed-weighted split misses: a CPU thread decodes a 2-s 1080p GOP in about
    0.7 s (H100 machine, 2026-11-26: 16 threads at 1199 frames/s, 53-frame GOPs), longer than
    NVDEC's 14 sessions take for the whole 60-s clip (0.63 s), so a share of one GOP per thread,
    which the work bound calls small, holds the request past the GPU's end.
    """

    __slots__ = ("speed", "slot_speed", "free", "work", "last")

    def __init__(self, speed: float, slots: int, slot_speed: float):
        self.speed, self.slot_speed = speed, slot_speed
        self.free = [0.0] * slots  # a min-heap of each decoder's finish time
        self.work = 0
        self.last = 0.0  # the latest decoder's finish time

    def finish_with(self, cost: int) -> float:
        """The rank's finish time if it also decoded a segment of ``cost`` frames."""
        return max((self.work + cost) / self.speed, self.free[0] + cost / self.slot_speed, self.last)

    def add(self, cost: int) -> None:
        end = self.free[0] + cost / self.slot_speed
        heapq.heapreplace(self.free, end)
        self.work += cost
        self.last = max(self.last, end)


def rank_finish_time(costs: Sequence[int], speed: float, slots: int, slot_speed: float | None = None) -> float:
    """Estimated time for a rank to decode segments of ``costs`` (in order); see :class:`_RankClock`.

    ``speed``: the rank's frames/s over all its decoders; ``slot_speed``: one decoder's frames/s
    while it runs (default ``speed / slots``). Units are the caller's (relative speeds give
    relative times).
    """
    clock = _RankClock(speed, slots, min(speed, slot_speed or speed / slots))
    finish = 0.0
    for c in costs:
        finish = clock.finish_with(c)
        clock.add(c)
    return finish


def _cuts_within(costs: Sequence[int], ranks: Sequence[tuple[float, int, float]], limit: float) -> list[int] | None:
    """Cut points when each rank in turn takes the longest run of segments it finishes by ``limit``;
    None if segments are left over."""
    cuts, i, limit = [0], 0, limit * (1 + 1e-9)
    for speed, slots, slot_speed in ranks:
        clock = _RankClock(speed, max(1, min(slots, len(costs) - i)), slot_speed)
        while i < len(costs) and clock.finish_with(costs[i]) <= limit:
            clock.add(costs[i])
            i += 1
        cuts.append(i)
    return cuts if i == len(costs) else None


def partition_by_finish_time(costs: Sequence[int], speeds: Sequence[float], slots: Sequence[int],
                             slot_speeds: Sequence[float]) -> list[range]:
    """Split ``costs`` into contiguous runs, one per rank, so that the last rank to finish finishes soonest.

    Each rank's finish time is estimated by :class:`_RankClock` (work bound and list schedule). The
    split is the speed-weighted one (:func:`partition_contiguous`) when that is as good; otherwise a
    bisection on the finish time, each rank in turn taking the longest run it finishes in time. A
    rank whose one decoder would finish a segment after the others finish everything gets none
    (a CPU thread beside NVDEC on a short clip), which the weighted split cannot see.

    All speeds must be positive (leave ranks that take no part out).
    """
    ranks = [(float(v), int(n), min(float(v), float(s))) for v, n, s in zip(speeds, slots, slot_speeds)]
    weighted = partition_contiguous(costs, len(ranks), [v for v, _, _ in ranks])
    if len(ranks) == 1 or not costs:
        return weighted

    def makespan(parts: Sequence[range]) -> float:
        return max(rank_finish_time([costs[i] for i in part], v, n, s) for part, (v, n, s) in zip(parts, ranks))

    hi = weighted_end = makespan(weighted)
    best = _cuts_within(costs, ranks, hi)
    if best is None:
        return weighted
    lo = sum(costs) / sum(v for v, _, _ in ranks)  # no split beats every rank's throughput together
    for _ in range(60):
        if hi - lo <= 1e-4 * hi:
            break
        mid = (lo + hi) / 2
        cuts = _cuts_within(costs, ranks, mid)
        if cuts is None:
            lo = mid
        else:
            hi, best = mid, cuts
    parts = [range(a, b) for a, b in zip(best, best[1:])]
    return parts if makespan(parts) < weighted_end else weighted


def align_rank_boundaries(counts: Sequence[int], factor: int = 2) -> tuple[list[int], int]:
    """Make every rank's frame count but the last divisible by ``factor`` by *increasing* it.

    Returns ``(new_counts, num_pad_frames)``; padding (repeating the last frame) happens only on
    the last rank. Raising counts moves the next rank's first frames backwards, which costs at
    most a few extra decoded frames, where lowering them would cost nearly a whole GOP
    (FlashCodec paper, Fig. 7b).
    """
    total = sum(counts)
    cap = total - total % factor  # no rank boundary may pass the last full temporal patch
    bounds, acc = [], 0
    for c in counts[:-1]:
        acc += c
        b = min(-(-acc // factor) * factor, cap)
        bounds.append(max(b, bounds[-1] if bounds else 0))
    edges = [0] + bounds + [total]
    new_counts = [b - a for a, b in zip(edges, edges[1:])]
    return new_counts, (-new_counts[-1]) % factor


def plan_distribution(
    frame_indices: Sequence[int],
    table: GopTable,
    *,
    num_ranks: int = 1,
    decoders_per_rank: int | Sequence[int] = 1,
    temporal_patch_size: int = 2,
    rank_speeds: Sequence[float] | None = None,
    slot_speeds: Sequence[float] | None = None,
) -> list[RankPlan]:
    """Spread the target frames over ranks x decoders by decode cost, so the last rank finishes soonest.

    Ranks receive contiguous runs of frames (so each rank's temporal patches are whole and the
    concatenated output equals a single-rank decode); within a rank, decoders receive contiguous
    runs of segments so one decoder can continue from one GOP into the next without seeking.

    Args:
        frame_indices: display indices to output, ascending (repeats allowed).
        table: the video's GOP table.
        num_ranks: ranks (the CPU, each GPU's NVDEC sessions, ...).
        decoders_per_rank: decoder slots (lanes) per rank: one number for all, or one per rank.
        temporal_patch_size: every rank but the last one with frames outputs a multiple of this.
        rank_speeds: relative throughput per rank (default: equal). A rank gets work in
            proportion to its speed while its decoders have several segments each; a rank of speed
            0 (one that cannot decode this video, e.g. NVDEC on AV1) gets an empty plan and never
            the padding.
        slot_speeds: one decoder's throughput per rank while it runs, in the units of
            ``rank_speeds`` (default: the rank's speed over its decoders). With few segments per
            decoder the split follows finish times, not speeds (:func:`partition_by_finish_time`):
            a rank whose decoder takes longer for one segment than the others take for the rest
            gets nothing.

    Returns:
        one :class:`RankPlan` per rank, in rank order.

    Raises:
        ValueError: bad counts or speeds, or unsorted frame indices.
    """
    slots = [decoders_per_rank] * num_ranks if isinstance(decoders_per_rank, int) else list(decoders_per_rank)
    if num_ranks < 1 or len(slots) != num_ranks or any(d < 1 for d in slots):
        raise ValueError(f"need num_ranks >= 1 and at least one decoder per rank, got {num_ranks} ranks "
                         f"with decoders {decoders_per_rank}")
    speeds = [1.0] * num_ranks if rank_speeds is None else [float(v) for v in rank_speeds]
    if len(speeds) != num_ranks or any(not v >= 0 for v in speeds) or not sum(speeds) > 0:
        raise ValueError(f"rank_speeds must be {num_ranks} non-negative numbers, not all 0; got {rank_speeds}")
    frame_indices = list(frame_indices)
    if frame_indices != sorted(frame_indices):
        raise ValueError("frame indices must be in display order")
    segments = build_segments(frame_indices, table)
    one = [v / n for v, n in zip(speeds, slots)] if slot_speeds is None else [float(v) for v in slot_speeds]
    if len(one) != num_ranks or any(not v > 0 for v, speed in zip(one, speeds) if speed > 0):
        raise ValueError(f"slot_speeds must be {num_ranks} numbers, positive where the rank's speed is; "
                         f"got {slot_speeds}")
    # Ranks of speed 0 take no part in the split, the alignment or the padding.
    active = [r for r in range(num_ranks) if speeds[r] > 0]

    # 1. Active ranks by cost (by finish time), at segment granularity, then as frame counts.
    counts = []
    for part in partition_by_finish_time([s.cost for s in segments], [speeds[r] for r in active],
                                         [slots[r] for r in active], [one[r] for r in active]):
        members = {d for s in segments[part.start:part.stop] for d in s.target_indices}
        counts.append(sum(1 for d in frame_indices if d in members))
    # 2. Temporal-patch alignment across ranks.
    counts, num_pad = align_rank_boundaries(counts, temporal_patch_size)

    plans, offset = [], 0
    count_of = dict(zip(active, counts))
    for rank in range(num_ranks):
        count = count_of.get(rank, 0)
        rank_frames = tuple(frame_indices[offset:offset + count])
        offset += count
        rank_segments = build_segments(rank_frames, table) if rank_frames else []
        lanes = tuple(
            tuple(rank_segments[p.start:p.stop])
            for p in partition_contiguous([s.cost for s in rank_segments], slots[rank])
        )
        plans.append(RankPlan(rank, rank_frames, num_pad if rank == active[-1] else 0, lanes))
    return plans


def decode_floor_cost(frame_indices: Sequence[int], table: GopTable) -> int:
    """Frames that must be decoded to produce ``frame_indices`` (the sum of segment costs)."""
    return sum(s.cost for s in build_segments(frame_indices, table))

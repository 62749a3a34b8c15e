"""One request's bookkeeping on one rank: its lanes of GOP segments, its runs in flight and the frames it emitted.

Each request arrives as one job per rank (:class:`RankJob`), each job as *lanes*: one ordered run of GOP segments
per slot, balanced by decode cost. Within a request, a thread takes the next segment of its
own lane first (its decoder is already positioned there, so no seek is needed); when its lane is
empty it takes an unclaimed lane, then steals from the tail of the lane with the most work left
(:meth:`RankJob.take`).
A streamed request (``in_order``) is one queue in display order instead: every slot takes the
earliest segment left, so the prefix of finished frames, which is what a stream hands out, grows at
the rank's pace rather than at one slot's (with lanes, the prefix is the first lane's progress, and
the other lanes' frames all come out at the end).
Another rank's dry slot steals from the tail of the lane with the most work left (:meth:`RankJob.peek_tail`), and
a segment a second slot backs up is decoded twice, so each frame is emitted once, by whichever run emits it first
(:meth:`RankJob.emit_once`). Which slot takes what, and when to steal or back up, is decided by the rank's
scheduler (:mod:`flashcodec.decode.scheduler`), under its rank group's lock; this module is bookkeeping only.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from flashcodec.plan.segments import GopSegment, RankPlan

if TYPE_CHECKING:  # annotations only: this module imports neither the decoders (torch, av) nor the scheduler
    from flashcodec.decode.backends import Backend, SegmentDecoder
    from flashcodec.decode.scheduler import RankScheduler


@dataclass
class _Run:
    """A segment being decoded: by whom, since when, and whether a second slot backs it up."""

    rank: "RankScheduler"
    began: float
    backed_up: bool = False


@dataclass(frozen=True)
class SlotEvent:
    """One piece of a slot's work on a traced request: opening a decoder, or decoding a segment."""

    rank: str  # the slot's rank (``"cpu"``, ``"cuda:0"``)
    slot: int
    kind: str  # ``"open"`` or ``"decode"``
    start_s: float  # from ``t0`` of the trace (the request's queueing)
    end_s: float
    start_position: int  # the segment's first packet
    cost: int  # frames the segment decodes
    stolen: bool  # the segment was planned for another rank
    backup: bool = False  # a second run of a segment another slot was decoding


class _Emitter:
    """A request's ``emit`` as its segment decoders see it: ``emitter(display, frame)``, and ``emitter.many(displays,
    frames)`` for a batch (see :func:`flashcodec.decode.backends.emit_many`)."""

    __slots__ = ("_job",)

    def __init__(self, job: "RankJob"):
        self._job = job

    def __call__(self, display: int, frame) -> None:
        self._job.emit_once(display, frame)

    def many(self, displays: list[int], frames) -> None:
        self._job.emit_once_many(displays, frames)


class RankJob:
    """One request's work on one rank. Bookkeeping only; the rank group's lock guards it.

    ``open_decoder(backend)`` opens a segment decoder for this request on ``backend`` (the
    owner rank's, or a thief rank's); ``allowed_ranks`` names the ranks that may decode this
    request's segments (``None``: any), e.g. only CPU ranks for a video NVDEC cannot decode;
    ``fallback_ranks`` those that take it only once every allowed rank has failed it (the CPU rank of an
    engine whose GPUs alone take the video).
    ``trace``: ``(t0, events)``, a ``time.perf_counter()`` origin and a list every slot appends its
    :class:`SlotEvent` to (the request's ranks share one), or None (no tracing).
    ``in_order``: the plan's segments form one queue in display order that every slot takes from the head (a
    streamed request; module docstring); another rank steals from its tail, the end of the video.
    """

    def __init__(self, key_id: int, plan: RankPlan, open_decoder: Callable[[Backend], SegmentDecoder],
                 emit: Callable[[int, object], None], on_segment_done: Callable[[GopSegment, list[int]], None],
                 on_finished: Callable[["RankJob", BaseException | None], None],
                 allowed_ranks: frozenset[int] | None = None,
                 trace: tuple[float, list[SlotEvent]] | None = None,
                 emit_many: Callable[[list[int], object], None] | None = None,
                 fallback_ranks: frozenset[int] = frozenset(), in_order: bool = False):
        self.key_id = key_id
        self.plan = plan
        self.open_decoder = open_decoder
        self.emit = emit
        self.emit_many = emit_many
        self.on_segment_done = on_segment_done
        self.on_finished = on_finished
        self.allowed_ranks = allowed_ranks
        self.fallback_ranks = fallback_ranks
        self.excluded: set[int] = set()  # ranks that failed this request: they take none of its segments any more
        self.trace = trace
        self.running: dict[GopSegment, _Run] = {}  # segments a slot is decoding and no run has ended
        self.ended: set[GopSegment] = set()  # segments a run has completed
        self.claimed: set[int] = set()  # display indices emitted (so a backed-up segment's frames are written once)
        self._claim_lock = threading.Lock()
        self.in_order = in_order
        self.lanes = [deque(plan.segments)] if in_order else [deque(lane) for lane in plan.lanes]
        self.lane_owner: list[int | None] = [None] * len(self.lanes)
        self.in_flight = 0
        self.error: BaseException | None = None
        self.cancelled = False
        self.owner: RankScheduler | None = None  # set by submit
        self.emitter = _Emitter(self)  # what its segment decoders emit to: emit_once, and .many for batches

    def should_stop(self) -> bool:
        """Polled by decoders at each packet: a cancelled or failed request stops where it is."""
        return self.cancelled

    def emit_once(self, display: int, frame) -> None:
        """``emit``, unless another run of the same segment (a backup) has emitted this frame already."""
        with self._claim_lock:
            if display in self.claimed:
                return
            self.claimed.add(display)
        self.emit(display, frame)

    def emit_once_many(self, displays: list[int], frames) -> None:
        """``emit_once`` for a batch (``frames[i]`` is ``displays[i]``): one ``emit_many`` call when no frame of it
        was emitted before (the usual case), else the others one by one."""
        with self._claim_lock:
            keep = [i for i, d in enumerate(displays) if d not in self.claimed]
            self.claimed.update(displays[i] for i in keep)
        if len(keep) == len(displays) and self.emit_many is not None:
            self.emit_many(displays, frames)
            return
        for i in keep:
            self.emit(displays[i], frames[i])

    @property
    def has_pending(self) -> bool:
        return not self.cancelled and any(self.lanes)

    @property
    def is_done(self) -> bool:
        return self.in_flight == 0 and not self.has_pending

    @property
    def pending_cost(self) -> int:
        return 0 if self.cancelled else sum(s.cost for lane in self.lanes for s in lane)

    def can_run_on(self, rank_index: int) -> bool:
        if rank_index in self.excluded:
            return False
        if self.allowed_ranks is None or rank_index in self.allowed_ranks:
            return True
        return rank_index in self.fallback_ranks and self.allowed_ranks <= self.excluded

    def give_back(self, segment: GopSegment) -> None:
        """Queue a segment again, in a lane of its own that no slot holds (a failed rank's run of it)."""
        self.lanes.append(deque([segment]))
        self.lane_owner.append(None)

    def take(self, slot: int) -> GopSegment | None:
        """Next segment for ``slot``: own lane, else an unclaimed lane, else steal the largest tail."""
        if self.cancelled:
            return None
        if self.in_order:  # the one queue's head, then anything given back
            lane = next((ln for ln in self.lanes if ln), None)
            return None if lane is None else lane.popleft()
        for i, owner in enumerate(self.lane_owner):
            if owner == slot and self.lanes[i]:
                return self.lanes[i].popleft()
        for i, owner in enumerate(self.lane_owner):
            if owner is None and self.lanes[i]:
                self.lane_owner[i] = slot
                return self.lanes[i].popleft()
        return self._pop_largest_tail()

    def peek_tail(self) -> GopSegment | None:
        """The segment another rank would steal: the tail of the lane with the most work left."""
        lane = self._largest_lane()
        return None if lane is None else lane[-1]

    def _largest_lane(self) -> deque | None:
        if self.cancelled:
            return None
        lane = max(self.lanes, key=lambda ln: sum(s.cost for s in ln), default=None)
        return lane if lane else None

    def _pop_largest_tail(self) -> GopSegment | None:
        lane = self._largest_lane()
        return None if lane is None else lane.pop()

"""Stall-free scheduling of GOP segments over every rank's decoder slots (paper Algorithm 2).

A rank (the CPU, or one GPU's NVDEC sessions) has a fixed number of decoder threads (its slots),
shared by every request in flight, so many concurrent videos never oversubscribe the hardware.
Requests share the slots evenly (``request_order="fair"``, the default): a thread that finishes a
segment works next for the request the fewest threads work for, staying with its own on a tie, so a
short video asked while a long one decodes gets its share of the slots at once instead of after the
long one's last segment (``"fifo"``).
Each request arrives as one job per rank (:class:`~flashcodec.decode.rank_job.RankJob`: its lanes of GOP
segments, one per slot, or one queue in display order for a streamed request; that module says which segment
a slot takes next). No slot idles while a segment of any request remains.

Ranks differ in speed (an H100's 7 NVDEC engines vs a few CPU cores), and the planner's split
(by estimated finish times, :func:`flashcodec.plan.segments.partition_by_finish_time`) is only an
estimate. So a rank that runs dry takes work from another rank:
from the tail of the busiest lane of the rank that would finish last, but only when it would
finish that segment sooner than the victim would finish its backlog (:func:`should_steal`); a slow
rank therefore never takes the last segments from a fast one and stalls it. When nothing is
left to take, a dry slot *backs up* a segment another rank is still decoding, if it would end it
much sooner than that rank is expected to (:func:`should_back_up`): both decode it, each frame is
written by whichever run emits it first, the first run to end completes the segment and the other
stops at its next packet. So a segment that a slow rank holds (its speed misjudged, or its core
taken by another process) cannot hold the request. A rank that fails a request (an NVDEC session
that cannot be created, a decoder that raises) hands the segment back when another rank may decode
the request: the failing rank takes no more of it, and the others take the segment and the rest of
its lanes (:meth:`RankScheduler._hand_over`); the request fails only when no rank is left. All
ranks of an engine share one lock (:class:`RankGroup`); segments take milliseconds, so it is not
contended.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

from flashcodec.decode.backends import Backend, SegmentDecoder
from flashcodec.decode.rank_job import RankJob, SlotEvent, _Run
from flashcodec.devices import log_once
from flashcodec.plan.segments import GopSegment

log = logging.getLogger(__name__)


def should_steal(segment_cost: int, thief_slot_speed: float, victim_backlog_cost: int, victim_speed: float) -> bool:
    """Whether a dry slot of another rank should take a segment from a victim rank.

    Args:
        segment_cost: frames the segment decodes.
        thief_slot_speed: the thief slot's throughput (frames/s; its rank's speed / slots).
        victim_backlog_cost: frames still queued on the victim rank (not yet taken by a slot).
        victim_speed: the victim rank's throughput over all its slots (frames/s).

    Returns:
        True when the thief would finish the segment before the victim finishes its backlog, so
        the steal can only bring the end of the request forward.
    """
    if segment_cost <= 0 or thief_slot_speed <= 0:
        return False
    if victim_speed <= 0:
        return True
    return segment_cost / thief_slot_speed < victim_backlog_cost / victim_speed


#: A backup starts only when the dry slot's own estimate is below this fraction of the holder's
#: expected remaining time: both estimates are rough, and a backup costs a decoder's work.
BACKUP_MARGIN = 0.5


def should_back_up(segment_cost: int, thief_slot_speed: float, holder_slot_speed: float, elapsed_s: float) -> bool:
    """Whether a dry slot should decode a segment another rank's slot has been decoding for ``elapsed_s``.

    The holder is expected to need ``cost / holder_slot_speed`` in all; once it is past that (it is
    late: its speed was misjudged), it is taken to need as long again as it has had. The thief
    backs the segment up when it would need less than :data:`BACKUP_MARGIN` of that.
    """
    if segment_cost <= 0 or thief_slot_speed <= 0:
        return False
    return segment_cost / thief_slot_speed < BACKUP_MARGIN * holder_time_left(segment_cost, holder_slot_speed,
                                                                              elapsed_s)


def holder_time_left(segment_cost: int, holder_slot_speed: float, elapsed_s: float) -> float:
    """A running segment's expected time left: its estimate less ``elapsed_s``, or ``elapsed_s`` once it is late."""
    expected = segment_cost / holder_slot_speed if holder_slot_speed > 0 else float("inf")
    return max(expected - elapsed_s, elapsed_s)


#: how a rank's slots share the requests in flight: ``fair`` (each next segment for the request the fewest slots
#: work for) or ``fifo`` (the oldest request's segments until none is left, then the next request's)
REQUEST_ORDERS = ("fair", "fifo")


class RankGroup:
    """The ranks of one engine, sharing one lock so that a dry rank can take another's work, and the order in which
    their slots serve requests (``request_order``, one of :data:`REQUEST_ORDERS`)."""

    def __init__(self, request_order: str = "fair") -> None:
        if request_order not in REQUEST_ORDERS:
            raise ValueError(f"request_order must be one of {', '.join(REQUEST_ORDERS)}, got {request_order!r}")
        self.fifo = request_order == "fifo"
        self.cond = threading.Condition()
        self.ranks: list[RankScheduler] = []

    def live_keys(self) -> set[int]:
        """Key ids of requests with a job queued on any rank (call with ``cond`` held)."""
        return {job.key_id for rank in self.ranks for job in rank._jobs}

    def cancel(self, key_id: int, error: BaseException) -> None:
        """Stop a request on every rank: queued segments are dropped, running ones stop at their next
        packet, and each of its rank jobs finishes with ``error`` once no slot is working on it."""
        idle = []
        with self.cond:
            for rank in self.ranks:
                for job in [j for j in rank._jobs if j.key_id == key_id]:
                    job.cancelled = True
                    if job.error is None:
                        job.error = error
                    if job.in_flight == 0:  # no slot will finish it: do it here
                        rank._jobs.remove(job)
                        idle.append(job)
            self.cond.notify_all()
        for job in idle:
            job.on_finished(job, job.error)

    def shutdown(self) -> None:
        for rank in self.ranks:
            rank.shutdown()


class RankScheduler:
    """The decoder threads of one rank and the requests with work on it (oldest first), which share them.

    Args:
        backend: opens this rank's segment decoders.
        num_slots: decoder threads of the rank.
        name: thread-name prefix (``"cpu"``, ``"cuda:0"``).
        speed: the rank's throughput over all slots, in frames/s (relative values are what
            matter); it weights the planner's split and decides cross-rank steals.
        group: the engine's :class:`RankGroup` (a rank alone gets its own).
    """

    def __init__(self, backend: Backend, num_slots: int, name: str = "cpu", *, speed: float = 1.0,
                 group: RankGroup | None = None):
        if num_slots < 1:
            raise ValueError("a rank needs at least one decoder slot")
        if not speed > 0:
            raise ValueError(f"a rank's speed must be positive, got {speed}")
        self.backend = backend
        self.num_slots = num_slots
        self.name = name
        self.speed = float(speed)
        self.group = group if group is not None else RankGroup()
        self.index = len(self.group.ranks)
        self.group.ranks.append(self)
        self._cond = self.group.cond
        self._jobs: deque[RankJob] = deque()
        self._stopping = False
        self.num_stolen = 0  # segments this rank's slots took from other ranks
        self.num_backups = 0  # segments this rank's slots decoded beside another rank's slot
        self._threads = [
            threading.Thread(target=self._run_slot, args=(slot,), name=f"flashcodec-{name}-{slot}", daemon=True)
            for slot in range(num_slots)
        ]
        for t in self._threads:
            try:
                t.start()
            except RuntimeError as e:  # the OS refused a thread: the caller's clean-up stops those started
                raise OSError(f"cannot start decoder thread {t.name}: {e}") from None

    @property
    def slot_speed(self) -> float:
        return self.speed / self.num_slots

    def submit(self, job: RankJob) -> None:
        with self._cond:
            if self._stopping:
                raise RuntimeError("the decode engine is shut down")
            job.owner = self
            if not job.is_done:
                self._jobs.append(job)
                self._cond.notify_all()
                return
        job.on_finished(job, None)  # nothing to decode on this rank

    def shutdown(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        for t in self._threads:
            if t.ident is not None:  # a thread the OS refused to start (RuntimeError in __init__) has none
                t.join(timeout=5)

    def pending_cost(self) -> int:
        """Frames queued on this rank and not yet taken by a slot (call with the lock held)."""
        return sum(job.pending_cost for job in self._jobs)

    def _next(self, slot: int, current: RankJob | None) -> tuple[RankJob, GopSegment, bool] | None:
        """The slot's next segment and whether it backs up another slot's run (call with the lock held)."""
        if self.group.fifo:  # the slot's own request (its decoder is positioned there), then the oldest
            jobs = [*([current] if current in self._jobs else []), *self._jobs]
        else:  # the fewest slots at work first, a tie as fifo: a small video asked while a long one decodes is
            # decoded beside it, not after its last segment (bench/decode/bench_fairness.py)
            jobs = sorted(self._jobs, key=lambda j: (j.in_flight, j is not current))  # stable: the oldest first
        for job in jobs:
            segment = job.take(slot) if job.can_run_on(self.index) else None
            if segment is not None:
                return job, segment, False
        stolen = self._steal()
        if stolen is not None:
            return stolen[0], stolen[1], False
        return self._backup()

    def _backup(self) -> tuple[RankJob, GopSegment, bool] | None:
        """A segment another rank's slot is decoding that this dry slot would end much sooner, the latest first."""
        now, best, best_left = time.perf_counter(), None, 0.0
        for job, segment, run in self._others_runs():
            elapsed = now - run.began
            if should_back_up(segment.cost, self.slot_speed, run.rank.slot_speed, elapsed):
                left = holder_time_left(segment.cost, run.rank.slot_speed, elapsed)
                if best is None or left > best_left:
                    best, best_left = (job, segment, run), left
        if best is None:
            return None
        job, segment, run = best
        run.backed_up = True
        self.num_backups += 1
        return job, segment, True

    def _others_runs(self):
        """``(job, segment, run)`` of every segment another rank's slot is decoding alone that this rank may take."""
        for rank in self.group.ranks:
            for job in rank._jobs:
                if job.cancelled or not job.can_run_on(self.index):
                    continue
                for segment, run in job.running.items():
                    if not run.backed_up and run.rank is not self:
                        yield job, segment, run

    def _backup_wait(self) -> float | None:
        """Seconds until a run on another rank becomes worth backing up here (None: there is none to wait for)."""
        now, wait = time.perf_counter(), None
        for _, segment, run in self._others_runs():
            due = segment.cost / self.slot_speed / BACKUP_MARGIN - (now - run.began)  # when it is late enough
            wait = due if wait is None else min(wait, due)
        return None if wait is None else max(wait, 0.001)

    def _steal(self) -> tuple[RankJob, GopSegment] | None:
        """A segment from the rank that would finish last, if taking it brings the end forward."""
        victims = [(rank.pending_cost() / rank.speed, rank) for rank in self.group.ranks if rank is not self]
        for _, victim in sorted(victims, key=lambda v: -v[0]):
            backlog = victim.pending_cost()
            for job in victim._jobs:
                segment = job.peek_tail() if job.can_run_on(self.index) else None
                # a victim that failed this request decodes none of it: its segments go whatever the speeds
                if segment is not None and (not job.can_run_on(victim.index)
                                            or should_steal(segment.cost, self.slot_speed, backlog, victim.speed)):
                    self.num_stolen += 1
                    return job, job._pop_largest_tail()
        return None

    def _hand_over(self, job: RankJob, segment: GopSegment, error: Exception) -> bool:
        """This rank failed ``segment`` of ``job``: if another rank may decode the request, queue the segment again
        for it, and take none of the request here any more. False (the request fails) when no rank is left.
        Call with ``cond`` held."""
        job.excluded.add(self.index)  # (a fallback rank may take the request only once this one is out)
        if job.cancelled or not any(job.can_run_on(rank.index) for rank in self.group.ranks):
            job.excluded.discard(self.index)
            return False
        job.running.pop(segment, None)
        job.give_back(segment)
        log_once(f"{self.name} failed a video ({type(error).__name__}: {error}); the other ranks decode it")
        self._cond.notify_all()  # idle slots of the other ranks: there is work for them now
        return True

    def _record(self, job: RankJob, slot: int, kind: str, began: float, segment: GopSegment, backup: bool) -> None:
        if job.trace is not None:
            t0, events = job.trace
            events.append(SlotEvent(self.name, slot, kind, began - t0, time.perf_counter() - t0,
                                    segment.start_position, segment.cost, job.owner is not self, backup))

    def _pop_stale(self, decoders: dict[int, SegmentDecoder]) -> list[SegmentDecoder]:
        """Take out of ``decoders`` those of requests no rank holds any more (call with ``cond`` held; close them
        after releasing it: closing flushes a session)."""
        live = self.group.live_keys()
        return [decoders.pop(k) for k in [k for k in decoders if k not in live]]

    def _run_slot(self, slot: int) -> None:
        decoders: dict[int, SegmentDecoder] = {}  # this thread's open decoder per request
        current: RankJob | None = None
        while True:
            stale: list[SegmentDecoder] = []
            with self._cond:
                task = self._next(slot, current)
                while task is None and not self._stopping:
                    # Idle: first give back the decoders of requests that are over, so their hardware sessions
                    # return to the backend's pool (torchcodec's cache) before the next request asks for
                    # sessions; held here, the next request would create new ones (measured on the H100: its
                    # first request after another paid for 13 of 14 sessions).
                    stale = self._pop_stale(decoders)
                    if stale:
                        break
                    self._cond.wait(self._backup_wait())  # timed while a run elsewhere may need backing up
                    task = self._next(slot, current)
                if task is None and not stale:
                    break
                if task is not None:
                    job, segment, backup = task
                    job.in_flight += 1
                    if not backup:
                        job.running[segment] = _Run(self, time.perf_counter())
                        if len(self.group.ranks) > 1:  # idle slots of other ranks time their backup checks anew
                            self._cond.notify_all()
            for decoder in stale:
                decoder.close()
            if task is None:
                continue
            current = job
            failed: list[int] = []
            error = None

            def should_stop(job=job, segment=segment) -> bool:  # the request stopped, or the segment's other run ended
                return job.cancelled or segment in job.ended

            try:
                if job.error is None:
                    decoder = decoders.get(job.key_id)
                    if decoder is None:
                        opened = time.perf_counter()
                        decoder = decoders[job.key_id] = job.open_decoder(self.backend)
                        self._record(job, slot, "open", opened, segment, backup)
                    began = time.perf_counter()
                    failed = decoder.decode_segment(segment, job.emitter, should_stop)
                    self._record(job, slot, "decode", began, segment, backup)
            except BaseException as e:  # reported to the request, never kills the slot
                log.debug("segment %s of request %s failed on %s", segment, job.key_id, self.name, exc_info=True)
                error = e
            with self._cond:
                if error is not None and (backup or segment in job.ended):
                    error = None  # one run of a backed-up segment failed: the other one stands for it
                    completes = False
                elif isinstance(error, Exception) and self._hand_over(job, segment, error):
                    error = None  # another rank decodes it
                    completes = False
                else:
                    completes = error is None and segment not in job.ended
                if completes:  # the first run to end completes the segment; the other stops at its next packet
                    job.ended.add(segment)
                    job.running.pop(segment, None)
            if completes:
                try:
                    job.on_segment_done(segment, [d for d in failed if d not in job.claimed])
                except BaseException as e:
                    error = e
            with self._cond:
                job.in_flight -= 1
                if error is not None and job.error is None:
                    job.error = error
                    job.cancelled = True  # stop handing out its segments
                owner_jobs = job.owner._jobs
                finished = job.is_done and job in owner_jobs
                if finished:
                    owner_jobs.remove(job)
                    self._cond.notify_all()  # idle slots holding this request's decoders give them back
                stale = self._pop_stale(decoders)
            if finished:
                job.on_finished(job, job.error)
            for decoder in stale:
                decoder.close()
        for decoder in decoders.values():
            decoder.close()

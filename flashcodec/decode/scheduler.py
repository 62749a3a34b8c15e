"""Stall-free scheduling of GOP segments over one rank's decoder slots (paper Algorithm 2).

A rank has a fixed number of decoder threads (its slots), shared by every request in flight, so
many concurrent videos never oversubscribe the cores. Each request arrives as *lanes*: one
ordered run of GOP segments per slot, balanced by decode cost. A thread that finishes a segment
takes the next segment of its own lane first (its decoder is already positioned there, so no
seek is needed); when its lane is empty it takes an unclaimed lane, then steals from the tail of
the lane with the most work left, and only then moves to the next request. No slot idles while a
segment of any request remains.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Callable

from flashcodec.decode.backends import Backend, SegmentDecoder
from flashcodec.plan.segments import GopSegment, RankPlan

log = logging.getLogger(__name__)


class RankJob:
    """One request's work on one rank. Bookkeeping only; the scheduler's lock guards it."""

    def __init__(self, key_id: int, plan: RankPlan, open_decoder: Callable[[], SegmentDecoder],
                 emit: Callable[[int, object], None], on_segment_done: Callable[[GopSegment, list[int]], None],
                 on_finished: Callable[["RankJob", BaseException | None], None]):
        self.key_id = key_id
        self.plan = plan
        self.open_decoder = open_decoder
        self.emit = emit
        self.on_segment_done = on_segment_done
        self.on_finished = on_finished
        self.lanes = [deque(lane) for lane in plan.lanes]
        self.lane_owner: list[int | None] = [None] * len(self.lanes)
        self.in_flight = 0
        self.error: BaseException | None = None
        self.cancelled = False

    @property
    def has_pending(self) -> bool:
        return not self.cancelled and any(self.lanes)

    @property
    def is_done(self) -> bool:
        return self.in_flight == 0 and not self.has_pending

    def take(self, slot: int) -> GopSegment | None:
        """Next segment for ``slot``: own lane, else an unclaimed lane, else steal the largest tail."""
        if self.cancelled:
            return None
        for i, owner in enumerate(self.lane_owner):
            if owner == slot and self.lanes[i]:
                return self.lanes[i].popleft()
        for i, owner in enumerate(self.lane_owner):
            if owner is None and self.lanes[i]:
                self.lane_owner[i] = slot
                return self.lanes[i].popleft()
        victim = max(range(len(self.lanes)), key=lambda i: sum(s.cost for s in self.lanes[i]), default=None)
        if victim is not None and self.lanes[victim]:
            return self.lanes[victim].pop()
        return None


class RankScheduler:
    """The decoder threads of one rank and the FIFO of requests with work on it."""

    def __init__(self, backend: Backend, num_slots: int, name: str = "cpu"):
        if num_slots < 1:
            raise ValueError("a rank needs at least one decoder slot")
        self.backend = backend
        self.num_slots = num_slots
        self.name = name
        self._cond = threading.Condition()
        self._jobs: deque[RankJob] = deque()
        self._stopping = False
        self._threads = [
            threading.Thread(target=self._run_slot, args=(slot,), name=f"flashcodec-{name}-{slot}", daemon=True)
            for slot in range(num_slots)
        ]
        for t in self._threads:
            t.start()

    def submit(self, job: RankJob) -> None:
        with self._cond:
            if self._stopping:
                raise RuntimeError("the decode engine is shut down")
            if job.is_done:  # nothing to decode on this rank
                job.on_finished(job, None)
                return
            self._jobs.append(job)
            self._cond.notify_all()

    def shutdown(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        for t in self._threads:
            t.join(timeout=5)

    def _next(self, slot: int, current: RankJob | None) -> tuple[RankJob, GopSegment] | None:
        if current is not None and current in self._jobs:
            segment = current.take(slot)
            if segment is not None:
                return current, segment
        for job in self._jobs:  # oldest request first
            segment = job.take(slot)
            if segment is not None:
                return job, segment
        return None

    def _run_slot(self, slot: int) -> None:
        decoders: dict[int, SegmentDecoder] = {}  # this thread's open decoder per request
        current: RankJob | None = None
        while True:
            with self._cond:
                task = self._next(slot, current)
                while task is None and not self._stopping:
                    self._cond.wait()
                    task = self._next(slot, current)
                if task is None:
                    break
                job, segment = task
                job.in_flight += 1
            current = job
            failed: list[int] = []
            error = None
            try:
                if job.error is None:
                    decoder = decoders.get(job.key_id)
                    if decoder is None:
                        decoder = decoders[job.key_id] = job.open_decoder()
                    failed = decoder.decode_segment(segment, job.emit)
            except BaseException as e:  # reported to the request, never kills the slot
                log.debug("segment %s of request %s failed", segment, job.key_id, exc_info=True)
                error = e
            if error is None:
                try:
                    job.on_segment_done(segment, failed)
                except BaseException as e:
                    error = e
            with self._cond:
                job.in_flight -= 1
                if error is not None and job.error is None:
                    job.error = error
                    job.cancelled = True  # stop handing out its segments
                finished = job.is_done and job in self._jobs
                if finished:
                    self._jobs.remove(job)
            if finished:
                job.on_finished(job, job.error)
            self._close_finished(decoders)
        for decoder in decoders.values():
            decoder.close()

    def _close_finished(self, decoders: dict[int, SegmentDecoder]) -> None:
        with self._cond:
            live = {job.key_id for job in self._jobs}
        for key_id in [k for k in decoders if k not in live]:
            decoders.pop(key_id).close()

"""Stall-free scheduling over ranks of different speeds (fake GPU and CPU ranks, no media)."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from flashcodec.decode.backends import Backend, SegmentDecoder, never
from flashcodec.decode.scheduler import RankGroup, RankJob, RankScheduler, should_back_up, should_steal
from flashcodec.plan.segments import GopTable, partition_contiguous, plan_distribution

SLOTS = 2


class SleepDecoder(SegmentDecoder):
    """Decodes a segment in ``cost * seconds_per_frame`` and emits its targets (tagged with the rank)."""

    def __init__(self, backend: "SleepBackend"):
        self.backend = backend

    def decode_segment(self, segment, emit, should_stop=never):
        self.backend.started.append(segment)
        deadline = time.monotonic() + segment.cost * self.backend.seconds_per_frame
        while (left := deadline - time.monotonic()) > 0:  # a "packet" every 5 ms: stop there when asked
            if should_stop():
                self.backend.stopped.append(segment)
                return list(segment.target_indices)
            time.sleep(min(0.005, left))
        for display in segment.target_indices:
            emit(display, self.backend.device)
        return []


class SleepBackend(Backend):
    name = "fake"

    def __init__(self, device: str, seconds_per_frame: float):
        self.device = device
        self.seconds_per_frame = seconds_per_frame
        self.started, self.stopped = [], []  # segments begun, and those cut short by should_stop

    def open(self, source, info, height, width, resize="exact"):
        return SleepDecoder(self)


class Collector:
    def __init__(self, num_jobs: int):
        self.lock = threading.Lock()
        self.decoded: list[tuple[int, str]] = []
        self.left = num_jobs
        self.done = threading.Event()
        self.errors: list[BaseException] = []

    def emit(self, display, device):
        with self.lock:
            self.decoded.append((display, device))

    def finished(self, job, error):
        with self.lock:
            if error is not None:
                self.errors.append(error)
            self.left -= 1
            if self.left == 0:
                self.done.set()


def make_ranks(*specs):
    """``specs``: (device, seconds_per_frame) per rank; declared speed = slots / seconds_per_frame."""
    group = RankGroup()
    for device, spf in specs:
        RankScheduler(SleepBackend(device, spf), SLOTS, device, speed=SLOTS / spf, group=group)
    return group


def submit(group, plans, allowed=None, key_id=1):
    collector = Collector(len(plans))
    for plan, rank in zip(plans, group.ranks):
        rank.submit(RankJob(key_id, plan, open_decoder=lambda backend: backend.open(None, None, 0, 0),
                            emit=collector.emit, on_segment_done=lambda s, f: None,
                            on_finished=collector.finished, allowed_ranks=allowed))
    return collector


def wait(collector):
    assert collector.done.wait(10), "a rank stalled"
    assert not collector.errors
    return collector


def run(group, plans, allowed=None, key_id=1):
    return wait(submit(group, plans, allowed, key_id))


def timed_run(group, plans):
    """``run`` one request, then shut the ranks down; returns the collector and the request's seconds."""
    started = time.perf_counter()
    try:
        collector = run(group, plans)
        return collector, time.perf_counter() - started
    finally:
        time.sleep(0.02)  # runs stopped early (backed-up segments) return
        group.shutdown()


TABLE = GopTable(list(range(400)), list(range(0, 400, 10)))  # 40 GOPs of 10 frames
TARGETS = list(range(0, 400, 5))  # 2 targets per GOP: 40 segments of cost 6


def test_a_streamed_rank_decodes_the_video_front_to_back():
    """All slots start on the first segments at once (the prefix a stream hands out grows at the rank's pace);
    with lanes they start on each lane's head, and the prefix is the first lane's progress."""
    heads = {}
    for in_order in (True, False):
        group = RankGroup()
        rank = RankScheduler(SleepBackend("cpu", 0.002), 4, "cpu", speed=2000, group=group)
        (plan,) = plan_distribution(TARGETS, TABLE, num_ranks=1, decoders_per_rank=4)
        collector = Collector(1)
        rank.submit(RankJob(1, plan, open_decoder=lambda backend: backend.open(None, None, 0, 0), emit=collector.emit,
                            on_segment_done=lambda s, f: None, on_finished=collector.finished, in_order=in_order))
        try:
            wait(collector)
        finally:
            group.shutdown()
        assert sorted(d for d, _ in collector.decoded) == TARGETS
        heads[in_order] = sorted(s.start_position for s in rank.backend.started[:4])
    assert heads == {True: [0, 10, 20, 30], False: [0, 100, 200, 300]}


def test_should_steal_only_when_the_thief_finishes_before_the_victim():
    assert should_steal(6, thief_slot_speed=1000, victim_backlog_cost=120, victim_speed=100)
    assert not should_steal(6, thief_slot_speed=50, victim_backlog_cost=120, victim_speed=2000)
    assert not should_steal(6, thief_slot_speed=0, victim_backlog_cost=120, victim_speed=2000)


def test_a_fast_rank_that_runs_dry_takes_the_slow_ranks_work():
    group = make_ranks(("cuda:0", 0.001), ("cpu", 0.02))  # 20x apart
    # The planner was told they are equally fast: the slow rank alone would need 10 segments x 0.12 s.
    plans = plan_distribution(TARGETS, TABLE, num_ranks=2, decoders_per_rank=SLOTS)
    collector, elapsed = timed_run(group, plans)
    assert sorted(d for d, _ in collector.decoded) == TARGETS  # every target exactly once
    by_gpu = sum(1 for _, device in collector.decoded if device == "cuda:0")
    assert group.ranks[0].num_stolen > 0 and by_gpu >= 60
    assert elapsed < 0.8, f"the slow rank held the request for {elapsed:.2f} s"


def test_a_slow_rank_never_takes_work_a_fast_rank_finishes_sooner():
    group = make_ranks(("cuda:0", 0.001), ("cpu", 0.05))
    # Correct speeds: the CPU rank gets almost nothing and runs dry at once.
    plans = plan_distribution(TARGETS, TABLE, num_ranks=2, decoders_per_rank=SLOTS, rank_speeds=[2000, 40])
    try:
        collector = run(group, plans)
    finally:
        group.shutdown()
    assert sorted(d for d, _ in collector.decoded) == TARGETS
    assert group.ranks[1].num_stolen == 0  # 6 frames at 20 fps > the GPU's whole backlog


def test_slow_decoders_beside_fast_ones_get_no_segment_they_would_end_last():
    """NVDEC beside CPU threads on a short clip: one CPU thread takes longer for one segment than the GPU for
    the whole video, so the split by speed (which gave the CPU a few segments) would hold the request."""
    group = RankGroup()
    gpu_spf, cpu_spf, slots = 0.02 / 6, 0.4 / 6, 8  # a segment of 6 frames: 20 ms on a GPU slot, 0.4 s on a CPU one
    for device, spf in (("cuda:0", gpu_spf), ("cpu", cpu_spf)):
        RankScheduler(SleepBackend(device, spf), slots, device, speed=slots / spf, group=group)
    speeds = [r.speed for r in group.ranks]
    costs = [6] * 40
    by_speed = partition_contiguous(costs, 2, speeds)
    assert len(by_speed[1]) >= 1  # the speed-weighted split gave the CPU segments (2): 0.4 s each
    plans = plan_distribution(TARGETS, TABLE, num_ranks=2, decoders_per_rank=slots, rank_speeds=speeds)
    assert plans[1].cost == 0
    collector, elapsed = timed_run(group, plans)
    assert sorted(d for d, _ in collector.decoded) == TARGETS
    assert group.ranks[1].backend.started == []  # no CPU thread took a segment, nor stole one
    assert elapsed < 0.35, f"{elapsed:.2f} s: 5 rounds of 20 ms on the GPU rank; a CPU segment alone is 0.4 s"


def test_should_back_up_when_the_holder_would_end_much_later():
    # holder expected 0.3 s in all (6 frames at 20 fps); the thief needs 6 ms
    assert should_back_up(6, thief_slot_speed=1000, holder_slot_speed=20, elapsed_s=0.0)
    # a holder about as fast: never, while it keeps to its estimate
    assert not should_back_up(6, thief_slot_speed=1000, holder_slot_speed=800, elapsed_s=0.001)
    # ... but once it is late (its speed misjudged), it is taken to need as long again as it has had
    assert not should_back_up(6, thief_slot_speed=1000, holder_slot_speed=1000, elapsed_s=0.011)
    assert should_back_up(6, thief_slot_speed=1000, holder_slot_speed=1000, elapsed_s=0.013)
    assert not should_back_up(6, thief_slot_speed=0, holder_slot_speed=20, elapsed_s=1.0)


def test_a_dry_fast_rank_backs_up_what_a_misjudged_slow_rank_holds():
    """The planner was told the CPU rank is as fast as the GPU rank; it is 50x slower. Once the GPU rank has
    done its share and stolen the CPU's queue, the CPU's slots still hold a segment each (0.3 s): the GPU's
    slots decode those too, the frames are written once, and the CPU's runs stop."""
    group = make_ranks(("cuda:0", 0.001), ("cpu", 0.001))
    group.ranks[1].backend.seconds_per_frame = 0.05  # really 50x slower than declared
    plans = plan_distribution(TARGETS, TABLE, num_ranks=2, decoders_per_rank=SLOTS)
    collector, elapsed = timed_run(group, plans)
    assert sorted(d for d, _ in collector.decoded) == TARGETS  # every target written exactly once
    assert group.ranks[0].num_backups >= 1 and group.ranks[1].num_backups == 0
    assert group.ranks[1].backend.stopped  # the CPU's run of a backed-up segment stopped early
    assert elapsed < 0.25, f"{elapsed:.2f} s: a CPU segment alone is 0.3 s"


class FailingBackend(SleepBackend):
    def open(self, source, info, height, width, resize="exact"):
        raise RuntimeError("this rank cannot open the video")


def test_a_failed_backup_leaves_the_request_to_the_run_it_backed_up():
    group = RankGroup()
    cpu = RankScheduler(SleepBackend("cpu", 0.02), SLOTS, "cpu", speed=SLOTS / 0.02, group=group)
    (plan,) = plan_distribution(TARGETS[:4], TABLE, decoders_per_rank=SLOTS)  # 2 segments of 0.12 s, one per slot
    collector = Collector(1)
    cpu.submit(RankJob(1, plan, open_decoder=lambda backend: backend.open(None, None, 0, 0), emit=collector.emit,
                       on_segment_done=lambda s, f: None, on_finished=collector.finished))
    try:
        deadline = time.monotonic() + 5
        while len(cpu.backend.started) < 2 and time.monotonic() < deadline:
            time.sleep(0.001)
        # a fast rank arrives with nothing queued: it backs up both running segments, and cannot open the video
        gpu = RankScheduler(FailingBackend("cuda:0", 0.0001), SLOTS, "cuda:0", speed=SLOTS / 0.0001, group=group)
        wait(collector)  # no error reaches the request
    finally:
        group.shutdown()
    assert sorted(d for d, _ in collector.decoded) == TARGETS[:4]
    assert gpu.num_backups >= 1 and all(device == "cpu" for _, device in collector.decoded)


class BreakingDecoder(SleepDecoder):
    """Emits a segment's first target, then raises: a decoder that fails part-way through."""

    def decode_segment(self, segment, emit, should_stop=never):
        emit(segment.target_indices[0], self.backend.device)
        raise RuntimeError("the hardware decoder went away")


class BreakingBackend(SleepBackend):
    def open(self, source, info, height, width, resize="exact"):
        return BreakingDecoder(self)


def failing_ranks(gpu_backend, cpu_spf=0.0002):
    """A fast fake GPU rank on ``gpu_backend`` (it gets most of the plan), then a slower working CPU rank."""
    group = RankGroup()
    RankScheduler(gpu_backend, SLOTS, gpu_backend.device, speed=SLOTS / 0.00005, group=group)
    RankScheduler(SleepBackend("cpu", cpu_spf), SLOTS, "cpu", speed=SLOTS / cpu_spf, group=group)
    return group


def submit_with(group, plans, **job_options):
    collector = Collector(len(plans))
    for plan, rank in zip(plans, group.ranks):
        rank.submit(RankJob(1, plan, open_decoder=lambda backend: backend.open(None, None, 0, 0), emit=collector.emit,
                            on_segment_done=lambda s, f: None, on_finished=collector.finished, **job_options))
    assert collector.done.wait(10), "a rank stalled"
    return collector


@pytest.mark.parametrize("gpu_backend", [FailingBackend("cuda:0", 0.00005), BreakingBackend("cuda:0", 0.00005)],
                         ids=["cannot-open", "fails-mid-segment"])
def test_a_rank_that_fails_a_request_hands_it_to_the_other_ranks(gpu_backend, caplog, monkeypatch):
    """The GPU rank holds most of the plan and fails every segment it starts (at the open, or after emitting a
    frame): its segments, queued and failed, go to the CPU rank, each frame is emitted once, the request
    succeeds, and one warning says why."""
    from flashcodec import devices

    monkeypatch.setattr(devices, "_logged", set())  # (log_once: another test may have logged the same line)
    group = failing_ranks(gpu_backend)
    plans = plan_distribution(TARGETS, TABLE, num_ranks=2, decoders_per_rank=SLOTS,
                              rank_speeds=[r.speed for r in group.ranks])
    assert plans[0].cost > plans[1].cost > 0
    try:
        with caplog.at_level(logging.WARNING, logger="flashcodec.devices"):
            collector = submit_with(group, plans)
    finally:
        group.shutdown()
    assert not collector.errors
    displays = [d for d, _ in collector.decoded]
    assert sorted(displays) == TARGETS  # every target exactly once
    gpu_frames = {d for d, device in collector.decoded if device == "cuda:0"}
    assert len(gpu_frames) <= SLOTS and all(d in TARGETS for d in gpu_frames)  # at most its first segments' heads
    assert [r.getMessage() for r in caplog.records] == [
        "flashcodec: cuda:0 failed a video (RuntimeError: "
        + ("this rank cannot open the video" if isinstance(gpu_backend, FailingBackend)
           else "the hardware decoder went away") + "); the other ranks decode it"]


def test_a_request_fails_when_every_rank_that_may_take_it_failed_it():
    group = RankGroup()
    for device in ("cuda:0", "cpu"):
        RankScheduler(FailingBackend(device, 0.0001), SLOTS, device, speed=SLOTS / 0.0001, group=group)
    plans = plan_distribution(TARGETS, TABLE, num_ranks=2, decoders_per_rank=SLOTS)
    try:
        collector = submit_with(group, plans)
    finally:
        group.shutdown()
    assert collector.errors and all(str(e) == "this rank cannot open the video" for e in collector.errors)


@pytest.mark.parametrize("fallback", [True, False])
def test_the_cpu_rank_takes_a_gpu_only_video_once_every_gpu_failed_it(fallback):
    """allowed_ranks {GPU}: the CPU rank decodes none of it while the GPU may; fallback_ranks {CPU}: it takes the
    request once the GPU has failed it; without, the request fails."""
    group = failing_ranks(FailingBackend("cuda:0", 0.00005))
    plans = plan_distribution(TARGETS, TABLE, num_ranks=2, decoders_per_rank=SLOTS, rank_speeds=[1, 0])
    try:
        collector = submit_with(group, plans, allowed_ranks=frozenset({0}),
                                fallback_ranks=frozenset({1}) if fallback else frozenset())
    finally:
        group.shutdown()
    if fallback:
        assert not collector.errors and sorted(d for d, _ in collector.decoded) == TARGETS
        assert {device for _, device in collector.decoded} == {"cpu"}
    else:
        assert collector.errors and not collector.decoded


def test_a_rank_not_allowed_for_a_video_never_decodes_it():
    group = make_ranks(("cuda:0", 0.001), ("cpu", 0.002))
    # NVDEC cannot take this video: the plan gives the GPU rank nothing and it may not steal.
    plans = plan_distribution(TARGETS, TABLE, num_ranks=2, decoders_per_rank=SLOTS, rank_speeds=[0, 1])
    try:
        collector = run(group, plans, allowed=frozenset({1}))
    finally:
        group.shutdown()
    assert sorted(d for d, _ in collector.decoded) == TARGETS
    assert {device for _, device in collector.decoded} == {"cpu"}
    assert group.ranks[0].num_stolen == 0


def test_many_requests_over_mixed_ranks_all_complete_once():
    group = make_ranks(("cuda:0", 0.0005), ("cuda:1", 0.0005), ("cpu", 0.003))
    collectors = []
    try:
        for key in range(1, 6):
            targets = TARGETS[key:]
            plans = plan_distribution(targets, TABLE, num_ranks=3, decoders_per_rank=SLOTS,
                                      rank_speeds=[r.speed for r in group.ranks])
            collectors.append((targets, submit(group, plans, key_id=key)))  # all in flight at once
        for targets, collector in collectors:
            assert sorted(d for d, _ in wait(collector).decoded) == targets
    finally:
        group.shutdown()


def test_a_rank_needs_a_positive_speed():
    with pytest.raises(ValueError, match="speed"):
        RankScheduler(SleepBackend("cpu", 0.001), 1, speed=0)


def test_a_thread_the_os_refuses_is_a_clean_error(monkeypatch):
    """Thread creation failing part-way: an OSError naming the thread, the started ones stopped, no join of the rest."""
    import threading

    from flashcodec import DecodeEngine

    real_start, started = threading.Thread.start, []

    def start(self):
        if self.name.startswith("flashcodec-") and len(started) == 2:
            raise RuntimeError("can't start new thread")
        if self.name.startswith("flashcodec-"):
            started.append(self)
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    with pytest.raises(OSError, match=r"cannot start decoder thread flashcodec-cpu-2: can't start new thread"):
        DecodeEngine(cpu_threads=4)
    for t in started:
        t.join(timeout=5)
        assert not t.is_alive()


def test_idle_slots_give_back_a_finished_requests_decoders():
    """Every slot that opened a decoder for a request closes it once the request is over, without waiting for
    more work: a backend's hardware sessions (torchcodec's NVDEC cache) are then free for the next request,
    which otherwise creates new ones (the H100 run: 13 of 14 sessions made anew on a second request)."""
    lock = threading.Lock()
    state = {"open": 0, "opened": 0}

    class CountingDecoder(SleepDecoder):
        def close(self):
            with lock:
                state["open"] -= 1

    class CountingBackend(SleepBackend):
        def open(self, source, info, height, width, resize="exact"):
            with lock:
                state["open"] += 1
                state["opened"] += 1
            return CountingDecoder(self)

    group = RankGroup()
    rank = RankScheduler(CountingBackend("cuda:0", 0.0005), 4, "cuda:0", speed=4 / 0.0005, group=group)
    try:
        for key_id in (1, 2):
            wait(submit(group, plan_distribution(TARGETS, TABLE, num_ranks=1), key_id=key_id))
            deadline = time.monotonic() + 5
            while state["open"] and time.monotonic() < deadline:
                time.sleep(0.01)
            assert state["open"] == 0, f"request {key_id}: {state['open']} decoders still held by idle slots"
        assert state["opened"] >= 2  # more than one slot took part
    finally:
        rank.shutdown()


# --- batched emits ----------------------------------------------------------------------------------------------


def _short_behind_long(request_order: str) -> tuple[float, float]:
    """Seconds from its submission to its end of a 2-segment request asked while a 40-segment one decodes on 4 slots,
    and of the long one."""
    group = RankGroup(request_order)
    rank = RankScheduler(SleepBackend("cpu", 0.005), 4, "cpu", speed=800, group=group)
    (long_plan,) = plan_distribution(TARGETS, TABLE, num_ranks=1, decoders_per_rank=4)
    (short_plan,) = plan_distribution(TARGETS[:4], TABLE, num_ranks=1, decoders_per_rank=4)
    ends = {}

    def job(key, plan, collector):
        return RankJob(key, plan, open_decoder=lambda backend: backend.open(None, None, 0, 0), emit=collector.emit,
                       on_segment_done=lambda s, f: None, on_finished=collector.finished)

    try:
        long_done, short_done = Collector(1), Collector(1)
        started = time.perf_counter()
        rank.submit(job(1, long_plan, long_done))
        time.sleep(0.03)  # the long request holds every slot
        asked = time.perf_counter()
        rank.submit(job(2, short_plan, short_done))
        wait(short_done)
        ends["short"] = time.perf_counter() - asked
        wait(long_done)
        ends["long"] = time.perf_counter() - started
    finally:
        group.shutdown()
    assert sorted(d for d, _ in short_done.decoded) == TARGETS[:4] and len(long_done.decoded) == len(TARGETS)
    return ends["short"], ends["long"]


def test_a_short_request_is_decoded_beside_a_long_one_not_after_it():
    """fair (default): the short request gets slots as segments of the long one end; fifo: after its last segment."""
    fair_short, fair_long = _short_behind_long("fair")
    fifo_short, fifo_long = _short_behind_long("fifo")
    assert fair_short < 0.4 * fifo_short, (fair_short, fifo_short)  # 2 segments of 30 ms vs the long one's ~300 ms
    assert fair_short < 0.5 * fair_long and fifo_short > 0.5 * fifo_long
    with pytest.raises(ValueError, match="request_order must be one of fair, fifo"):
        RankGroup("lifo")

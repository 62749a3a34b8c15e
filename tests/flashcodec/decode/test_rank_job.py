"""One request's bookkeeping on one rank (flashcodec.decode.rank_job): which segment a slot takes, which ranks may
take the request, and each frame emitted once (no threads, no media)."""

from __future__ import annotations

from flashcodec.decode.rank_job import RankJob
from flashcodec.plan.segments import GopTable, RankPlan, plan_distribution

TABLE = GopTable(list(range(400)), list(range(0, 400, 10)))  # 40 GOPs of 10 frames
TARGETS = list(range(0, 400, 5))  # 2 targets per GOP: 40 segments of cost 6


def _in_order_job(plan):
    return RankJob(1, plan, open_decoder=None, emit=None, on_segment_done=None, on_finished=None, in_order=True)


def test_an_in_order_job_hands_every_slot_the_earliest_segment_and_gives_its_tail_to_thieves():
    (plan,) = plan_distribution(TARGETS, TABLE, num_ranks=1, decoders_per_rank=4)
    assert len(plan.lanes) == 4 and [lane[0].start_position for lane in plan.lanes] == [0, 100, 200, 300]
    job = _in_order_job(plan)
    starts = [job.take(slot).start_position for slot in (0, 1, 2, 3, 0, 2)]
    assert starts == [0, 10, 20, 30, 40, 50]  # one queue in display order, whichever slot asks
    assert job.peek_tail().start_position == 390 and job._pop_largest_tail().start_position == 390  # a thief: the end
    job.give_back(plan.segments[0])  # a failed rank's run of it: queued behind the rest
    taken = [job.take(1).start_position for _ in range(34)]
    assert taken == list(range(60, 390, 10)) + [0] and job.take(1) is None and not job.has_pending


def test_a_fallback_rank_waits_while_an_allowed_rank_works():
    job = RankJob(1, RankPlan(0, (), 0, ()), open_decoder=None, emit=None, on_segment_done=None, on_finished=None,
                  allowed_ranks=frozenset({0, 1}), fallback_ranks=frozenset({2}))
    assert job.can_run_on(0) and job.can_run_on(1) and not job.can_run_on(2)
    job.excluded.add(0)
    assert not job.can_run_on(0) and job.can_run_on(1) and not job.can_run_on(2)
    job.excluded.add(1)
    assert job.can_run_on(2) and not job.can_run_on(3)


def test_a_backups_batch_emits_only_the_frames_not_emitted_yet():
    singles, batches = [], []
    job = RankJob(1, RankPlan(0, (), 0, ()), open_decoder=None,
                  emit=lambda d, f: singles.append((d, f)), on_segment_done=None, on_finished=None,
                  emit_many=lambda ds, fs: batches.append((list(ds), fs)))
    job.emitter.many([4, 5], ["f4", "f5"])
    job.emitter(6, "f6")
    job.emitter.many([5, 6, 7], ["f5", "f6", "f7"])  # the other run of the segment: only frame 7 is new
    job.emitter.many([4, 5], ["f4", "f5"])
    assert batches == [([4, 5], ["f4", "f5"])] and singles == [(6, "f6"), (7, "f7")]

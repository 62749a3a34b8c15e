"""Speed-weighted distribution over ranks of different speeds and slot counts (GPU + CPU ranks)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashcodec.plan.segments import (GopTable, partition_by_finish_time, partition_contiguous, plan_distribution,
                                      rank_finish_time)

from test_segments import tables


def output(plans):
    """The frames a request outputs: every rank's frames in rank order, padding included."""
    frames = []
    for p in plans:
        frames += list(p.frame_indices) + [p.frame_indices[-1]] * p.num_pad_frames if p.frame_indices else []
    return frames


@settings(max_examples=300, deadline=None)
@given(costs=st.lists(st.integers(1, 50), max_size=60),
       weights=st.lists(st.sampled_from([0.0, 0.5, 1.0, 3.0, 10.0]), min_size=1, max_size=6))
def test_weighted_partition_is_contiguous_and_follows_weights(costs, weights):
    if not sum(weights) > 0:
        weights = weights[:-1] + [1.0]
    ranges = partition_contiguous(costs, len(weights), weights)
    assert [i for r in ranges for i in r] == list(range(len(costs)))
    total = sum(costs)
    for r, w in zip(ranges, weights):
        if w == 0:
            assert len(r) == 0  # a rank that cannot decode the video gets nothing
        elif costs:
            assert sum(costs[i] for i in r) <= total * w / sum(weights) + max(costs)


def test_partition_rejects_bad_weights():
    with pytest.raises(ValueError, match="weights"):
        partition_contiguous([1, 2], 2, [0, 0])
    with pytest.raises(ValueError, match="weights"):
        partition_contiguous([1, 2], 2, [1.0])


def test_a_rank_three_times_faster_gets_three_quarters_of_the_work():
    table = GopTable(list(range(400)), list(range(0, 400, 10)))  # 40 GOPs of 10 frames
    targets = list(range(0, 400, 5))  # 2 targets per GOP: every GOP costs 6
    # One decoder each: a rank's finish time is its work over its speed, so the split follows the speeds.
    gpu, cpu = plan_distribution(targets, table, num_ranks=2, decoders_per_rank=1, rank_speeds=[3.0, 1.0])
    assert gpu.cost == 3 * cpu.cost == 180
    assert output([gpu, cpu]) == output(plan_distribution(targets, table))


def test_with_few_segments_per_decoder_the_split_follows_finish_times_not_speeds():
    table = GopTable(list(range(400)), list(range(0, 400, 10)))
    targets = list(range(0, 400, 5))  # 40 segments of cost 6
    gpu, cpu = plan_distribution(targets, table, num_ranks=2, decoders_per_rank=[14, 4], rank_speeds=[3.0, 1.0])
    assert len(gpu.lanes) == 14 and len(cpu.lanes) == 4
    # By speed alone: 30 segments (3 rounds of 14 decoders at 3/14: 84) and 10 (3 rounds of 4 at 1/4: 72).
    # Two whole GPU rounds (28 segments, 56) and 12 on the CPU (72) end sooner.
    assert (gpu.cost, cpu.cost) == (168, 72)
    finish = [rank_finish_time([s.cost for s in p.segments], v, n) for p, v, n in ((gpu, 3.0, 14), (cpu, 1.0, 4))]
    assert max(finish) == pytest.approx(72)
    assert rank_finish_time([6] * 30, 3.0, 14) == pytest.approx(84)
    assert output([gpu, cpu]) == output(plan_distribution(targets, table))


def h100_clip(seconds: int):
    """A 1080p clip's GOP table as benchmarked on the H100 (2-s GOPs at 30 fps), with Qwen's dense 2 fps."""
    n = seconds * 30
    return GopTable(list(range(n)), list(range(0, n, 60))), list(range(0, n, 15))


def test_cpu_threads_beside_nvdec_get_only_what_they_finish_before_it():
    """The H100's measured speeds (docs/gpu.md, 2026-11-26): NVDEC 14 sessions 2540 frames/s, one session alone
    on an engine ~363 (7 engines); 16 CPU threads 1199 frames/s together. A GOP is ~0.7 s on one thread."""
    speeds, slots, one = [2540.0, 1199.0], [14, 16], [2540.0 / 7, 1199.0 / 16]
    table, targets = h100_clip(60)  # 30 GOPs: NVDEC alone ends in ~0.63 s, before a thread ends one GOP
    gpu, cpu = plan_distribution(targets, table, num_ranks=2, decoders_per_rank=slots, rank_speeds=speeds,
                                 slot_speeds=one)
    assert cpu.cost == 0 and len(gpu.segments) == 30
    # The speed-weighted split gave the CPU ~10 GOPs, one per thread: ~0.75 s, later than NVDEC alone.
    assert rank_finish_time([46], 1199.0, 16) > rank_finish_time([46] * 30, 2540.0, 14, 2540.0 / 7)

    table, targets = h100_clip(150)  # 75 GOPs: now a GOP per thread ends before NVDEC ends the rest
    gpu, cpu = plan_distribution(targets, table, num_ranks=2, decoders_per_rank=slots, rank_speeds=speeds,
                                 slot_speeds=one)
    assert len(cpu.segments) == 16 and len(gpu.segments) == 59
    alone = rank_finish_time([s.cost for s in gpu.segments + cpu.segments], 2540.0, 14, 2540.0 / 7)
    both = max(rank_finish_time([s.cost for s in gpu.segments], 2540.0, 14, 2540.0 / 7),
               rank_finish_time([s.cost for s in cpu.segments], 1199.0, 16))
    assert both < 0.82 * alone


@settings(max_examples=300, deadline=None)
@given(costs=st.lists(st.integers(1, 60), min_size=1, max_size=80),
       ranks=st.lists(st.tuples(st.sampled_from([0.5, 1.0, 3.0, 14.0]), st.integers(1, 16), st.sampled_from([1, 2, 4])),
                      min_size=1, max_size=4))
def test_the_finish_time_split_never_ends_later_than_the_speed_weighted_one(costs, ranks):
    speeds = [v for v, _, _ in ranks]
    slots = [n for _, n, _ in ranks]
    one = [v / n * k for v, n, k in ranks]  # decoders that run up to 4x faster alone than all at once
    parts = partition_by_finish_time(costs, speeds, slots, one)
    assert [i for r in parts for i in r] == list(range(len(costs)))  # contiguous, in rank order, all of it

    def end(split):
        return max(rank_finish_time([costs[i] for i in r], v, n, s) for r, v, n, s in zip(split, speeds, slots, one))

    assert end(parts) <= end(partition_contiguous(costs, len(ranks), speeds)) * (1 + 1e-9)


@settings(max_examples=300, deadline=None)
@given(table=tables, data=st.data(),
       speeds=st.lists(st.sampled_from([0.0, 1.0, 2.5, 14.0]), min_size=1, max_size=4),
       slots=st.integers(1, 5))
def test_mixed_ranks_output_equals_single_rank_and_zero_speed_ranks_are_empty(table, data, speeds, slots):
    if not any(speeds):
        speeds = speeds[:-1] + [1.0]
    n = table.num_frames
    count = data.draw(st.integers(1, min(n, 64)))
    targets = sorted(data.draw(st.lists(st.integers(0, n - 1), min_size=count, max_size=count)))
    plans = plan_distribution(targets, table, num_ranks=len(speeds), decoders_per_rank=slots, rank_speeds=speeds)
    assert [p.rank for p in plans] == list(range(len(speeds)))
    assert output(plans) == output(plan_distribution(targets, table))  # every target once, in order
    last_active = max(r for r, v in enumerate(speeds) if v > 0)
    for p, v in zip(plans, speeds):
        if v == 0:
            assert p.frame_indices == () and p.cost == 0 and p.num_pad_frames == 0
        elif p.rank != last_active:
            assert len(p.frame_indices) % 2 == 0 and p.num_pad_frames == 0  # whole temporal patches
    assert sum(p.num_output_frames for p in plans) % 2 == 0


def test_bad_speeds_and_slot_lists_are_rejected():
    table = GopTable(list(range(10)), [0])
    with pytest.raises(ValueError, match="rank_speeds"):
        plan_distribution([0, 1], table, num_ranks=2, rank_speeds=[0, 0])
    with pytest.raises(ValueError, match="rank_speeds"):
        plan_distribution([0, 1], table, num_ranks=2, rank_speeds=[1.0])
    with pytest.raises(ValueError, match="decoder"):
        plan_distribution([0, 1], table, num_ranks=2, decoders_per_rank=[2])
    with pytest.raises(ValueError, match="slot_speeds"):
        plan_distribution([0, 1], table, num_ranks=2, rank_speeds=[1, 1], slot_speeds=[1.0, 0.0])
    with pytest.raises(ValueError, match="slot_speeds"):
        plan_distribution([0, 1], table, num_ranks=2, slot_speeds=[1.0])
    # a rank that takes no part needs no slot speed
    plan_distribution([0, 1], table, num_ranks=2, rank_speeds=[0, 1], slot_speeds=[0.0, 1.0])

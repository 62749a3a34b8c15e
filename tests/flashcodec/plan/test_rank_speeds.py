"""Speed-weighted distribution over ranks of different speeds and slot counts (GPU + CPU ranks)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashcodec.plan.segments import GopTable, partition_contiguous, plan_distribution

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
    gpu, cpu = plan_distribution(targets, table, num_ranks=2, decoders_per_rank=[14, 4], rank_speeds=[3.0, 1.0])
    assert len(gpu.lanes) == 14 and len(cpu.lanes) == 4
    assert gpu.cost == 3 * cpu.cost == 180
    assert output([gpu, cpu]) == output(plan_distribution(targets, table))


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

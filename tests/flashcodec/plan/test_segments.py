"""GOP segments, cost-balanced distribution and temporal-patch alignment (property-tested)."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashcodec.plan.segments import (
    GopTable,
    align_rank_boundaries,
    build_segments,
    decode_floor_cost,
    partition_contiguous,
    plan_distribution,
)


def make_table(gop_sizes, bframes=0, open_gop=False, seed=0):
    """A GOP table like an encoder writes: I/P anchors in decode order, B-frames shown before them.

    With ``open_gop``, each keyframe (but the first) is followed in decode order by B-frames that
    are shown before it and reference the previous GOP.
    """
    rng = random.Random(seed)
    decode_to_display, keyframes, base = [], [], 0
    for g, size in enumerate(gop_sizes):
        keyframes.append(len(decode_to_display))
        display = list(range(base, base + size))
        lead = min(bframes, size - 1) if open_gop and g > 0 else 0
        # keyframe first in decode order, then its leading frames (shown before it: previous GOP's tail)
        order = []
        if lead:
            order.append(display[lead])
            order += display[:lead]
            rest = display[lead + 1:]
        else:
            order.append(display[0])
            rest = display[1:]
        i = 0
        while i < len(rest):
            run = rng.randint(0, bframes) if bframes else 0
            chunk = rest[i:i + run + 1]
            order.append(chunk[-1])  # the anchor is decoded before the B-frames it closes
            order += chunk[:-1]
            i += len(chunk)
        decode_to_display += order
        base += size
    n = len(decode_to_display)
    decode_positions = [0] * n
    for pos, disp in enumerate(decode_to_display):
        decode_positions[disp] = pos
    return GopTable(decode_positions, keyframes)


tables = st.builds(
    make_table,
    gop_sizes=st.lists(st.integers(1, 40), min_size=1, max_size=25),
    bframes=st.integers(0, 3),
    open_gop=st.booleans(),
    seed=st.integers(0, 1000),
)


def test_two_gops_one_target_each():
    table = GopTable(list(range(20)), [0, 10])
    segments = build_segments([3, 12], table)
    assert [(s.start_position, s.stop_position, s.target_indices) for s in segments] == [(0, 3, (3,)), (10, 12, (12,))]


def test_gop_without_target_is_never_decoded():
    table = GopTable(list(range(30)), [0, 10, 20])
    segments = build_segments([2, 25], table)
    assert [(s.start_position, s.stop_position) for s in segments] == [(0, 2), (20, 25)]
    assert decode_floor_cost([2, 25], table) == 3 + 6


def test_open_gop_leading_frame_starts_at_previous_keyframe():
    table = make_table([6, 6], bframes=2, open_gop=True)
    leading = 6  # display 6,7 are leading frames of GOP 1, keyframe shows at display 8
    assert table.decode_positions[8] == 6
    (segment,) = build_segments([leading], table)
    assert segment.start_position == 0


def test_out_of_range_target_raises():
    with pytest.raises(ValueError, match="out of range"):
        build_segments([10], GopTable(list(range(10)), [0]))


def test_alignment_raises_counts_and_pads_only_last_rank():
    assert align_rank_boundaries([3, 3, 3]) == ([4, 2, 3], 1)
    assert align_rank_boundaries([5, 5]) == ([6, 4], 0)
    assert align_rank_boundaries([1]) == ([1], 1)
    assert align_rank_boundaries([3, 0, 1]) == ([4, 0, 0], 0)


@settings(max_examples=300, deadline=None)
@given(costs=st.lists(st.integers(1, 100), max_size=60), parts=st.integers(1, 8))
def test_partition_is_contiguous_complete_and_balanced(costs, parts):
    ranges = partition_contiguous(costs, parts)
    assert len(ranges) == parts
    assert [i for r in ranges for i in r] == list(range(len(costs)))
    if costs:
        ideal = sum(costs) / parts
        for r in ranges:
            assert sum(costs[i] for i in r) <= ideal + max(costs)


@settings(max_examples=300, deadline=None)
@given(table=tables, data=st.data())
def test_segments_decode_from_a_keyframe_to_the_last_target(table, data):
    n = table.num_frames
    targets = sorted(set(data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=n))))
    segments = build_segments(targets, table)
    covered = [t for s in segments for t in s.target_indices]
    assert sorted(covered) == targets  # every target exactly once
    keyframes = set(table.keyframe_positions)
    target_gops = {table.gop_of_position(table.decode_positions[t]) for t in targets}
    for s in segments:
        assert s.start_position in keyframes
        assert s.stop_position == max(table.decode_positions[t] for t in s.target_indices)
        for t in s.target_indices:
            assert s.start_position <= table.decode_positions[t] <= s.stop_position
        # only GOPs holding a target are decoded (plus the one before an open-GOP leading frame)
        for gop in range(table.gop_of_position(s.start_position), table.gop_of_position(s.stop_position) + 1):
            assert gop in target_gops or gop + 1 in target_gops
    starts = [s.start_position for s in segments]
    assert starts == sorted(set(starts))


@settings(max_examples=300, deadline=None)
@given(table=tables, ranks=st.integers(1, 4), decoders=st.integers(1, 4), data=st.data())
def test_multi_rank_output_equals_single_rank(table, ranks, decoders, data):
    n = table.num_frames
    count = data.draw(st.integers(1, min(n, 64)))
    targets = sorted(data.draw(st.lists(st.integers(0, n - 1), min_size=count, max_size=count)))
    single = plan_distribution(targets, table)
    multi = plan_distribution(targets, table, num_ranks=ranks, decoders_per_rank=decoders)
    assert len(multi) == ranks and all(len(r.lanes) == decoders for r in multi)

    def output(plans):
        frames = []
        for p in plans:
            frames += list(p.frame_indices)
            if p.num_pad_frames:
                frames += [p.frame_indices[-1]] * p.num_pad_frames
        return frames

    assert output(multi) == output(single)
    for p in multi[:-1]:
        assert len(p.frame_indices) % 2 == 0 and p.num_pad_frames == 0  # only the last rank pads
    assert multi[-1].num_output_frames % 2 == 0
    for p in multi:  # each rank's lanes decode exactly its own frames
        assert sorted(t for s in p.segments for t in s.target_indices) == sorted(set(p.frame_indices))


@settings(max_examples=200, deadline=None)
@given(table=tables, decoders=st.integers(2, 4), data=st.data())
def test_lanes_are_balanced_by_decode_cost_not_target_count(table, decoders, data):
    n = table.num_frames
    targets = sorted(set(data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=n))))
    (plan,) = plan_distribution(targets, table, decoders_per_rank=decoders)
    costs = [sum(s.cost for s in lane) for lane in plan.lanes]
    biggest = max(s.cost for s in plan.segments)
    assert max(costs) <= sum(costs) / decoders + biggest


def test_cost_balance_prefers_cheap_gops_over_equal_target_counts():
    # GOP 0 needs 1 frame decoded per target (targets at its start); GOP 1 needs 100.
    table = GopTable(list(range(200)), [0, 100])
    targets = [0, 1, 2, 3, 199]
    (plan,) = plan_distribution(targets, table, decoders_per_rank=2)
    assert [sum(s.cost for s in lane) for lane in plan.lanes] == [4, 100]

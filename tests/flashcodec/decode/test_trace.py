"""flashcodec.decode.trace: a traced request's time per rank, its first segment, and the one-line account."""

import pytest

from flashcodec.decode.rank_job import SlotEvent
from flashcodec.decode.trace import describe_trace, rank_slots, trace_summary


def ev(rank, slot, kind, a, b, position=0, cost=10, stolen=False, backup=False):
    return SlotEvent(rank, slot, kind, a, b, position, cost, stolen, backup)


EVENTS = [ev("cuda:0", 0, "open", 0.0, 0.05), ev("cuda:0", 0, "decode", 0.05, 0.25, position=250),
          ev("cuda:0", 1, "open", 0.0, 0.02), ev("cuda:0", 1, "decode", 0.02, 0.30, position=0),
          ev("cuda:0", 1, "decode", 0.30, 0.40, position=500, stolen=True), ev("cpu", 0, "open", 0.0, 0.01),
          ev("cpu", 0, "decode", 0.01, 0.70, position=500, cost=12),
          ev("cuda:0", 0, "decode", 0.40, 0.45, position=0, cost=12, backup=True)]


def test_the_summary_says_where_a_requests_time_went():
    s = trace_summary(EVENTS, 0.8, {"cuda:0": 4, "cpu": 16})
    g, c = s["ranks"]["cuda:0"], s["ranks"]["cpu"]
    assert (g["slots_used"], g["segments"], g["stolen"], g["backups"], g["frames"]) == (2, 4, 1, 1, 42)
    assert g["open_s_sum"] == pytest.approx(0.07) and g["open_s_max"] == pytest.approx(0.05)
    assert g["opens"] == 2 and g["open_end_s"] == pytest.approx(0.05) and c["opens"] == 1
    assert g["busy"] == pytest.approx(0.70 / (4 * 0.8))  # opens 0.07 + decodes 0.63 over 4 slots x 0.8 s
    assert g["end_s"] == pytest.approx(0.45) and g["slowest_segment_s"] == pytest.approx(0.28)
    assert c["first_decode_s"] == pytest.approx(0.01) and c["frames"] == 12 and c["end_s"] == pytest.approx(0.70)
    assert s["last"]["rank"] == "cpu" and s["last"]["end_s"] == pytest.approx(0.70)


def test_the_first_segment_is_the_earliest_positions_first_decode_not_its_backup():
    first = trace_summary(EVENTS, 0.8, {"cuda:0": 4, "cpu": 16})["first_segment"]
    assert (first["rank"], first["slot"]) == ("cuda:0", 1)
    assert (first["start_s"], first["end_s"]) == pytest.approx((0.02, 0.30))
    assert (first["open_start_s"], first["open_end_s"]) == pytest.approx((0.0, 0.02))  # its slot's open before it


def test_the_first_segment_names_the_open_that_held_it():
    """Opens one after another (as a driver that creates decoders one at a time would run them): the slot of the
    video's first segment opened last, so the first segment starts late although each open is short."""
    events = [ev("cuda:0", slot, "open", 0.05 * slot, 0.05 * (slot + 1)) for slot in range(4)]
    events += [ev("cuda:0", slot, "decode", 0.05 * (slot + 1), 0.05 * (slot + 1) + 0.1, position=(3 - slot) * 250)
               for slot in range(4)]
    s = trace_summary(events, 0.4, {"cuda:0": 4})
    first, g = s["first_segment"], s["ranks"]["cuda:0"]
    assert first["slot"] == 3 and (first["open_start_s"], first["open_end_s"]) == pytest.approx((0.15, 0.20))
    assert g["open_s_max"] == pytest.approx(0.05) and g["open_end_s"] == pytest.approx(0.20)
    line = describe_trace(s)
    assert "first segment on cuda:0 slot 3 0.200-0.300 s after its open 0.150-0.200 s;" in line
    assert "4 opens 0.200 s (max 0.050, the last ended at 0.200 s)" in line


def test_a_first_segment_on_a_slot_already_open_names_no_open():
    events = [ev("cpu", 0, "open", 0.0, 0.01), ev("cpu", 0, "decode", 0.01, 0.1, position=250),
              ev("cpu", 0, "decode", 0.1, 0.2, position=0)]
    first = trace_summary(events, 0.2, {"cpu": 1})["first_segment"]
    assert (first["open_start_s"], first["open_end_s"]) == pytest.approx((0.0, 0.01))  # the slot's one open
    events = [ev("cpu", 0, "decode", 0.0, 0.1, position=0)]  # a trace without the open (a warm slot)
    s = trace_summary(events, 0.1, {"cpu": 1})
    assert s["first_segment"]["open_start_s"] is None and "after its open" not in describe_trace(s)


def test_an_empty_trace_has_no_first_segment_and_idle_ranks():
    s = trace_summary([], 0.5, {"cpu": 2})
    assert s["ranks"]["cpu"]["segments"] == 0 and "first_segment" not in s and "last" not in s
    assert describe_trace(s) == "0.500 s"  # idle ranks are left out of the line


def test_the_line_names_the_first_segment_and_each_busy_rank():
    line = describe_trace(trace_summary(EVENTS, 0.8, {"cuda:0": 4, "cpu": 16, "cuda:1": 4}))
    assert line.startswith("0.800 s; first segment on cuda:0 slot 1 0.020-0.300 s after its open 0.000-0.020 s; "
                           "cuda:0: 4 segments (1 stolen, 1 backups) on 2/4 slots")
    assert "cpu: 1 segments (0 stolen, 0 backups) on 1/16 slots, first decode 0.010 s, slowest segment 0.690 s, " \
           "end 0.700 s" in line
    assert "cuda:1" not in line and "\n" not in line


def test_a_rank_without_slots_or_wall_time_still_reads():
    line = describe_trace(trace_summary(EVENTS, 0.0, {"cpu": 16}))
    assert "busy n/a" in line and line.startswith("0.000 s; first segment")


def test_rank_slots_names_ranks_as_traces_do():
    class Layout:
        gpus, nvdec_sessions, cpu_threads = (0, 1), 14, 13

    class Engine:
        layout = Layout()

    assert rank_slots(Engine()) == {"cuda:0": 14, "cuda:1": 14, "cpu": 13}
    Layout.cpu_threads = 0
    assert rank_slots(Engine()) == {"cuda:0": 14, "cuda:1": 14}

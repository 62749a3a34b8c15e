"""Cancelling a request stops its work: queued segments dropped, running ones stopped, the engine reusable."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from flashcodec import DecodeCancelledError, DecodeEngine
from flashcodec.decode.rank_job import RankJob
from flashcodec.decode.scheduler import RankGroup, RankScheduler
from flashcodec.plan.segments import GopTable, plan_distribution
from test_ranks import SLOTS, SleepBackend

TABLE = GopTable(list(range(400)), list(range(0, 400, 10)))  # 40 GOPs of 10 frames
TARGETS = list(range(0, 400, 5))  # 40 segments of cost 6


def test_cancel_drops_queued_segments_and_stops_running_ones():
    backend = SleepBackend("cpu", 0.02)  # 0.12 s a segment: 40 segments on 2 slots would take 2.4 s
    group = RankGroup()
    RankScheduler(backend, SLOTS, "cpu", group=group)
    finished = threading.Event()
    errors = []
    plan, = plan_distribution(TARGETS, TABLE, num_ranks=1, decoders_per_rank=SLOTS)
    try:
        group.ranks[0].submit(RankJob(7, plan, open_decoder=lambda b: b.open(None, None, 0, 0),
                                      emit=lambda d, f: None, on_segment_done=lambda s, f: None,
                                      on_finished=lambda job, error: (errors.append(error), finished.set())))
        time.sleep(0.05)  # both slots are inside their first segment
        started = time.perf_counter()
        group.cancel(7, DecodeCancelledError("cancelled"))
        assert finished.wait(1.0)
        elapsed = time.perf_counter() - started
    finally:
        group.shutdown()
    assert isinstance(errors[0], DecodeCancelledError) and len(errors) == 1
    assert len(backend.started) == SLOTS  # nothing queued ran after the cancel
    assert len(backend.stopped) == SLOTS  # and the running segments stopped at their next "packet"
    assert elapsed < 0.06, f"the running segments took {elapsed:.3f} s to stop"


def test_cancel_an_idle_job_finishes_it_at_once():
    group = RankGroup()
    RankScheduler(SleepBackend("cpu", 0.02), SLOTS, "cpu", group=group)
    other = RankScheduler(SleepBackend("cuda:0", 0.02), SLOTS, "cuda:0", group=group)
    done = []
    plans = plan_distribution(TARGETS, TABLE, num_ranks=2, decoders_per_rank=SLOTS)
    try:
        with group.cond:  # queue both jobs before any slot can take from the second
            for plan, rank in zip(plans, group.ranks):
                job = RankJob(3, plan, open_decoder=lambda b: b.open(None, None, 0, 0), emit=lambda d, f: None,
                              on_segment_done=lambda s, f: None, on_finished=lambda j, e: done.append(e))
                job.owner = rank
                rank._jobs.append(job)
            group.cancel(3, DecodeCancelledError("cancelled"))
        assert len(done) == 2 and all(isinstance(e, DecodeCancelledError) for e in done)
        assert not other._jobs and other.backend.started == []
    finally:
        group.shutdown()


@pytest.fixture(scope="module")
def long_clip(video_factory):
    return video_factory(codec="h264", suffix=".mp4", width=640, height=360, duration_s=24.0, fps=25.0, gop=25,
                         seed=11)


def test_a_cancelled_video_stops_and_the_engine_serves_the_next(long_clip, tiny_h264):
    with DecodeEngine("pyav", 1) as engine:
        started = time.perf_counter()
        whole = engine.decode_video(long_clip, fps=25.0, max_frames=600, height=112, width=196)
        full_s = time.perf_counter() - started
        a = engine.analyse_bitstream(long_clip, fps=25.0, max_frames=600, height=112, width=196)
        engine.add_decoding_request(a.key_id)
        time.sleep(full_s / 10)
        started = time.perf_counter()
        assert engine.cancel(a.key_id)
        with pytest.raises(DecodeCancelledError):
            engine.get_decoding_output(a.key_id, timeout=30)
        cancel_s = time.perf_counter() - started
        assert cancel_s < full_s / 3, f"cancel took {cancel_s:.2f} s of a {full_s:.2f} s decode"
        assert not engine.cancel(a.key_id)  # already ended
        out = engine.decode_video(tiny_h264, num_frames=4)  # the same decoders, still usable
        assert out.frames.shape[0] == 4 and whole.frames.shape[0] == 600
        assert engine._finished == {} and engine._cancelled == set()  # nothing of it is kept


def test_cancel_before_decoding_and_unknown_keys(tiny_h264):
    with DecodeEngine("pyav", 1) as engine:
        a = engine.analyse_bitstream(tiny_h264, num_frames=4)
        assert engine.cancel(a.key_id)
        with pytest.raises(KeyError):
            engine.add_decoding_request(a.key_id)
        assert not engine.cancel(12345)
        assert isinstance(engine.decode_video(tiny_h264, num_frames=4).frames, torch.Tensor)


def test_a_segment_stopped_midway_leaves_its_decoder_to_seek_afresh(tiny_h264, monkeypatch):
    """A stopped run (a cancel, or the losing run of a backed-up segment) forgets where its demuxer was: the
    decoder's next segment seeks to its own keyframe, neither scanning on from the stopped one to the end of the file
    nor opening the video again."""
    from flashcodec._probe import probe
    from flashcodec.decode.pyav import PyAVSegmentDecoder
    from flashcodec.plan.segments import GopSegment
    from flashcodec.source import Source

    src = Source.of(tiny_h264)
    decoder = PyAVSegmentDecoder(src, probe(src), 96, 128)
    opens = []
    real_open = decoder._open
    monkeypatch.setattr(decoder, "_open", lambda: opens.append(1) or real_open())
    calls = []
    stop = lambda: calls.append(1) or len(calls) > 4  # noqa: E731
    left = decoder.decode_segment(GopSegment(24, 35, tuple(range(24, 36))), lambda i, f: None, stop)
    assert left  # stopped with targets left
    got = []
    assert decoder.decode_segment(GopSegment(0, 11, tuple(range(12))), lambda i, f: got.append(i)) == []
    assert sorted(got) == list(range(12)) and opens == []
    decoder.close()

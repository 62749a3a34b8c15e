"""Streamed output: parts in display order, as the prefix of final rows grows, equal to the whole output."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from flashcodec import DecodeCancelledError, DecodeEngine, DecodedSlice
from flashcodec.decode.backends import Backend, SegmentDecoder, never
from flashcodec.decode.cpu import get_backend
from flashcodec.decode.request import BitstreamAnalysis, DecodeRequest
from flashcodec.patches import PatchSpec
from flashcodec.plan.sampling import SamplingOptions
from flashcodec.plan.video import plan_video
from slow_decoding import SlowBackend


@pytest.fixture(scope="module")
def gop_clip(video_factory):
    """4 s at 24 fps with a keyframe every 12 frames: 8 GOPs, so 2 decoder slots finish out of order."""
    return video_factory(codec="h264", bframes=2, suffix=".mp4", width=128, height=96, duration_s=4.0, fps=24.0,
                         gop=12, seed=5)


def read_all(engine, key_id):
    parts = list(engine.stream_decoding_output(key_id, timeout=60))
    assert parts and all(isinstance(p, DecodedSlice) for p in parts)
    assert parts[0].start == 0 and parts[-1].is_last and not any(p.is_last for p in parts[:-1])
    for before, after in zip(parts, parts[1:]):
        assert after.start == before.stop > before.start  # contiguous, growing, in order
    return parts


@pytest.mark.parametrize("output", ["rgb", "patches"])
def test_streamed_parts_are_in_order_and_equal_the_whole_output(gop_clip, output):
    spec = PatchSpec()
    with DecodeEngine("pyav", 2) as engine:
        whole = engine.decode_video(gop_clip, fps=12.0, output=output, patch_spec=spec)
        a = engine.analyse_bitstream(gop_clip, fps=12.0)
        engine.add_decoding_request(a.key_id, output=output, patch_spec=spec, stream=True)
        parts = read_all(engine, a.key_id)
        assert engine._streams == {} and engine._finished == {}  # nothing of it is kept
    if output == "rgb":
        assert all(p.patches is None and p.frames.dtype == torch.uint8 for p in parts)
        assert torch.equal(torch.cat([p.frames for p in parts]), whole.frames)
        assert parts[-1].stop == whole.frames.shape[0]
    else:
        rows_per_slice = whole.grid_thw[1] * whole.grid_thw[2]
        assert all(p.frames is None and (p.stop - p.start) % rows_per_slice == 0 for p in parts)
        assert torch.equal(torch.cat([p.patches for p in parts]), whole.patches)
        assert parts[-1].num_rows == whole.patches.shape[0] and parts[0].grid_thw == whole.grid_thw


def test_patches_come_in_the_asked_dtype_rounded_once(gop_clip):
    """``patch_dtype``: whole and streamed patches in bfloat16, each the float32 value rounded once."""
    with DecodeEngine("pyav", 2) as engine:
        reference = engine.decode_video(gop_clip, fps=12.0, output="patches").patches.to(torch.bfloat16)
        a = engine.analyse_bitstream(gop_clip, fps=12.0)
        engine.add_decoding_request(a.key_id, output="patches", patch_dtype=torch.bfloat16)
        whole = engine.get_decoding_output(a.key_id).patches
        b = engine.analyse_bitstream(gop_clip, fps=12.0)
        engine.add_decoding_request(b.key_id, output="patches", stream=True, patch_dtype=torch.bfloat16)
        streamed = torch.cat([p.patches for p in read_all(engine, b.key_id)])
        assert whole.dtype == streamed.dtype == torch.bfloat16
        assert torch.equal(whole, reference) and torch.equal(streamed, reference)
        c = engine.analyse_bitstream(gop_clip, fps=12.0)
        for bad in (torch.uint8, "bfloat16"):
            with pytest.raises(ValueError, match="patch_dtype must be a floating torch dtype"):
                engine.add_decoding_request(c.key_id, output="patches", patch_dtype=bad)


def test_the_first_part_arrives_long_before_the_video_is_done(gop_clip):
    with DecodeEngine(SlowBackend(0.08), 2) as engine:  # 8 segments on 2 slots: >= 0.32 s in all
        a = engine.analyse_bitstream(gop_clip, fps=12.0)
        assert len(a.plan.ranks[0].segments) >= 6
        started = time.perf_counter()
        engine.add_decoding_request(a.key_id, output="patches", stream=True)
        arrivals = [time.perf_counter() - started for _ in engine.stream_decoding_output(a.key_id, timeout=60)]
    assert len(arrivals) >= 3
    assert arrivals[0] < 0.5 * arrivals[-1], f"first part at {arrivals[0]:.3f} s, the last at {arrivals[-1]:.3f} s"


def test_the_prefix_waits_for_the_earliest_rank(gop_clip):
    """Two ranks finishing out of order: nothing is final until rank 0's first frame is, then the
    prefix jumps over what rank 1 already has."""
    with DecodeEngine("pyav", 1) as engine:
        info = engine.analyse_bitstream(gop_clip).info
    plan = plan_video(info, SamplingOptions(fps=12.0), num_ranks=2, decoders_per_rank=[1, 1])
    analysis = BitstreamAnalysis(1, info, plan, 0.0, source=None)
    request = DecodeRequest(analysis, "rgb", "error", None, None, lambda r: None, stream=True)
    frame = np.zeros((plan.height, plan.width, 3), np.uint8)
    rank0, rank1 = plan.ranks
    assert rank0.frame_indices and rank1.frame_indices
    for display in rank1.frame_indices:
        request.emit(display, frame)
    assert request.num_ready == 0
    for display in rank0.frame_indices[1:]:
        request.emit(display, frame)
    assert request.num_ready == 0
    request.emit(rank0.frame_indices[0], frame)
    assert request.num_ready == len(rank0.frame_indices) + len(rank1.frame_indices)  # padding waits for rank 1's end


def test_cancel_mid_stream_stops_it_and_keeps_nothing(gop_clip, tiny_h264):
    with DecodeEngine(SlowBackend(0.1), 2) as engine:
        a = engine.analyse_bitstream(gop_clip, fps=12.0)
        engine.add_decoding_request(a.key_id, output="patches", stream=True)
        parts = engine.stream_decoding_output(a.key_id, timeout=60)
        first = next(parts)
        assert not first.is_last
        started = time.perf_counter()
        assert engine.cancel(a.key_id)
        with pytest.raises(DecodeCancelledError):
            next(parts)
        assert time.perf_counter() - started < 0.5
        assert engine._streams == {} and engine._cancelled == set() and engine._finished == {}
        assert engine.decode_video(tiny_h264, num_frames=4).frames.shape[0] == 4  # the engine still serves


def test_closing_the_stream_early_cancels_the_request(gop_clip):
    with DecodeEngine(SlowBackend(0.1), 2) as engine:
        a = engine.analyse_bitstream(gop_clip, fps=12.0)
        engine.add_decoding_request(a.key_id, stream=True)
        parts = engine.stream_decoding_output(a.key_id)
        next(parts)
        parts.close()
        deadline = time.monotonic() + 5
        while (engine._in_flight or engine._streams or engine._cancelled) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not engine._in_flight and engine._streams == {} and engine._cancelled == set()


def test_streamed_and_plain_keys_are_read_their_own_way(tiny_h264):
    with DecodeEngine("pyav", 1) as engine:
        a = engine.analyse_bitstream(tiny_h264, num_frames=4)
        engine.add_decoding_request(a.key_id, stream=True)
        with pytest.raises(ValueError, match="stream_decoding_output"):
            engine.get_decoding_output(a.key_id)
        assert sum(p.stop - p.start for p in engine.stream_decoding_output(a.key_id)) == 4
        with pytest.raises(KeyError):
            engine.stream_decoding_output(a.key_id)  # read already
        b = engine.analyse_bitstream(tiny_h264, num_frames=4)
        engine.add_decoding_request(b.key_id)
        with pytest.raises(KeyError, match="stream=True"):
            engine.stream_decoding_output(b.key_id)
        assert engine.get_decoding_output(b.key_id).frames.shape[0] == 4


def test_a_waiter_for_any_request_never_takes_a_streamed_one(tiny_h264):
    with DecodeEngine("pyav", 1) as engine:
        a = engine.analyse_bitstream(tiny_h264, num_frames=4)
        engine.add_decoding_request(a.key_id, stream=True)
        result = []
        waiter = threading.Thread(target=lambda: result.append(engine.get_decoding_output(timeout=0.5)))
        b = engine.analyse_bitstream(tiny_h264, num_frames=6)
        engine.add_decoding_request(b.key_id)
        waiter.start()
        waiter.join(10)
        assert result and result[0].key_id == b.key_id
        list(engine.stream_decoding_output(a.key_id))


class LosingDecoder(SegmentDecoder):
    """PyAV's decoder that cannot produce the targets in ``lost`` (as a corrupt GOP would)."""

    def __init__(self, inner: SegmentDecoder, lost: set[int]):
        self.inner, self.lost = inner, lost

    def decode_segment(self, segment, emit, should_stop=never):
        failed = self.inner.decode_segment(segment, lambda d, f: None if d in self.lost else emit(d, f), should_stop)
        return sorted(set(failed) | (self.lost & set(segment.target_indices)))


class LosingBackend(Backend):
    name = "losing-pyav"

    def __init__(self, lost: set[int]):
        self.inner, self.lost = get_backend("pyav"), lost

    def open(self, source, info, height, width, resize="exact"):
        return LosingDecoder(self.inner.open(source, info, height, width, resize), self.lost)


def test_lost_frames_repeated_in_a_stream_as_in_the_whole_output(gop_clip):
    with DecodeEngine("pyav", 2) as probe_engine:
        targets = probe_engine.analyse_bitstream(gop_clip, fps=12.0).plan.frame_indices
    lost = {targets[9], targets[10]}
    with DecodeEngine(LosingBackend(lost), 2) as engine:
        whole = engine.decode_video(gop_clip, fps=12.0, on_corrupt="repeat")
        assert sorted(lost) == whole.failed_frame_indices
        a = engine.analyse_bitstream(gop_clip, fps=12.0)
        engine.add_decoding_request(a.key_id, on_corrupt="repeat", stream=True)
        parts = read_all(engine, a.key_id)
    assert torch.equal(torch.cat([p.frames for p in parts]), whole.frames)


def test_a_corrupt_frame_ends_the_stream_with_the_error_after_the_frames_before_it(gop_clip):
    from flashcodec import CorruptVideoError

    with DecodeEngine("pyav", 2) as probe_engine:
        targets = probe_engine.analyse_bitstream(gop_clip, fps=12.0).plan.frame_indices
    with DecodeEngine(LosingBackend({targets[9]}), 2) as engine:
        a = engine.analyse_bitstream(gop_clip, fps=12.0)
        engine.add_decoding_request(a.key_id, stream=True)
        parts = []
        with pytest.raises(CorruptVideoError):
            for part in engine.stream_decoding_output(a.key_id, timeout=60):
                parts.append(part)
        assert engine._streams == {} and engine._finished == {}
    assert parts[-1].stop == 9  # every frame before the lost one (the 10th), and nothing past it


# --- batched emits (a GPU rank's chunk of frames in one copy) ----------------------------------------------------


def _request(engine, source, frame_indices, stream):
    analysis = engine.analyse_bitstream(source, frame_indices=frame_indices)
    return analysis, DecodeRequest(analysis, "rgb", "error", None, None, lambda request: None, stream=stream)


def _frames(displays, h, w):
    return torch.stack([torch.full((h, w, 3), d, dtype=torch.uint8) for d in displays])  # frame d is all d


@pytest.mark.parametrize("stream", [False, True])
def test_a_batch_of_consecutive_rows_is_one_copy_and_streams_its_rows(tiny_h264, stream):
    with DecodeEngine("pyav", num_threads=1) as engine:
        analysis, request = _request(engine, tiny_h264, [0, 1, 2, 3, 4, 5], stream)
    plan = analysis.plan
    request.emit = lambda display, frame: pytest.fail("one by one for a batch of consecutive rows")
    request.emit_many([0, 1, 2, 3], _frames([0, 1, 2, 3], plan.height, plan.width))
    out = request.rank_outputs[0]
    assert [int(out[row, 0, 0, 0]) for row in range(4)] == [0, 1, 2, 3]
    assert request.produced == {0, 1, 2, 3}
    assert request.num_ready == (4 if stream else 0)


def test_a_batch_with_a_frame_sampled_twice_goes_one_by_one(tiny_h264):
    with DecodeEngine("pyav", num_threads=1) as engine:
        analysis, request = _request(engine, tiny_h264, [0, 1, 1, 2], stream=True)  # frame 1 fills rows 1 and 2
    plan = analysis.plan
    assert plan.ranks[0].frame_indices == (0, 1, 1, 2)
    request.emit_many([1, 2], _frames([1, 2], plan.height, plan.width))
    out = request.rank_outputs[0]
    assert [int(out[row, 0, 0, 0]) for row in (1, 2, 3)] == [1, 1, 2]
    assert request.num_ready == 0  # row 0 not written yet
    request.emit_many([0], _frames([0], plan.height, plan.width))
    assert request.num_ready == 4

"""Decoded frames equal a sequential PyAV decode converted the same way, for every codec and container."""

import re
import threading
import time

import av
import numpy as np
import pytest
import torch
import synthetic_video

import flashcodec
from flashcodec.decode.pyav import convert_frame, rotate_display
from flashcodec.resize import RESIZE_MODES

TINY = dict(width=128, height=96, duration_s=2.0, fps=24.0, gop=12)

CASES = [
    ("h264", ".mp4", dict(bframes=2)),
    ("h264", ".mkv", dict(bframes=3)),
    ("h264", ".mov", dict()),
    ("h264", ".mp4", dict(bframes=2, open_gop=True)),
    ("h264", ".mkv", dict(vfr=True)),
    ("hevc", ".mp4", dict(bframes=2)),
    ("hevc", ".mkv", dict(bframes=2, open_gop=True)),
    ("vp9", ".webm", dict(preset="realtime")),
    ("vp9", ".mkv", dict(preset="realtime")),
    ("av1", ".mp4", dict()),
    ("av1", ".webm", dict()),
    ("mpeg4", ".avi", dict()),
    ("mpeg4", ".mp4", dict(bframes=2)),
]


def sequential_reference(path, indices, height, width, resize="exact", turn=True):
    """Decode every frame in order with PyAV and convert the wanted ones the same way as flashcodec (``turn``:
    turned by FFmpeg's angle, else as stored, ``height`` x ``width`` the stored size).

    (How close each resize mode is to Qwen2.5-VL's own preprocessing is tests/flashcodec/test_resize.py.)
    """
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        frames = list(container.decode(stream))
    out = []
    for i in indices:
        f = frames[i]
        if not turn:
            out.append(convert_frame(f, height, width, resize).transpose(2, 0, 1))
            continue
        h, w = (width, height) if f.rotation % 180 else (height, width)
        rgb = convert_frame(f, h, w, resize)
        out.append(rotate_display(rgb, int(f.rotation) % 360).transpose(2, 0, 1))
    return np.stack(out)


@pytest.fixture(scope="module")
def engine():
    with flashcodec.DecodeEngine("pyav", num_threads=2) as e:
        yield e


@pytest.mark.parametrize("resize", RESIZE_MODES)
@pytest.mark.parametrize("codec,suffix,extra", CASES,
                         ids=[f"{c}{s}{'-' + '-'.join(e) if e else ''}" for c, s, e in CASES])
def test_pyav_backend_equals_sequential_decode(video_factory, engine, codec, suffix, extra, resize):
    path = video_factory(codec=codec, suffix=suffix, **TINY, **extra)
    result = engine.decode_video(path, num_frames=16, resize=resize)  # spread over every GOP
    assert result.frames.dtype == torch.uint8 and result.frames.shape[1] == 3
    assert len(result.frame_indices) == 16 and result.failed_frame_indices == []
    expected = sequential_reference(path, result.frame_indices, *result.frames.shape[2:], resize)
    assert np.array_equal(result.frames.numpy(), expected)  # bit-exact
    for row, display in enumerate(result.frame_indices):
        assert synthetic_video.read_frame_index(result.frames[row].permute(1, 2, 0).numpy()) == display


@pytest.mark.parametrize("resize", RESIZE_MODES)
@pytest.mark.parametrize("rotation", [90, 180, 270])
def test_rotated_video_comes_out_in_display_orientation(video_factory, engine, rotation, resize):
    path = video_factory(codec="h264", suffix=".mp4", rotation=rotation, **TINY)
    result = engine.decode_video(path, num_frames=8, resize=resize)
    h, w = result.frames.shape[2:]
    assert (h > w) == (rotation in (90, 270))
    expected = sequential_reference(path, result.frame_indices, h, w, resize)
    assert np.array_equal(result.frames.numpy(), expected)
    for row, display in enumerate(result.frame_indices):
        frame = result.frames[row].permute(1, 2, 0).numpy()
        assert synthetic_video.read_frame_index(frame, rotation=rotation) == display


@pytest.mark.parametrize("resize", RESIZE_MODES)
@pytest.mark.parametrize("rotation", [0, 90, 180, 270])
def test_mirrored_video_comes_out_as_displayed(video_factory, engine, rotation, resize):
    """A display matrix that mirrors as well as turns (a front camera's recording): FFmpeg's angle alone reads a
    left-right mirror as a half turn, and an up-down one (rotation 180 here) as none. The frames come out as the
    ``ffmpeg`` command line shows them: turned, then mirrored left-right."""
    path = video_factory(codec="h264", suffix=".mp4", rotation=rotation, mirror=True, **TINY)
    info = flashcodec.probe(path)
    assert info.mirror and info.rotation == -rotation % 360
    result = engine.decode_video(path, num_frames=8, resize=resize)
    h, w = result.frames.shape[2:]
    assert (h > w) == (rotation in (90, 270))
    stored = sequential_reference(path, result.frame_indices, *((w, h) if rotation in (90, 270) else (h, w)),
                                  resize, turn=False)  # [n, 3, H, W] as stored
    expected = np.flip(np.rot90(stored, k=-rotation // 90, axes=(2, 3)), axis=3)  # clockwise turn, then the mirror
    assert np.array_equal(result.frames.numpy(), expected)
    for row, display in enumerate(result.frame_indices):
        frame = result.frames[row].permute(1, 2, 0).numpy()
        assert synthetic_video.read_frame_index(frame, rotation=rotation, mirror=True) == display
    if "torchcodec" in flashcodec.available_backends():  # it turns by FFmpeg's angle; its backend mirrors the rest
        with flashcodec.DecodeEngine("torchcodec", num_threads=1) as theirs:
            again = theirs.decode_video(path, num_frames=8, resize=resize)
        assert again.frame_indices == result.frame_indices
        ours, theirs = result.frames.float(), again.frames.float()  # fast: torchcodec's Resize is not swscale's
        same = (ours - theirs).abs().mean().item()
        assert same < (1.0 if resize == "exact" else 8.0) and (ours.flip(3) - theirs).abs().mean().item() > 4 * same


@pytest.mark.parametrize("rotation", [90, 180, 270])
def test_rotation_matches_torchcodec(video_factory, rotation):
    import torch

    tc = pytest.importorskip("torchcodec.decoders")
    path = video_factory(codec="h264", suffix=".mp4", rotation=rotation, **TINY)
    decoded = flashcodec.decode_video(path, num_frames=4)
    theirs = tc.VideoDecoder(str(path)).get_frames_at(decoded.frame_indices).data.float()  # torchcodec rotates
    ours = torch.nn.functional.interpolate(decoded.frames.float(), size=theirs.shape[2:], mode="bilinear")
    same = (ours - theirs).abs().mean().item()
    flipped = (torch.rot90(ours, 2, dims=(2, 3)) - theirs).abs().mean().item()
    assert same < 8.0 and flipped > 4 * same


def test_patch_output_matches_frames(tiny_h264, engine):
    from flashcodec.patches import frames_to_patches

    rgb = engine.decode_video(tiny_h264, num_frames=6)
    patches = engine.decode_video(tiny_h264, num_frames=6, output="patches")
    expected, grid = frames_to_patches(rgb.frames)
    assert patches.grid_thw == tuple(grid) == rgb.grid_thw
    assert patches.patches.shape == (grid[0] * grid[1] * grid[2], 1176)
    assert patches.frames is None and np.array_equal(patches.patches.numpy(), expected.numpy())


def test_sources_path_bytes_and_file_object_agree(tiny_h264, engine):
    by_path = engine.decode_video(str(tiny_h264), num_frames=6).frames
    by_bytes = engine.decode_video(tiny_h264.read_bytes(), num_frames=6).frames
    with open(tiny_h264, "rb") as f:
        by_file = engine.decode_video(f, num_frames=6).frames
    assert np.array_equal(by_path.numpy(), by_bytes.numpy()) and np.array_equal(by_path.numpy(), by_file.numpy())


def test_two_concurrent_videos_both_come_back_right(video_factory, engine):
    a = video_factory(codec="h264", suffix=".mp4", bframes=2, seed=1, **TINY)
    b = video_factory(codec="hevc", suffix=".mkv", seed=2, **TINY)
    alone_a = engine.decode_video(a, fps=12.0).frames
    alone_b = engine.decode_video(b, fps=6.0).frames
    key_a = engine.analyse_bitstream(a, fps=12.0).key_id
    key_b = engine.analyse_bitstream(b, fps=6.0).key_id
    engine.add_decoding_request(key_a)
    engine.add_decoding_request(key_b)
    got = {}
    for _ in range(2):
        out = engine.get_decoding_output(timeout=60)  # whichever finishes first
        got[out.key_id] = out.frames
    assert np.array_equal(got[key_a].numpy(), alone_a.numpy())
    assert np.array_equal(got[key_b].numpy(), alone_b.numpy())


def test_many_requests_share_a_bounded_set_of_decoder_threads(tiny_h264):
    before = threading.active_count()
    with flashcodec.DecodeEngine("pyav", num_threads=2) as engine:
        keys = [engine.analyse_bitstream(tiny_h264, num_frames=8).key_id for _ in range(12)]
        for k in keys:
            engine.add_decoding_request(k)
        assert threading.active_count() - before == 2
        results = [engine.get_decoding_output(k, timeout=60) for k in keys]
    first = results[0].frames.numpy()
    assert all(np.array_equal(r.frames.numpy(), first) for r in results)


def test_decoder_threads_run_in_parallel_so_the_gil_is_released(video_factory):
    """Two decoder threads must burn more than one core's worth of CPU time while they run.

    If decoding held the GIL, process CPU time could not exceed wall time by much.
    """
    import os

    if (os.cpu_count() or 1) < 2:
        pytest.skip("needs two cores")
    path = video_factory(codec="h264", suffix=".mp4", width=640, height=360, duration_s=4.0, fps=30.0, gop=30)
    with flashcodec.DecodeEngine("pyav", num_threads=2) as engine:
        engine.decode_video(path, num_frames=8)  # warm up
        best = 0.0
        for _ in range(3):
            wall, cpu = time.perf_counter(), time.process_time()
            engine.decode_video(path, fps=30.0, max_frames=120)
            best = max(best, (time.process_time() - cpu) / (time.perf_counter() - wall))
    assert best > 1.3, f"CPU/wall ratio {best:.2f}: decoder threads did not run in parallel"


def test_get_decoding_output_errors(engine, tiny_h264):
    with pytest.raises(KeyError):
        engine.get_decoding_output(12345, timeout=1)
    with pytest.raises(KeyError):
        engine.add_decoding_request(12345)
    key = engine.analyse_bitstream(tiny_h264, num_frames=4).key_id
    with pytest.raises(ValueError, match="output"):
        engine.add_decoding_request(key, output="jpeg")


def test_pictures_over_max_source_pixels_are_refused_before_decoding(tiny_h264, monkeypatch):
    """The cap is on the stored picture (128x96 here), checked at analysis from the header: nothing is queued or
    decoded, not even the probe's first keyframe (a 16000x16000 one took 843 MB to refuse after it)."""
    from flashcodec import DecodeEngine, VideoTooLargeError, _probe
    from flashcodec.decode.engine import MAX_SOURCE_PIXELS

    assert MAX_SOURCE_PIXELS >= 7680 * 4320  # 8K UHD fits the default
    small = DecodeEngine(cpu_threads=1, max_source_pixels=128 * 96 - 1)
    try:
        with monkeypatch.context() as m:
            m.setattr(_probe, "_first_frame_orientation", lambda *a: pytest.fail("the probe decoded a keyframe"))
            with pytest.raises(VideoTooLargeError, match=r"128x96 \(12288 pixels\); at most 12287 are decoded"):
                small.analyse_bitstream(tiny_h264, num_frames=4)
        with pytest.raises(VideoTooLargeError, match=r"128x96 \(12288 pixels\); at most 12287 are decoded"):
            small.analyse_bitstream(tiny_h264, num_frames=4)
        with pytest.raises(VideoTooLargeError):
            small.decode_video(tiny_h264, num_frames=4)
    finally:
        small.close()
    exact = DecodeEngine(cpu_threads=1, max_source_pixels=128 * 96)
    try:
        assert exact.decode_video(tiny_h264, num_frames=4).frames.shape[0] == 4
    finally:
        exact.close()
    with pytest.raises(ValueError, match="max_source_pixels must be at least 1"):
        DecodeEngine(cpu_threads=1, max_source_pixels=0)


def test_a_traced_request_says_which_slot_opened_and_decoded_what_and_when(video_factory, engine):
    path = video_factory(codec="h264", suffix=".mp4", bframes=2, seed=5, width=128, height=96, duration_s=4.0,
                         fps=24.0, gop=12)  # 8 GOPs over the engine's 2 slots
    analysis = engine.analyse_bitstream(path, num_frames=16)
    engine.add_decoding_request(analysis.key_id, trace=True)
    out = engine.get_decoding_output(analysis.key_id)
    decodes = [e for e in out.trace if e.kind == "decode"]
    opens = [e for e in out.trace if e.kind == "open"]
    planned = analysis.plan.ranks[0].segments
    assert sorted((e.start_position, e.cost) for e in decodes) == [(s.start_position, s.cost) for s in planned]
    assert 1 <= len(opens) <= 2 and len({e.slot for e in opens}) == len(opens)  # one open per slot that worked
    for e in out.trace:
        assert e.rank == "cpu" and e.slot in (0, 1) and not e.stolen
        assert 0 <= e.start_s <= e.end_s <= out.decode_s
    for e in opens:  # a slot opens the video before its first segment
        assert e.end_s <= min(d.start_s for d in decodes if d.slot == e.slot)
    untraced = engine.decode_video(path, num_frames=16)
    assert untraced.trace is None and torch.equal(untraced.frames, out.frames)
    # a stream's trace comes whole with its last part; the other parts carry none
    analysis = engine.analyse_bitstream(path, num_frames=16)
    engine.add_decoding_request(analysis.key_id, trace=True, stream=True)
    parts = list(engine.stream_decoding_output(analysis.key_id))
    assert len(parts) > 1 and parts[-1].is_last and all(p.trace is None for p in parts[:-1])
    streamed = [e for e in parts[-1].trace if e.kind == "decode"]
    assert sorted((e.start_position, e.cost) for e in streamed) == [(s.start_position, s.cost) for s in planned]
    assert all(0 <= e.start_s <= e.end_s <= parts[-1].decode_s for e in parts[-1].trace)


def test_a_traced_stream_cancelled_while_its_slots_end_yields_no_partial_last_part(video_factory, monkeypatch):
    """The last part of a traced stream waits for every slot's end (its trace whole); a cancel in that wait ends the
    stream as an untraced one would (no further part, DecodeCancelledError), not with a part carrying half a trace."""
    from flashcodec.decode import pyav

    path = video_factory(codec="h264", suffix=".mp4", bframes=2, seed=5, width=128, height=96, duration_s=4.0,
                         fps=24.0, gop=12)
    decode = pyav.PyAVSegmentDecoder.decode_segment

    def slow(self, *args, **kwargs):  # a slot still working after its frames are out
        failed = decode(self, *args, **kwargs)
        time.sleep(0.5)
        return failed

    monkeypatch.setattr(pyav.PyAVSegmentDecoder, "decode_segment", slow)
    with flashcodec.DecodeEngine("pyav", num_threads=2) as engine:
        analysis = engine.analyse_bitstream(path, num_frames=16)
        engine.add_decoding_request(analysis.key_id, trace=True, stream=True)
        request = engine._streams[analysis.key_id]

        def cancel_once_every_frame_is_out():
            while request.num_ready < request.num_frames:
                time.sleep(0.005)
            time.sleep(0.1)
            engine.cancel(analysis.key_id)

        canceller = threading.Thread(target=cancel_once_every_frame_is_out)
        canceller.start()
        parts = []
        with pytest.raises(flashcodec.DecodeCancelledError):
            for part in engine.stream_decoding_output(analysis.key_id):
                parts.append(part)
        canceller.join(10)
        assert not any(p.is_last or p.trace is not None for p in parts)


def test_a_raw_stream_without_timestamps_is_refused_by_its_probe_with_the_way_out(tiny_h264, tmp_path, remux,
                                                                                  monkeypatch):
    """At the probe's first packet: no frame of it could be placed, and decoding used to find that out only after
    demuxing the whole stream twice (the probe's scan, then a segment's search for its first packet)."""
    path = remux(tiny_h264, tmp_path / "raw.h264", raw=True)
    with pytest.raises(flashcodec.CorruptVideoError, match=r"raw.h264: its packets carry no timestamps .* -c copy"):
        flashcodec.probe(str(path))
    from flashcodec.decode import pyav

    monkeypatch.setattr(pyav.PyAVSegmentDecoder, "_seek_to", lambda *a: pytest.fail("a raw stream was decoded"))
    for backend in ["pyav"] + (["torchcodec"] if "torchcodec" in flashcodec.available_backends() else []):
        with pytest.raises(flashcodec.CorruptVideoError, match=r"raw.h264: its packets carry no timestamps"):
            flashcodec.decode_video(str(path), backend=backend)


def test_frame_indices_are_integers_and_no_more_than_the_video_has(tiny_h264):
    """3.7 was truncated to 3, "3" and True taken as 3 and 1; 10,000 repeats of frame 0 made 10,000 output frames
    (3.4 GB). numpy's and torch's integers, and whole floats, are indices."""
    import numpy as np

    for bad, needle in (([1.5, 3], "holds 1.5"), (["3"], "holds '3'"), ([True, 2], "holds True"),
                        (torch.tensor([3.5]), r"holds tensor\(3.5"), ([0] * 49, "lists 49 frames; the video has 48")):
        with pytest.raises(ValueError, match=needle):
            flashcodec.decode_video(str(tiny_h264), frame_indices=bad)
    # whole floats are indices (np.linspace(...).round() is a common way to pick frames)
    for good in ([np.int64(3), 7], torch.tensor([3, 7]), np.linspace(3, 7, 2).round(), torch.tensor([3.0, 7.0]),
                 [0] * 48):
        result = flashcodec.decode_video(str(tiny_h264), frame_indices=good)
        assert len(result.frame_indices) == (48 if len(good) == 48 else 2)


def test_too_few_frames_to_sample_names_the_file(video_factory):
    path = video_factory(codec="h264", suffix=".mp4", width=64, height=48, duration_s=1 / 24, fps=24.0, gop=1)
    with pytest.raises(flashcodec.NoFramesError,
                       match=rf"^{re.escape(str(path))}: the video has 1 frame; sampling needs"):
        flashcodec.decode_video(str(path), backend="pyav")

"""Frames that share a pts (a broken muxer's file): every frame still comes out, in decode order among equals.

The PyAV backend placed a decoded frame by its pts, so of two frames with one pts only one could be placed and the
other was reported as corrupt (half of a file with a coarse clock). It now places frames by decode position, and
counts packets instead of seeking to a pts that names two of them.
"""

import av
import numpy as np
import pytest
import synthetic_video

import flashcodec
from flashcodec.decode.pyav import pts_index

CLIP = dict(codec="h264", suffix=".mp4", width=128, height=96, duration_s=2.0, fps=24.0, gop=12)


def _with_shared_pts(src_path, path, shift: int):
    """``src_path``'s packets (no B-frames: pts == dts) into Matroska, frames ``2k - shift`` and ``2k + 1 - shift``
    sharing one timestamp (``shift`` 1: every keyframe shares its pts with the frame before it)."""
    with av.open(str(src_path)) as src, av.open(str(path), "w") as out:
        stream = out.add_stream_from_template(src.streams.video[0])
        for i, packet in enumerate(p for p in src.demux(src.streams.video[0]) if p.size):
            packet.stream = stream
            packet.pts = packet.dts = (i + shift) // 2 * 84  # ms: two frames at 24 fps
            out.mux(packet)
    return path


@pytest.mark.parametrize("shift", [0, 1])
@pytest.mark.parametrize("num_frames", [48, 8])
def test_frames_sharing_a_pts_all_come_out_in_decode_order(video_factory, tmp_path, shift, num_frames):
    path = _with_shared_pts(video_factory(**CLIP), tmp_path / f"shared{shift}.mkv", shift)
    info = flashcodec.probe(path)
    assert info.num_frames == 48 and pts_index(info)[3]  # the probe keeps every packet, equals in decode order
    assert info.decode_positions.tolist() == list(range(48))
    with flashcodec.DecodeEngine("pyav", num_threads=2) as engine:
        result = engine.decode_video(str(path), num_frames=num_frames)
    assert result.failed_frame_indices == [] and len(result.frame_indices) == num_frames
    for row, display in enumerate(result.frame_indices):
        assert synthetic_video.read_frame_index(result.frames[row].permute(1, 2, 0).numpy()) == display
    whole = flashcodec.decode_video(str(video_factory(**CLIP)), frame_indices=result.frame_indices)
    assert np.array_equal(result.frames.numpy(), whole.frames.numpy())  # the very frames of the clean file


def test_torchcodec_and_nvdec_leave_such_videos_to_pyav(video_factory, tmp_path):
    """torchcodec seeks by pts: asked for 8 frames of such a file it returned neighbours of 5 of them (0, 6, 12, 20,
    26, ... for 0, 7, 13, 20, 27, ...), silently. Its CPU backend hands such a video to PyAV; NVDEC refuses it, so
    the CPU rank decodes it."""
    from flashcodec.devices import video_nvdec_reason

    path = _with_shared_pts(video_factory(**CLIP), tmp_path / "shared.mkv", 0)
    info = flashcodec.probe(path)
    assert "share timestamps" in video_nvdec_reason(info, 0)
    assert video_nvdec_reason(flashcodec.probe(video_factory(**CLIP)), 0) != video_nvdec_reason(info, 0)
    if "torchcodec" not in flashcodec.available_backends():
        pytest.skip("torchcodec is not installed here")
    result = flashcodec.decode_video(str(path), num_frames=8, backend="torchcodec")
    for row, display in enumerate(result.frame_indices):
        assert synthetic_video.read_frame_index(result.frames[row].permute(1, 2, 0).numpy()) == display


def test_a_segment_whose_keyframe_has_its_own_pts_is_sought_not_counted_from_the_start(video_factory, tmp_path,
                                                                                      monkeypatch):
    """Counting packets from the start for every segment of such a file made decoding a long one quadratic: only a
    packet whose pts another frame shares is counted to; the rest are sought as in any file."""
    from flashcodec.decode import pyav

    src = video_factory(**CLIP)
    path = tmp_path / "one-pair.mkv"
    with av.open(str(src)) as clean, av.open(str(path), "w") as out:
        stream = out.add_stream_from_template(clean.streams.video[0])
        for i, packet in enumerate(p for p in clean.demux(clean.streams.video[0]) if p.size):
            packet.stream = stream
            packet.pts = packet.dts = (i - (i == 6)) * 42  # frames 5 and 6 share a pts; keyframes 0, 12, 24, 36
            out.mux(packet)
    info = flashcodec.probe(path)
    assert pts_index(info)[3] == {int(info.frame_pts[5])} and info.frame_pts[5] == info.frame_pts[6]
    opens = []
    real_open = pyav.PyAVSegmentDecoder._open
    monkeypatch.setattr(pyav.PyAVSegmentDecoder, "_open", lambda self: opens.append(1) or real_open(self))
    wanted = [37, 40, 47, 5, 6]  # a late GOP first, then the shared pair's GOP: both keyframes' pts are their own
    with flashcodec.DecodeEngine("pyav", num_threads=1) as engine:
        late = engine.decode_video(str(path), frame_indices=wanted[:3])
        assert len(opens) == 1  # counted from the start, it was opened a second time
        pair = engine.decode_video(str(path), frame_indices=wanted[3:])
        assert len(opens) == 2  # its own decoder, sought to frame 0 (counting reopened it: 4)
    for result, asked in ((late, wanted[:3]), (pair, wanted[3:])):
        assert result.failed_frame_indices == [] and result.frame_indices == sorted(asked)
        for row, display in enumerate(result.frame_indices):
            assert synthetic_video.read_frame_index(result.frames[row].permute(1, 2, 0).numpy()) == display

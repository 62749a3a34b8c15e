"""flashcodec.decode.pyav: a probe's shared pts index, a stream that starts mid-GOP, pictures that grow midway."""

import av
import numpy as np
import pytest

import flashcodec


def test_segment_decoders_of_one_probe_share_its_pts_index(tiny_h264):
    from flashcodec.decode.pyav import PyAVSegmentDecoder, pts_index
    from flashcodec.source import Source

    info = flashcodec.probe(tiny_h264)
    a = PyAVSegmentDecoder(Source.of(tiny_h264), info, 32, 32)
    b = PyAVSegmentDecoder(Source.of(tiny_h264), info, 32, 32)
    assert a._pts_by_position is b._pts_by_position and a._display_by_pts is b._display_by_pts  # built once
    pts_by_position, display_by_pts, display_by_position, shared = pts_index(info)
    assert pts_by_position[info.decode_positions].tolist() == info.frame_pts.tolist()
    assert [display_by_pts[int(p)] for p in info.frame_pts] == list(range(info.num_frames))
    assert display_by_position[info.decode_positions].tolist() == list(range(info.num_frames)) and not shared
    with pytest.raises(ValueError):  # shared by every thread's decoder: nobody may write it
        pts_by_position[0] = 1
    with pytest.raises(ValueError):
        display_by_position[0] = 1
    assert pts_index(flashcodec.probe(tiny_h264))[0] is not pts_by_position  # a new probe, its own index


@pytest.mark.parametrize("suffix", [".mkv", ".mp4"])
def test_a_stream_that_starts_mid_gop_fails_its_first_frames_cleanly_and_decodes_the_rest(tiny_h264, tmp_path, remux,
                                                                                          suffix):
    """Without its first keyframe the stream's first frames cannot be decoded: a CorruptVideoError naming them, and
    with on_corrupt="repeat" the rest. The segment from packet 0 used to seek to a keyframe that is not there: Matroska
    landed on the next one (an EOFError traceback), MP4 refused the seek (av's PermissionError, "Operation not
    permitted")."""
    path = remux(tiny_h264, tmp_path / f"nokey{suffix}", drop=1)
    with pytest.raises(flashcodec.CorruptVideoError, match="sampled frames could not be decoded"):
        flashcodec.decode_video(str(path), backend="pyav")
    result = flashcodec.decode_video(str(path), backend="pyav", on_corrupt="repeat")
    assert result.frames.shape[0] == 4 and result.failed_frame_indices == [0]


def test_a_seek_that_lands_past_its_packet_demuxes_no_further(tiny_h264, tmp_path, remux, monkeypatch):
    """Matroska seeks to the next keyframe when none is at or before the packet (a stream that starts mid-GOP):
    the first packet past it ends that search, and the decoder starts again from the top, instead of demuxing the
    rest of the file first (36 of 47 packets here; a long video's whole file)."""
    from flashcodec.decode import pyav

    path = remux(tiny_h264, tmp_path / "nokey.mkv", drop=1)  # 47 packets, keyframes at 11, 23, 35
    demuxed = []

    class Counting:  # the container, its demux counted
        def __init__(self, container):
            self._container = container

        def __getattr__(self, name):
            return getattr(self._container, name)

        def demux(self, *streams):
            for packet in self._container.demux(*streams):
                demuxed[-1] += 1
                yield packet

    opened = pyav.PyAVSegmentDecoder._open

    def counting_open(self):
        opened(self)
        self._container = Counting(self._container)

    monkeypatch.setattr(pyav.PyAVSegmentDecoder, "_open", counting_open)
    original_scan = pyav.PyAVSegmentDecoder._scan_to

    def scan(self, *args, **kwargs):
        demuxed.append(0)
        return original_scan(self, *args, **kwargs)

    monkeypatch.setattr(pyav.PyAVSegmentDecoder, "_scan_to", scan)
    result = flashcodec.decode_video(str(path), backend="pyav", on_corrupt="repeat", num_threads=1)
    assert result.failed_frame_indices == [0]
    # the seek for position 0 landed on the keyframe at 11, past it: one packet (37 before, to the end of the
    # file); then the search from the top found it
    assert demuxed[0] == 1 and len(demuxed) > 1, demuxed


def _size_switch_ts(path, small=(64, 48), large=(128, 96), n_small=8, n_large=4):
    """One H.264 transport stream whose pictures grow midway (its header says ``small``)."""
    parts = []
    for (w, h), n in ((small, n_small), (large, n_large)):
        part = path.with_suffix(f".{w}.ts")
        with av.open(str(part), "w", format="mpegts") as out:
            stream = out.add_stream("libx264", rate=24)
            stream.width, stream.height, stream.options = w, h, {"preset": "ultrafast", "g": "4", "bf": "0"}
            for i in range(n):
                frame = av.VideoFrame.from_ndarray(np.full((h, w, 3), 40 * i % 255, np.uint8), format="rgb24")
                frame.pts = i
                for packet in stream.encode(frame):
                    out.mux(packet)
            for packet in stream.encode():
                out.mux(packet)
        with av.open(str(part)) as src:
            parts.append([p for p in src.demux(src.streams.video[0]) if p.size])
    with av.open(str(path), "w", format="mpegts") as out, av.open(str(path.with_suffix(f".{small[0]}.ts"))) as t:
        stream = out.add_stream_from_template(t.streams.video[0])
        offset = 0
        for packets in parts:
            base = min(p.pts for p in packets)
            for p in packets:
                p.pts, p.dts, p.stream = p.pts - base + offset, p.dts - base + offset, stream
                out.mux(p)
            offset = max(p.pts for p in packets) + 3750
    return path


def test_pictures_that_grow_past_the_cap_midway_are_not_decoded(tmp_path):
    """The probe checks the header's size; a stream may change size later (a 12000x12000 picture after 64x48 ones
    was decoded at 1.3 GB): the PyAV decoders refuse pictures well past the engine's cap, which count as corrupt
    frames; pictures within it decode, whatever their padding (FFmpeg counts 50x48 as 64x48)."""
    from flashcodec.decode.pyav import decoder_pixel_limit

    path = _size_switch_ts(tmp_path / "switch.ts", small=(200, 150), large=(600, 450))
    info = flashcodec.probe(str(path))
    assert (info.width, info.height, info.num_frames) == (200, 150, 12)
    frames = list(range(12))
    with flashcodec.DecodeEngine("pyav", cpu_threads=1) as engine:  # the default cap: 8K
        assert engine.decode_video(str(path), frame_indices=frames).failed_frame_indices == []
    assert decoder_pixel_limit(200 * 150) < 600 * 450
    with flashcodec.DecodeEngine("pyav", cpu_threads=1, max_source_pixels=200 * 150) as engine:
        with pytest.raises(flashcodec.CorruptVideoError, match=r"4 of 12 sampled frames could not be decoded"):
            engine.decode_video(str(path), frame_indices=frames)
        capped = engine.decode_video(str(path), frame_indices=frames, on_corrupt="repeat")
    assert capped.failed_frame_indices == [8, 9, 10, 11]
    # a cap of exactly its stored size: a picture whose width FFmpeg pads (370 -> 384) still decodes
    odd = _size_switch_ts(tmp_path / "odd.ts", small=(370, 250), large=(370, 250))
    assert decoder_pixel_limit(370 * 250) > 1 << 16  # past the floor: the padding allowance is what lets it in
    with flashcodec.DecodeEngine("pyav", cpu_threads=1, max_source_pixels=370 * 250) as engine:
        assert engine.decode_video(str(odd), frame_indices=frames).failed_frame_indices == []

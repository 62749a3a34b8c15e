"""The probe reads metadata, display-order pts and the GOP table without decoding the video."""

import enum
import types

import av
import numpy as np
import pytest

import flashcodec
from flashcodec import NoFramesError, NotAVideoError, SourceNotFoundError, UnsupportedCodecError
from flashcodec import _probe as probe_module
from flashcodec._probe import probe

TINY = dict(width=128, height=96, duration_s=2.0, fps=24.0, gop=12)


def decoded_pts(path):
    with av.open(str(path)) as c:
        return sorted(f.pts for f in c.decode(video=0))


@pytest.mark.parametrize("codec,suffix,extra", [
    ("h264", ".mp4", dict(bframes=2)), ("h264", ".mkv", {}), ("h264", ".mov", {}), ("h264", ".avi", {}),
    ("hevc", ".mp4", dict(bframes=2)), ("vp9", ".webm", dict(preset="realtime")), ("av1", ".mkv", {}),
    ("mpeg4", ".avi", {}),
])
def test_probe_matches_a_full_decode(video_factory, codec, suffix, extra):
    path = video_factory(codec=codec, suffix=suffix, **TINY, **extra)
    info = flashcodec.probe(path)
    assert info.codec in (codec, "libdav1d") and (info.width, info.height) == (128, 96)
    assert info.num_frames == 48
    assert info.frame_pts.tolist() == decoded_pts(path)
    assert info.average_fps == pytest.approx(24.0, rel=0.01)
    assert info.duration_s == pytest.approx(2.0, rel=0.05)
    assert info.keyframe_indices[0] == 0 and len(info.gops) == info.num_keyframes
    assert sum(g.num_frames for g in info.gops) == 48
    if codec in ("h264", "hevc"):
        assert info.keyframe_indices == list(range(0, 48, 12))  # closed GOPs of 12


def test_bframes_make_decode_order_differ_from_display_order(video_factory):
    info = flashcodec.probe(video_factory(codec="h264", suffix=".mp4", bframes=3, **TINY))
    assert sorted(info.decode_positions.tolist()) == list(range(48))
    assert info.decode_positions.tolist() != list(range(48))


def test_open_gop_has_leading_frames_shown_before_their_keyframe(video_factory):
    info = flashcodec.probe(video_factory(codec="h264", suffix=".mkv", bframes=2, open_gop=True, **TINY))
    gops = info.gops
    assert len(gops) > 1
    # some frame decoded after the second keyframe is displayed before it
    order = np.argsort(info.decode_positions)  # decode position -> display index
    second = gops[1]
    assert any(order[p] < second.keyframe_index for p in range(second.start_position, second.end_position))


def test_variable_frame_rate(video_factory):
    info = flashcodec.probe(video_factory(codec="h264", suffix=".mkv", vfr=True, **TINY))
    assert info.is_vfr
    deltas = np.diff(info.frame_pts)
    assert deltas.max() > deltas.min()


def test_rotation_and_display_size(video_factory):
    # FFmpeg reports the display matrix's angle anticlockwise: the generator's 90 (clockwise) is 270.
    info = flashcodec.probe(video_factory(codec="h264", suffix=".mp4", rotation=90, **TINY))
    assert info.rotation in (90, 270)
    assert (info.display_width, info.display_height) == (96, 128)
    info = flashcodec.probe(video_factory(codec="h264", suffix=".mp4", rotation=180, **TINY))
    assert info.rotation == 180 and (info.display_width, info.display_height) == (128, 96)


def test_frame_count_comes_from_the_packets_not_the_header(video_factory):
    # Matroska/WebM headers carry no frame count; the probe counts packets.
    info = flashcodec.probe(video_factory(codec="vp9", suffix=".webm", preset="realtime", **TINY))
    assert info.header_num_frames in (None, 48) and info.num_frames == 48


def test_sources_and_json(tiny_h264):
    a = flashcodec.probe(tiny_h264)
    b = flashcodec.probe(tiny_h264.read_bytes())
    assert a.to_dict() == b.to_dict()
    assert a.to_dict()["num_frames"] == 48 and len(a.to_dict()["frame_pts"]) == 48


def test_bad_inputs(tmp_path, tiny_h264):
    with pytest.raises(SourceNotFoundError):
        flashcodec.probe(tmp_path / "missing.mp4")
    text = tmp_path / "notes.mp4"
    text.write_text("not a video at all\n" * 50)
    with pytest.raises(NotAVideoError):
        flashcodec.probe(text)
    with pytest.raises(NotAVideoError):
        flashcodec.probe(b"")


def test_container_without_video_stream(tmp_path):
    path = tmp_path / "audio.wav"
    with av.open(str(path), "w") as c:
        s = c.add_stream("pcm_s16le", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), dtype=np.int16), format="s16", layout="mono")
        frame.sample_rate = 8000
        for p in s.encode(frame):
            c.mux(p)
    with pytest.raises(NotAVideoError, match="no video stream"):
        flashcodec.probe(path)


def test_zero_frames(tmp_path, video_factory):
    # A Matroska file cut right after its first cluster header: a video track, no packets.
    data = video_factory(codec="h264", suffix=".mkv", **TINY).read_bytes()
    cluster = data.find(bytes.fromhex("1F43B675"))
    path = tmp_path / "empty.mkv"
    path.write_bytes(data[:cluster + 8])
    with pytest.raises(NoFramesError):
        flashcodec.probe(path)


def test_unsupported_codec(tmp_path, video_factory):
    # An AVI whose codec tag no decoder knows.
    data = bytearray(video_factory(codec="mpeg4", suffix=".avi", **TINY).read_bytes())
    for tag in (b"FMP4", b"fmp4", b"XVID", b"xvid", b"DIVX", b"divx", b"DX50", b"mp4v"):
        data = data.replace(tag, b"QQQQ")
    path = tmp_path / "unknown.avi"
    path.write_bytes(bytes(data))
    with pytest.raises(UnsupportedCodecError):
        flashcodec.probe(path)


# --- the fast open: FFmpeg's stream-info pass decodes no picture ----------------------------------------------------


@pytest.mark.parametrize("spec", [
    dict(codec="h264", bframes=2, suffix=".mp4"),
    dict(codec="h264", pix_fmt="yuv444p", suffix=".mp4"),
    dict(codec="h264", pix_fmt="yuv420p10le", suffix=".mkv"),
    dict(codec="h264", rotation=90, suffix=".mp4"),
    dict(codec="h264", vfr=True, suffix=".mkv"),
    dict(codec="h264", bframes=2, suffix=".mov"),
    dict(codec="hevc", bframes=2, suffix=".mp4"),
    dict(codec="vp9", suffix=".webm"),
    dict(codec="av1", suffix=".mkv"),
    dict(codec="mpeg4", bframes=1, suffix=".avi"),
])
def test_the_fast_probe_reads_what_a_full_open_reads(video_factory, monkeypatch, spec):
    path = video_factory(duration_s=1.0, **spec)
    fast = probe(path)
    monkeypatch.setattr(probe_module, "FAST_PROBE_OPTIONS", None)
    full = probe(path)
    assert fast.to_dict() == full.to_dict()
    assert fast.pix_fmt == full.pix_fmt and fast.pix_fmt  # from the first keyframe when the fast pass left it out
    assert (fast.decode_positions == full.decode_positions).all()


def test_a_stream_the_fast_pass_cannot_size_is_opened_again(tiny_h264, monkeypatch):
    opened = []
    real_open = probe_module._open_container

    def spy(source, options=None):
        opened.append(options)
        return real_open(source, options)

    monkeypatch.setattr(probe_module, "_open_container", spy)
    monkeypatch.setattr(probe_module, "_stream_known", lambda container: False)
    assert probe(tiny_h264).num_frames == 48
    assert opened == [probe_module.FAST_PROBE_OPTIONS, None]


def test_a_tag_that_is_not_utf8_does_not_make_the_video_unreadable(tiny_h264, tmp_path):
    """A Latin-1 title made PyAV's open raise UnicodeDecodeError (no file name, no flashcodec error) for a video
    ffprobe reads: tags are read with undecodable bytes replaced."""
    tagged = tmp_path / "tagged.mp4"
    with av.open(str(tiny_h264)) as src, av.open(str(tagged), "w") as out:
        out.metadata["title"] = "Cafe_ZZ_title"
        stream = out.add_stream_from_template(src.streams.video[0])
        for packet in src.demux(src.streams.video[0]):
            if packet.size:
                packet.stream = stream
                out.mux(packet)
    raw = tagged.read_bytes()
    assert raw.count(b"_ZZ_") == 1
    latin1 = tmp_path / "latin1.mp4"
    latin1.write_bytes(raw.replace(b"_ZZ_", b"\xe9 ZZ"))
    info = flashcodec.probe(str(latin1))
    assert info.num_frames == flashcodec.probe(str(tiny_h264)).num_frames
    assert flashcodec.decode_video(str(latin1), backend="pyav", num_frames=4).frames.shape[0] == 4


def test_a_stream_with_more_frames_than_the_cap_is_refused_during_the_scan(tiny_h264, monkeypatch):
    """The probe's time and memory grow with the packets (10M one-byte packets: 21 s and 755 MB): at most
    MAX_VIDEO_FRAMES, refused as the scan passes it."""
    monkeypatch.setattr(probe_module, "MAX_VIDEO_FRAMES", 48)  # the clip's own count: fits
    assert probe(str(tiny_h264)).num_frames == 48
    monkeypatch.setattr(probe_module, "MAX_VIDEO_FRAMES", 47)
    with pytest.raises(flashcodec.VideoTooLargeError, match=r"more than 47 frames; flashcodec reads at most 47"):
        probe(str(tiny_h264))


def test_a_packet_without_timestamps_after_timed_ones_is_named(tiny_h264, monkeypatch):
    """Only a stream untimed from its first packet is taken for a raw stream; a later untimed packet is named, as
    the place where the file's timing breaks (its frames could not be placed either)."""
    opened = probe_module._open_container

    class OneUntimed:
        def __init__(self, container):
            self._container = container

        def __getattr__(self, name):
            return getattr(self._container, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._container.close()

        def demux(self, *streams):
            for i, packet in enumerate(self._container.demux(*streams)):
                if i == 5:
                    packet.pts = packet.dts = None
                yield packet

    monkeypatch.setattr(probe_module, "_open_container", lambda *a, **k: OneUntimed(opened(*a, **k)))
    with pytest.raises(flashcodec.CorruptVideoError, match=r"packet 5 of the video stream carries no timestamp"):
        probe(str(tiny_h264))


class _SideData(bytes):
    """Display-matrix side data as PyAV hands it: its bytes, and its ``type`` (an enum member)."""

    def __new__(cls, matrix, kind):
        made = super().__new__(cls, np.asarray(matrix, dtype=np.int32).tobytes())
        made.type = kind
        return made


class _SideDataMap(dict):
    """PyAV 19's ``Frame.side_data``: a mapping whose iteration yields the side-data types (keys)."""


@pytest.mark.parametrize("pyav", [18, 19])
def test_the_display_matrix_is_read_from_either_pyav_side_data_shape(pyav):
    """PyAV 18 iterates a frame's SideData objects; PyAV 19 iterates their types (its container is a Mapping):
    reading ``.type`` off a 19 key raised AttributeError, and every video open failed on the GPU machine."""
    kind = enum.Enum("Type", "SEI_UNREGISTERED DISPLAYMATRIX")
    other = _SideData([0] * 9, kind.SEI_UNREGISTERED)
    mirrored_quarter = _SideData((0, -1 << 16, 0, -1 << 16, 0, 0, 0, 0, 1 << 30), kind.DISPLAYMATRIX)  # 90 + hflip
    side = [other, mirrored_quarter] if pyav == 18 else _SideDataMap({d.type: d for d in (other, mirrored_quarter)})
    frame = types.SimpleNamespace(side_data=side, rotation=0)
    assert probe_module.frame_orientation(frame) == (90, True)
    assert probe_module.frame_orientation(types.SimpleNamespace(side_data=_SideDataMap(), rotation=-90)) == (270, False)


@pytest.mark.parametrize("version,passed", [("18.1.0", {"metadata_errors": "replace"}), ("19.0.2", {})])
def test_containers_are_opened_with_the_arguments_the_installed_pyav_takes(monkeypatch, version, passed):
    """PyAV 19 removed av.open's metadata_errors (TypeError: every open failed on the GPU machine's 19.0.2)."""
    calls = []
    monkeypatch.setattr(av, "__version__", version)
    monkeypatch.setattr(av, "open", lambda file, mode, options, **kw: calls.append((file, mode, options, kw)))
    probe_module.open_input("clip.mp4", {"probesize": "32"})
    assert calls == [("clip.mp4", "r", {"probesize": "32"}, passed)]

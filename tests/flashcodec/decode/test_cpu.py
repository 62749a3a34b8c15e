"""flashcodec.decode.cpu: the torchcodec CPU backend's frames against PyAV's, and videos torchcodec cannot open."""

import pytest
import torch
import synthetic_video

import flashcodec

TINY = dict(width=128, height=96, duration_s=2.0, fps=24.0, gop=12)


@pytest.mark.parametrize("codec,suffix", [("h264", ".mp4"), ("hevc", ".mkv"), ("vp9", ".webm")])
def test_torchcodec_backend_returns_the_same_frames(video_factory, codec, suffix):
    pytest.importorskip("torchcodec.decoders")
    path = video_factory(codec=codec, suffix=suffix, bframes=2 if codec != "vp9" else 0, **TINY)
    with flashcodec.DecodeEngine("torchcodec", num_threads=2) as engine:
        result = engine.decode_video(path, fps=12.0)
    with flashcodec.DecodeEngine("pyav", num_threads=1) as engine:
        reference = engine.decode_video(path, fps=12.0)
    assert result.frames.shape == reference.frames.shape
    for row, display in enumerate(result.frame_indices):
        assert synthetic_video.read_frame_index(result.frames[row].permute(1, 2, 0).numpy()) == display
    # torchcodec scales with its own filter; the pictures agree closely, not bit for bit
    diff = (result.frames.float() - reference.frames.float()).abs().mean().item()
    assert diff < 8.0


@pytest.mark.skipif("torchcodec" not in flashcodec.available_backends(), reason="torchcodec not installed")
def test_a_video_torchcodec_cannot_open_is_decoded_by_pyav(tiny_h264, tmp_path, remux, caplog):
    """torchcodec 0.13 opens no MPEG-TS file ("FrameDims.height must be > 0"); its backend hands the video to PyAV,
    and says so once."""
    path = remux(tiny_h264, tmp_path / "stream.ts")
    caplog.set_level("INFO", logger="flashcodec")
    ours = flashcodec.decode_video(str(path), num_frames=6, backend="torchcodec")
    pyav = flashcodec.decode_video(str(path), num_frames=6, backend="pyav")
    assert ours.frame_indices == pyav.frame_indices and torch.equal(ours.frames, pyav.frames)
    opened = flashcodec.decode_video(str(tiny_h264), num_frames=6, backend="torchcodec")  # no notice for a good one
    assert opened.failed_frame_indices == []
    notices = {r.getMessage() for r in caplog.records if "decoding it with PyAV" in r.getMessage()}
    from flashcodec.decode.cpu import TorchCodecSegmentDecoder
    from flashcodec.source import Source

    try:  # (a torchcodec that opens it decodes it itself, and says nothing)
        TorchCodecSegmentDecoder(Source(str(path)), flashcodec.probe(str(path)), 64, 64).close()
        opens = True
    except flashcodec.CorruptVideoError:
        opens = False
    assert len(notices) == (0 if opens else 1), notices


@pytest.mark.skipif("torchcodec" not in flashcodec.available_backends(), reason="torchcodec not installed")
def test_a_file_torchcodec_cannot_open_is_one_clear_error(tiny_h264, tmp_path):
    """torchcodec's open raises a plain, three-line ValueError or RuntimeError (a file that changed after its
    probe, here one that is no video any more)."""
    from flashcodec.decode.cpu import TorchCodecSegmentDecoder
    from flashcodec.source import Source

    info = flashcodec.probe(str(tiny_h264))
    garbage = tmp_path / "changed.mp4"
    garbage.write_bytes(b"\x00" * 4096)
    with pytest.raises(flashcodec.CorruptVideoError, match=r"changed.mp4: torchcodec cannot open the video \("):
        TorchCodecSegmentDecoder(Source(str(garbage)), info, 64, 64)
    from flashcodec._errors import error_line

    assert error_line(ValueError("first line\nThis should never happen.\nPlease report")) == "first line"

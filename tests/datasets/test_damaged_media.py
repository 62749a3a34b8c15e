"""Tests for datasets/damaged_media.py (truncated and corrupted copies of clips)."""

from __future__ import annotations

import av
import pytest

import damaged_media as dm
from frame_code import try_read_frame_index

SMALL = dict(width=128, height=96, duration_s=1.0, fps=24.0, gop=8)


def packets(path):
    with av.open(str(path)) as c:
        return [(p.pts, p.dts, p.is_keyframe, p.size) for p in c.demux(video=0) if p.size]


def test_truncate(tiny_h264, video_factory, tmp_path):
    src = tiny_h264.read_bytes()
    dst = dm.truncate_file(tiny_h264, tmp_path / "t.mp4", keep_fraction=0.5)
    data = dst.read_bytes()
    assert len(data) == len(src) // 2 and src.startswith(data) and data != src
    # mkv is streamable: the truncated file opens and yields a prefix of the frames
    mkv = video_factory(codec="h264", suffix=".mkv", **dict(SMALL, duration_s=2.0))
    cut = dm.truncate_file(mkv, tmp_path / "t.mkv", keep_fraction=0.5)
    got = []
    with av.open(str(cut)) as c:
        try:
            for f in c.decode(video=0):
                got.append(try_read_frame_index(f))
        except av.error.FFmpegError:
            pass
    assert 0 < len(got) < 48 and got[:5] == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError):
        dm.truncate_file(mkv, tmp_path / "x.mkv", keep_fraction=0)


@pytest.mark.parametrize(
    "codec,suffix,bframes", [("h264", ".mp4", 2), ("hevc", ".mkv", 0), ("vp9", ".webm", 0)]
)
def test_corrupt_middle(video_factory, tmp_path, codec, suffix, bframes):
    src = video_factory(codec=codec, bframes=bframes, suffix=suffix, **dict(SMALL, duration_s=2.0))
    dst = dm.corrupt_middle(src, tmp_path / f"bad{suffix}", seed=1)
    a, b = src.read_bytes(), dst.read_bytes()
    assert len(a) == len(b) and a != b
    # container untouched: demuxing yields the same packets (sizes, timestamps)
    assert packets(src) == packets(dst)
    # ...but decoding the middle GOP yields errors or wrong/garbage frames
    got, errors = [], 0
    with av.open(str(dst)) as c:
        s = c.streams.video[0]
        for pkt in c.demux(s):
            try:
                got.extend(try_read_frame_index(f) for f in s.decode(pkt))
            except av.error.FFmpegError:
                errors += 1
    good = [k for k, i in enumerate(got) if i == k]
    assert errors > 0 or len(good) < 48
    assert got[:8] == list(range(8)), "the first GOP is intact"
    assert dm.corrupt_middle(src, tmp_path / f"bad2{suffix}", seed=1).read_bytes() == b

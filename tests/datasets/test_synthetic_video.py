"""Tests for datasets/synthetic_video.py (synthetic clips, their cache and the CLI)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import av
import numpy as np
import pytest

import frame_code
import synthetic_video as sv

SMALL = dict(width=128, height=96, duration_s=1.0, fps=24.0, gop=8)

# (codec, container suffix, bframes)
ROUNDTRIPS = [
    ("h264", ".mp4", 2),
    ("h264", ".mkv", 0),
    ("h264", ".mov", 1),
    ("hevc", ".mp4", 2),
    ("hevc", ".mkv", 0),
    ("vp9", ".webm", 0),
    ("vp9", ".mkv", 0),
    ("av1", ".mp4", 0),
    ("av1", ".webm", 0),
    ("mpeg4", ".avi", 2),
    ("mpeg4", ".mp4", 0),
]


def decode_all(path, scale=1):
    """[(display index read from the frame, index at 1/scale, frame)] in output order."""
    out = []
    with av.open(str(path)) as c:
        for f in c.decode(video=0):
            small = None
            if scale > 1:
                small = frame_code.try_read_frame_index(
                    f.reformat(width=f.width // scale, height=f.height // scale, format="rgb24")
                )
            out.append((frame_code.try_read_frame_index(f.to_ndarray(format="rgb24")), small, f))
    return out


def packets(path):
    with av.open(str(path)) as c:
        return [(p.pts, p.dts, p.is_keyframe, p.size) for p in c.demux(video=0) if p.size]


# ---------------------------------------------------------------------------
# round trips
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("codec,suffix,bframes", ROUNDTRIPS, ids=lambda v: str(v))
def test_roundtrip(video_factory, codec, suffix, bframes):
    path = video_factory(codec=codec, bframes=bframes, suffix=suffix, **SMALL)
    assert path.suffix == suffix and path.stat().st_size > 0
    n = len(sv.frame_times(duration_s=1.0, fps=24.0))
    assert n == 24
    frames = decode_all(path, scale=4)
    assert len(frames) == n
    for _, _, f in frames:
        assert (f.width, f.height) == (128, 96)
    # display order, also readable at 1/4 scale (32x24)
    assert [full for full, _, _ in frames] == list(range(n))
    assert [small for _, small, _ in frames] == list(range(n))
    # regular GOPs: keyframes exactly every `gop` frames in display order
    keys = [full for full, _, f in frames if f.key_frame]
    assert keys == list(range(0, n, SMALL["gop"]))
    with av.open(str(path)) as c:
        assert c.streams.video[0].codec_context.codec.canonical_name == codec


def test_tiny_h264_fixture(tiny_h264):
    frames = decode_all(tiny_h264)
    assert [i for i, _, _ in frames] == list(range(48))
    assert [i for i, _, f in frames if f.key_frame] == [0, 12, 24, 36]
    pk = packets(tiny_h264)
    assert any(b[0] < a[0] for a, b in zip(pk, pk[1:])), "expected B-frames"


@pytest.mark.parametrize("codec", ["h264", "hevc", "mpeg4"])
def test_bframes_reorder(video_factory, codec):
    with_b = packets(video_factory(codec=codec, bframes=2, suffix=".mkv", **SMALL))
    no_b = packets(video_factory(codec=codec, bframes=0, suffix=".mkv", **SMALL))
    pts_b = [p[0] for p in with_b]
    assert pts_b != sorted(pts_b), "B-frames: decode order differs from display order"
    pts_0 = [p[0] for p in no_b]
    assert pts_0 == sorted(pts_0)


@pytest.mark.parametrize("codec", ["h264", "hevc", "mpeg4"])
@pytest.mark.parametrize("open_gop", [False, True])
def test_gop_structure(video_factory, codec, open_gop):
    """Fixed B-run length (no adaptive B decisions); open GOPs lead into the
    keyframe with B-frames, closed GOPs end on a P-frame."""
    path = video_factory(codec=codec, bframes=2, open_gop=open_gop, suffix=".mkv", **SMALL)
    frames = decode_all(path)
    assert [i for i, _, _ in frames] == list(range(24))
    types = "".join(" IPB"[int(f.pict_type)] for _, _, f in frames)
    gop = "IBBPBBPB" if open_gop else "IBBPBBPP"
    assert types[:16] == gop * 2


@pytest.mark.parametrize("codec,suffix", [("h264", ".mp4"), ("hevc", ".mkv"), ("vp9", ".webm")])
def test_vfr(video_factory, codec, suffix):
    kw = dict(SMALL, vfr=True, seed=3)
    path = video_factory(codec=codec, suffix=suffix, **kw)
    expected = sv.frame_times(duration_s=1.0, fps=24.0, vfr=True, seed=3)
    frames = decode_all(path)
    assert [i for i, _, _ in frames] == list(range(len(expected)))
    times = [f.time for _, _, f in frames]
    assert times == pytest.approx([float(t) for t in expected], abs=1.5e-3)
    steps = np.diff(times) * 24.0  # in nominal frame durations
    assert np.allclose(steps, np.round(steps), atol=0.05)  # (mkv: 1 ms timestamps)
    assert set(np.round(steps).astype(int)) == {1, 2}
    with av.open(str(path)) as c:
        s = c.streams.video[0]
        # no constant rate advertised: average differs from the nominal rate
        assert s.average_rate is None or float(s.average_rate) != pytest.approx(24.0)


def test_vfr_mp4_ffprobe(video_factory):
    ffprobe = shutil.which("ffprobe")
    if not ffprobe:
        pytest.skip("ffprobe not installed")
    path = video_factory(codec="h264", vfr=True, suffix=".mp4", **SMALL)
    out = subprocess.run(
        [ffprobe, "-v", "error", "-select_streams", "v", "-show_entries",
         "stream=r_frame_rate,avg_frame_rate", "-of", "csv=p=0", str(path)],
        capture_output=True, text=True, check=True,
    ).stdout.strip()
    r, avg = out.split(",")
    assert r == "24/1" and avg != r


@pytest.mark.parametrize("rotation", [90, 180, 270])
@pytest.mark.parametrize("suffix", [".mp4", ".mkv"])
def test_rotation(video_factory, rotation, suffix):
    path = video_factory(codec="h264", rotation=rotation, suffix=suffix, **dict(SMALL, duration_s=0.25))
    assert sv.probe_rotation(path) == rotation
    with av.open(str(path)) as c:
        f = next(c.decode(video=0))
        # PyAV reports counter-clockwise degrees in [-180, 180]
        assert f.rotation % 360 == (-rotation) % 360
        # pixels are stored unrotated
        assert (f.width, f.height) == (128, 96)
        rgb = f.to_ndarray(format="rgb24")
    assert frame_code.read_frame_index(rgb) == 0
    displayed = np.rot90(rgb, k=-(rotation // 90))  # what a player shows (clockwise)
    assert frame_code.read_frame_index(displayed, rotation=rotation) == 0
    assert displayed.shape[:2] == ((96, 128) if rotation == 180 else (128, 96))


def test_rotation_ffprobe(video_factory):
    ffprobe = shutil.which("ffprobe")
    if not ffprobe:
        pytest.skip("ffprobe not installed")
    path = video_factory(codec="h264", rotation=90, suffix=".mp4", **dict(SMALL, duration_s=0.25))
    out = subprocess.run(
        [ffprobe, "-v", "error", "-select_streams", "v", "-show_streams", str(path)],
        capture_output=True, text=True, check=True,
    ).stdout
    assert "Display Matrix" in out and "rotation=-90" in out


def test_no_rotation(video_factory):
    assert sv.probe_rotation(video_factory(codec="h264", suffix=".mp4", **SMALL)) == 0


@pytest.mark.parametrize(
    "codec,pix_fmt", [("h264", "yuv444p"), ("hevc", "yuv420p10le"), ("vp9", "yuv420p")]
)
def test_pix_fmt(video_factory, codec, pix_fmt):
    suffix = ".webm" if codec == "vp9" else ".mkv"
    path = video_factory(codec=codec, pix_fmt=pix_fmt, suffix=suffix, **dict(SMALL, duration_s=0.5))
    frames = decode_all(path)
    assert frames[0][2].format.name == pix_fmt
    assert [i for i, _, _ in frames] == list(range(12))


def test_deterministic(video_factory, tmp_path):
    a = sv.make_video(tmp_path / "a.mp4", codec="h264", bframes=2, **SMALL)
    b = sv.make_video(tmp_path / "b.mp4", codec="h264", bframes=2, **SMALL)
    assert a.read_bytes() == b.read_bytes()
    c = sv.make_video(tmp_path / "c.mp4", codec="h264", bframes=2, seed=1, **SMALL)
    assert c.read_bytes() != a.read_bytes()
    fa, fc = decode_all(a), decode_all(c)
    assert [i for i, _, _ in fc] == list(range(24))  # same codes, different texture
    assert not np.array_equal(fa[5][2].to_ndarray(), fc[5][2].to_ndarray())


def test_frames_distinct(tiny_h264):
    frames = [f.to_ndarray(format="gray") for _, _, f in decode_all(tiny_h264)]
    for a, b in zip(frames, frames[1:]):
        # not only the code strip changes: the textured part moves too
        lower = slice(a.shape[0] // 2, None)
        assert np.abs(a[lower].astype(int) - b[lower].astype(int)).mean() > 2


# ---------------------------------------------------------------------------
# argument checking
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,kwargs,match",
    [
        ("x.webm", dict(codec="hevc"), "cannot be stored"),
        ("x.mp4", dict(codec="mjpeg"), "unknown codec"),
        ("x.flv", dict(), "unsupported container"),
        ("x.mp4", dict(width=127), "even"),
        ("x.webm", dict(codec="vp9", bframes=2), "no B-frames"),
        ("x.avi", dict(vfr=True), "variable frame rate"),
        ("x.avi", dict(rotation=90), "rotation"),
        ("x.mp4", dict(rotation=45), "rotation"),
        ("x.mp4", dict(gop=4, bframes=4), "smaller than gop"),
        ("x.mp4", dict(codec="hevc", width=8, height=8), "at least 16"),
    ],
)
def test_bad_arguments(tmp_path, name, kwargs, match):
    with pytest.raises(ValueError, match=match):
        sv.make_video(tmp_path / name, **kwargs)
    assert not (tmp_path / name).exists()


# ---------------------------------------------------------------------------
# cache and CLI
# ---------------------------------------------------------------------------


def test_cached_video(tmp_path, monkeypatch):
    spec = dict(codec="h264", width=64, height=48, duration_s=0.25, suffix=".mkv")
    p1 = sv.cached_video(spec, cache_dir=tmp_path)
    assert p1.parent == tmp_path and p1.suffix == ".mkv" and p1.exists()
    mtime = p1.stat().st_mtime_ns
    p2 = sv.cached_video(dict(spec), cache_dir=tmp_path)
    assert p2 == p1 and p2.stat().st_mtime_ns == mtime  # not regenerated
    # explicit defaults hash the same; other specs get other names
    assert sv.cached_video(dict(spec, gop=12), cache_dir=tmp_path) == p1
    assert sv.cached_video(dict(spec, seed=1), cache_dir=tmp_path) != p1
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]
    monkeypatch.setenv("FLASHCODEC_CACHE", str(tmp_path / "env"))
    p3 = sv.cached_video(spec)
    assert p3.parent == tmp_path / "env" / "videos" and p3.name == p1.name
    with pytest.raises(ValueError, match="unknown"):
        sv.cached_video(dict(spec, colour="red"), cache_dir=tmp_path)


def test_cli(tmp_path, capsys):
    out = tmp_path / "cli.mkv"
    rc = sv.main([str(out), "--codec", "h264", "--width", "64", "--height", "48",
                  "--duration", "0.5", "--fps", "30", "--gop", "5", "--bframes", "1",
                  "--rotation", "90", "--preset", "ultrafast", "--vfr", "--seed", "2"])
    assert rc == 0 and out.exists()
    assert "wrote" in capsys.readouterr().out
    assert sv.probe_rotation(out) == 90
    with pytest.raises(SystemExit) as e:
        sv.main([str(out), "--codec", "nope"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error" in err
    assert sv.main([str(tmp_path / "x.webm"), "--codec", "hevc"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot be stored" in err


def test_cli_help():
    script = os.path.join(os.path.dirname(sv.__file__), "synthetic_video.py")
    res = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True)
    assert res.returncode == 0 and "--codec" in res.stdout and "--vfr" in res.stdout


# ---------------------------------------------------------------------------
# marked tests (see tests/conftest.py)
# ---------------------------------------------------------------------------


@pytest.mark.slow
def test_720p_quarter_scale(video_factory):
    path = video_factory(codec="h264", width=1280, height=720, duration_s=2.0, fps=30.0,
                         gop=30, bframes=3, preset="veryfast", suffix=".mp4")
    frames = decode_all(path, scale=4)
    assert [i for i, _, _ in frames] == list(range(60))
    assert [i for _, i, _ in frames] == list(range(60))

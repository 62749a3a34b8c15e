"""Fast H.264 opens: FFmpeg's stream-info pass decodes nothing. PyAV's take an option and the reorder depth from
our probe; torchcodec's go through flashcodec/decode/fast_open.c where the stream states a depth that covers ours."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
import subprocess
import sys

import av
import pytest
import torch

from flashcodec import DecodeEngine
from flashcodec._probe import probe
from flashcodec.decode import backends, fast_open, pyav
from flashcodec.source import Source

ROOT = pathlib.Path(__file__).resolve().parents[3]


def _h264(video_factory, bframes, open_gop=False):  # the tiny_* clips' size: 128x96, 2 s at 24 fps, GOPs of 12
    return video_factory(codec="h264", bframes=bframes, open_gop=open_gop, suffix=".mp4", width=128, height=96,
                         duration_s=2.0, fps=24.0, gop=12)


@pytest.mark.parametrize("bframes, depth", [(0, 0), (1, 1), (3, 2)])  # x264's B-pyramid: 3 B-frames hold 2 back
def test_reorder_depth_is_how_far_decode_order_runs_ahead_of_display(video_factory, bframes, depth):
    assert backends.reorder_depth(probe(Source.of(_h264(video_factory, bframes)))) == depth


@pytest.mark.parametrize("bframes, open_gop", [(0, False), (2, False), (3, False), (3, True)])
def test_a_fast_open_decodes_what_a_full_open_decodes(video_factory, monkeypatch, bframes, open_gop):
    path = _h264(video_factory, bframes, open_gop)
    info = probe(Source.of(path))
    opened = []
    real_open = av.open
    monkeypatch.setattr(pyav.av, "open", lambda *a, **kw: (opened.append(kw.get("options")), real_open(*a, **kw))[1])
    for indices in (list(range(info.num_frames)), list(range(1, info.num_frames, 5))):  # dense; sparse (NONREF skips)
        with DecodeEngine("pyav", num_threads=2) as engine:
            fast = engine.decode_video(path, frame_indices=indices)
        decoders = [o for o in opened if o is not None]  # the probe's own open is the full one
        assert decoders and all(o == {"skip_frame": "all"} for o in decoders)
        with monkeypatch.context() as full_open:
            full_open.setattr(pyav, "FAST_OPEN_OPTIONS", {})
            with DecodeEngine("pyav", num_threads=2) as engine:
                full = engine.decode_video(path, frame_indices=indices)
        assert opened[-1] is None  # the full open's decoders: no options
        assert not fast.failed_frame_indices and not full.failed_frame_indices
        assert torch.equal(fast.frames, full.frames)
        opened.clear()


def test_the_fast_decoder_holds_back_at_least_our_depth(video_factory):
    path = _h264(video_factory, 3)
    info = probe(Source.of(path))
    decoder = pyav.PyAVBackend().open(Source.of(path), info, 32, 32)
    try:
        assert decoder._context.reorder_depth >= backends.reorder_depth(info) == 2
    finally:
        decoder.close()


# ---- torchcodec's opens: flashcodec/decode/fast_open.py and fast_open.c ----

TORCHCODEC_OPENS = r"""
import json, sys, torch
from flashcodec import DecodeEngine
from flashcodec._probe import probe
from flashcodec.decode import backends, fast_open

report = {"installed": fast_open.install(), "reason": fast_open.reason(), "cases": []}
device = sys.argv[1]  # cpu: the torchcodec backend's CPU decoders; cuda:N: NVDEC sessions


def engine():
    if device == "cpu":
        return DecodeEngine("torchcodec", num_threads=2)
    return DecodeEngine(devices=[device], cpu_threads=0, nvdec_sessions=2)


for path in sys.argv[2:]:
    info = probe(path)
    case = {"path": path, "depth": backends.reorder_depth(info), "open_depth": info.open_reorder_depth,
            "usable": fast_open.usable(info, backends.reorder_depth(info))}
    for name, indices in (("dense", list(range(info.num_frames))), ("sparse", list(range(1, info.num_frames, 5)))):
        before, formats = fast_open.fast_opens(), fast_open.formats_set()
        with engine() as e:
            fast = e.decode_video(path, frame_indices=indices)
        case[name + "_fast_opens"] = fast_open.fast_opens() - before
        case[name + "_formats_set"] = fast_open.formats_set() - formats
        with fast_open.full_opens(), engine() as e:
            full = e.decode_video(path, frame_indices=indices)
        case[name + "_full_opens_fast"] = fast_open.fast_opens() - before - case[name + "_fast_opens"]
        case[name + "_equal"] = bool(torch.equal(fast.frames, full.frames)) and not fast.failed_frame_indices
    report["cases"].append(case)
report["reason_after"] = fast_open.reason()  # set if an NVDEC session fell back to the CPU after a fast open
print(json.dumps(report))
"""


def _audio_first(tmp_path):
    """An H.264 clip with B-frames behind an audio stream: the video is stream 1 of 2."""
    import numpy as np

    path = tmp_path / "audio_first.mp4"
    with av.open(str(path), "w") as out:
        audio = out.add_stream("aac", rate=16000)
        video = out.add_stream("libx264", rate=24, options={"bf": "3", "g": "12"})
        video.width, video.height, video.pix_fmt = 64, 48, "yuv420p"
        yy, xx = np.mgrid[0:48, 0:64]
        for i in range(36):  # a slowly moving gradient: x264 chooses B-frames for it
            image = np.repeat(((xx * 4 + yy * 2 + i * 5) % 256).astype(np.uint8)[..., None], 3, axis=2)
            frame = av.VideoFrame.from_ndarray(image, format="rgb24")
            frame.pts = i  # with timestamps x264 may reorder
            out.mux(video.encode(frame))
        out.mux(video.encode(None))
        samples = av.AudioFrame.from_ndarray(np.zeros((1, 16000), dtype=np.float32), format="fltp", layout="mono")
        samples.sample_rate = 16000
        out.mux(audio.encode(samples))
        out.mux(audio.encode(None))
    return path


def test_the_probe_reads_the_depth_an_open_without_the_decode_leaves(video_factory, tmp_path):
    stated = probe(Source.of(_h264(video_factory, 3)))
    assert stated.open_reorder_depth == 2 == backends.reorder_depth(stated) and stated.num_streams == 1
    assert probe(Source.of(_h264(video_factory, 0))).open_reorder_depth == 0
    behind = probe(Source.of(_audio_first(tmp_path)))
    assert (behind.stream_index, behind.num_streams, behind.open_reorder_depth) == (1, 2, 2)


def test_only_h264_whose_stated_depth_covers_the_measured_one_opens_without_the_decode(video_factory):
    info = probe(Source.of(_h264(video_factory, 3)))
    assert fast_open.usable(info, 2)
    assert not fast_open.usable(info, 3)  # the stream reorders deeper than its headers say: a full open
    assert not fast_open.usable(dataclasses.replace(info, open_reorder_depth=None), 0)  # the probe's open was full
    assert not fast_open.usable(dataclasses.replace(info, codec="hevc"), 0)  # its pass decodes nothing anyway
    assert not fast_open.usable(dataclasses.replace(info, num_streams=info.stream_index), 0)
    assert not fast_open.usable(dataclasses.replace(info, pix_fmt=None), 0)  # the open's context would have none


def _torchcodec_opens(video_factory, tmp_path, device):
    """In a fresh process (the library must load before torchcodec): B-frames 0-3, an open GOP, the video
    behind an audio stream; dense and sparse; PyAV's opens (the probe's) pass through uncounted."""
    paths = [_h264(video_factory, 0), _h264(video_factory, 3), _h264(video_factory, 3, open_gop=True),
             _audio_first(tmp_path)]
    run = subprocess.run([sys.executable, "-c", TORCHCODEC_OPENS, device, *map(str, paths)], capture_output=True,
                         text=True, cwd=ROOT, timeout=300, env=dict(os.environ, FLASHCODEC_CACHE=str(tmp_path / "c")))
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.splitlines()[-1])
    assert report["installed"] and report["reason"] is None
    assert report["reason_after"] is None  # no session decoded on the CPU after an open without the decode
    for case in report["cases"]:
        assert case["usable"], case
        for name in ("dense", "sparse"):
            assert case[name + "_fast_opens"] >= 1 and case[name + "_full_opens_fast"] == 0, case
            # every such open's codec context got the probe's pixel format (the pass learnt none)
            assert case[name + "_formats_set"] == case[name + "_fast_opens"], case
            assert case[name + "_equal"], case


def test_torchcodec_opens_without_the_decode_give_the_frames_of_full_opens(video_factory, tmp_path):
    pytest.importorskip("torchcodec.decoders")
    _torchcodec_opens(video_factory, tmp_path, "cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available (torch.cuda.is_available() is False)")
def test_cuda_nvdec_sessions_open_without_the_decode_and_give_the_frames_of_full_opens(video_factory, tmp_path):
    from flashcodec.devices import nvdec_unavailable_reason

    if nvdec_unavailable_reason(0):
        pytest.skip(nvdec_unavailable_reason(0))
    _torchcodec_opens(video_factory, tmp_path, "cuda:0")


class _FakeLibrary:
    """fast_open.c's entry points as the Python side calls them; ``consume`` plays FFmpeg's call."""

    def __init__(self):
        self.armed = None

    def flashcodec_fast_open_arm(self, stream, streams, pix_fmt):
        self.armed = (stream, streams)
        self.pix_fmt = pix_fmt

    def flashcodec_fast_open_pending(self):
        return int(self.armed is not None)

    def flashcodec_fast_open_disarm(self):
        self.armed = None

    def consume(self):
        self.armed = None


def test_an_arm_never_outlives_its_open_and_an_unused_one_turns_fast_opens_off(video_factory, monkeypatch, caplog):
    info = probe(Source.of(_h264(video_factory, 3)))
    lib = _FakeLibrary()
    monkeypatch.setattr(fast_open, "_lib", lib)
    monkeypatch.setattr(fast_open, "_reason", None)
    with fast_open.opening(info, 2) as armed:
        assert armed and lib.armed == (info.stream_index, info.num_streams) and lib.pix_fmt == b"yuv420p"
        lib.consume()
    assert fast_open._lib is lib
    with pytest.raises(RuntimeError), fast_open.opening(info, 2):
        raise RuntimeError("the open failed before its stream-info pass")
    assert lib.armed is None and fast_open._lib is lib  # a failed open says nothing about the library
    with fast_open.opening(info, 3) as armed:  # the stream reorders deeper than stated: not armed
        assert not armed and lib.armed is None
    with caplog.at_level(logging.WARNING), fast_open.opening(info, 2):
        pass  # torchcodec's call never reached the library
    assert lib.armed is None and fast_open._lib is None
    assert "did not reach" in caplog.text
    with fast_open.opening(info, 2) as armed:
        assert not armed


def test_giving_up_stops_every_later_fast_open_and_says_why_once(video_factory, monkeypatch, caplog):
    info = probe(Source.of(_h264(video_factory, 3)))
    monkeypatch.setattr(fast_open, "_lib", _FakeLibrary())
    monkeypatch.setattr(fast_open, "_reason", None)
    with caplog.at_level(logging.WARNING):
        fast_open.give_up("an NVDEC session opened without it decoded on the CPU")
        fast_open.give_up("again")  # already off: nothing more
    assert fast_open._lib is None and fast_open.reason() == "an NVDEC session opened without it decoded on the CPU"
    assert caplog.text.count("stream-info pass") == 1 and "again" not in caplog.text
    with fast_open.opening(info, 2) as armed:
        assert not armed


def test_without_a_compiler_opens_stay_full_and_say_why_once(video_factory, monkeypatch, tmp_path, caplog):
    info = probe(Source.of(_h264(video_factory, 3)))
    monkeypatch.setenv("FLASHCODEC_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a compiler that always fails
    for name, value in (("_installed", False), ("_lib", None), ("_reason", None)):
        monkeypatch.setattr(fast_open, name, value)
    monkeypatch.setattr(fast_open, "_torchcodec_loaded", lambda: False)
    assert fast_open.install() is False and "false failed" in fast_open.reason()
    assert fast_open.install() is False  # once per process
    with caplog.at_level(logging.WARNING), fast_open.opening(info, 2) as armed:
        assert not armed
    assert caplog.text.count("stream-info pass") == 1
    monkeypatch.setattr(fast_open, "_installed", False)
    monkeypatch.setenv("FLASHCODEC_FAST_OPEN", "0")
    assert fast_open.install() is False and fast_open.reason() == "FLASHCODEC_FAST_OPEN=0"


def test_flashcodec_bench_loads_the_library_before_listing_its_peers():
    """`flashcodec bench` lists the installed peers by importing them, torchcodec among them; the library goes in
    first, so the torchcodec backend it then times opens fast."""
    pytest.importorskip("torchcodec")
    code = ("from flashcodec import benchmark\nfrom flashcodec.decode import fast_open\n"
            "print('torchcodec' in benchmark.installed_peers(), fast_open.install(), fast_open.reason())")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["True", "True", "None"], run.stdout


def test_timestamps_that_run_backwards_get_ffmpegs_own_open_not_an_abort(video_factory, tmp_path):
    """Presentation timestamps running backwards (the file's fault) make the probe's reorder depth the whole clip
    (47 here). Told to hold more than H.264's 16 pictures, FFmpeg's decoder failed an assertion and aborted the
    process (exit 134, no message: any client's file could kill the server's vision process); such a probe now gets
    FFmpeg's own open, and the decode returns. In a child process: an abort would take pytest with it."""
    src = av.open(str(_h264(video_factory, 0)))
    path = tmp_path / "backwards.mkv"
    with av.open(str(path), "w") as out:
        stream = out.add_stream_from_template(src.streams.video[0])
        for k, packet in enumerate(p for p in src.demux(src.streams.video[0]) if p.size):
            packet.pts, packet.dts = 51200 - 256 * k, 512 * k  # pts descending, dts ascending
            packet.stream = stream
            out.mux(packet)
    src.close()
    assert backends.reorder_depth(probe(Source.of(path))) > pyav.MAX_REORDER_DEPTH
    code = ("import sys, flashcodec; r = flashcodec.decode_video(sys.argv[1], backend='pyav'); "
            "print(tuple(r.frames.shape))")
    run = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
    assert run.stdout.strip().startswith("(4, 3,"), run.stdout

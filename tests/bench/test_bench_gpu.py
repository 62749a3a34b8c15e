"""bench/decode/bench_gpu.py: runs end to end on a tiny setting (GPU parts skipped with reasons on a
machine without one), the static GOP split, the ratios and target checks, the made clips."""

from __future__ import annotations

import json
import pathlib
import sys
from types import SimpleNamespace

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "decode"))

import bench_gpu  # noqa: E402
import gpu_media  # noqa: E402
from gpu_report import _note, check_targets, markdown, ratios  # noqa: E402

import flashcodec  # noqa: E402

TINY = ["--duration", "1", "--size", "96x64", "--fps", "24", "--gop", "12", "--jpegs", "3",
        "--jpeg-size", "96x64", "--cpu-threads", "1", "--codecs", "h264"]


def test_short_and_defaults(tmp_path):
    assert bench_gpu.parse_args(["--out", str(tmp_path), "--short"]).duration == 60.0
    args = bench_gpu.parse_args(["--out", str(tmp_path)])
    assert args.duration == 150.0 and (args.width, args.height) == (1920, 1080) and args.gop == 60  # 2 s at 30 fps
    assert bench_gpu.parse_args(["--out", str(tmp_path), "--fps", "25", "--gop", "100"]).gop == 100
    with pytest.raises(SystemExit):
        bench_gpu.parse_args(["--out", str(tmp_path), "--size", "1920x1082"])  # height not a multiple of 4


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the skips of a machine without a GPU")
def test_runs_end_to_end_on_cpu(tmp_path, capsys):
    out = tmp_path / "out"
    assert bench_gpu.main(["--out", str(out), "--cache", str(tmp_path / "cache"), *TINY]) == 0
    report = json.loads((out / "gpu-decode.json").read_text())
    assert report["machine"]["commit"] and report["machine"]["torch"] == torch.__version__
    assert any("1 s long" in n for n in report["notes"])
    h264 = report["codecs"]["h264"]
    assert h264["clip"]["frames"] == 24 and h264["clip"]["gops"] == 2
    m = h264["measurements"]
    assert m["cpu_alone"]["seconds"] > 0 and m["cpu_alone"]["fps"] > 0
    for name in ("gpu_alone", "one_session", "ceiling", "naive_split", "naive_split_opened", "gpu_and_cpu",
                 "engines_busy", "sparse_gpu", "sparse_one_session"):
        assert "CPU-only" in m[name]["skipped"] or "no CUDA GPU" in m[name]["skipped"], name
    assert h264["ratios"]["speedup_vs_one_session"] is None and h264["targets"]["fraction_of_ceiling"] is None
    jpeg = report["jpeg"]
    assert jpeg["count"] == 3 and jpeg["cpu"]["seconds"] > 0 and "skipped" in jpeg["nvjpeg"]
    md = (out / "gpu-decode.md").read_text()
    assert "| cpu_alone |" in md and "flashcodec GPU vs one NVDEC session" in md


def test_a_run_cut_short_keeps_each_measurement_done(tmp_path, monkeypatch):
    """A device run ends at its time limit, maybe mid-codec: what was measured is on disk already."""
    out = tmp_path / "out"

    class Cut(BaseException):
        pass

    real = bench_gpu._measure

    def measure_then_cut(results, name, fn):
        if name == "one_session":
            raise Cut  # the limit struck here
        return real(results, name, fn)

    monkeypatch.setattr(bench_gpu, "_measure", measure_then_cut)
    with pytest.raises(Cut):
        bench_gpu.main(["--out", str(out), "--cache", str(tmp_path / "cache"), *TINY])
    h264 = json.loads((out / "gpu-decode.json").read_text())["codecs"]["h264"]
    assert h264["partial"] == "cut short after gpu_alone" and h264["measurements"]["cpu_alone"]["seconds"] > 0


def test_gop_split_is_static_contiguous_and_gop_aligned():
    info = SimpleNamespace(gops=[SimpleNamespace(keyframe_index=k) for k in range(0, 100, 10)])  # 10 GOPs
    indices = list(range(0, 100, 5))
    runs = bench_gpu.gop_split(info, indices, 4)
    assert [i for r in runs for i in r] == indices  # every sampled frame once, in order
    assert [len(r) for r in runs] == [4, 6, 4, 6]  # GOPs 0-1, 2-4, 5-6, 7-9
    assert all(r[0] % 10 == 0 for r in runs)  # each run starts at a keyframe
    assert bench_gpu.gop_split(info, [95], 4) == [[95]]  # runs without sampled frames are dropped


def test_ratios_and_targets():
    m = {"gpu_alone": {"seconds": 1.0, "fps": 3000.0, "host_cores_busy": 3.25},
         "cpu_alone": {"seconds": 2.0, "fps": 1500.0},
         "gpu_and_cpu": {"seconds": 0.7, "fps": 4000.0, "cpu_threads": 13,
                         "segments_per_rank": {"cuda:0": 59, "cpu": 16}},
         "gpu_and_cpu_all_threads": {"seconds": 0.8, "fps": 3600.0, "cpu_threads": 16},
         "one_session": {"seconds": 7.0},
         "ceiling": {"seconds": 12.6}, "naive_split": {"seconds": 1.4},
         "naive_split_opened": {"seconds": 1.6}, "sparse_gpu": {"seconds": 0.1},
         "sparse_one_session": {"seconds": 0.3},
         "engines_busy": {"num_nvdec_busy": 7, "nvdec_mean_pct": [90.0] * 7}}
    r = ratios(m, 0.6, 14)
    assert r["speedup_vs_one_session"] == 7.0
    assert r["fraction_of_ceiling"] == pytest.approx(12.6 / 14)
    assert r["speedup_vs_naive_split"] == pytest.approx(1.4)
    assert r["speedup_vs_naive_split_opened"] == pytest.approx(1.6)  # reported, not a target
    assert "speedup_vs_naive_split_opened" not in check_targets(r)
    assert r["collaborative_fraction"] == pytest.approx(4000 / 4500)
    assert r["collaborative_fraction_all_threads"] == pytest.approx(3600 / 4500)  # reported, not a target
    assert "collaborative_fraction_all_threads" not in check_targets(r)
    assert r["gpu_and_cpu_vs_gpu_alone"] == pytest.approx(1 / 0.7)
    assert r["ceiling_vs_one_session"] == pytest.approx(14 * 7 / 12.6)
    assert r["sparse_speedup_vs_one_session"] == pytest.approx(3.0) and r["nvdec_engines"] == 7
    assert check_targets(r) == {"speedup_vs_one_session": True, "fraction_of_ceiling": True,
                                "speedup_vs_naive_split": True, "collaborative_fraction": True,
                                "gpu_vs_cpu_mean_abs_diff": True, "nvdec_engines_busy": True}
    slow = ratios({**m, "gpu_alone": {"seconds": 2.0, "fps": 1500.0}}, 1.5, 14)
    assert check_targets(slow)["speedup_vs_one_session"] is False  # 3.5x
    assert check_targets(slow)["gpu_vs_cpu_mean_abs_diff"] is False
    report = {"started": 0, "command": "x", "machine": {"gpu": "H100", "cores": 16, "torch": "2.11",
                                                        "torchcodec": "0.16", "commit": "abc"},
              "notes": [], "codecs": {"h264": {"clip": {"size": [1920, 1080], "duration_s": 150.0,
                                                        "measured_mbit_s": 10.1, "encoder": "h264_nvenc"},
                                               "dense_frames": 300, "out_size": [532, 952], "frames_must_decode": 4500,
                                               "measurements": m, "ratios": slow, "targets": check_targets(slow)}},
              "jpeg": {"count": 256, "size": [1280, 720], "cpu": {"seconds": 0.13}, "nvjpeg": {"seconds": 0.04},
                       "nvjpeg_bare": {"skipped": "no torchvision"}, "nvjpeg_speedup_vs_cpu": 3.25}}
    md = markdown(report)
    assert "| flashcodec GPU vs one NVDEC session | 3.50 | >= 6.0 | NO |" in md
    assert "| gpu_and_cpu | 0.700 | 4000 | 13 CPU threads; segments cuda:0 59, cpu 16 |" in md
    assert "| gpu_alone | 1.000 | 3000 | host cores busy 3.2 |" in md
    assert "nvJPEG vs CPU: 3.25x" in md and "nvjpeg_bare: no torchvision" in md


def test_made_clip_has_the_asked_gop_rate_and_motion(tmp_path):
    spec = gpu_media.ClipSpec("h264", 128, 96, 2.0, 24, 1_000_000, 12)
    clip = gpu_media.make_clip(spec, tmp_path)
    info = flashcodec.probe(str(clip.path))
    assert info.num_frames == 48 and [g.keyframe_index for g in info.gops] == [0, 12, 24, 36]
    assert 0.5e6 < clip.measured_bitrate < 2e6  # rate control near the asked 1 Mbit/s
    again = gpu_media.make_clip(spec, tmp_path)
    assert again.path == clip.path and again.encode_s < clip.encode_s  # from the cache
    frames = flashcodec.decode_video(str(clip.path), frame_indices=[0, 1, 24]).frames.float()
    assert (frames[0] - frames[1]).abs().mean() > 2  # frames move and carry fresh noise
    assert frames[0].std() > 20  # textured, not flat


def test_jpegs_are_distinct_baseline_jpegs():
    jpegs = gpu_media.make_jpegs(2, 96, 64)
    assert all(j[:3] == b"\xff\xd8\xff" for j in jpegs) and jpegs[0] != jpegs[1]


def test_the_note_names_a_traced_ranks_busy_share():
    """The summary itself is flashcodec.decode.trace's (tests/flashcodec/decode/test_trace.py)."""
    from flashcodec.decode.rank_job import SlotEvent
    from flashcodec.decode.trace import trace_summary

    events = [SlotEvent("cpu", 0, "open", 0.0, 0.01, 0, 10, False), SlotEvent("cpu", 0, "decode", 0.01, 0.70, 0, 12,
                                                                              False)]
    s = trace_summary(events, 0.8, {"cpu": 16})
    assert "traced cpu: busy" in _note({"trace": s})

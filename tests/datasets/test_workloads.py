"""Tests for datasets/workloads.py and its workload_*.py modules (seeded serving workloads and dataset
loaders)."""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import json
import os
import re
import subprocess
import sys

import av
import numpy as np
import pytest

import workloads as wl
from workload_config import WorkloadConfig, arrival_times
from workload_datasets import load_egoschema, load_mlvu, load_visionarena
from workload_jsonl import read_workload, validate_record, write_workload
from workload_media import image_spec, video_spec
from workload_synthetic import TEXT_PROMPTS, VIDEO_QUESTIONS, generate_workload, video_questions

TINY = dict(scale=0.01, num_videos=1)  # 9-minute videos become ~5 s at 114x64


def gaps(times):
    return np.diff(np.asarray(times))


# ---------------------------------------------------------------------------
# arrivals
# ---------------------------------------------------------------------------


def test_poisson_mean_inter_arrival_is_one_over_rate():
    t = arrival_times(20_000, 4.0, seed=1)
    assert t[0] == 0.0 and np.all(gaps(t) >= 0)
    g = gaps(t)
    assert g.mean() == pytest.approx(0.25, rel=0.03)
    assert g.std() / g.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV 1


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_burstiness_sets_the_variance(burstiness):
    rate = 4.0
    g = gaps(arrival_times(20_000, rate, arrival="gamma", burstiness=burstiness, seed=2))
    assert g.mean() == pytest.approx(1 / rate, rel=0.05)  # the rate does not change
    # gamma(k, 1/(rate*k)) has variance 1/(k*rate^2)
    assert g.var() == pytest.approx(1 / (burstiness * rate**2), rel=0.1)


def test_infinite_rate_puts_every_request_at_zero():
    assert arrival_times(7, float("inf")) == [0.0] * 7
    assert arrival_times(0, 2.0) == [] and arrival_times(1, 2.0) == [0.0]


def test_arrival_argument_errors():
    with pytest.raises(ValueError, match="--arrival gamma"):
        arrival_times(3, 1.0, arrival="poisson", burstiness=0.5)
    with pytest.raises(ValueError, match="request_rate"):
        arrival_times(3, 0.0)


# ---------------------------------------------------------------------------
# synthetic workloads
# ---------------------------------------------------------------------------


def test_same_seed_gives_identical_jsonl(tmp_path):
    cfg = WorkloadConfig(workload="mixed", num_requests=20, request_rate=5.0, seed=3,
                         media_dir=str(tmp_path / "media"), **TINY)
    a = write_workload(generate_workload(cfg), tmp_path / "a.jsonl")
    b = write_workload(generate_workload(cfg), tmp_path / "b.jsonl")
    assert a.read_bytes() == b.read_bytes()
    other = generate_workload(dataclasses.replace(cfg, seed=4))
    assert other != read_workload(a)


def test_mixed_has_every_kind_and_valid_records(tmp_path):
    cfg = WorkloadConfig(workload="mixed", num_requests=40, text_share=0.25, output_len=16,
                         media_dir=str(tmp_path), **TINY)
    records = generate_workload(cfg)
    kinds = {tuple(m["type"] for m in r["media"]) for r in records}
    assert kinds == {("video",), ("image",), ()}
    for r in records:
        validate_record(r)
        assert r["output_len"] == 16 and r["ignore_eos"] is True
        for m in r["media"]:
            assert m["path"].startswith(str(tmp_path)) and (m["fps"] == 2.0) == (m["type"] == "video")
    assert {r["prompt"] for r in records if not r["media"]} <= set(TEXT_PROMPTS)


def test_request_rate_changes_only_the_arrivals(tmp_path):
    base = dict(workload="image", num_requests=10, media_dir=str(tmp_path), **TINY)
    slow = generate_workload(WorkloadConfig(request_rate=1.0, **base))
    fast = generate_workload(WorkloadConfig(request_rate=100.0, **base))
    strip = [{k: v for k, v in r.items() if k != "arrival_s"} for r in slow]
    assert strip == [{k: v for k, v in r.items() if k != "arrival_s"} for r in fast]
    assert slow[-1]["arrival_s"] > fast[-1]["arrival_s"] > 0


def test_scale_shrinks_durations_and_sizes():
    for i in range(5):
        full, small = video_spec("long-video", i), video_spec("long-video", i, scale=0.05)
        assert 480 <= full["duration_s"] <= 600 and (full["width"], full["height"]) == (1280, 720)
        assert small["duration_s"] == pytest.approx(full["duration_s"] * 0.05, abs=0.01)
        assert small["width"] < full["width"] and small["height"] == 64 and small["width"] % 2 == 0
        assert 2 * 30 <= full["gop"] <= 8 * 30 and small["gop"] == full["gop"]
    short = video_spec("short-video", 0)
    assert short["duration_s"] == 180 and video_spec("short-video", 0, scale=0.1)["duration_s"] == 18
    img_full, img_small = image_spec(3), image_spec(3, scale=0.05)
    assert img_small["width"] < img_full["width"] and min(img_small["width"], img_small["height"]) == 64


def test_video_seconds_replaces_the_duration_range_unscaled():
    for i in range(5):
        spec = video_spec("long-video", i, seconds=(60, 300))
        assert 60 <= spec["duration_s"] <= 300 and (spec["width"], spec["height"]) == (1280, 720)
        small = video_spec("long-video", i, scale=0.5, seconds=(60, 300))
        assert small["duration_s"] == spec["duration_s"] and (small["width"], small["height"]) == (640, 360)
    assert {video_spec("long-video", i, seconds=(90, 90))["duration_s"] for i in range(3)} == {90}
    cfg = wl.config_from_args(argparse_for_workloads().parse_args(["--video-seconds", "60,300"]))
    assert cfg.video_seconds == (60.0, 300.0)


@pytest.mark.parametrize("kw, needle", [
    (dict(video_seconds=(0, 10)), "0 < MIN <= MAX"),
    (dict(video_seconds=(30, 10)), "0 < MIN <= MAX"),
    (dict(video_seconds=(10, float("inf"))), "0 < MIN <= MAX"),
    (dict(workload="image", video_seconds=(10, 20)), "not to workload 'image'"),
])
def test_bad_video_seconds(kw, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        WorkloadConfig(**kw)


def test_video_seconds_flag_needs_two_numbers():
    with pytest.raises(SystemExit):
        argparse_for_workloads().parse_args(["--video-seconds", "60"])


def argparse_for_workloads():
    p = argparse.ArgumentParser()
    wl.add_workload_args(p)
    wl.add_arrival_args(p)
    return p


def test_generated_video_matches_its_scaled_spec(tmp_path):
    cfg = WorkloadConfig(workload="long-video", num_requests=1, media_dir=str(tmp_path), **TINY)
    (rec,) = generate_workload(cfg)
    spec = video_spec("long-video", 0, scale=TINY["scale"])
    with av.open(rec["media"][0]["path"]) as c:
        s = c.streams.video[0]
        assert (s.codec_context.name, s.width, s.height) == ("h264", spec["width"], spec["height"])
        assert float(c.duration / av.time_base) == pytest.approx(spec["duration_s"], abs=0.1)
        assert 4.5 <= spec["duration_s"] <= 6.0


def test_media_files_exist_and_are_reused(tmp_path):
    cfg = WorkloadConfig(workload="short-video", num_requests=6, num_videos=2, scale=0.01,
                         media_dir=str(tmp_path))
    first = generate_workload(cfg)
    paths = [r["media"][0]["path"] for r in first]
    assert paths[0::2] == [paths[0]] * 3 and paths[1::2] == [paths[1]] * 3 and paths[0] != paths[1]
    files = sorted(tmp_path.rglob("*.mp4"))
    assert len(files) == 2
    mtimes = [f.stat().st_mtime_ns for f in files]
    again = generate_workload(cfg)
    assert [r["media"][0]["path"] for r in again] == paths
    assert sorted(tmp_path.rglob("*.mp4")) == files and [f.stat().st_mtime_ns for f in files] == mtimes
    images = generate_workload(dataclasses.replace(cfg, workload="image", num_requests=3))
    assert all(p.is_file() for p in tmp_path.rglob("img_*"))
    assert len({r["media"][0]["path"] for r in images}) == 2


def test_missing_media_are_made_in_parallel_processes_when_there_are_cores(tmp_path, monkeypatch):
    import concurrent.futures

    pools = []

    class Recording(concurrent.futures.ProcessPoolExecutor):
        def __init__(self, jobs, **kw):
            pools.append(jobs)
            super().__init__(jobs, **kw)

    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", Recording)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    cfg = WorkloadConfig(workload="short-video", num_requests=6, num_videos=3, scale=0.01,
                         media_dir=str(tmp_path))
    records = generate_workload(cfg)
    assert pools == [3]  # three missing clips, up to 16 // 4 workers
    paths = {r["media"][0]["path"] for r in records}
    assert len(paths) == 3 and all(pathlib.Path(p).is_file() for p in paths)
    assert not list(tmp_path.rglob(".tmp-*"))
    assert generate_workload(cfg) == records and pools == [3]  # all cached: no pool the second time
    sequential = tmp_path / "sequential"
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    again = generate_workload(dataclasses.replace(cfg, media_dir=str(sequential)))
    assert pools == [3] and sorted(pathlib.Path(r["media"][0]["path"]).name for r in again) == sorted(
        pathlib.Path(r["media"][0]["path"]).name for r in records)


def test_config_errors_say_what_to_fix():
    with pytest.raises(ValueError, match="scale"):
        WorkloadConfig(scale=0.0)
    with pytest.raises(ValueError, match="--dataset-path"):
        WorkloadConfig(workload="mlvu")
    with pytest.raises(ValueError, match="unknown workload"):
        WorkloadConfig(workload="audio")


# ---------------------------------------------------------------------------
# real-dataset loaders on fake folders
# ---------------------------------------------------------------------------


def touch(path, data=b"\x00"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def test_load_mlvu(tmp_path):
    touch(tmp_path / "video" / "1_plotQA" / "a.mp4")
    touch(tmp_path / "video" / "b.mp4")
    items = [{"video": "a.mp4", "question": "Who runs?", "candidates": ["dog", "cat"], "answer": "dog"},
             {"video": "b.mp4", "question": "Where?", "candidates": ["park", "home"]},
             {"video": "gone.mp4", "question": "Lost?", "candidates": ["yes", "no"]}]
    touch(tmp_path / "json" / "1_plotQA.json", json.dumps(items).encode())
    with pytest.warns(UserWarning, match="skipped 1"):
        records = load_mlvu(tmp_path, video_fps=1.0, max_frames=256)
    assert [r["request_id"] for r in records] == ["mlvu-1_plotQA-0", "mlvu-1_plotQA-1"]
    assert records[0]["prompt"].splitlines()[:3] == ["Who runs?", "(A) dog", "(B) cat"]
    assert records[0]["media"] == [{"type": "video", "path": str((tmp_path / "video/1_plotQA/a.mp4").resolve()),
                                    "fps": 1.0, "max_frames": 256}]
    assert records[1]["media"][0]["path"].endswith("video/b.mp4")


def test_load_egoschema_and_sampling(tmp_path):
    touch(tmp_path / "videos" / "q1.mp4")
    qs = [{"q_uid": "q1", "question": "What is c doing?", **{f"option {k}": f"o{k}" for k in range(5)}}]
    touch(tmp_path / "questions.json", json.dumps(qs).encode())
    (rec,) = load_egoschema(tmp_path)
    assert rec["request_id"] == "egoschema-q1" and "(E) o4" in rec["prompt"]
    cfg = WorkloadConfig(workload="egoschema", dataset_path=str(tmp_path), num_requests=3,
                         output_len=8, request_rate=2.0)
    out = wl.build_workload(cfg)
    assert [r["request_id"] for r in out] == ["egoschema-q1", "egoschema-q1#1", "egoschema-q1#2"]
    assert all(r["output_len"] == 8 for r in out) and out[0]["arrival_s"] == 0 < out[2]["arrival_s"]


def test_load_visionarena(tmp_path):
    touch(tmp_path / "img" / "1.png")
    abs_img = touch(tmp_path / "elsewhere" / "2.jpg")
    lines = [{"question": "What is this?", "images": ["img/1.png"]},
             {"question": "And this?", "image": str(abs_img)},
             {"question": "Missing", "images": ["img/none.png"]}]
    touch(tmp_path / "chat.jsonl", "\n".join(json.dumps(x) for x in lines).encode())
    with pytest.warns(UserWarning):
        records = load_visionarena(tmp_path)
    assert [r["prompt"] for r in records] == ["What is this?", "And this?"]
    assert records[0]["media"][0] == {"type": "image", "path": str((tmp_path / "img/1.png").resolve()),
                                      "fps": None, "max_frames": None}


@pytest.mark.parametrize("loader,layout", [(load_mlvu, "json/*.json"), (load_egoschema, "questions.json"),
                                           (load_visionarena, "*.jsonl")])
def test_loaders_name_the_layout_when_missing(tmp_path, loader, layout):
    with pytest.raises(FileNotFoundError, match="expected layout") as e:
        loader(tmp_path / "nope")
    assert layout in str(e.value)
    with pytest.raises(FileNotFoundError, match="expected layout"):
        loader(tmp_path)  # folder exists but is empty


# ---------------------------------------------------------------------------
# read_workload
# ---------------------------------------------------------------------------

GOOD = {"request_id": "r0", "arrival_s": 0.5, "prompt": "q", "output_len": 4, "ignore_eos": True,
        "media": [{"type": "video", "path": "/v.mp4", "fps": 2.0, "max_frames": None}]}


def test_read_workload_round_trip(tmp_path):
    recs = [GOOD, {**GOOD, "request_id": "r1", "media": []}]
    path = write_workload(recs, tmp_path / "w.jsonl")
    path.write_text(path.read_text() + "\n")  # blank lines are fine
    assert read_workload(path) == recs


@pytest.mark.parametrize("line,message", [
    ("{not json", "invalid JSON"),
    (json.dumps({k: v for k, v in GOOD.items() if k != "prompt"}), "missing field 'prompt'"),
    (json.dumps({**GOOD, "arrival_s": -1}), "arrival_s"),
    (json.dumps({**GOOD, "output_len": True}), "output_len"),
    (json.dumps({**GOOD, "media": [{"type": "audio", "path": "/a.wav"}]}), r"media\[0\].type"),
    (json.dumps({**GOOD, "media": [{**GOOD["media"][0], "fps": 0}]}), r"media\[0\].fps"),
    (json.dumps(GOOD), "request_id 'r0' repeats line 1"),
])
def test_read_workload_names_the_bad_line(tmp_path, line, message):
    path = tmp_path / "w.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=f"w.jsonl:2: .*{message}"):
        read_workload(path)


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------


def test_cli_writes_a_workload(tmp_path, capsys):
    out = tmp_path / "w.jsonl"
    rc = wl.main(["--workload", "image", "--num-requests", "4", "--scale", "0.05", "--request-rate", "2",
                  "--burstiness", "0.5", "--media-dir", str(tmp_path / "m"), "--out", str(out), "--no-progress"])
    assert rc == 0 and "wrote 4 requests" in capsys.readouterr().out
    recs = read_workload(out)
    assert len(recs) == 4 and recs[-1]["arrival_s"] > 0


def test_cli_user_error_is_one_line(tmp_path, capsys):
    assert wl.main(["--scale", "2", "--out", str(tmp_path / "w.jsonl")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "scale must be in (0, 1]" in err


def test_cli_help_runs_standalone():
    out = subprocess.run([sys.executable, "datasets/workloads.py", "--help"], capture_output=True, text=True,
                         cwd=wl.__file__.rsplit("/datasets/", 1)[0], check=True).stdout
    assert "--burstiness" in out and "long-video" in out


# ---------------------------------------------------------------------------
# multi-question
# ---------------------------------------------------------------------------


def test_multi_question_asks_k_different_questions_per_video(tmp_path):
    cfg = WorkloadConfig(workload="multi-question", num_requests=18, questions_per_video=4, num_videos=2,
                         request_rate=4.0, scale=0.1, media_dir=str(tmp_path))
    records = generate_workload(cfg)
    by_video = {}
    for r in records:
        validate_record(r)
        (m,) = r["media"]
        assert m["type"] == "video" and m["fps"] == 2.0
        by_video.setdefault(m["path"], []).append(r["prompt"])
    # ceil(18 / 4) = 5 videos: four asked 4 questions, the last 2; no question repeats on a video
    assert sorted(len(q) for q in by_video.values()) == [2, 4, 4, 4, 4]
    assert all(len(set(q)) == len(q) for q in by_video.values())
    assert len({tuple(q) for q in by_video.values()}) > 1  # videos do not all get the same questions
    # at most num_videos videos are open at once: a video's questions span no more than 2 videos' worth
    order = [r["media"][0]["path"] for r in records]
    for n in range(len(order)):
        opened = {p for p in order[:n + 1]}
        done = {p for p in opened if order[:n + 1].count(p) == len(by_video[p])}
        assert len(opened - done) <= 2
    assert order[:4] != [order[0]] * 4  # interleaved, not one video's questions back to back
    t = [r["arrival_s"] for r in records]
    assert t[0] == 0.0 and t == sorted(t) and t[-1] > 0


def test_multi_question_videos_are_demo_size():
    for i in range(5):
        spec = video_spec("multi-question", i)
        assert (spec["width"], spec["height"]) == (480, 270) and 8 <= spec["duration_s"] <= 12


def test_video_questions_beyond_the_pool_stay_different():
    qs = video_questions(len(VIDEO_QUESTIONS) + 3, np.random.default_rng(0))
    assert len(set(qs)) == len(qs) and set(VIDEO_QUESTIONS) <= set(qs)


def test_questions_per_video_is_refused_elsewhere():
    with pytest.raises(ValueError, match="questions_per_video must be >= 1"):
        WorkloadConfig(workload="multi-question", questions_per_video=0)
    with pytest.raises(ValueError, match="only applies to --workload multi-question"):
        WorkloadConfig(workload="mixed", questions_per_video=2)


def test_cli_multi_question(tmp_path, capsys):
    out = tmp_path / "w.jsonl"
    rc = wl.main(["--workload", "multi-question", "--num-requests", "6", "--questions-per-video", "3",
                  "--scale", "0.1", "--request-rate", "2", "--media-dir", str(tmp_path / "m"), "--out", str(out),
                  "--no-progress"])
    assert rc == 0 and "(2 media files" in capsys.readouterr().out
    assert len(read_workload(out)) == 6

"""bench/decode/bench_open.py: runs end to end on a tiny clip in a fresh process (its library loads before
torchcodec there), times both kinds of open on both front ends, and refuses a clip that is not H.264."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _run(tmp_path, *args):
    env = dict(os.environ, FLASHCODEC_CACHE=str(tmp_path / "native"))
    return subprocess.run([sys.executable, str(ROOT / "bench" / "decode" / "bench_open.py"), "--out", str(tmp_path),
                           "--cache", str(tmp_path / "videos"), *args], capture_output=True, text=True, env=env,
                          timeout=300)


def test_times_full_and_fast_opens_and_a_request_with_each(tmp_path):
    pytest.importorskip("torchcodec.decoders")
    run = _run(tmp_path, "--size", "160x96", "--duration", "2", "--opens", "2", "--repeat", "1")
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads((tmp_path / "bench_open_cpu.json").read_text())
    assert report["fast_open_installed"] and report["reason"] is None
    assert set(report["opens_s"]) == {"pyav_full", "pyav_fast", "torchcodec_full", "torchcodec_fast"}
    assert all(v > 0 for v in report["opens_s"].values())
    for name in ("sparse", "dense"):
        d = report["decode_video"][name]
        assert d["frames"] > 0 and d["fast_s"] > 0 and d["full_s"] > 0
        assert d["fast_opens_per_run"] >= 1  # the torchcodec backend's decoders opened without the decode
    assert "torchcodec" in run.stdout and "ratio" in run.stdout


def test_a_clip_that_is_not_h264_is_refused(tmp_path, video_factory):
    pytest.importorskip("torchcodec.decoders")
    run = _run(tmp_path, "--clip", str(video_factory(codec="hevc", duration_s=1.0)))
    assert run.returncode == 2 and run.stderr.strip().startswith("error:") and "hevc" in run.stderr


@pytest.mark.parametrize("args, says", [(["--clip", "/nonexistent.mp4"], "error: "),
                                        (["--size", "1920by1080"], "expected WxH"),
                                        (["--size", "1921x1080"], "must be even")])
def test_bad_arguments_get_one_error_line(tmp_path, args, says):
    pytest.importorskip("torchcodec.decoders")
    run = _run(tmp_path, *args)
    assert run.returncode == 2 and says in run.stderr and "Traceback" not in run.stderr

"""bench/decode/bench_stream.py: runs end to end on a tiny clip, both plans, and puts the scheduler back."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "decode"))

import bench_stream  # noqa: E402

from flashcodec.decode import rank_job  # noqa: E402


def test_times_the_prefix_of_both_plans_and_restores_the_scheduler(tmp_path, capsys):
    init = rank_job.RankJob.__init__
    assert bench_stream.main(["--size", "160x96", "--duration", "4", "--gop", "24", "--repeat", "1", "--threads", "2",
                              "--out", str(tmp_path), "--cache", str(tmp_path / "videos")]) == 0
    assert rank_job.RankJob.__init__ is init
    report = json.loads((tmp_path / "bench_stream_cpu.json").read_text())
    for name in ("in_order", "lanes"):
        (run,) = report["runs"][name]
        shares = [run["share_of_time"][q] for q in ("0.25", "0.5", "0.75", "1.0")]
        assert run["frames"] > 0 and shares == sorted(shares) and 0 < shares[0] and shares[-1] <= 1.0
        assert 0 < run["first_part_s"] <= run["seconds"]
    # the whole decode beside them; every run traced: the CPU rank decoded every segment of the 4-s clip's GOPs
    (whole,) = report["runs"]["whole"]
    assert whole["frames"] == report["runs"]["in_order"][0]["frames"] and whole["seconds"] > 0
    segments = set()
    for name in ("in_order", "lanes", "whole"):
        cpu = report["runs"][name][0]["trace"]["ranks"]["cpu"]
        assert cpu["slots"] == 2 and cpu["end_s"] <= report["runs"][name][0]["seconds"]
        segments.add(cpu["segments"])
    assert len(segments) == 1 and segments.pop() > 1  # the same GOP segments in each plan, several
    out = capsys.readouterr().out
    assert "in_order" in out and "whole" in out and "    cpu: " in out


def test_patch_rows_count_toward_the_same_quarters(tmp_path):
    """With --output patches the parts are patch rows, not frames: the quarters are shares of the rows."""
    assert bench_stream.main(["--size", "160x96", "--duration", "4", "--gop", "24", "--repeat", "1", "--threads", "2",
                              "--output", "patches", "--out", str(tmp_path), "--cache", str(tmp_path / "videos")]) == 0
    report = json.loads((tmp_path / "bench_stream_cpu.json").read_text())
    for name in ("in_order", "lanes"):
        (run,) = report["runs"][name]
        shares = [run["share_of_time"][q] for q in ("0.25", "0.5", "0.75", "1.0")]
        assert shares == sorted(shares) and shares[-1] > 0.5, shares  # the last quarter comes with the end


def test_bad_arguments_get_one_error_line(tmp_path, capsys):
    args = ["--size", "160x96", "--duration", "2", "--repeat", "1", "--out", str(tmp_path),
            "--cache", str(tmp_path / "v")]
    assert bench_stream.main([*args, "--device", "bogus"]) == 2  # was taken for the CPU
    assert capsys.readouterr().err.startswith("error: unknown device 'bogus'")
    for bad in (["--gop", "0"], ["--max-pixels", "-5"], ["--repeat", "0"]):
        with pytest.raises(SystemExit):
            bench_stream.main([*args, *bad])
        assert "must be at least 1" in capsys.readouterr().err


def test_a_run_cut_short_keeps_the_runs_it_finished(tmp_path, monkeypatch):
    """A device run's time limit can stop it mid-way: the JSON is written after every run, marked partial."""
    def cut(*args):
        raise KeyboardInterrupt  # the limit's signal, as it lands in the third plan of the first repeat

    monkeypatch.setattr(bench_stream, "whole", cut)
    with pytest.raises(KeyboardInterrupt):
        bench_stream.main(["--size", "160x96", "--duration", "4", "--gop", "24", "--repeat", "2", "--threads", "2",
                           "--out", str(tmp_path), "--cache", str(tmp_path / "videos")])
    report = json.loads((tmp_path / "bench_stream_cpu.json").read_text())
    assert report["partial"] is True and "median" not in report
    assert [len(report["runs"][n]) for n in ("in_order", "lanes", "whole")] == [1, 1, 0]

"""bench/kernels/bench_sm_shares.py: modes, SM splits, the table; its workers run on the CPU here (the
green-context and MPS modes need the GPU: `scripts/gpu_check.sh decode` runs them)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "kernels" / "bench_sm_shares.py"
sys.path.insert(0, str(SCRIPT.parent))

import bench_sm_shares as sm  # noqa: E402

TINY = ["--device", "cpu", "--model", "demo", "--layers", "1", "--batch", "2", "--chunk", "32", "--dtype", "float32",
        "--seconds", "0.2", "--warmup", "1"]


def test_modes_parse_or_say_why():
    assert sm.parse_mode("alone") == ("alone", None) and sm.parse_mode("green:32") == ("green", 32)
    assert sm.parse_mode("mps:25") == ("mps", 25) and sm.parse_mode("unified:0") == ("unified", 0)
    assert sm.parse_mode("priority:30") == ("priority", 30)
    for bad, needle in (("green:4", "at least 8 SMs"), ("mps:0", "1..99"), ("mps:100", "1..99"),
                        ("unified:100", "0..99"), ("priority:x", "a mode is"), ("unified", "a mode is"),
                        ("alone:3", "a mode is"), ("green", "a mode is"), ("fast", "a mode is")):
        with pytest.raises(ValueError, match=needle):
            sm.parse_mode(bad)


def test_green_split_rounds_to_sm_groups():
    assert sm.green_split(132, 32) == (32, 96)  # H100: 132 SMs
    assert sm.green_split(132, 37) == (32, 96)
    assert sm.green_split(132, 48) == (48, 80)
    with pytest.raises(ValueError, match="no 8-SM group for prefill"):
        sm.green_split(132, 128)


def test_percentile():
    assert sm.percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert sm.percentile([0.0, 10.0], 99) == pytest.approx(9.9)
    assert sm.percentile([], 50) != sm.percentile([], 50)  # nan


@pytest.mark.parametrize("role", ["decode", "prefill", "together"])
def test_a_worker_measures_on_the_cpu(role):
    done = subprocess.run([sys.executable, str(SCRIPT), "--worker", role, *TINY], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if role in ("decode", "together"):
        d = result["decode"]
        assert d["steps"] > 0 and 0 < d["p50_ms"] <= d["p99_ms"]
    if role in ("prefill", "together"):
        assert result["prefill"]["passes"] > 0 and result["prefill"]["tflops"] > 0


def test_mps_pair_waits_for_both(tmp_path):
    """The two processes of an MPS pair start their windows together (a file barrier); here on the CPU."""
    args = sm.parse_args(["--worker", "decode", *TINY])
    decode = sm.spawn(args, "decode", barrier=str(tmp_path))
    prefill = sm.spawn(args, "prefill", barrier=str(tmp_path))
    assert sm.collect(decode, "decode", 120)["decode"]["steps"] > 0
    assert sm.collect(prefill, "prefill", 120)["prefill"]["passes"] > 0
    assert len(list(tmp_path.glob("ready-*"))) == 2


def test_in_process_modes_and_the_table():
    args = sm.parse_args(["--worker", "decode", *TINY])  # the parent's path, on the CPU
    results = {"alone": sm.measure(args, "alone", None), "shared": sm.measure(args, "shared", None),
               "mps:25": {"error": "skipped: nvidia-cuda-mps-control is not installed"}}
    text = sm.table(results)
    assert text.splitlines()[2].startswith("| alone | - | ") and "| 1.00 |" in text.splitlines()[2]
    assert text.splitlines()[3].startswith("| shared | - | ")
    assert "| mps:25 | - | skipped: nvidia-cuda-mps-control is not installed |" in text


def test_each_mps_mode_gives_the_servers_settings_for_its_policy():
    """mps:P is split's disjoint caps; unified:P caps prefill only (none at 0); priority:P adds MPS client priorities,
    prefill below normal (--mps-priority)."""
    cap, prio = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "CUDA_MPS_CLIENT_PRIORITY"
    assert sm.mps_pair_env("mps", 30) == ({cap: "30"}, {cap: "70"})
    assert sm.mps_pair_env("unified", 30) == ({}, {cap: "70"}) and sm.mps_pair_env("unified", 0) == ({}, {})
    assert sm.mps_pair_env("priority", 0) == ({prio: "0"}, {prio: "1"})
    assert sm.mps_pair_env("priority", 25) == ({prio: "0"}, {cap: "75", prio: "1"})


def test_the_mps_modes_are_skipped_without_the_daemon(tmp_path, monkeypatch, capsys):
    """No nvidia-cuda-mps-control here: every MPS mode is recorded as skipped (the last ones too: the JSON was written
    only after a measured mode), alone still measured."""
    import shutil
    import signal

    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # main's SIGTERM handler is for its own process
    monkeypatch.setattr(sm, "measure", lambda args, kind, value: {"decode": {"p50_ms": 1.0, "p99_ms": 1.0},
                                                                  "prefill": {"tflops": 1.0}})
    out = tmp_path / "sm.json"
    argv = ["--modes", "alone,mps:25,unified:30,priority:0", "--out", str(out)]
    assert sm.main(argv) == 0
    results = json.loads(out.read_text())["results"]
    assert [m for m, r in results.items() if "skipped" in r.get("error", "")] == ["mps:25", "unified:30",
                                                                                   "priority:0"]


def test_table_names_the_shares():
    alone = {"decode": {"p50_ms": 2.0, "p99_ms": 3.0}, "prefill": {"tflops": 600.0}}
    green = {"decode": {"p50_ms": 3.0, "p99_ms": 4.0}, "prefill": {"tflops": 450.0}, "green_sms": [32, 96]}
    mps = {"decode": {"p50_ms": 2.5, "p99_ms": 3.5}, "prefill": {"tflops": 300.0}, "mps_percent": [25, 75]}
    lines = sm.table({"alone": alone, "green:32": green, "mps:25": mps}).splitlines()
    assert lines[3] == "| green:32 | 32 / 96 SMs | 3.00 / 4.00 | 1.50 | 450.0 | 0.75 |"
    assert lines[4] == "| mps:25 | 25 / 75 % | 2.50 / 3.50 | 1.25 | 300.0 | 0.50 |"
    free = {"decode": {"p50_ms": 4.0, "p99_ms": 5.0}, "prefill": {"tflops": 540.0}, "mps_percent": [None, None],
            "mps_priority": ["0", "1"]}
    capped = {"decode": {"p50_ms": 2.0, "p99_ms": 2.5}, "prefill": {"tflops": 390.0}, "mps_percent": [None, 70],
              "mps_priority": [None, None]}
    lines = sm.table({"alone": alone, "priority:0": free, "unified:30": capped}).splitlines()
    assert lines[3] == "| priority:0 | all / all %, prefill low priority | 4.00 / 5.00 | 2.00 | 540.0 | 0.90 |"
    assert lines[4] == "| unified:30 | all / 70 % | 2.00 / 2.50 | 1.00 | 390.0 | 0.65 |"


@pytest.mark.parametrize("argv, needle", [
    (["--device", "cpu"], "SM shares need a CUDA device"),
    (["--modes", "shared,green:32"], "must include alone"),
    (["--modes", "alone,green:2"], "at least 8 SMs"),
    (["--layers", "0"], "--layers must be at least 1"),
    (["--seconds", "0"], "--seconds must be positive"),
])
def test_bad_arguments_are_one_error(argv, needle, capsys):
    with pytest.raises(SystemExit):
        sm.parse_args(argv)
    assert needle in capsys.readouterr().err


@pytest.mark.cuda
def test_green_and_shared_modes_on_the_gpu(tmp_path):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("CUDA not available")
    out = tmp_path / "sm.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--model", "qwen2.5-vl-3b", "--layers", "2", "--chunk", "2048",
                           "--seconds", "0.5", "--modes", "alone,shared,green:32", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    results = json.loads(out.read_text())["results"]
    assert "error" not in results["green:32"] and results["green:32"]["green_sms"][0] == 32, results["green:32"]
    for mode in ("alone", "shared", "green:32"):
        assert results[mode]["decode"]["steps"] > 0 and results[mode]["prefill"]["tflops"] > 0

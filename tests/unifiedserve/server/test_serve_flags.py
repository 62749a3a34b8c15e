"""Bad `unifiedserve serve` flags: one error line naming the flag, before anything is built or spawned."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from unifiedserve.cli import main


@pytest.mark.parametrize("args, needle", [
    (["--port", "-5"], "argument --port: must be at least 1"),
    (["--port", "70000"], "port number in 1..65535"),
    (["--prefill-token-budget", "0"], "argument --prefill-token-budget: must be at least 1"),
    (["--encode-token-budget", "-3"], "argument --encode-token-budget"),
    (["--kv-cache-gb", "nan"], "argument --kv-cache-gb: must be a positive finite number"),
    (["--max-frames", "abc"], "argument --max-frames: 'abc' is not an integer"),
    (["--block-size", "0"], "argument --block-size"),
    (["--max-request-mb", "0"], "argument --max-request-mb"),
    (["--policy", "bogus"], "argument --policy: invalid choice"),
    (["--device", "gpu"], "argument --device: invalid choice"),
    (["--media-cache-gb", "-1"], "argument --media-cache-gb: must be a finite number >= 0"),
    (["--media-cache-gb", "inf"], "argument --media-cache-gb: must be a finite number >= 0"),
    (["--ingest", "foo"], "argument --ingest: invalid choice"),
])
def test_bad_values_are_one_line_before_anything_starts(args, needle, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", *args])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and needle in err and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("unifiedserve serve: error:")


@pytest.mark.parametrize("args, needle", [
    (["--max-frames", "1"], "--max-frames must be at least 2"),
    (["--gpu-memory-utilization", "0.5"], "--gpu-memory-utilization applies to CUDA only"),
    (["--model", "/nonexistent/folder"], "no config.json there"),
])
def test_contradictions_exit_1_fast_without_spawning(args, needle):
    started = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "unifiedserve.cli", "serve", "--device", "cpu", *args],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and needle in run.stderr and "Traceback" not in run.stderr
    assert "starting workers" not in run.stderr + run.stdout
    assert time.perf_counter() - started < 5.0

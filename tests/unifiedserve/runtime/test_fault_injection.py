"""UNIFIEDSERVE_INJECT_FAULT, the testing hook behind issue 14's fault test (parsing; the fault itself is
exercised end to end in tests/launch/test_serve_node_script.py)."""

from __future__ import annotations

import pytest

from unifiedserve.runtime.worker import parse_fault


def test_the_setting_names_a_worker_its_steps_and_an_optional_marker():
    assert parse_fault("decode:3", "decode") == (3, None)
    assert parse_fault("decode:3:/tmp/x.fired", "decode") == (3, "/tmp/x.fired")
    assert parse_fault("decode:3", "core") is None  # another worker's fault
    assert parse_fault(None, "decode") is None and parse_fault("", "decode") is None


@pytest.mark.parametrize("value", ["decode", "decode:0", "decode:x", "api:2", "gpu:1:/tmp/m", ":3"])
def test_a_malformed_setting_is_one_clear_error(value):
    with pytest.raises(ValueError, match="UNIFIEDSERVE_INJECT_FAULT must be worker:steps"):
        parse_fault(value, "decode")


def test_serve_refuses_a_malformed_setting_in_one_line():
    import os
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "unifiedserve.cli", "serve", "--device", "cpu"],
                         env={**os.environ, "UNIFIEDSERVE_INJECT_FAULT": "gpu:1"}, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 1
    assert run.stderr.strip().splitlines() == [
        "unifiedserve: error: UNIFIEDSERVE_INJECT_FAULT must be worker:steps[:marker] with worker vision, core or "
        "decode and steps >= 1; got 'gpu:1'"]

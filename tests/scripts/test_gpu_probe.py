"""scripts/gpu_probe.py's decode check: it passes on a working stack and says why when flashcodec cannot decode."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _probe_module():
    spec = importlib.util.spec_from_file_location("gpu_probe", ROOT / "scripts" / "gpu_probe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_flashcodec_decode_passes_here_and_fails_with_the_reason(monkeypatch):
    probe = _probe_module()
    report = probe.flashcodec_decode()
    assert report["ok"] is True and report["pyav"]
    import flashcodec

    def broken(*args, **kwargs):  # what PyAV 19 did to every open on 2026-11-28
        raise TypeError("open() got an unexpected keyword argument 'metadata_errors'")

    monkeypatch.setattr(flashcodec, "decode_video", broken)
    assert probe._try(probe.flashcodec_decode) == {
        "error": "TypeError: open() got an unexpected keyword argument 'metadata_errors'"}


def test_gpu_check_stops_a_video_group_on_a_failed_decode_check(tmp_path):
    """The check gpu_check.sh runs on probe.json after the probe (the same command, as the script holds it)."""
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    check = script.split("if ! report=$(python3 -c '", 1)[1].split("' \"$out/probe.json\"", 1)[0]
    for report, rc in (({"ok": True}, 0), ({"error": "TypeError: ..."}, 1)):
        path = tmp_path / "probe.json"
        path.write_text(json.dumps({"flashcodec_decode": report}))
        assert subprocess.run([sys.executable, "-c", check, str(path)], timeout=30).returncode == rc

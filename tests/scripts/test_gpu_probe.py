"""scripts/gpu_probe.py's decode check: it passes on a working stack and says why when flashcodec cannot decode."""

from __future__ import annotations

import importlib.util
import json
import os
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


def test_gpu_check_stops_the_policies_group_without_mps(tmp_path):
    """The policies group's gate after its MPS start (the script's own lines, run by bash with the steps around it
    stubbed): a run where MPS is not usable stops with one status line and packs what it has, before any policy
    runs; a usable MPS passes."""
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    group = script.split("\npolicies)\n", 1)[1]
    gate = "if ! grep -q" + group.split("serve_under_mps\n  if ! grep -q", 1)[1].split("\n  fi\n", 1)[0] + "\n  fi\n"
    for mps_rc, rc in ((0, 0), (1, 1)):
        out = tmp_path / f"out{mps_rc}"
        out.mkdir()
        (out / "status.txt").write_text(f"mps-start: rc=0\nmps-check: rc={mps_rc}\n")
        stubbed = (f'out={out}\npack_out() {{ echo packed >> "$out/status.txt"; }}\nsleep 30 & media_job=$!\n'
                   f'{gate}kill "$media_job"\necho reached >> "$out/status.txt"\n')
        assert subprocess.run(["bash", "-c", stubbed], timeout=30, capture_output=True).returncode == rc
        status = (out / "status.txt").read_text()
        if rc:
            assert "policies: stopped, MPS is not usable here" in status and "packed" in status
            assert "reached" not in status
        else:
            assert status.endswith("reached\n") and "stopped" not in status


def test_gpu_check_shares_group_makes_the_policies_videos_at_nice_19_beside_its_bench(tmp_path):
    """The shares group (its own lines, `run` stubbed): the policies workload's videos are made in the background
    at the lowest CPU priority while the bench keeps its own, and the group waits for them; SHARES_MEDIA=0 skips
    them."""
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    block = script.split("\nshares)\n", 1)[1].split("\n  ;;\n", 1)[0]
    media = "workload_media() {" + script.split("workload_media() {", 1)[1].split("\n}\n", 1)[0] + "\n}\n"
    for skip in ("", "0"):
        out = tmp_path / f"out{skip}"
        out.mkdir()
        stubbed = (f'out={out}\nSHARES_MEDIA={skip or 1}\nstep() {{ :; }}\n'
                   'run() { local name=$2; echo "$name nice=$(nice)" >> "$out/calls"; sleep 0.5; '
                   'echo "$name: rc=0" >> "$out/status.txt"; }\n' + media + block + "\n")
        assert subprocess.run(["bash", "-c", stubbed], timeout=30, capture_output=True).returncode == 0
        calls = sorted((out / "calls").read_text().split("\n")[:-1])
        bench = f"bench-sm-shares nice={os.nice(0)}"  # the bench keeps the caller's priority, whatever it is
        assert calls == ([bench] if skip else sorted([bench, "media nice=19"]))
        assert ("media: rc=0" in (out / "status.txt").read_text()) != bool(skip)

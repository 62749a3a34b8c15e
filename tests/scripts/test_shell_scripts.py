"""The shell scripts parse, and the GPU-run scripts refuse bad arguments before touching anything.

gpu_check.sh and gpu_wheels.sh run only on the GPU machine or before a device run, never in CI: a syntax
error or a bad argument check there would cost a rare device run, so both are checked here."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted([*ROOT.glob("scripts/*.sh"), *ROOT.glob("launch/*.sh")])


def test_scripts_are_found():
    names = {p.name for p in SCRIPTS}
    assert {"gpu_check.sh", "gpu_wheels.sh", "mps.sh", "serve-node.sh", "ray-cluster.sh"} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_script_parses(script):
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("args, env, needle", [
    ([], {}, "usage: scripts/gpu_check.sh OUTDIR"),
    (["OUT", "benchmarks"], {},
     "gpu_check.sh: error: group must be decode, attention, engine, serve, policies, shares or tests"),
    (["OUT", "policies"], {"POLICY": "fast"}, "gpu_check.sh: error: POLICY must be unified, monolithic or split"),
    (["OUT", "policies"], {"POLICY": "unified,fast"}, "gpu_check.sh: error: POLICY must be unified, monolithic or"),
    (["OUT", "policies"], {"POLICY": "unified,,split"}, "gpu_check.sh: error: POLICY has an empty name"),
    (["OUT", "decode"], {"GPU_CHECK_LIMIT_S": "9.5"}, "gpu_check.sh: error: GPU_CHECK_LIMIT_S must be whole seconds"),
    (["OUT", "decode"], {"GPU_CHECK_LIMIT_S": ""}, "gpu_check.sh: error: GPU_CHECK_LIMIT_S must be whole seconds"),
    (["OUT", "policies"], {"MAX_FRAMES": ""}, "gpu_check.sh: error: MAX_FRAMES must be a whole number of frames"),
    (["OUT", "policies"], {"MAX_FRAMES": "64f"}, "gpu_check.sh: error: MAX_FRAMES must be a whole number of frames"),
    (["OUT", "policies"], {"MAX_FRAMES": "1"}, "gpu_check.sh: error: MAX_FRAMES must be a whole number of frames"),
])
def test_gpu_check_refuses_bad_arguments_before_doing_anything(tmp_path, args, env, needle):
    out = [str(tmp_path / a) if a == "OUT" else a for a in args]
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), *out], capture_output=True, text=True,
                          timeout=30, env={"PATH": "/usr/bin:/bin", **env})
    assert proc.returncode != 0 and needle in proc.stderr
    assert not (tmp_path / "OUT").exists()  # no output folder, no log: nothing started


def test_gpu_wheels_needs_a_known_group_and_leaves_the_folder_alone(tmp_path):
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_wheels.sh")], capture_output=True, text=True,
                          timeout=30, env={"PATH": "/usr/bin:/bin"})
    assert proc.returncode != 0 and "usage: scripts/gpu_wheels.sh all|decode|attention" in proc.stderr
    dest = tmp_path / "wheels"
    dest.mkdir()
    (dest / "kept.whl").write_bytes(b"")
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_wheels.sh"), "foo", str(dest)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode != 0 and "group must be one of all, attention, decode, got 'foo'" in proc.stderr
    assert (dest / "kept.whl").exists()  # nothing emptied before the group was known


def test_gpu_check_packs_its_outputs_into_one_archive(tmp_path):
    """The device tool brings back at most 8 files from OUTDIR: gpu_check.sh's pack_out leaves the console log,
    status.txt and one archive holding every other log, XML, JSON and result folder."""
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    body = script[script.index("pack_out() {"):]
    body = body[:body.index("\n}\n") + 3]
    out = tmp_path / "out"
    (out / "policies-unified").mkdir(parents=True)
    for name in ["gpu_check.log", "status.txt", "probe.json", "pytest-cuda.log", "pytest-cuda.xml",
                 "policies-unified/results.json"]:
        (out / name).write_text(name)
    proc = subprocess.run(["bash", "-c", f'set -uo pipefail; out="$1"\n{body}\npack_out', "_", str(out)],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.log", "results.tar.gz", "status.txt"]
    listing = subprocess.run(["tar", "-tzf", str(out / "results.tar.gz")], capture_output=True, text=True,
                             check=True).stdout.split()
    assert {"probe.json", "pytest-cuda.log", "pytest-cuda.xml", "policies-unified/results.json"} <= set(listing)
    assert "gpu_check.log" not in listing


def test_gpu_check_turns_a_faulted_path_off_for_the_steps_after_it(tmp_path):
    """The engine group's never-run paths: a GPU fault in a step's log switches that path off for the later steps
    (one line in status.txt); a log without one, or a missing log, changes nothing."""
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    body = script[script.index("switch_off_after_fault() {"):]
    body = body[:body.index("\n}\n") + 3]
    out = tmp_path / "out"
    out.mkdir()
    (out / "faulted.log").write_text("E   RuntimeError: CUDA error: an illegal memory access was encountered\n")
    (out / "clean.log").write_text("3 passed in 12.0s\n")
    probe = ('switch_off_after_fault clean A; switch_off_after_fault missing B; switch_off_after_fault faulted C\n'
             'echo "A=${A-unset} B=${B-unset} C=${C-unset}"; bash -c \'echo "child C=$C"\'')
    proc = subprocess.run(["bash", "-c", f'set -uo pipefail; out="$1"\n{body}\n{probe}', "_", str(out)],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-2:] == ["A=unset B=unset C=0", "child C=0"]
    assert (out / "status.txt").read_text() == "faulted: a GPU fault; the steps after it run with C=0\n"


def test_make_setup_pins_triton_only_beside_a_cpu_torch():
    """PyPI's torch 2.13.0 for Linux is a CUDA build that requires triton==3.7.1: a Triton pin among the pins
    `make setup` always installs made pip refuse the whole install on any machine without a CPU build of torch at
    hand. The pin lives apart, and the Makefile adds it only where the installed torch has no CUDA."""
    from packaging.requirements import Requirement

    def names(path):
        lines = (line.strip() for line in (ROOT / path).read_text().splitlines())
        return [Requirement(line).name for line in lines if line and not line.startswith("#")]

    assert names("requirements/cpu.txt") == ["torch", "torchcodec"]
    assert names("requirements/triton-cpu.txt") == ["triton"]
    make = (ROOT / "Makefile").read_text()
    assert "import torch; print(\"\" if torch.version.cuda else \"-r requirements/triton-cpu.txt\")" in make


def test_make_setup_refuses_an_older_python_with_pyprojects_floor():
    """scripts/check_python.py runs in the new venv before anything is installed: its floor is requires-python's, and
    the Python running this suite passes it."""
    import re
    import sys

    floor = re.search(r'requires-python = ">=(\d+)\.(\d+)"', (ROOT / "pyproject.toml").read_text())
    script = (ROOT / "scripts" / "check_python.py").read_text()
    assert floor and f"FLOOR = ({floor[1]}, {floor[2]})" in script
    ok = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_python.py")], capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stderr == ""
    assert "@$(PY) scripts/check_python.py" in (ROOT / "Makefile").read_text()

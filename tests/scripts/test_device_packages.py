"""scripts/device_packages.py: the GPU machine's package set, checked here (wheel closure, and commands run
with only the device's packages importable)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "device_packages.py"


def make_wheel(folder: Path, name: str, version: str, *requires: str) -> None:
    """A minimal wheel: only the METADATA the check reads."""
    dist = name.replace("-", "_")
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}", *(f"Requires-Dist: {r}" for r in requires)]
    with zipfile.ZipFile(folder / f"{dist}-{version}-py3-none-any.whl", "w") as z:
        z.writestr(f"{dist}-{version}.dist-info/METADATA", "\n".join(lines) + "\n")


def tool(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


def test_complete_set_passes(tmp_path):
    make_wheel(tmp_path, "fastapi", "0.165.0", "starlette>=0.40", "pydantic>=2", "opentelemetry-api>=1.44.0",
               "email-validator; extra == 'all'", "tomli; python_version < '3.11'")
    make_wheel(tmp_path, "starlette", "1.10.0", "anyio>=3")  # anyio: on the machine
    make_wheel(tmp_path, "pydantic", "2.14.3", "typing-extensions>=4")
    make_wheel(tmp_path, "opentelemetry-api", "1.45.2")
    make_wheel(tmp_path, "flashinfer-python", "0.6.13", "einops", "nvidia-cutlass-dsl>=4.5.0", "torch")
    done = tool("closure", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "every requirement" in done.stdout


def test_missing_requirement_is_named(tmp_path):
    make_wheel(tmp_path, "fastapi", "0.165.0", "starlette>=0.40", "opentelemetry-api>=1.44.0")
    make_wheel(tmp_path, "starlette", "1.10.0")
    make_wheel(tmp_path, "av", "19.0.2", "einops")  # einops is excused for flashinfer only
    done = tool("closure", str(tmp_path))
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        "device_packages.py: missing: av-19.0.2-py3-none-any.whl needs einops",
        "device_packages.py: missing: fastapi-0.165.0-py3-none-any.whl needs opentelemetry-api>=1.44.0",
    ]


def test_a_listed_wheel_that_did_not_download_is_named(tmp_path):
    """gpu_wheels.sh ignores pip's errors per package: closure --group catches a wheel the group lists but
    the folder lacks (its own requirements could not name it)."""
    make_wheel(tmp_path, "fastapi", "0.165.0")
    done = tool("closure", str(tmp_path), "--group", "decode")
    assert done.returncode == 1
    named = [line for line in done.stderr.splitlines() if "no wheel for" in line]
    assert any("no wheel for av==" in line for line in named) and any("torchcodec==" in line for line in named)
    assert not any("fastapi" in line for line in named)
    bad = tool("closure", str(tmp_path), "--group", "bogus")
    assert bad.returncode == 2 and "group must be one of" in bad.stderr


def test_bad_arguments(tmp_path):
    empty = tool("closure", str(tmp_path))
    assert empty.returncode == 2 and empty.stderr.startswith("device_packages.py: error: no .whl files")
    bogus = tool("list", "bogus")
    assert bogus.returncode == 2 and "group must be one of attention, decode, got 'bogus'" in bogus.stderr
    nothing = tool("run", "decode", "--")
    assert nothing.returncode == 2 and "run needs a command" in nothing.stderr


def test_groups_list_their_wheels_and_the_common_ones():
    decode = tool("list", "decode").stdout.split()
    attention = tool("list", "attention").stdout.split()
    assert "torchcodec==0.16.0" in decode and "torchcodec==0.16.0" not in attention
    assert "flashinfer-python==0.6.13" in attention and "flashinfer-python==0.6.13" not in decode
    for both in ("av==19.0.2", "fastapi==0.165.0", "opentelemetry-api==1.45.2", "llguidance==1.9.1"):
        assert both in decode and both in attention


def test_run_hides_what_the_device_lacks_from_the_command_and_its_children():
    pytest.importorskip("jsonschema")  # installed here by the test extra, absent on the GPU machine
    code = ("import subprocess, sys, torch, fastapi\n"
            "try:\n    import jsonschema\nexcept ModuleNotFoundError as e:\n    print('parent:', e.name)\n"
            "subprocess.run([sys.executable, '-c', 'import jsonschema'], check=False)\n")
    done = tool("run", "attention", "--", sys.executable, "-c", code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "parent: jsonschema"
    assert "No module named 'jsonschema' (not on the GPU machine)" in done.stderr  # the child's traceback


@pytest.mark.parametrize("group", ["decode", "attention"])
def test_the_cuda_tests_collect_and_the_server_imports_with_the_device_packages(group):
    """What broke before a device run could: a dependency the device lacks, imported by a module every
    cuda test or the server needs (pytest then collects nothing and the run is lost)."""
    collect = tool("run", group, "--", sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "cuda",
                   "-p", "no:cacheprovider", "tests", timeout=240)
    assert collect.returncode == 0, collect.stdout[-3000:] + collect.stderr[-2000:]
    assert "error" not in collect.stdout.splitlines()[-1]
    modules = ["unifiedserve.server.serve", "unifiedserve.server.api", "unifiedserve.runtime.core_worker",
               "unifiedserve.runtime.decode_worker", "unifiedserve.runtime.vision_worker", "unifiedserve.engine.llm",
               "unifiedserve.runtime.cuda_pools", "flashcodec.decode.nvdec", "flashcodec.telemetry"]
    imported = tool("run", group, "--", sys.executable, "-c", "import " + ", ".join(modules), timeout=120)
    assert imported.returncode == 0, imported.stderr[-3000:]

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
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}",
             *(f"Requires-Dist: {r}" for r in requires)]
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
    assert empty.returncode == 2 and empty.stderr.startswith("device_packages.py: error: no .whl files and no wheels")
    bogus = tool("list", "bogus")
    assert bogus.returncode == 2 and "group must be one of all, attention, decode, got 'bogus'" in bogus.stderr
    nothing = tool("run", "decode", "--")
    assert nothing.returncode == 2 and "run needs a command" in nothing.stderr


def test_groups_list_their_wheels_and_the_common_ones():
    decode = tool("list", "decode").stdout.split()
    attention = tool("list", "attention").stdout.split()
    assert "torchcodec==0.16.0" in decode and "torchcodec==0.16.0" not in attention
    assert "flashinfer-python==0.6.13" in attention and "flashinfer-python==0.6.13" not in decode
    for both in ("av==19.0.2", "fastapi==0.165.0", "opentelemetry-api==1.45.2", "llguidance==1.9.1"):
        assert both in decode and both in attention
    assert sorted(tool("list", "all").stdout.split()) == sorted(set(decode) | set(attention))  # one set for all


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
    modules = ["unifiedserve.server.serve", "unifiedserve.server.serve_setup", "unifiedserve.server.api",
               "unifiedserve.runtime.core_worker", "unifiedserve.runtime.decode_worker",
               "unifiedserve.runtime.vision_worker", "unifiedserve.engine.llm", "unifiedserve.runtime.cuda_pools",
               "flashcodec.decode.nvdec", "flashcodec.telemetry"]
    imported = tool("run", group, "--", sys.executable, "-c", "import " + ", ".join(modules), timeout=120)
    assert imported.returncode == 0, imported.stderr[-3000:]


def installable_wheel(folder: Path, name: str = "tinypkg", version: str = "1.0") -> Path:
    """A wheel pip installs: a package with a module and an executable data file, METADATA, WHEEL, RECORD."""
    info = f"{name}-{version}.dist-info"
    files = {f"{name}/__init__.py": b"VALUE = 42\n", f"{name}/tool.sh": b"#!/bin/sh\necho hi\n" * 200,
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
             f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for member, data in files.items():
            zi = zipfile.ZipInfo(member, (2026, 11, 27, 0, 0, 0))
            zi.external_attr = (0o100755 if member.endswith(".sh") else 0o100644) << 16  # regular file + mode
            z.writestr(zi, data, zipfile.ZIP_DEFLATED)
        z.writestr(f"{info}/RECORD", "".join(f"{m},,\n" for m in [*files, f"{info}/RECORD"]))
    return path


def test_pack_keeps_every_file_of_every_wheel_and_unpack_gives_them_back(tmp_path):
    wheels = tmp_path / "whl"
    wheels.mkdir()
    make_wheel(wheels, "fastapi", "0.165.0", "starlette>=0.40")
    original = installable_wheel(wheels)
    before = {p.name: zipfile.ZipFile(p) for p in wheels.glob("*.whl")}
    expected = {name: [(i.filename, i.external_attr, i.date_time, z.read(i)) for i in z.infolist()]
                for name, z in before.items()}
    packed = tool("pack", str(wheels))
    assert packed.returncode == 0, packed.stderr
    assert sorted(p.name for p in wheels.iterdir()) == ["wheels.tar.xz"]  # the wheels are replaced
    assert "MB of wheels ->" in packed.stdout
    unpacked = tool("unpack", str(wheels / "wheels.tar.xz"), str(tmp_path / "out"))
    assert unpacked.returncode == 0 and "2 wheels into" in unpacked.stdout, unpacked.stderr
    for name, members in expected.items():
        with zipfile.ZipFile(tmp_path / "out" / name) as z:
            assert [(i.filename, i.external_attr, i.date_time, z.read(i)) for i in z.infolist()] == members
            assert {i.compress_type for i in z.infolist()} == {zipfile.ZIP_STORED}  # xz compresses the set
    assert original.name in expected
    # closure reads a packed folder as it reads the wheels
    closed = tool("closure", str(wheels))
    assert closed.returncode == 1 and "fastapi-0.165.0-py3-none-any.whl needs starlette>=0.40" in closed.stderr


def test_unpack_takes_only_wheels_at_the_top_level(tmp_path):
    import io
    import lzma
    import tarfile
    archive = tmp_path / "wheels.tar.xz"
    with lzma.open(archive, "wb") as xz, tarfile.open(fileobj=xz, mode="w") as tar:
        info = tarfile.TarInfo("../escape.whl")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"abc"))
    done = tool("unpack", str(archive), str(tmp_path / "out"))
    assert done.returncode == 2 and "unexpected member '../escape.whl'" in done.stderr
    assert not (tmp_path / "escape.whl").exists()
    garbage = tmp_path / "garbage.tar.xz"
    garbage.write_bytes(b"not xz")
    bad = tool("unpack", str(garbage), str(tmp_path / "out2"))
    assert bad.returncode == 2 and bad.stderr.startswith("device_packages.py: error:")
    missing_dir = tool("pack", str(tmp_path / "none"))
    assert missing_dir.returncode == 2 and "no .whl files in" in missing_dir.stderr


def test_gpu_checks_install_step_installs_a_packed_set_once(tmp_path):
    """gpu_check.sh's wheel step, run here on a packed pure-Python wheel: unpacked, installed with pip into the
    site folder, and on a second run (a warm machine) neither unpacked nor installed again."""
    import os
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    body = script[script.index('wheels=${GPU_WHEELS:-.whl}'):script.index("export PYTHONPATH=$PWD:$site")]
    body = body.replace("site=/tmp/site", f"site={tmp_path}/site").replace("/tmp/carried-wheels", f"{tmp_path}/cw")
    carried = tmp_path / "carry"
    carried.mkdir()
    installable_wheel(carried)
    assert tool("pack", str(carried)).returncode == 0
    bindir = tmp_path / "bin"
    bindir.mkdir()
    # a wrapper, not a symlink: a symlink to a venv's python outside the venv runs the base interpreter, which
    # may lack the venv's packages (Python 3.13's has no `packaging`, which device_packages.py needs)
    (bindir / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bindir / "python3").chmod(0o755)
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "GPU_WHEELS": str(carried)}
    for run in range(2):
        done = subprocess.run(["bash", "-c", f"set -uo pipefail\n{body}"], capture_output=True, text=True, cwd=ROOT,
                              env=env, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        if run == 0:
            assert "1 wheels into" in done.stdout
        else:
            assert "already installed" in done.stdout and "wheels into" not in done.stdout
    site = tmp_path / "site"
    assert (site / "tinypkg" / "__init__.py").read_text() == "VALUE = 42\n"
    assert os.access(site / "tinypkg" / "tool.sh", os.X_OK)  # modes kept through the stored wheel

"""scripts/wheel_closure.py: a wheel set for the GPU machine is complete, or each missing requirement is named."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "wheel_closure.py"


def make_wheel(folder: Path, name: str, version: str, *requires: str) -> None:
    """A minimal wheel: only the METADATA the check reads."""
    dist = name.replace("-", "_")
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}", *(f"Requires-Dist: {r}" for r in requires)]
    with zipfile.ZipFile(folder / f"{dist}-{version}-py3-none-any.whl", "w") as z:
        z.writestr(f"{dist}-{version}.dist-info/METADATA", "\n".join(lines) + "\n")


def check(folder: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), str(folder)], capture_output=True, text=True, timeout=60)


def test_complete_set_passes(tmp_path):
    make_wheel(tmp_path, "fastapi", "0.165.0", "starlette>=0.40", "pydantic>=2", "opentelemetry-api>=1.44.0",
               "email-validator; extra == 'all'", "tomli; python_version < '3.11'")
    make_wheel(tmp_path, "starlette", "1.10.0", "anyio>=3")  # anyio: on the machine
    make_wheel(tmp_path, "pydantic", "2.14.3", "typing-extensions>=4")
    make_wheel(tmp_path, "opentelemetry-api", "1.45.2")
    make_wheel(tmp_path, "flashinfer-python", "0.6.13", "einops", "nvidia-cutlass-dsl>=4.5.0", "torch")
    done = check(tmp_path)
    assert done.returncode == 0, done.stderr
    assert "every requirement" in done.stdout


def test_missing_requirement_is_named(tmp_path):
    make_wheel(tmp_path, "fastapi", "0.165.0", "starlette>=0.40", "opentelemetry-api>=1.44.0")
    make_wheel(tmp_path, "starlette", "1.10.0")
    make_wheel(tmp_path, "av", "19.0.2", "einops")  # einops is excused for flashinfer only
    done = check(tmp_path)
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        "wheel_closure.py: missing: av-19.0.2-py3-none-any.whl needs einops",
        "wheel_closure.py: missing: fastapi-0.165.0-py3-none-any.whl needs opentelemetry-api>=1.44.0",
    ]


def test_empty_folder_is_an_error(tmp_path):
    done = check(tmp_path)
    assert done.returncode == 2 and done.stderr.startswith("wheel_closure.py: error: no .whl files")

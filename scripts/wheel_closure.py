"""Check that a folder of wheels for the GPU machine is complete: every requirement of every wheel is met by
another wheel in the folder or by what the machine already has.

The wheels are installed there with ``pip install --no-deps --target`` (the machine has no network), so a
missing dependency shows only when an import fails on the device, in a run of a few precious minutes. This
finds it here. Used by ``scripts/gpu_wheels.sh``; by hand:

    python scripts/wheel_closure.py .whl

Exit 0 when complete; otherwise one line per missing requirement and exit 1.
"""

from __future__ import annotations

import argparse
import re
import sys
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# What the GPU machine has before any wheel is installed: the packages ../shared/gpu/README.md names (Python
# 3.12, torch 2.11.0+cu130, torchvision 0.26, triton 3.6, cuda-bindings, nvidia-ml-py, transformers 5.17,
# safetensors, tokenizers, pytest, hypothesis, prometheus-client) and their dependencies as pip resolves
# them for Python 3.12 (`pip install --dry-run --report`, 2026-11-23), less the ones that README says are not
# there (pydantic and what only it needs).
DEVICE_BASE = frozenset(canonicalize_name(n) for n in """
    annotated-doc anyio certifi click cuda-bindings cuda-pathfinder cuda-toolkit filelock fsspec h11 hf-xet
    httpcore httpx huggingface-hub hypothesis idna iniconfig jinja2 markdown-it-py markupsafe mdurl mpmath
    networkx numpy nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13
    nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
    nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx packaging pillow pluggy
    prometheus-client pygments pytest pyyaml regex rich safetensors setuptools shellingham sortedcontainers
    sympy tokenizers torch torchvision tqdm transformers triton typer typing-extensions ninja
""".split())

# Requirements left out on purpose: flashinfer's for kernels the project does not use (CuTe DSL, cuDNN and
# cuda-tile back ends, the artifact downloader). flashinfer 0.6.13 imports and runs its paged attention
# without them on the machine (../shared/gpu/README.md, measured there).
NOT_NEEDED = {
    "flashinfer-python": {"cuda-tile", "einops", "nvidia-cudnn-frontend", "nvidia-cutlass-dsl", "requests", "tabulate"},
}

# The machine's interpreter, for environment markers.
DEVICE_ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
              "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
              "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}


def wheel_name(path: Path) -> str:
    """The distribution a wheel file holds (``fastapi-0.165.0-py3-none-any.whl`` -> ``fastapi``)."""
    return canonicalize_name(re.split(r"-\d", path.name, maxsplit=1)[0])


def requirements(path: Path) -> list[Requirement]:
    """The unconditional requirements of a wheel (no extras) on the GPU machine's interpreter."""
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode("utf-8", "replace")
    found = []
    for line in text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is None or req.marker.evaluate(DEVICE_ENV):
            found.append(req)
    return found


def missing(folder: Path) -> list[str]:
    """One line per requirement that neither the folder nor the machine meets."""
    wheels = sorted(folder.glob("*.whl"))
    have = DEVICE_BASE | {wheel_name(w) for w in wheels}
    lines = []
    for w in wheels:
        skip = NOT_NEEDED.get(wheel_name(w), set())
        for req in requirements(w):
            name = canonicalize_name(req.name)
            if name not in have and name not in skip:
                lines.append(f"{w.name} needs {req}")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", type=Path, help="a folder of .whl files (scripts/gpu_wheels.sh fills .whl/)")
    args = p.parse_args(argv)
    if not args.folder.is_dir() or not any(args.folder.glob("*.whl")):
        print(f"wheel_closure.py: error: no .whl files in {args.folder}", file=sys.stderr)
        return 2
    lines = missing(args.folder)
    for line in lines:
        print(f"wheel_closure.py: missing: {line}", file=sys.stderr)
    if not lines:
        print(f"{args.folder}: every requirement is in the folder or on the GPU machine")
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main())

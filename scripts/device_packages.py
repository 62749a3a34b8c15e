"""What Python packages a run on the GPU machine has, and how to find out here what would break there.

The GPU machine has no network: it has its own packages (:data:`DEVICE_BASE`) and whatever wheels a run
brings (``scripts/gpu_wheels.txt``, downloaded by ``scripts/gpu_wheels.sh``, installed with ``pip install
--no-deps``). A dependency missing from both shows only when an import fails on the device, in a run of a
few precious minutes. Three commands find it on this machine first:

    python scripts/device_packages.py list attention        # the group's wheels (gpu_wheels.sh reads this)
    python scripts/device_packages.py closure .whl          # every requirement of every wheel is met
    python scripts/device_packages.py run attention -- python -m pytest --collect-only -m cuda tests
        # a command with only the device's packages importable (+ the group's wheels); others raise
        # ModuleNotFoundError, in the command's subprocesses too (the server's workers)

``closure`` exits 1 with one line per missing requirement; ``run`` exits with the command's status.

Two more carry the wheels in less than the 64 MiB a device run may bring:

    python scripts/device_packages.py pack .whl            # the wheels -> .whl/wheels.tar.xz (gpu_wheels.sh)
    python scripts/device_packages.py unpack .whl/wheels.tar.xz DIR   # on the device (gpu_check.sh)

A wheel deflates each file alone; ``pack`` stores every file of every wheel (the same bytes, names, order and
modes: pip installs them as it would the originals) and compresses the set as one xz stream, which finds what
the files share: both groups' wheels together, 66 MB as wheels, fit one run that way.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import lzma
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

WHEELS_FILE = Path(__file__).with_name("gpu_wheels.txt")

# What the GPU machine has before any wheel is installed: the packages ../shared/gpu/README.md names (Python
# 3.12, torch 2.11.0+cu130, torchvision 0.26, triton 3.6, cuda-bindings, nvidia-ml-py, transformers 5.17,
# safetensors, tokenizers, pytest, hypothesis, prometheus-client, ninja) and their dependencies as pip
# resolves them for Python 3.12 (`pip install --dry-run --report`, 2026-11-23), less the ones that README
# says are not there (pydantic and what only it needs).
DEVICE_BASE = frozenset(canonicalize_name(n) for n in """
    annotated-doc anyio certifi click cuda-bindings cuda-pathfinder cuda-toolkit filelock fsspec h11 hf-xet
    httpcore httpx huggingface-hub hypothesis idna iniconfig jinja2 markdown-it-py markupsafe mdurl mpmath
    networkx numpy nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13
    nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
    nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx packaging pillow pluggy
    prometheus-client pygments pytest pyyaml regex rich safetensors setuptools shellingham sortedcontainers
    sympy tokenizers torch torchvision tqdm transformers triton typer typing-extensions ninja
    pip wheel unifiedserve
""".split())  # (+ pip and wheel, and this project, which a run brings as its working tree)

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

# Put first on PYTHONPATH by `run`: every module of a distribution the device lacks raises ModuleNotFoundError
# (what a missing package raises, so pytest.importorskip skips as it would there).
_BLOCKER = '''\
import os, sys
_blocked = frozenset(os.environ.get("DEVICE_PACKAGES_BLOCKED", "").split(","))
class _NotOnTheDevice:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in _blocked:
            raise ModuleNotFoundError(f"No module named {name!r} (not on the GPU machine)", name=name)
        return None
sys.meta_path.insert(0, _NotOnTheDevice())
'''


def groups() -> dict[str, list[str]]:
    """``{group: [requirement, ...]}`` from ``gpu_wheels.txt``, each group with the common line added."""
    found: dict[str, list[str]] = {}
    for line in WHEELS_FILE.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, reqs = line.partition(":")
            found[name.strip()] = reqs.split()
    common = found.pop("common", [])
    return {name: reqs + common for name, reqs in found.items()}


def group_requirements(group: str) -> list[str]:
    """A group's requirements; ValueError naming the groups when there is no such group."""
    known = groups()
    if group not in known:
        raise ValueError(f"group must be one of {', '.join(sorted(known))}, got {group!r}")
    return known[group]


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
    """One line per requirement of the folder's wheels that neither the folder nor the machine meets."""
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


def absent(folder: Path, group: str) -> list[str]:
    """One line per wheel ``group`` lists that the folder lacks (a download that failed)."""
    have = {wheel_name(w) for w in folder.glob("*.whl")}
    return [f"no wheel for {r} (scripts/gpu_wheels.txt, group {group})" for r in group_requirements(group)
            if canonicalize_name(Requirement(r).name) not in have]


def blocked_modules(group: str) -> list[str]:
    """Top-level modules installed here whose distributions a run of ``group`` does not have there."""
    have = DEVICE_BASE | {canonicalize_name(Requirement(r).name) for r in group_requirements(group)}
    blocked = set()
    for module, dists in importlib.metadata.packages_distributions().items():
        if module.isidentifier() and not module.startswith("_") and \
                all(canonicalize_name(d) not in have for d in dists):
            blocked.add(module)
    return sorted(blocked)


def hiding_env(modules: list[str], folder: str | Path) -> dict[str, str]:
    """An environment in which Python processes cannot import ``modules`` (top-level names): writes the
    blocker into ``folder``, which must outlive the processes, and puts it first on ``PYTHONPATH``."""
    Path(folder, "sitecustomize.py").write_text(_BLOCKER)
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "DEVICE_PACKAGES_BLOCKED": ",".join(modules),
            "PYTHONPATH": str(folder) + (os.pathsep + path if path else "")}


def run_as_on_device(group: str, command: list[str]) -> int:
    """Run ``command`` with the modules of :func:`blocked_modules` unimportable, in its subprocesses too."""
    with tempfile.TemporaryDirectory(prefix="device-packages-") as folder:
        return subprocess.run(command, env=hiding_env(blocked_modules(group), folder)).returncode


ARCHIVE = "wheels.tar.xz"


def stored_wheel(src: Path, dest: Path) -> None:
    """Write wheel ``src`` to ``dest`` with every member stored, not deflated: the same names, order, bytes,
    dates and modes (so the same RECORD), only without each file's own compression."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dest, "w", zipfile.ZIP_STORED) as zout:
        for member in zin.infolist():
            info = zipfile.ZipInfo(member.filename, member.date_time)
            info.external_attr, info.create_system = member.external_attr, member.create_system
            info.compress_type = zipfile.ZIP_STORED
            zout.writestr(info, zin.read(member))


def pack(folder: Path) -> tuple[Path, int]:
    """Replace the folder's wheels by ``folder/wheels.tar.xz``: the wheels stored (:func:`stored_wheel`) in
    one tar, xz-compressed as one stream. Returns the archive and the wheels' bytes."""
    wheels = sorted(folder.glob("*.whl"))
    size = sum(w.stat().st_size for w in wheels)
    if not wheels:
        raise ValueError(f"no .whl files in {folder}")
    archive = folder / ARCHIVE
    tmp = archive.with_name(ARCHIVE + ".tmp")
    try:
        with tempfile.TemporaryDirectory(prefix="wheels-stored-") as stage, lzma.open(tmp, "wb", preset=9) as xz, \
                tarfile.open(fileobj=xz, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for wheel in wheels:  # one at a time: a stored set is about 4x the wheels
                stored = Path(stage, wheel.name)
                stored_wheel(wheel, stored)
                tar.add(stored, arcname=wheel.name, recursive=False)
                stored.unlink()
        tmp.replace(archive)
    finally:
        tmp.unlink(missing_ok=True)
    for wheel in wheels:
        wheel.unlink()
    return archive, size


def unpack(archive: Path, dest: Path) -> list[Path]:
    """The wheels of a :func:`pack` archive, written into ``dest`` (made if missing); only plain ``*.whl``
    files at the top level are taken."""
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    with tarfile.open(archive, "r:xz") as tar:
        for member in tar:
            name = member.name
            if not member.isfile() or "/" in name or not name.endswith(".whl") or name.startswith("."):
                raise ValueError(f"{archive}: unexpected member {name!r} (not a wheel at the top level)")
            src = tar.extractfile(member)
            target = dest / name
            with open(target, "wb") as out:
                while chunk := src.read(1 << 20):
                    out.write(chunk)
            written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    sub.add_parser("list", help="a group's wheels, one requirement per line").add_argument("group")
    closure = sub.add_parser("closure", help="check a folder of wheels against the machine")
    closure.add_argument("folder", type=Path,
                         help=f"a folder of .whl files, or of their {ARCHIVE} (scripts/gpu_wheels.sh fills .whl/)")
    closure.add_argument("--group", default=None, help="also check that every wheel this group lists is there")
    packer = sub.add_parser("pack", help=f"replace a folder's wheels by FOLDER/{ARCHIVE} (fits a device run)")
    packer.add_argument("folder", type=Path)
    unpacker = sub.add_parser("unpack", help=f"write the wheels of a {ARCHIVE} into a folder")
    unpacker.add_argument("archive", type=Path)
    unpacker.add_argument("dest", type=Path)
    run = sub.add_parser("run", help="run a command with only the device's packages importable")
    run.add_argument("group")
    run.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    args = p.parse_args(argv)
    prog = "device_packages.py"
    try:
        if args.what == "list":
            print("\n".join(group_requirements(args.group)))
            return 0
        if args.what == "run":
            command = args.command[1:] if args.command[:1] == ["--"] else args.command
            if not command:
                raise ValueError("run needs a command after --")
            group_requirements(args.group)
            return run_as_on_device(args.group, command)
        if args.what == "pack":
            archive, size = pack(args.folder)
            print(f"{archive}: {size / 1e6:.1f} MB of wheels -> {archive.stat().st_size / 1e6:.1f} MB")
            return 0
        if args.what == "unpack":
            if not args.archive.is_file():
                raise ValueError(f"no such archive: {args.archive}")
            print(f"{len(unpack(args.archive, args.dest))} wheels into {args.dest}")
            return 0
    except (ValueError, OSError, tarfile.TarError, lzma.LZMAError, zipfile.BadZipFile) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    packed = args.folder / ARCHIVE
    if not args.folder.is_dir() or not (any(args.folder.glob("*.whl")) or packed.is_file()):
        print(f"{prog}: error: no .whl files and no {ARCHIVE} in {args.folder}", file=sys.stderr)
        return 2
    try:
        with tempfile.TemporaryDirectory(prefix="wheels-") as unpacked:
            folder = args.folder
            if not any(folder.glob("*.whl")):  # a packed folder: check the wheels it carries
                folder = Path(unpacked)
                unpack(packed, folder)
            lines = (absent(folder, args.group) if args.group else []) + missing(folder)
    except (ValueError, OSError, tarfile.TarError, lzma.LZMAError, zipfile.BadZipFile) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    for line in lines:
        print(f"{prog}: missing: {line}", file=sys.stderr)
    if not lines:
        print(f"{args.folder}: every requirement is in the folder or on the GPU machine")
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Compile-only check of the CUDA sources in csrc/ with nvcc against the installed torch's headers.

For machines without a GPU (or without a CUDA build of torch): it runs the device and host compilation
that ``torch.utils.cpp_extension.load`` would run for each ``.cu`` file, with the same defines, and
stops before linking. A CPU build of torch ships the c10/ATen CUDA headers except one generated at
torch's build time, ``c10/cuda/impl/cuda_cmake_macros.h``; when it is missing, a stand-in with the one
define a CUDA build of torch has in it (``C10_CUDA_BUILD_SHARED_LIBS``) is put on the include path.

    python csrc/nvcc_check.py                 # every csrc/*.cu for sm_90 (H100); exit status of nvcc
    python csrc/nvcc_check.py --arch sm_80 -v # another arch, ptxas register/spill report

Exit status: 0 when every file compiles, nvcc's status for the first that does not, 2 without nvcc.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

CSRC = pathlib.Path(__file__).resolve().parent
# what cpp_extension passes to nvcc for every extension (torch/utils/cpp_extension.py, COMMON_NVCC_FLAGS)
TORCH_NVCC_FLAGS = ["-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
                    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__", "--expt-relaxed-constexpr"]
MACROS_STANDIN = "#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n"


def find_nvcc() -> str | None:
    """nvcc under CUDA_HOME (as cpp_extension finds it), else on PATH."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (pathlib.Path(home) / "bin" / "nvcc").exists():
        return str(pathlib.Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def nvcc_command(nvcc: str, source: pathlib.Path, output: pathlib.Path, include_dirs: list[str], arch: str,
                 verbose: bool) -> list[str]:
    """The compile-only nvcc command line for one source."""
    number = arch.removeprefix("sm_")
    cmd = [nvcc, "-x", "cu", "-c", str(source), "-o", str(output), "-std=c++17", "-O3", f"-I{CSRC}",
           *TORCH_NVCC_FLAGS, f"-gencode=arch=compute_{number},code=sm_{number}", "-Xcompiler", "-fPIC",
           "-DTORCH_API_INCLUDE_EXTENSION_H"]
    for d in include_dirs:
        cmd += ["-isystem", d]
    if verbose:
        cmd += ["-Xptxas", "-v"]
    return cmd


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="nvcc_check.py", description=__doc__.split("\n\n")[0])
    p.add_argument("sources", nargs="*", type=pathlib.Path, help="default: every csrc/*.cu")
    p.add_argument("--arch", default="sm_90", help="GPU arch to compile for (default sm_90, the H100)")
    p.add_argument("-v", "--verbose", action="store_true", help="print the commands and ptxas's resource report")
    args = p.parse_args(argv)
    if not args.arch.removeprefix("sm_").rstrip("a").isdigit():
        p.error(f"--arch must look like sm_90, got {args.arch!r}")
    nvcc = find_nvcc()
    if nvcc is None:
        print("nvcc_check.py: error: nvcc not found (set CUDA_HOME or put nvcc on PATH)", file=sys.stderr)
        return 2
    from torch.utils import cpp_extension

    include_dirs = list(cpp_extension.include_paths())
    sources = args.sources or sorted(CSRC.glob("*.cu"))
    with tempfile.TemporaryDirectory(prefix="nvcc-check-") as tmp:
        if not any((pathlib.Path(d) / "c10/cuda/impl/cuda_cmake_macros.h").exists() for d in include_dirs):
            standin = pathlib.Path(tmp) / "include" / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
            standin.parent.mkdir(parents=True)
            standin.write_text(MACROS_STANDIN)
            include_dirs.append(str(pathlib.Path(tmp) / "include"))
        for source in sources:
            cmd = nvcc_command(nvcc, source, pathlib.Path(tmp) / (source.stem + ".o"), include_dirs, args.arch,
                               args.verbose)
            if args.verbose:
                print(" ".join(cmd))
            run = subprocess.run(cmd)
            if run.returncode != 0:
                print(f"nvcc_check.py: error: {source.name} does not compile (nvcc exit {run.returncode})",
                      file=sys.stderr)
                return run.returncode
            print(f"{source.name}: compiles for {args.arch}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

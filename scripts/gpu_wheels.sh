#!/usr/bin/env bash
# Download the wheels the GPU machine lacks (it has no network) into .whl/ (git-ignored), for its
# Python 3.12 / torch 2.11 (cu130), and pack them into .whl/wheels.tar.xz: one device run may carry 64 MiB
# with the tree, and scripts/gpu_check.sh OUTDIR GROUP installs whatever .whl/ holds. The lists are in
# scripts/gpu_wheels.txt:
#   all       : both sets below in one archive (66 MB of wheels -> 42 MB packed, +3 MB of kernels): every
#               group runs on it, so one carry serves a whole session on one warm machine          ~45 MB
#   decode    : PyAV 19 (FFmpeg with NVDEC), torchcodec 0.16 (first CUDA 13 build on PyPI)
#   attention : flashinfer-python 0.6.13 + apache-tvm-ffi, and PyAV 19: the server's vision process and the
#               tests that import flashcodec need it
# For all and attention, flashinfer's attention kernels are compiled here for sm_90a
# (scripts/flashinfer_kernels.py: ~12 min on two cores the first time, then kept in ~/.cache/unifiedserve)
# into flashinfer-kernels.tar.xz, so no device run spends its minutes on the JIT, and the flashinfer wheel
# loses CUTLASS's headers (only that JIT reads them); FLASHINFER_KERNELS=0 skips both.
# Every group adds the server's dependencies (fastapi 0.165 imports opentelemetry-api at import; the engine's
# sampler imports llguidance, whose wheel is manylinux_2_31) and pytest-timeout. scripts/device_packages.py
# closure then checks that every wheel's requirements are in the folder or on the machine; `pack` stores the
# wheels' files undeflated in one xz stream (pip installs them as the originals: same files, same RECORD);
# this script then checks that the archive and the working tree fit one run.
# Usage: scripts/gpu_wheels.sh all|decode|attention [DEST]   (empties DEST first)
set -euo pipefail
cd "$(dirname "$0")/.."
group=${1:?usage: scripts/gpu_wheels.sh all|decode|attention [DEST]}; dest=${2:-.whl}
py=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
pkgs=$("$py" scripts/device_packages.py list "$group")
rm -rf "$dest" && mkdir -p "$dest"
plat=""
for p in manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_24_x86_64 \
         manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do plat="$plat --platform $p"; done
for pkg in $pkgs; do
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $plat \
    -d "$dest" "$pkg" 2>&1 | grep -v '^WARNING' || true
done
if [ "$group" != decode ] && [ "${FLASHINFER_KERNELS:-1}" != 0 ]; then
  # a Python-3.11 flashinfer to drive its own JIT recipe here (the .whl/ wheels are for the device's 3.12), and
  # cuRAND's headers, which CUTLASS's utilities include and this machine's CUDA toolkit lacks
  build_site=${XDG_CACHE_HOME:-$HOME/.cache}/unifiedserve/flashinfer-build-site
  reqs="$(echo "$pkgs" | tr ' ' '\n' | grep -E '^(flashinfer-python|apache-tvm-ffi)==' | tr '\n' ' ')nvidia-curand==10.4.0.35"
  reqs="$reqs nvidia-ml-py requests tabulate einops charset-normalizer idna urllib3 certifi"
  if [ "$(cat "$build_site/.requirements" 2>/dev/null)" != "$reqs" ]; then
    rm -rf "$build_site"
    # shellcheck disable=SC2086
    "$py" -m pip install -q --no-deps --target "$build_site" $reqs 2>&1 | grep -v '^WARNING' || true
    echo "$reqs" > "$build_site/.requirements"
  fi
  # check: the project's backends, planned against this flashinfer, ask for exactly the modules built
  if PYTHONPATH="$build_site" "$py" scripts/flashinfer_kernels.py check &&
     PYTHONPATH="$build_site" "$py" scripts/flashinfer_kernels.py build "$dest/flashinfer-kernels.tar.xz"; then
    "$py" scripts/flashinfer_kernels.py slim-wheel "$dest"/flashinfer_python-*.whl
  else
    echo "gpu_wheels.sh: the kernels did not build: the device runs will JIT them (full flashinfer wheel kept)" >&2
  fi
fi
"$py" scripts/device_packages.py closure "$dest" --group "$group"  # a failed download, too, stops here
"$py" scripts/device_packages.py pack "$dest"
du -sh "$dest"
# what one device run may bring: the archives and the working tree (tracked and untracked, not ignored)
total=$(( $(cat "$dest"/* | wc -c) + $(git ls-files -co --exclude-standard -z | xargs -0 cat 2>/dev/null | wc -c) ))
echo "with the working tree: $(( total / 1048576 )) MiB of the 64 MiB a run may carry"
[ "$total" -le $(( 64 * 1048576 )) ] || { echo "gpu_wheels.sh: error: over 64 MiB" >&2; exit 1; }

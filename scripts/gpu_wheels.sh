#!/usr/bin/env bash
# Download the wheels the GPU machine lacks (it has no network) into .whl/ (git-ignored), for its
# Python 3.12 / torch 2.11 (cu130). One run on the device may carry 64 MiB with the tree, so the two
# groups go in two runs: scripts/gpu_check.sh OUTDIR decode|attention installs whatever is in .whl/.
#   decode    : PyAV 19 (FFmpeg with NVDEC), torchcodec 0.16 (first CUDA 13 build on PyPI)   ~50 MB
#   attention : flashinfer-python 0.6.13 + apache-tvm-ffi (kernels JIT-compiled on first use), and PyAV 19:
#               the server's vision process and the tests that import flashcodec need it          ~63 MB
# Both add the server's dependencies (fastapi 0.165 imports opentelemetry-api at import; the engine's sampler
# imports llguidance, whose wheel is manylinux_2_31) and pytest-timeout;
# scripts/wheel_closure.py then checks that every wheel's requirements are in the folder or on the machine.
# Usage: scripts/gpu_wheels.sh decode|attention [DEST]   (empties DEST first)
set -euo pipefail
group=${1:?usage: scripts/gpu_wheels.sh decode|attention [DEST]}; dest=${2:-.whl}
common="msgspec==0.22.0 pyzmq==27.3.0 fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.3 pydantic-core==2.50.4
        annotated-types==0.8.0 typing-inspection==0.4.5 uvicorn==0.54.0 openai==3.54.0 jiter==0.19.0 sniffio==1.3.1
        distro httpx2==2.16.2 httpcore2==2.16.2 truststore opentelemetry-api==1.45.2 llguidance==1.9.1 pytest-timeout"
case $group in
  decode) pkgs="av==19.0.2 torchcodec==0.16.0 $common" ;;
  attention) pkgs="flashinfer-python==0.6.13 apache-tvm-ffi==0.1.15.post2 av==19.0.2 $common" ;;
  *) echo "gpu_wheels.sh: error: group must be decode or attention, got '$group'" >&2; exit 2 ;;
esac
rm -rf "$dest" && mkdir -p "$dest"
plat=""
for p in manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_24_x86_64 \
         manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do plat="$plat --platform $p"; done
for pkg in $pkgs; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $plat \
    -d "$dest" "$pkg" 2>&1 | grep -v '^WARNING' || true
done
du -sh "$dest"
# what one device run may bring: these wheels and the working tree (tracked and untracked, not ignored)
total=$(( $(cat "$dest"/*.whl | wc -c) + $(git ls-files -co --exclude-standard -z | xargs -0 cat 2>/dev/null | wc -c) ))
echo "with the working tree: $(( total / 1048576 )) MiB of the 64 MiB a run may carry"
[ "$total" -le $(( 64 * 1048576 )) ] || { echo "gpu_wheels.sh: error: over 64 MiB" >&2; exit 1; }
"${PYTHON:-python3}" "$(dirname "$0")/wheel_closure.py" "$dest"

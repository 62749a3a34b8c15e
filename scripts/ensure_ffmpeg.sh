#!/usr/bin/env bash
# Make sure the system FFmpeg shared libraries are present (torchcodec links against them;
# PyAV bundles its own). Installs them as root, otherwise prints the exact command.
set -euo pipefail
if ldconfig -p 2>/dev/null | grep -q 'libavcodec\.so\.'; then
  exit 0
fi
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  echo "[setup] installing the system FFmpeg libraries: apt-get install -y ffmpeg"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq ffmpeg >/dev/null
  exit 0
fi
echo "[setup] the FFmpeg libraries are missing. Install them with:" >&2
echo "    sudo apt-get install -y ffmpeg" >&2
exit 1

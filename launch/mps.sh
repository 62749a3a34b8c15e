#!/usr/bin/env bash
# A user-level CUDA MPS control daemon with private pipe and log folders, so that it never touches
# a system-wide daemon and leaves nothing behind when stopped.
#
#   launch/mps.sh start     start the daemon (no-op if this folder's daemon already runs)
#   launch/mps.sh stop      quit it, wait until its server is gone, remove the folders
#   launch/mps.sh status    say whether it runs, and list its servers (exit 3 when it does not run)
#   launch/mps.sh env       print the exports a client needs (eval "$(launch/mps.sh env)")
#
# Folder: $UNIFIEDSERVE_MPS_DIR (default /tmp/unifiedserve-mps-$UID), holding pipe/ and log/.
# Clients pick the daemon up through CUDA_MPS_PIPE_DIRECTORY; each client's SM share is
# CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, fixed when its CUDA context is created. The card's own settings
# (compute mode, clocks) are never changed.
set -euo pipefail
prog=mps.sh
die() { echo "$prog: error: $*" >&2; exit 1; }
dir=${UNIFIEDSERVE_MPS_DIR:-/tmp/unifiedserve-mps-$(id -u)}
export CUDA_MPS_PIPE_DIRECTORY=$dir/pipe CUDA_MPS_LOG_DIRECTORY=$dir/log

# Alive = this folder's control pipe answers (another daemon, with other folders, is never mistaken for it).
is_running() {
  [ -S "$CUDA_MPS_PIPE_DIRECTORY/control" ] && command -v nvidia-cuda-mps-control >/dev/null 2>&1 \
    && echo get_server_list | timeout 3 nvidia-cuda-mps-control >/dev/null 2>&1
}
need_binary() { command -v nvidia-cuda-mps-control >/dev/null 2>&1 || die "nvidia-cuda-mps-control not found (MPS needs the NVIDIA driver's utilities); run without MPS: the processes then time-slice the GPU"; }

case ${1:-} in
  start)
    need_binary
    if is_running; then echo "MPS already running ($dir)"; exit 0; fi
    # not running: a control socket left by a killed daemon would pass for a live one (here and in every
    # client's check), so the folders start empty
    rm -rf "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    nvidia-cuda-mps-control -d || die "nvidia-cuda-mps-control -d failed; see $CUDA_MPS_LOG_DIRECTORY/control.log"
    for _ in $(seq 50); do is_running && break; sleep 0.1; done
    is_running || die "the MPS daemon did not answer on its control pipe in 5 s; see $CUDA_MPS_LOG_DIRECTORY/control.log"
    echo "MPS started ($dir)"
    ;;
  stop)
    if ! is_running; then rm -rf "$dir"; echo "MPS not running"; exit 0; fi
    # quit waits for the daemon's servers and clients; a faulted server may never finish: the wait below decides
    echo quit | timeout 10 nvidia-cuda-mps-control >/dev/null 2>&1 || true
    for _ in $(seq 100); do is_running || break; sleep 0.1; done
    is_running && die "the MPS daemon did not quit in 10 s"
    rm -rf "$dir"
    echo "MPS stopped"
    ;;
  status)
    if is_running; then
      echo "MPS running ($dir); servers: $(echo get_server_list | nvidia-cuda-mps-control | tr '\n' ' ')"
    else
      echo "MPS not running ($dir)"; exit 3
    fi
    ;;
  env)
    echo "export CUDA_MPS_PIPE_DIRECTORY=$CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY=$CUDA_MPS_LOG_DIRECTORY"
    ;;
  *)
    echo "usage: launch/mps.sh start|stop|status|env" >&2; exit 2 ;;
esac

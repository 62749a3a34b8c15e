#!/usr/bin/env bash
# A user-level CUDA MPS control daemon with private pipe and log folders, so that it never touches
# a system-wide daemon and leaves nothing behind when stopped.
#
#   launch/mps.sh start     start the daemon (no-op if this folder's daemon already runs)
#   launch/mps.sh stop      quit it, wait until its server is gone, remove the folders
#   launch/mps.sh status    say whether it runs, and list its servers (exit 3 when it does not run)
#   launch/mps.sh check     run a CUDA client under it (the driver through python3's ctypes, 60 s at most): the
#                           daemon answering does not prove a client can connect (its server starts with the
#                           first client)
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
# This folder's daemon and its servers, found by their name and the pipe folder they inherit (not through
# the control pipe: for a daemon that no longer answers); ps is not on every image, /proc is
own_pids() {
  local f comm
  for f in /proc/[0-9]*; do
    { read -r comm < "$f/comm"; } 2>/dev/null || continue
    [[ $comm == nvidia-cuda-mps* ]] || continue
    { tr '\0' '\n' < "$f/environ"; } 2>/dev/null | grep -qxF "CUDA_MPS_PIPE_DIRECTORY=$CUDA_MPS_PIPE_DIRECTORY" \
      && echo "${f#/proc/}"
  done
}
kill_own() {  # SIGKILL this folder's daemon and servers, and wait up to 5 s for them to go
  local pids
  pids=$(own_pids)
  [ -n "$pids" ] || return 0
  kill -KILL $pids 2>/dev/null || true
  for _ in $(seq 50); do [ -z "$(own_pids)" ] && return 0; sleep 0.1; done
}
need_binary() { command -v nvidia-cuda-mps-control >/dev/null 2>&1 || die "nvidia-cuda-mps-control not found (MPS needs the NVIDIA driver's utilities); run without MPS: the processes then time-slice the GPU"; }

case ${1:-} in
  start)
    need_binary
    if is_running; then echo "MPS already running ($dir)"; exit 0; fi
    # not running: a control socket left by a killed daemon would pass for a live one (here and in every
    # client's check), so the folders start empty; and a daemon of this folder that is alive but not answering
    # goes first, or a second would start beside it
    kill_own
    rm -rf "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    nvidia-cuda-mps-control -d || die "nvidia-cuda-mps-control -d failed; see $CUDA_MPS_LOG_DIRECTORY/control.log"
    for _ in $(seq 50); do is_running && break; sleep 0.1; done
    if ! is_running; then  # a daemon that does not answer must not outlive this, nor its socket pass for live
      log=$(tail -n 3 "$CUDA_MPS_LOG_DIRECTORY/control.log" 2>/dev/null | tr '\n' ' ' || true)
      kill_own
      rm -rf "$dir"
      die "the MPS daemon did not answer on its control pipe in 5 s (stopped; its log: ${log:-empty})"
    fi
    echo "MPS started ($dir)"
    ;;
  stop)
    if ! is_running; then kill_own; rm -rf "$dir"; echo "MPS not running"; exit 0; fi
    # quit waits for the daemon's servers and clients; a faulted server may never finish: the wait below decides
    echo quit | timeout 10 nvidia-cuda-mps-control >/dev/null 2>&1 || true
    for _ in $(seq 100); do is_running || break; sleep 0.1; done
    how="stopped"
    if is_running || [ -n "$(own_pids)" ]; then
      kill_own
      how="killed (it did not quit in 10 s)"
      is_running && die "the MPS daemon did not quit in 10 s, nor die on SIGKILL"
    fi
    rm -rf "$dir"
    echo "MPS $how"
    ;;
  status)
    if is_running; then
      echo "MPS running ($dir); servers: $(echo get_server_list | nvidia-cuda-mps-control | tr '\n' ' ')"
    else
      echo "MPS not running ($dir)"; exit 3
    fi
    ;;
  check)
    is_running || { echo "MPS not running ($dir)"; exit 3; }
    # GPU 0's primary context (the client connects to MPS here), 1 MiB allocated, set and synced: driver calls
    # only, so any python3 does (no torch needed)
    err=$(timeout 60 python3 - 2>&1 <<'PY'
import ctypes, sys
cuda = ctypes.CDLL("libcuda.so.1")
dev, ctx, ptr = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
for name, args in (("cuInit", (0,)), ("cuDeviceGet", (ctypes.byref(dev), 0)),
                   ("cuDevicePrimaryCtxRetain", (ctypes.byref(ctx), dev)), ("cuCtxSetCurrent", (ctx,)),
                   ("cuMemAlloc_v2", (ctypes.byref(ptr), 1 << 20)), ("cuMemsetD8_v2", (ptr, 7, 1 << 20)),
                   ("cuCtxSynchronize", ()), ("cuMemFree_v2", (ptr,)), ("cuDevicePrimaryCtxRelease_v2", (dev,))):
    code = getattr(cuda, name)(*args)
    if code:
        sys.exit(f"{name} returned CUDA error {code}")
PY
) || die "a CUDA client could not run under the MPS daemon ($dir): $(echo "${err:-timed out}" | tail -n 1)"
    echo "MPS usable ($dir): a CUDA client ran under it"
    ;;
  env)
    echo "export CUDA_MPS_PIPE_DIRECTORY=$CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY=$CUDA_MPS_LOG_DIRECTORY"
    ;;
  *)
    echo "usage: launch/mps.sh start|stop|status|check|env" >&2; exit 2 ;;
esac

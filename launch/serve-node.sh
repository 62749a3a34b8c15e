#!/usr/bin/env bash
# One serving node: the MPS daemon (launch/mps.sh) when the node has an NVIDIA GPU, then
# `unifiedserve serve` in the background; `stop` takes both down and leaves nothing behind.
#
#   launch/serve-node.sh start [--no-mps] [--restart N] [SERVE FLAGS...]
#                                                           start MPS (GPU nodes), then the server;
#                                                           returns once /health answers 200
#   launch/serve-node.sh stop                                drain and stop the server, then MPS
#   launch/serve-node.sh status                              the server's pid and /health, and MPS
#
# SERVE FLAGS go to `unifiedserve serve` unchanged (see `unifiedserve serve --help`); the server
# places its processes on the GPU and gives each its MPS SM share itself (runtime/gpu_placement.py).
# Without a GPU, or with --no-mps, no daemon starts: on a GPU the processes then time-slice it, which
# is said once at start. --restart N: when the server exits with an error after running at least
# 10 s (a worker died; on a GPU a fatal CUDA fault in one MPS client can end every client), restart
# MPS (if this script started it) and the server, at most N times; the server itself fails the
# in-flight requests and turns /health 503 before it exits.
#
# State folder: $UNIFIEDSERVE_NODE_DIR (default /tmp/unifiedserve-node-$UID) holds server.pid,
# server.log, the health URL, and mps/ (the daemon's private pipe and log folders). The CPU pools live
# in a folder of /dev/shm named after the state folder (unless SERVE FLAGS give --shm-dir), removed by
# `stop`.
# Environment: UNIFIEDSERVE_BIN (default: this checkout's .venv/bin/unifiedserve, else `unifiedserve`
# on PATH), UNIFIEDSERVE_START_TIMEOUT (seconds to wait for /health, default 900: a GPU's first start
# compiles kernels), UNIFIEDSERVE_STOP_TIMEOUT (seconds to drain before SIGKILL, default 60).
set -euo pipefail
prog=serve-node.sh
here=$(cd "$(dirname "$0")" && pwd)
die() { echo "$prog: error: $*" >&2; exit 1; }
dir=${UNIFIEDSERVE_NODE_DIR:-/tmp/unifiedserve-node-$(id -u)}
export UNIFIEDSERVE_MPS_DIR=$dir/mps
shm_default=/dev/shm/unifiedserve-node-$(id -u)-$(printf %s "$dir" | cksum | cut -d" " -f1)  # one per state folder
start_timeout=${UNIFIEDSERVE_START_TIMEOUT:-900}
stop_timeout=${UNIFIEDSERVE_STOP_TIMEOUT:-60}
[[ $start_timeout =~ ^[0-9]+$ ]] && [ "$start_timeout" -ge 1 ] || die "UNIFIEDSERVE_START_TIMEOUT must be a positive number of seconds, got '$start_timeout'"
[[ $stop_timeout =~ ^[0-9]+$ ]] && [ "$stop_timeout" -ge 1 ] || die "UNIFIEDSERVE_STOP_TIMEOUT must be a positive number of seconds, got '$stop_timeout'"
if [ -n "${UNIFIEDSERVE_BIN:-}" ]; then bin=$UNIFIEDSERVE_BIN
elif [ -x "$here/../.venv/bin/unifiedserve" ]; then bin=$here/../.venv/bin/unifiedserve
else bin=unifiedserve; fi

has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; }
server_pid() { [ -f "$dir/server.pid" ] && cat "$dir/server.pid"; }
alive() { local pid; pid=$(server_pid) && [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; }
# 0 when $1 answers 200 within 3 s (python: curl is not everywhere)
healthy() {
  python3 - "$1" <<'EOF' >/dev/null 2>&1
import sys, urllib.request
with urllib.request.urlopen(sys.argv[1], timeout=3) as r:
    sys.exit(0 if r.status == 200 else 1)
EOF
}
stop_mps() { if [ -f "$dir/mps.started" ]; then "$here/mps.sh" stop; rm -f "$dir/mps.started"; fi; }
# every process of the server's session (it was started with setsid: api, vision, core, decode)
# (from /proc, not ps: a minimal image has no procps; zombies, already dead, are left out)
session_pids() {
  local pid f stat state sid
  pid=$(server_pid) || return 0
  for f in /proc/[0-9]*/stat; do
    { read -r stat < "$f"; } 2>/dev/null || continue
    read -r state _ _ sid _ <<< "${stat##*) }"  # after "pid (comm) ": state ppid pgrp session
    [ "$sid" = "$pid" ] && [ "$state" != Z ] && { f=${f#/proc/}; echo "${f%/stat}"; }
  done
  return 0
}

start() {
  local use_mps=1 port=8000 host=127.0.0.1 shm_given=0 restarts=0
  local args=()
  while [ $# -gt 0 ]; do
    case $1 in
      --no-mps) use_mps=0; shift; continue ;;
      --restart)
        [ $# -ge 2 ] || die "--restart needs a number"
        restarts=$2; shift 2; continue ;;
      --shm-dir|--shm-dir=*) shm_given=1 ;;
      --port=*) port=${1#--port=} ;;
      --host=*) host=${1#--host=} ;;
      --port|--host) [ $# -ge 2 ] && { [ "$1" = --port ] && port=$2 || host=$2; } ;;
    esac
    args+=("$1"); shift
  done
  [[ $restarts =~ ^[0-9]+$ ]] || die "--restart must be a number of restarts (0 or more), got '$restarts'"
  [[ $port =~ ^[0-9]+$ ]] || die "--port must be a number, got '$port'"
  case $host in 0.0.0.0|::|'') host=127.0.0.1 ;; esac
  command -v "$bin" >/dev/null 2>&1 || die "'$bin' not found: run 'make setup' (or pip install unifiedserve) or set UNIFIEDSERVE_BIN"
  mkdir -p "$dir"
  # one start at a time per state folder (two at once would both find no server and start two), held until the
  # server's pid is written; fd 9 is closed for everything started meanwhile, or a daemon would keep the lock
  if command -v flock >/dev/null 2>&1; then
    exec 9>"$dir/start.lock"
    flock -n 9 || die "another '$prog start' is starting a server from $dir; wait for it, or: $0 stop"
  fi
  alive && die "a server already runs from $dir (pid $(server_pid)); stop it first: $0 stop"
  rm -f "$dir/server.pid" "$dir/mps.started" "$dir/restarts"
  if [ "$shm_given" = 0 ]; then
    # no server of this folder runs (checked above, under the lock): pool files still here are a killed one's
    # (a server killed before its workers were up has not unlinked them yet)
    rm -rf "$shm_default"
    mkdir -p "$shm_default"
    args=(--shm-dir "$shm_default" "${args[@]}")
  fi
  if has_gpu; then
    if [ "$use_mps" = 1 ] && command -v nvidia-cuda-mps-control >/dev/null 2>&1; then
      # a daemon that will not start, or that a CUDA client cannot use, is not fatal: the GPU is time-sliced
      # a daemon already answering in this node's own folder is a leftover of this node's: owned (stopped by
      # `stop`) as one started here
      if { "$here/mps.sh" status >/dev/null 2>&1 9>&- || "$here/mps.sh" start 9>&-; } && touch "$dir/mps.started"; then
        if "$here/mps.sh" check 9>&-; then
          eval "$("$here/mps.sh" env 9>&-)"
        else
          stop_mps
          echo "$prog: no MPS (its daemon is not usable, above): the server's processes time-slice the GPU"
        fi
      else
        echo "$prog: no MPS (its daemon did not start, above): the server's processes time-slice the GPU"
      fi
    else
      local why="--no-mps"
      [ "$use_mps" = 1 ] && why="nvidia-cuda-mps-control not found"
      echo "$prog: no MPS ($why): the server's processes time-slice the GPU"
    fi
  else
    echo "$prog: no NVIDIA GPU on this node: the server runs on the CPU"
  fi
  local url="http://$host:$port/health"
  [[ $host == *:* ]] && url="http://[$host]:$port/health"
  echo "$url" > "$dir/health_url"
  printf '%s\0' "${args[@]}" > "$dir/args"
  export UNIFIEDSERVE_BIN=$bin
  setsid bash "$here/serve-node.sh" _run "$restarts" >"$dir/server.log" 2>&1 < /dev/null 9>&- &
  echo $! > "$dir/server.pid"
  exec 9>&-  # the server is known now: another start finds it alive
  echo "starting: $bin serve ${args[*]} (session $!, log $dir/server.log)"
  local waited=0
  while ! healthy "$url"; do
    if ! alive; then
      echo "$prog: error: the server exited before it was ready; the end of $dir/server.log:" >&2
      tail -n 20 "$dir/server.log" >&2
      cleanup >/dev/null
      exit 1
    fi
    [ "$waited" -ge "$start_timeout" ] && { stop >/dev/null; die "the server was not ready in $start_timeout s (UNIFIEDSERVE_START_TIMEOUT); stopped it; see $dir/server.log"; }
    sleep 1; waited=$((waited + 1))
  done
  echo "ready: $url (pid $(server_pid))"
}

stop() {
  if alive; then
    local pid; pid=$(server_pid)
    kill -TERM "$pid" 2>/dev/null || true  # the server drains: in-flight requests end with a 503
    local waited=0
    while alive && [ "$waited" -lt "$((stop_timeout * 10))" ]; do sleep 0.1; waited=$((waited + 1)); done
    if alive; then
      echo "$prog: the server did not stop in $stop_timeout s: killing its processes"
      # shellcheck disable=SC2046
      kill -KILL $(session_pids) 2>/dev/null || true
    fi
    # its workers follow it (they die with their parent); wait for the last of them
    for _ in $(seq 100); do [ -z "$(session_pids)" ] && break; sleep 0.1; done
    echo "server stopped (pid $pid)"
  else
    # the session's leader is gone, but the server or its workers may still run (holding the port and the GPU)
    local left; left=$(session_pids)
    if [ -n "$left" ]; then
      echo "$prog: the server's session leader is gone; killing what is left of its session: $(echo $left)"
      # shellcheck disable=SC2086
      kill -KILL $left 2>/dev/null || true
      for _ in $(seq 100); do [ -z "$(session_pids)" ] && break; sleep 0.1; done
    fi
    echo "server not running"
  fi
  cleanup
}

# what a stopped (or never started) server leaves: its state files, the node's shm folder, our MPS daemon
cleanup() {
  rm -f "$dir/server.pid" "$dir/health_url" "$dir/args" "$dir/api.pid" "$dir/restarts"
  rm -rf "$shm_default"
  stop_mps
  rmdir "$dir/mps" 2>/dev/null || true
}

# The session leader: runs the server, forwards SIGTERM/SIGINT to it, and restarts it (and MPS) after
# a failure when asked to.
run_server() {
  local restarts=$1 n=0 rc began child= stopping=0
  local args=()
  mapfile -d '' args < "$dir/args"
  trap 'stopping=1; [ -n "$child" ] && kill -TERM "$child" 2>/dev/null' TERM INT
  while :; do
    [ "$stopping" = 1 ] && exit 0  # a stop that came during a restart's MPS cycle or pause: no new server
    began=$SECONDS
    "$bin" serve "${args[@]}" &
    child=$!
    echo "$child" > "$dir/api.pid"
    rc=0
    wait "$child" || rc=$?
    while kill -0 "$child" 2>/dev/null; do rc=0; wait "$child" || rc=$?; done  # a trapped signal ends `wait` early
    rm -f "$dir/api.pid"
    [ "$stopping" = 1 ] || [ "$rc" = 0 ] && exit "$rc"
    if [ "$n" -ge "$restarts" ] || [ $((SECONDS - began)) -lt 10 ]; then
      [ "$restarts" = 0 ] || echo "$prog: the server exited with status $rc; not restarting ($n of $restarts restarts used)"
      exit "$rc"
    fi
    n=$((n + 1))
    echo "$n" > "$dir/restarts"
    echo "$prog: the server exited with status $rc after $((SECONDS - began)) s; restart $n of $restarts"
    if [ -f "$dir/mps.started" ]; then "$here/mps.sh" stop || true; "$here/mps.sh" start; fi
    sleep 1
  done
}

status() {
  local rc=0
  if alive; then
    local url; url=$(cat "$dir/health_url" 2>/dev/null || echo)
    local restarted=; [ -f "$dir/restarts" ] && restarted=", restarted $(cat "$dir/restarts") times"
    if [ -n "$url" ] && healthy "$url"; then echo "server running (pid $(server_pid)$restarted), healthy: $url"
    else echo "server running (pid $(server_pid)$restarted), not healthy yet: ${url:-no health URL}"; rc=4; fi
  else
    echo "server not running"; rc=3
  fi
  if has_gpu && command -v nvidia-cuda-mps-control >/dev/null 2>&1; then "$here/mps.sh" status || true; fi
  return $rc
}

case ${1:-} in
  start) shift; start "$@" ;;
  stop) stop ;;
  status) status ;;
  _run) run_server "$2" ;;
  *) echo "usage: launch/serve-node.sh start [--no-mps] [SERVE FLAGS...] | stop | status" >&2; exit 2 ;;
esac

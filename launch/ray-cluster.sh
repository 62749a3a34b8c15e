#!/usr/bin/env bash
# Bring up (or down) one node of a Ray cluster for `unifiedserve serve --ray`. On a node with an
# NVIDIA GPU, the MPS daemon (launch/mps.sh) starts first, in the environment Ray's workers inherit,
# so a replica's vision, core and decode processes share the GPU under MPS.
#
#   launch/ray-cluster.sh head [--port P] [RAY START ARGS...]     start the head (default port 6379)
#   launch/ray-cluster.sh worker HOST:PORT [RAY START ARGS...]    join the head at HOST:PORT
#   launch/ray-cluster.sh stop                                    stop Ray on this node, then MPS
#
# Then, on the head: unifiedserve serve --ray --replicas N --ray-address HOST:PORT --model ... (the
# model folder and media must be at the same path on every node). `stop` runs `ray stop`, which
# ends every Ray process of this user on this node.
set -euo pipefail
prog=ray-cluster.sh
here=$(cd "$(dirname "$0")" && pwd)
die() { echo "$prog: error: $*" >&2; exit 1; }
ray_bin=${RAY_BIN:-ray}
need_ray() { command -v "$ray_bin" >/dev/null 2>&1 || die "'$ray_bin' not found: pip install 'unifiedserve[ray]' (or set RAY_BIN)"; }
has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; }
ray_failed() {  # ray start failed: the MPS daemon start_mps started must not outlive it
  local rc=$?
  "$here/mps.sh" stop >/dev/null 2>&1 || true
  die "ray start failed (exit $rc, above)"
}
start_mps() {  # a daemon that will not start, or that no CUDA client can use, is not fatal: time-slicing
  if has_gpu; then
    if "$here/mps.sh" start && "$here/mps.sh" check; then
      eval "$("$here/mps.sh" env)"
    else
      "$here/mps.sh" stop >/dev/null 2>&1 || true
      echo "$prog: no MPS (above): Ray's workers time-slice the GPU"
    fi
  fi
}

case ${1:-} in
  head)
    shift
    port=6379
    if [ "${1:-}" = "--port" ]; then
      [ $# -ge 2 ] || die "--port needs a value"
      port=$2; shift 2
    fi
    [[ $port =~ ^[0-9]+$ ]] && [ "$port" -ge 1 ] && [ "$port" -le 65535 ] || die "--port must be 1..65535, got '$port'"
    need_ray
    start_mps
    # Serve's controller loop every 0.5 s (Serve's default 0.1), as `serve --ray` sets on a local instance:
    # its idle CPU shares a node with the replicas' encode; the controller runs on the head
    export RAY_SERVE_CONTROL_LOOP_INTERVAL_S=${RAY_SERVE_CONTROL_LOOP_INTERVAL_S:-0.5}
    "$ray_bin" start --head --port "$port" --disable-usage-stats "$@" || ray_failed
    echo "head up: join workers with '$0 worker $(hostname -I 2>/dev/null | awk '{print $1}'):$port', then" \
         "unifiedserve serve --ray --ray-address 127.0.0.1:$port --replicas N"
    if [ -f "$HOME/.ray/auth_token" ]; then  # Ray >= 2.59 turns token authentication on for the cluster
      echo "the cluster takes its token: copy $HOME/.ray/auth_token to the same place on every worker node and" \
           "client machine ('ray get-auth-token' prints it); this script and unifiedserve send it from there"
    fi
    ;;
  worker)
    shift
    address=${1:-}
    [[ $address =~ ^[A-Za-z0-9_.:-]+:[0-9]+$ ]] || die "worker needs the head's HOST:PORT (e.g. 10.0.0.1:6379)"
    shift
    need_ray
    start_mps
    # a head with token authentication (Ray >= 2.59) takes only nodes that send its token: sent in token mode
    [ -z "${RAY_AUTH_MODE:-}" ] && [ -f "$HOME/.ray/auth_token" ] && export RAY_AUTH_MODE=token
    "$ray_bin" start --address "$address" --disable-usage-stats "$@" || ray_failed
    ;;
  stop)
    # MPS is stopped whatever happens to Ray's stop (Ray missing, or its stop failing): no daemon is left behind
    rc=0
    if command -v "$ray_bin" >/dev/null 2>&1; then "$ray_bin" stop || rc=$?; fi
    "$here/mps.sh" stop || rc=$?
    need_ray  # (after MPS's stop)
    [ "$rc" -eq 0 ] || die "stop did not finish cleanly (above)"
    ;;
  *)
    echo "usage: launch/ray-cluster.sh head [--port P] [ARGS...] | worker HOST:PORT [ARGS...] | stop" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# Start a local Ray cluster for raylora on loopback only: a head node (GCS + dashboard on
# 127.0.0.1) and, optionally, a second worker node on the same machine to exercise
# multi-node placement. Everything it starts carries this state dir's temp dir in its
# command line, which is how local-down.sh stops exactly these processes and no others.
#
#   cluster/local-up.sh [--cpus N] [--gpus N] [--port P] [--dashboard-port P]
#                       [--worker-node] [--worker-cpus N] [--worker-gpus N]
#
# State (temp dir, address, dashboard URL) lives in $RAYLORA_LOCAL_STATE, default
# <repo>/.ray-local (git-ignored). Prints `export RAY_ADDRESS=...` for the driver and the
# dashboard URL for `ray job submit --address`.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
STATE=${RAYLORA_LOCAL_STATE:-$ROOT/.ray-local}
RAY_BIN=${RAY_BIN:-}
if [ -z "$RAY_BIN" ]; then
  if [ -x "$ROOT/.venv/bin/ray" ]; then RAY_BIN="$ROOT/.venv/bin/ray"; else RAY_BIN=$(command -v ray); fi
fi
# A job's entrypoint (`python -m raylora ...`: `raylora submit`, the line printed at the end)
# runs with the head's PATH: lead it with the bin dir of the Python that Ray runs on, so
# `python` is raylora's venv also when the caller's shell has not activated it.
PATH="$(dirname "$RAY_BIN"):$PATH"
export PATH

CPUS=$(nproc)
GPUS=0
PORT=6390
DASH_PORT=8265
WORKER_NODE=0
WORKER_CPUS=2
WORKER_GPUS=0
while [ $# -gt 0 ]; do
  case "$1" in
    --cpus) CPUS=$2; shift 2 ;;
    --gpus) GPUS=$2; shift 2 ;;
    --port) PORT=$2; shift 2 ;;
    --dashboard-port) DASH_PORT=$2; shift 2 ;;
    --worker-node) WORKER_NODE=1; shift ;;
    --worker-cpus) WORKER_CPUS=$2; shift 2 ;;
    --worker-gpus) WORKER_GPUS=$2; shift 2 ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "local-up.sh: unknown option $1" >&2; exit 2 ;;
  esac
done

if [ -f "$STATE/address" ]; then
  echo "local-up.sh: a cluster from $STATE is already up ($(cat "$STATE/address")); run cluster/local-down.sh first" >&2
  exit 1
fi
mkdir -p "$STATE/tmp"
export RAY_USAGE_STATS_ENABLED=0

# Token authentication, explicitly: a fresh random token per cluster, readable only by this
# user. Clients (ray job submit, raylora train with RAY_ADDRESS) need the same two
# variables; they are written to $STATE/env for `source`.
if [ ! -s "$STATE/auth_token" ]; then
  (umask 077; head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$STATE/auth_token")
fi
export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH="$STATE/auth_token"
# `ray job stop` SIGKILLs a job's driver this long after its SIGTERM (Ray's default: 3 s,
# before the run's clean stop has written its checkpoint). The head runs every job's
# supervisor with the environment it was started in, so this holds for a plain `ray job
# submit` too; `raylora submit` sets its own per job.
export RAY_JOB_STOP_WAIT_TIME_S="${RAY_JOB_STOP_WAIT_TIME_S:-150}"

# Loopback only: node IP, GCS and dashboard all on 127.0.0.1. `setsid` gives the daemons
# their own session and process group, recorded below: some Ray processes rename
# themselves (ray::DashboardAgent), so local-down.sh stops them by group, and the caller's
# own group (a shell, a test runner) is never in the line of fire.
# Each node's dashboard agent listens on a free port (0; Ray records it in the GCS, where
# the job head looks it up). Ray's fixed default, 52365, is held by any other Ray on this
# machine (an embedded `raylora train`, another cluster), and a head whose agent cannot
# bind it never takes a job; a second node's agent could never bind it beside the head's.
setsid "$RAY_BIN" start --head \
  --node-ip-address=127.0.0.1 --port="$PORT" \
  --dashboard-host=127.0.0.1 --dashboard-port="$DASH_PORT" \
  --dashboard-agent-listen-port=0 \
  --num-cpus="$CPUS" --num-gpus="$GPUS" \
  --temp-dir="$STATE/tmp" --disable-usage-stats </dev/null >"$STATE/head.log" 2>&1 \
  || { cat "$STATE/head.log" >&2; exit 1; }

if [ "$WORKER_NODE" = 1 ]; then
  setsid "$RAY_BIN" start --address="127.0.0.1:$PORT" --node-ip-address=127.0.0.1 \
    --dashboard-agent-listen-port=0 \
    --num-cpus="$WORKER_CPUS" --num-gpus="$WORKER_GPUS" \
    --temp-dir="$STATE/tmp" --disable-usage-stats </dev/null >"$STATE/worker.log" 2>&1 \
    || { cat "$STATE/worker.log" >&2; "$ROOT/cluster/local-down.sh"; exit 1; }
fi

# Ready = a job can be submitted: the dashboard answers only when the head's job agent is
# up, and a submit right after `ray start` otherwise fails with "No available agent".
for i in $(seq 1 60); do
  if "$RAY_BIN" job submit --no-wait --address "http://127.0.0.1:$DASH_PORT" \
       --submission-id "local-up-ready-$i" -- true >"$STATE/ready.log" 2>&1; then
    break
  fi
  [ "$i" = 60 ] && { echo "local-up.sh: the cluster's job agent never became ready" >&2; exit 1; }
  sleep 2
done

# "pgid pid start" of each process naming the temp dir: local-down.sh signals a recorded
# group only while one of these processes still runs with that start time. After a
# reboot or an OOM kill the ids may belong to someone else's processes by then.
for pid in $(pgrep -f -- "$STATE/tmp"); do
  line=$(ps -o pgid=,lstart= -p "$pid" | sed 's/  */ /g; s/^ //; s/ $//') && [ -n "$line" ] \
    && echo "${line%% *} $pid ${line#* }"
done >"$STATE/pgids"
echo "127.0.0.1:$PORT" >"$STATE/address"
echo "http://127.0.0.1:$DASH_PORT" >"$STATE/dashboard"
cat >"$STATE/env" <<ENV
export RAY_ADDRESS=127.0.0.1:$PORT
export RAY_AUTH_MODE=token
export RAY_AUTH_TOKEN_PATH=$STATE/auth_token
ENV
echo "ray cluster up (state in $STATE); for clients: source $STATE/env"
cat "$STATE/env"
# The demo job (`make demo` builds runs/demo). runs/ is git-ignored, so the working dir the
# job receives has no runs/demo: it is named by absolute paths (the head is this machine).
# This cluster runs raylora's venv (PATH above), so the job installs nothing
# (jobs/runtime_env.local.yaml says why).
DEMO=$ROOT/runs/demo
echo "$RAY_BIN job submit --address http://127.0.0.1:$DASH_PORT --working-dir . --runtime-env jobs/runtime_env.local.yaml -- python -m raylora train jobs/configs/tiny-local.yaml model.pretrained=$DEMO/model data.uri=$DEMO/data output.uri=$DEMO/output"

#!/usr/bin/env bash
# Stop the cluster that cluster/local-up.sh started, and only it: every Ray process it
# started has this state dir's temp dir in its command line. (`ray stop` would kill every
# Ray process on the machine, including other people's.)
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
STATE=${RAYLORA_LOCAL_STATE:-$ROOT/.ray-local}
[ -d "$STATE/tmp" ] || { echo "local-down.sh: nothing to stop in $STATE"; exit 0; }

# The process groups local-up.sh recorded (its `setsid`-started daemons), plus anything
# still naming this temp dir; never our own group. A recorded group counts only while a
# process recorded in it runs with the start time recorded ("pgid pid start" lines): once
# the cluster is gone (a reboot, an OOM kill, `ray stop`), its ids may be reused by
# unrelated processes, which must not be signalled.
own=$(ps -o pgid= -p $$ | tr -d ' ')
recorded() {
  local g p start now
  while read -r g p start; do
    [ -n "$start" ] || continue  # an old one-id-per-line file: no proof, not signalled
    now=$(ps -o lstart= -p "$p" 2>/dev/null | sed 's/  */ /g; s/^ //; s/ $//') || continue
    [ "$now" = "$start" ] && echo "$g"
  done <"$STATE/pgids"
}
groups() {
  { [ -f "$STATE/pgids" ] && recorded; pgrep -f -- "$STATE/tmp" | xargs -r ps -o pgid= -p; } \
    | tr -d ' ' | sort -u | grep -vx -- "$own" | grep -vx 1 || true
}
# This cluster's processes that still run: "pgid pid stat args". A zombie (exited, not yet
# reaped by init, which on some machines takes seconds) is not one.
running() {
  local gs
  gs=" $(groups | tr '\n' ' ') "
  [ -n "${gs// /}" ] || return 0
  ps -e -o pgid=,pid=,stat=,args= | awk -v gs="$gs" '$3 !~ /^Z/ && index(gs, " " $1 " ")'
}
alive() { [ -n "$(running)" ]; }
signal_all() { for g in $(groups); do kill "-$1" -- "-$g" 2>/dev/null || true; done; }
# The GCS last. Ray 2.60's GCS, stopped together with its raylets and the autoscaler
# monitor, hangs in its shutdown ("flushing remaining events") and they wait on it: an idle
# 2-CPU head took over 10 s and SIGKILL. Stopped after them, it exits within a second.
non_gcs() { running | awk '$4 !~ /gcs_server$/ {print $2}'; }
for pid in $(non_gcs); do kill -TERM "$pid" 2>/dev/null || true; done
for _ in $(seq 1 20); do
  [ -n "$(non_gcs)" ] || break
  sleep 0.25
done
signal_all TERM
for _ in $(seq 1 40); do
  alive || break
  sleep 0.25
done
# What is left after 10 s more is killed (a hung GCS shutdown was seen to last over
# 20 s). Then wait: a killed process is gone only once it has exited, and
# "stopped" must mean that nothing of this cluster runs any more (a next local-up.sh
# reuses its ports; a test checks for it).
for _ in $(seq 1 40); do
  alive || break
  signal_all KILL
  sleep 0.25
done
if alive; then
  echo "local-down.sh: still running 10 s after SIGKILL:" >&2
  running | cut -c1-200 >&2
  exit 1
fi
rm -f "$STATE/address" "$STATE/dashboard" "$STATE/env" "$STATE/auth_token" "$STATE/pgids"
echo "ray cluster in $STATE stopped"

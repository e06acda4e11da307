#!/usr/bin/env bash
# Stop the cluster that cluster/local-up.sh started, and only it: every Ray process it
# started has this state dir's temp dir in its command line. (`ray stop` would kill every
# Ray process on the machine, including other people's.)
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
STATE=${RAYLORA_LOCAL_STATE:-$ROOT/.ray-local}
[ -d "$STATE/tmp" ] || { echo "local-down.sh: nothing to stop in $STATE"; exit 0; }

# The process groups local-up.sh recorded (its `setsid`-started daemons), plus anything
# still naming this temp dir; never our own group.
own=$(ps -o pgid= -p $$ | tr -d ' ')
groups() {
  { cat "$STATE/pgids" 2>/dev/null; pgrep -f -- "$STATE/tmp" | xargs -r ps -o pgid= -p; } \
    | tr -d ' ' | sort -u | grep -vx -- "$own" | grep -vx 1 || true
}
alive() { for g in $(groups); do pgrep -g "$g" >/dev/null && return 0; done; return 1; }
for g in $(groups); do kill -TERM -- "-$g" 2>/dev/null || true; done
for _ in $(seq 1 40); do
  alive || break
  sleep 0.25
done
for g in $(groups); do kill -KILL -- "-$g" 2>/dev/null || true; done
rm -f "$STATE/address" "$STATE/dashboard" "$STATE/env" "$STATE/auth_token" "$STATE/pgids"
echo "ray cluster in $STATE stopped"

#!/usr/bin/env bash
# Start P zerojax processes on this machine that form one mesh through jax.distributed (gloo on
# CPU): a local stand-in for P hosts. mesh.cpu_devices (default 8) is split between them.
#   scripts/bench/launch_local.sh P [zerojax train args...]
#   scripts/bench/launch_local.sh 2 zero.stage=3 mesh.replica=2 mesh.data=4
# SIGTERM/SIGINT are forwarded to every process; if one fails, the others are stopped and the
# launcher exits with its code.
# The interpreter that runs zerojax: $ZEROJAX_PYTHON if set, else the repository's .venv, else
# python3. (Not $PYTHON: that is the Makefile's bare interpreter that creates .venv.)
set -u
[ $# -ge 1 ] && [[ "$1" =~ ^[1-9][0-9]*$ ]] || { echo "usage: $0 P [zerojax train args...]" >&2; exit 2; }
procs=$1; shift
here=$(cd "$(dirname "$0")/../.." && pwd)
if [ -n "${ZEROJAX_PYTHON:-}" ]; then
  python=$ZEROJAX_PYTHON
  command -v "$python" >/dev/null || { echo "zerojax: launch_local: ZEROJAX_PYTHON=$python is not an executable" >&2; exit 2; }
elif [ -x "$here/.venv/bin/python" ]; then
  python=$here/.venv/bin/python
else
  python=python3
fi
port=$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
pids=()
stop() { kill -s "$1" "${pids[@]}" 2>/dev/null; }
trap 'stop TERM' TERM
trap 'stop INT' INT
for ((i = 0; i < procs; i++)); do
  "$python" -m zerojax train --coordinator "127.0.0.1:$port" --num-processes "$procs" --process-id "$i" "$@" &
  pids+=($!)
done
status=0
remaining=$procs
while [ "$remaining" -gt 0 ]; do
  wait -n -p done_pid "${pids[@]}"
  code=$?
  [ -z "${done_pid:-}" ] && continue  # interrupted by a forwarded signal: keep waiting
  remaining=$((remaining - 1))
  left=(); for p in "${pids[@]}"; do [ "$p" != "$done_pid" ] && left+=("$p"); done
  pids=("${left[@]}")  # `wait -n` on a pid already reaped says "no such job"
  if [ "$code" -ne 0 ] && [ "$status" -eq 0 ]; then
    status=$code
    echo "zerojax: launch_local: process $done_pid exited with $code; stopping the others" >&2
    stop TERM
  fi
done
exit "$status"

#!/bin/bash
# Stop what start.sh started, by pid file only: TERM, then KILL after 5 s.
#   usage: stop.sh DIR
D=$1
stop() {
  [ -f "$1" ] || return 0
  pid=$(cat "$1")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid"
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then kill -KILL "$pid"; fi
  fi
  rm -f "$1"
}
stop "$D/slurmd.pid"
stop "$D/slurmctld.pid"
stop "$D/munge/munged.pid"

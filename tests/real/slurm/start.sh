#!/bin/bash
# Start a one-node Slurm cluster on loopback: munged, slurmctld, slurmd.
#   usage: start.sh DIR      (DIR holds the config, state, logs and pid files)
# Needs root and the Debian packages slurmd slurmctld slurm-client munge.
# Then: SLURM_CONF=DIR/slurm.conf srun -N1 -n2 python ...; stop.sh DIR stops
# the daemons by pid file. The ports are free ones chosen now, so two
# clusters on one machine do not collide. Exits non-zero (with the daemons'
# logs on stderr) when the node does not come up within 20 s.
set -euo pipefail
D=$(mkdir -p "$1" && cd "$1" && pwd)
chmod 0755 "$D"   # munged (user munge) must reach its socket under DIR
here=$(cd "$(dirname "$0")" && pwd)
for tool in munged slurmctld slurmd sinfo srun; do
  command -v "$tool" >/dev/null || PATH=$PATH:/usr/sbin command -v "$tool" >/dev/null || {
    echo "start.sh: $tool not found; install it: apt-get install -y slurmd slurmctld slurm-client munge" >&2
    exit 1
  }
done
export PATH=$PATH:/usr/sbin
read -r ctld_port slurmd_port < <(python3 - <<'PY'
import socket
socks = [socket.socket() for _ in range(2)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))
PY
)
sed -e "s#@DIR@#$D#g" -e "s#@CTLD_PORT@#$ctld_port#" -e "s#@SLURMD_PORT@#$slurmd_port#" \
    -e "s#@CPUS@#$(nproc)#" "$here/slurm.conf.in" > "$D/slurm.conf"
export SLURM_CONF=$D/slurm.conf
mkdir -p "$D/state" "$D/spool" "$D/munge"
chown munge:munge "$D/munge" && chmod 0711 "$D/munge"   # munged refuses a socket dir others can't enter
if [ ! -f /etc/munge/munge.key ]; then
  mungekey -c -k /etc/munge/munge.key && chown munge:munge /etc/munge/munge.key
fi
runuser -u munge -- munged --socket="$D/munge/munge.socket.2" --pid-file="$D/munge/munged.pid" \
    --log-file="$D/munge/munged.log" --seed-file="$D/munge/munged.seed"
slurmctld -f "$SLURM_CONF"             # daemonizes; pid in $D/slurmctld.pid
slurmd -f "$SLURM_CONF" -N localhost   # -N: the node is called localhost whatever the hostname
st=
for _ in $(seq 1 100); do
  st=$(sinfo -h -n localhost -o %t 2>/dev/null || true)
  [ "$st" = idle ] && break
  sleep 0.2
done
if [ "$st" != idle ]; then
  echo "start.sh: the node is '$st', not idle, after 20 s; logs follow" >&2
  tail -n 20 "$D/slurmctld.log" "$D/slurmd.log" "$D/munge/munged.log" >&2 || true
  exit 1
fi
echo "slurm node idle (SLURM_CONF=$SLURM_CONF)"

#!/usr/bin/env bash
# A two-node Slurm on this one host, for trying scripts/slurm/train.sbatch and for
# tests/test_slurm.py: munged, slurmctld and two slurmd (nodes n1 and n2, both 127.0.0.1, each
# on its own port), all run as root with every file under DIR (config, state, logs, munge key
# and socket). Needs Debian's slurmctld slurmd slurm-client munge (Slurm 22.05 was used).
#   scripts/slurm/local_cluster.sh start DIR   # then: export SLURM_CONF=DIR/slurm.conf
#   scripts/slurm/local_cluster.sh stop DIR
# The one thing written outside DIR: n1 and n2 must resolve (JAX and zerojax take the
# coordinator's host from SLURM_STEP_NODELIST), so `start` appends "127.0.0.1 n1 n2 # zerojax
# local_cluster" to /etc/hosts where they do not, and `stop` removes exactly that line.
# What did not work here, and why the config reads as it does: proctrack/cgroup and task/cgroup
# cannot start tasks in this sandbox (proctrack/linuxproc and task/none can); accounting is off
# (no slurmdbd).
set -euo pipefail
[ $# -eq 2 ] && [[ "$1" =~ ^(start|stop)$ ]] || { echo "usage: $0 start|stop DIR" >&2; exit 2; }
action=$1; dir=$(mkdir -p "$2" && cd "$2" && pwd)
mark="# zerojax local_cluster"

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

stop() {
  for pidfile in "$dir"/slurmd-n1.pid "$dir"/slurmd-n2.pid "$dir"/slurmctld.pid "$dir"/munged.pid; do
    [ -s "$pidfile" ] && kill "$(cat "$pidfile")" 2>/dev/null || true
  done
  for pidfile in "$dir"/slurmd-n1.pid "$dir"/slurmd-n2.pid "$dir"/slurmctld.pid "$dir"/munged.pid; do
    for _ in $(seq 50); do [ -s "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null || break; sleep 0.2; done
    rm -f "$pidfile"
  done
  if [ -f "$dir/added-hosts-line" ]; then
    grep -vF "$mark" /etc/hosts > "$dir/hosts" && cat "$dir/hosts" > /etc/hosts  # in place: keep its inode
    rm -f "$dir/added-hosts-line" "$dir/hosts"
  fi
}

if [ "$action" = stop ]; then stop; exit 0; fi

[ "$(id -u)" -eq 0 ] || { echo "zerojax: local_cluster: must run as root (slurmd starts tasks as their user)" >&2; exit 2; }
for exe in munged slurmctld slurmd sbatch; do
  command -v "$exe" >/dev/null || { echo "zerojax: local_cluster: $exe not found; apt-get install slurmctld slurmd slurm-client munge" >&2; exit 2; }
done
mkdir -p "$dir/munge" "$dir/ctld" "$dir/n1" "$dir/n2" "$dir/log"
chmod 700 "$dir/munge"
dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
chmod 400 "$dir/munge/munge.key"
munged --force --key-file="$dir/munge/munge.key" --socket="$dir/munge/socket" --pid-file="$dir/munged.pid" \
  --log-file="$dir/log/munged.log" --seed-file="$dir/munge/seed"
cpus=$(nproc)
cat > "$dir/slurm.conf" <<CONF
ClusterName=zerojaxlocal
SlurmctldHost=$(hostname)(127.0.0.1)
SlurmctldPort=$(free_port)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$dir/munge/socket
CredType=cred/munge
StateSaveLocation=$dir/ctld
SlurmdSpoolDir=$dir/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
SlurmctldTimeout=30
SlurmdTimeout=30
KillWait=30
JobRequeue=1
NodeName=n1 NodeHostname=$(hostname) NodeAddr=127.0.0.1 Port=$(free_port) CPUs=$cpus State=UNKNOWN
NodeName=n2 NodeHostname=$(hostname) NodeAddr=127.0.0.1 Port=$(free_port) CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
CONF
if ! getent hosts n1 >/dev/null || ! getent hosts n2 >/dev/null; then
  echo "127.0.0.1 n1 n2 $mark" >> /etc/hosts
  touch "$dir/added-hosts-line"
fi
export SLURM_CONF=$dir/slurm.conf
slurmctld -f "$dir/slurm.conf"
slurmd -f "$dir/slurm.conf" -N n1
slurmd -f "$dir/slurm.conf" -N n2
for _ in $(seq 100); do  # both nodes idle: ready for jobs
  [ "$(sinfo -h -o '%t' -n n1,n2 2>/dev/null | sort -u)" = idle ] && { echo "export SLURM_CONF=$dir/slurm.conf"; exit 0; }
  sleep 0.3
done
echo "zerojax: local_cluster: nodes n1, n2 not idle after 30 s; see $dir/log" >&2
sinfo -N >&2 || true
stop
exit 1

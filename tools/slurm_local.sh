#!/usr/bin/env bash
# Single-node Slurm cluster on localhost, for CI and for trying the slurm/ scripts on one machine.
#
#   bash tools/slurm_local.sh start    # install (Debian packages) if needed, start munge + slurmctld + slurmd,
#                                      # wait until the node is idle, write $SLURM_LOCAL_DIR/env.sh
#   source "${SLURM_LOCAL_DIR:-/tmp/megatron-rlvr-slurm}/env.sh"   # exports SLURM_CONF for sbatch/srun/tests
#   bash tools/slurm_local.sh status
#   bash tools/slurm_local.sh stop     # stops only the daemons this script started (by their pid files)
#
# Environment (all optional):
#   SLURM_LOCAL_DIR        scratch dir for slurm.conf, state, spool, logs, pids  (default /tmp/megatron-rlvr-slurm)
#   SLURM_LOCAL_NO_INSTALL 1: never apt-get install (fail if the binaries are missing)
#   SLURM_LOCAL_CPUS       CPUs to declare for the node      (default: nproc)
#   SLURM_LOCAL_MEM_MB     RealMemory to declare             (default: 90% of MemTotal)
#   SLURM_LOCAL_TIMEOUT_S  how long start waits for an idle node (default 60)
#
# Needs root (munge key in /etc/munge, daemons run as root). Recipe measured on Debian 12 / Slurm 22.05.
# Accounting (sacct/slurmdbd) is NOT set up: query jobs with
# `scontrol show job <id>` (kept MinJobAge=600 s after the end) or squeue.
set -euo pipefail

DIR=${SLURM_LOCAL_DIR:-/tmp/megatron-rlvr-slurm}
CONF=$DIR/slurm.conf
ENV_FILE=$DIR/env.sh
TIMEOUT_S=${SLURM_LOCAL_TIMEOUT_S:-60}

log() { echo "[slurm_local] $*" >&2; }

install_packages() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
    && command -v munged >/dev/null; then
    return 0
  fi
  if [ "${SLURM_LOCAL_NO_INSTALL:-0}" = 1 ]; then
    log "slurm/munge binaries missing and SLURM_LOCAL_NO_INSTALL=1"; exit 1
  fi
  log "installing slurmctld slurmd slurm-client munge (apt-get)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null
  apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
}

start_munge() {
  if [ ! -s /etc/munge/munge.key ]; then
    log "creating /etc/munge/munge.key"
    install -d -o munge -g munge -m 700 /etc/munge
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    chown munge:munge /etc/munge/munge.key
    chmod 400 /etc/munge/munge.key
  fi
  if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    return 0  # a munged is already running (ours from an earlier start, or the system's)
  fi
  install -d -o munge -g munge -m 755 /run/munge
  install -d -o munge -g munge -m 700 /var/lib/munge /var/log/munge
  runuser -u munge -- munged
  touch "$DIR/munged.started-by-us"
  for _ in $(seq 50); do
    munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  log "munged did not come up"; exit 1
}

write_conf() {
  local cpus mem_mb
  cpus=${SLURM_LOCAL_CPUS:-$(nproc)}
  mem_mb=${SLURM_LOCAL_MEM_MB:-$(awk '/MemTotal/ {printf "%d", $2 / 1024 * 0.9}' /proc/meminfo)}
  mkdir -p "$DIR"/{state,spool,log}
  cat >"$CONF" <<EOF
# Written by tools/slurm_local.sh: a one-node cluster on localhost.
ClusterName=rlvr-local
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire is also how long a requeued job waits before it may start again (default 120 s): keep CI fast.
AuthInfo=cred_expire=5
# Requeued jobs only start on a scheduling pass after cred_expire: run the passes often (defaults 60 s / 30 s).
SchedulerParameters=sched_interval=2,bf_interval=1
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobRequeue=1
# Keep finished jobs visible to scontrol for 10 minutes (there is no sacct without slurmdbd).
MinJobAge=600
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
SlurmctldPort=6817
SlurmdPort=6818
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
  printf 'export SLURM_CONF=%q\n' "$CONF" >"$ENV_FILE"
}

pid_alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

wait_idle() {
  local deadline=$((SECONDS + TIMEOUT_S)) state=""
  while [ $SECONDS -lt $deadline ]; do
    state=$(SLURM_CONF=$CONF sinfo -h -n localhost -o %T 2>/dev/null || true)
    case "$state" in
      idle | mixed | allocated) log "node localhost is $state"; return 0 ;;
      drain* | down*) SLURM_CONF=$CONF scontrol update NodeName=localhost State=RESUME 2>/dev/null || true ;;
    esac
    sleep 0.3
  done
  log "node did not become idle within ${TIMEOUT_S}s (state: '${state}'); logs in $DIR/log"
  tail -n 20 "$DIR"/log/*.log >&2 || true
  exit 1
}

cmd_start() {
  install_packages
  mkdir -p "$DIR"
  start_munge
  if pid_alive "$DIR/slurmctld.pid" && pid_alive "$DIR/slurmd.pid"; then
    log "already running (SLURM_CONF=$CONF)"
  else
    write_conf
    # -c: a scratch cluster starts without the jobs of an earlier run.
    pid_alive "$DIR/slurmctld.pid" || slurmctld -c -f "$CONF"
    pid_alive "$DIR/slurmd.pid" || slurmd -f "$CONF" -N localhost  # the host name is not "localhost"
  fi
  wait_idle
  echo "$ENV_FILE"
}

stop_pidfile() {
  local f=$1 pid
  pid_alive "$f" || { rm -f "$f"; return 0; }
  pid=$(cat "$f")
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -0 "$pid" 2>/dev/null && kill -9 "$pid" 2>/dev/null || true
  rm -f "$f"
}

cmd_stop() {
  stop_pidfile "$DIR/slurmd.pid"
  stop_pidfile "$DIR/slurmctld.pid"
  if [ -e "$DIR/munged.started-by-us" ]; then
    stop_pidfile /run/munge/munged.pid
    rm -f "$DIR/munged.started-by-us"
  fi
  log "stopped"
}

cmd_status() {
  if pid_alive "$DIR/slurmctld.pid"; then
    SLURM_CONF=$CONF sinfo
    SLURM_CONF=$CONF squeue
  else
    log "not running"; exit 1
  fi
}

case "${1:-}" in
  start) cmd_start ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac

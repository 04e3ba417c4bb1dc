#!/usr/bin/env bash
# A multi-node Slurm cluster on one Linux machine: every node is a network namespace with its own address on a
# private bridge, its own host name and its own /etc/hosts. For CI (the multi-node tests) and for trying the
# slurm/ scripts across nodes on one machine. Coexists with tools/slurm_local.sh (own directory, own munged, daemons
# listening only inside their namespaces).
#
#   bash tools/slurm_cluster.sh start           # install the Debian packages if needed; bridge, namespaces, a private
#                                               # munged, slurmctld, one slurmd per node; waits until all are idle
#   source "${SLURM_CLUSTER_DIR:-/tmp/megatron-rlvr-slurm-cluster}/env.sh"   # exports SLURM_CONF: sbatch, scontrol,
#                                               # squeue, sinfo work from the machine itself
#   bash tools/slurm_cluster.sh status
#   bash tools/slurm_cluster.sh exec NODE CMD...    # run CMD "on" NODE (the namespaces its jobs run in)
#   bash tools/slurm_cluster.sh stop            # every daemon, job process, namespace, link and the bridge it made
#
# Node faults (NODE is node1, node2, ...):
#   crash NODE     unplug the node, then SIGKILL every process on it: its peers hear nothing more, as from a node
#                  that lost power. slurmctld marks it DOWN ~SlurmdTimeout + 2 x MessageTimeout later; its jobs are
#                  requeued (sbatch --requeue) or end NODE_FAIL.
#   poweroff NODE  SIGKILL every process on the node, link left up: peers' connections are reset at once.
#   netdown NODE   unplug the node's link, processes keep running (a network partition); netup NODE replugs it.
#   restart NODE   replug, start the node's slurmd again and wait until the node is idle.
#   hosts NODE loopback|normal
#                  loopback: the node's /etc/hosts maps its own name to 127.0.1.1 (what Debian and Ubuntu installers
#                  write), so gethostname() resolves to a loopback address there; normal: its bridge address.
#
# Layout (NET = $SLURM_CLUSTER_NET, P = $SLURM_CLUSTER_PREFIX): bridge ${P}br0 = NET.1/24 on the machine; namespace
# $P-ctl at NET.10 runs slurmctld (host name ctl); namespace $P-nodeK at NET.(10+K) runs `slurmd -N nodeK` (host name
# nodeK). The namespaces have no default route and the machine does not forward for them: nothing can leave the
# machine. Jobs run in the namespaces of the slurmd that started them, so they see the node's host name, address and
# hosts file, but share the machine's cores, memory, file systems and PIDs (every node sees the same /tmp).
# slurmd is started with `nsenter --net=`, not `ip netns exec`, which remounts /sys without /sys/fs/cgroup and makes
# slurmd 22.05 exit.
#
# Environment (all optional):
#   SLURM_CLUSTER_DIR              conf, state, spool, logs, pids      (default /tmp/megatron-rlvr-slurm-cluster)
#   SLURM_CLUSTER_NODES            number of nodes                     (default 3: two for a job, one spare)
#   SLURM_CLUSTER_NET              first three octets of the private /24 (default 10.77.0; refused if the machine
#                                  already has an address or a route in it)
#   SLURM_CLUSTER_PREFIX           namespace / link name prefix, at most 6 characters (default rlvc)
#   SLURM_CLUSTER_CPUS             CPUs declared per node              (default: nproc; they share the same cores)
#   SLURM_CLUSTER_MEM_MB           RealMemory declared per node        (default 2000)
#   SLURM_CLUSTER_SLURMD_TIMEOUT   SlurmdTimeout, s                    (default 10; Slurm's default is 300)
#   SLURM_CLUSTER_MSG_TIMEOUT      MessageTimeout, s                   (default 10, Slurm's default)
#   SLURM_CLUSTER_KILL_WAIT        KillWait, s                         (default 30, Slurm's default)
#   SLURM_CLUSTER_TIMEOUT_S        how long start / restart wait for idle nodes (default 60)
#   SLURM_CLUSTER_NO_INSTALL       1: never apt-get install
# docs/running-on-slurm.md, "7. Failures end the job", says what these timeouts mean for a job on a dead node.
set -euo pipefail

DIR=${SLURM_CLUSTER_DIR:-/tmp/megatron-rlvr-slurm-cluster}
N=${SLURM_CLUSTER_NODES:-3}
NET=${SLURM_CLUSTER_NET:-10.77.0}
P=${SLURM_CLUSTER_PREFIX:-rlvc}
BR=${P}br0
CONF=$DIR/slurm.conf
TIMEOUT_S=${SLURM_CLUSTER_TIMEOUT_S:-60}
MUNGE_SOCKET=$DIR/munge/munge.socket

log() { echo "[slurm_cluster] $*" >&2; }
die() { log "$*"; exit 1; }
pid_alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
nodes() { seq -f 'node%g' 1 "$N"; }
node_ip() { echo "$NET.$((10 + ${1#node}))"; }
sconf() { SLURM_CONF=$CONF "$@"; }

check_args() {
  [[ "$N" =~ ^[1-9][0-9]?$ ]] && [ "$N" -le 99 ] || die "SLURM_CLUSTER_NODES=$N: 1..99"
  [[ "$NET" =~ ^[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}$ ]] || die "SLURM_CLUSTER_NET=$NET: three octets, e.g. 10.77.0"
  [[ "$P" =~ ^[a-z][a-z0-9]{0,5}$ ]] || die "SLURM_CLUSTER_PREFIX=$P: 1-6 lower-case letters/digits (link names <= 15)"
}

check_node() {
  [[ "${1:-}" =~ ^node[0-9]+$ ]] && [ "${1#node}" -ge 1 ] && [ "${1#node}" -le "$N" ] \
    || die "no node '${1:-}' (node1..node$N)"
}

install_packages() {
  local b missing=0
  for b in slurmctld slurmd sbatch munged nsenter unshare ip; do command -v "$b" >/dev/null || missing=1; done
  [ "$missing" = 0 ] && return 0
  [ "${SLURM_CLUSTER_NO_INSTALL:-0}" = 1 ] && die "slurm/munge/iproute2 binaries missing and SLURM_CLUSTER_NO_INSTALL=1"
  log "installing slurmctld slurmd slurm-client munge iproute2 (apt-get)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null
  apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge iproute2 util-linux >/dev/null
}

# ------------------------------------------------------------------------------------------------------- network
our_namespaces() { ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^$P-(ctl|node[0-9]+)$" || true; }

add_host() {  # add_host NAME IP: namespace $P-NAME with eth0 = IP/24, plugged into the bridge through ${P}v-NAME
  local name=$1 ip=$2 ns=$P-$1 veth=${P}v-$1
  ip netns add "$ns"
  ip link add "$veth" type veth peer name eth0 netns "$ns"
  ip link set "$veth" master "$BR" up
  ip -n "$ns" addr add "$ip/24" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$ns" link set lo up
}

net_up() {
  if [ -n "$(ip -4 -o addr show | awk -v net="$NET." 'index($4, net) == 1')" ] \
    || [ -n "$(ip -4 route show "$NET.0/24")" ]; then
    die "the machine already has an address or a route in $NET.0/24: choose another SLURM_CLUSTER_NET"
  fi
  ip link add "$BR" type bridge
  ip addr add "$NET.1/24" dev "$BR"
  ip link set "$BR" up
  add_host ctl "$NET.10"
  local n
  for n in $(nodes); do add_host "$n" "$(node_ip "$n")"; done
}

net_down() {
  local ns
  for ns in $(our_namespaces); do
    ip link del "${P}v-${ns#"$P"-}" 2>/dev/null || true  # before the namespace: `ip netns del` frees it only later
    ip netns del "$ns"
  done
  if ip link show "$BR" >/dev/null 2>&1; then ip link del "$BR"; fi
  return 0
}

write_hosts() {  # write_hosts NAME [loopback]: NAME's /etc/hosts, rewritten in place (it is bind-mounted)
  local name=$1 mode=${2:-normal} f=$DIR/hosts/$1 n
  {
    echo "127.0.0.1 localhost"
    if [ "$mode" = loopback ]; then echo "127.0.1.1 $name"; fi
    echo "$NET.1 gateway"
    echo "$NET.10 ctl"
    for n in $(nodes); do
      if [ "$n" != "$name" ] || [ "$mode" != loopback ]; then echo "$(node_ip "$n") $n"; fi
    done
  } >"$f.new"
  if [ -e "$f" ]; then cat "$f.new" >"$f"; rm -f "$f.new"; else mv "$f.new" "$f"; fi
}

# Run "$@" as host NAME: its network namespace, plus a new UTS namespace (host name NAME) and a new mount namespace
# in which $DIR/hosts/NAME is bind-mounted over /etc/hosts (the machine's own file is not touched).
in_host() {
  local name=$1
  shift
  nsenter --net="/run/netns/$P-$name" unshare --uts --mount --propagation private \
    sh -c 'mount --bind "$0" /etc/hosts && hostname "$1" && shift && exec "$@"' "$DIR/hosts/$name" "$name" "$@"
}

exec_on() {  # exec_on NODE CMD...: in the namespaces of NODE's running slurmd
  local name=$1
  shift
  pid_alive "$DIR/run/slurmd-$name.pid" || die "$name: slurmd is not running"
  exec nsenter -t "$(cat "$DIR/run/slurmd-$name.pid")" --net --uts --mount "$@"
}

# --------------------------------------------------------------------------------------------------------- munge
start_munge() {
  install -d -o munge -g munge -m 755 "$DIR/munge"
  install -d -o munge -g munge -m 700 "$DIR/munge/key"
  if [ ! -s "$DIR/munge/key/munge.key" ]; then
    dd if=/dev/urandom of="$DIR/munge/key/munge.key" bs=1024 count=1 status=none
    chown munge:munge "$DIR/munge/key/munge.key"
    chmod 400 "$DIR/munge/key/munge.key"
  fi
  if ! pid_alive "$DIR/munge/munged.pid"; then
    runuser -u munge -- munged --socket="$MUNGE_SOCKET" --key-file="$DIR/munge/key/munge.key" \
      --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/munge/munged.log" --seed-file="$DIR/munge/munged.seed"
  fi
  for _ in $(seq 50); do
    munge -S "$MUNGE_SOCKET" -n 2>/dev/null | unmunge -S "$MUNGE_SOCKET" >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  die "munged did not come up (log: $DIR/munge/munged.log)"
}

# --------------------------------------------------------------------------------------------------------- slurm
write_conf() {
  local cpus=${SLURM_CLUSTER_CPUS:-$(nproc)} mem=${SLURM_CLUSTER_MEM_MB:-2000} n
  cat >"$CONF" <<EOF
# Written by tools/slurm_cluster.sh: $N nodes, each in its own network namespace on one machine.
ClusterName=rlvr-cluster
SlurmctldHost=ctl($NET.10)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# The private munged (clients read this too). cred_expire is also how long a requeued job waits before it may start
# again (default 120 s).
AuthInfo=socket=$MUNGE_SOCKET,cred_expire=5
SchedulerParameters=sched_interval=2,bf_interval=1
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
# The nodes declare the CPUs below even where the machine has fewer (else they go INVAL "Low CPUs").
SlurmdParameters=config_overrides
JobRequeue=1
MinJobAge=600
# A node that stops answering is DOWN about SlurmdTimeout + 2 x MessageTimeout after it died; its jobs are then
# requeued (--requeue) or end NODE_FAIL. Processes that ignore SIGTERM get SIGKILL KillWait seconds later.
SlurmdTimeout=${SLURM_CLUSTER_SLURMD_TIMEOUT:-10}
MessageTimeout=${SLURM_CLUSTER_MSG_TIMEOUT:-10}
KillWait=${SLURM_CLUSTER_KILL_WAIT:-30}
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
SlurmctldPort=6817
SlurmdPort=6818
EOF
  for n in $(nodes); do
    echo "NodeName=$n NodeAddr=$(node_ip "$n") CPUs=$cpus RealMemory=$mem State=UNKNOWN" >>"$CONF"
  done
  echo "PartitionName=debug Nodes=node[1-$N] Default=YES MaxTime=INFINITE State=UP" >>"$CONF"
  printf 'export SLURM_CONF=%q\n' "$CONF" >"$DIR/env.sh"
}

start_slurmd() {
  local n=$1
  mkdir -p "$DIR/spool/$n"
  in_host "$n" slurmd -f "$CONF" -N "$n" || { tail -n 20 "$DIR/log/slurmd-$n.log" >&2 || true; die "slurmd $n failed"; }
}

wait_idle() {  # wait_idle NODE...: until every NODE is idle (a DOWN node returns by itself: ReturnToService=2)
  local deadline=$((SECONDS + TIMEOUT_S)) n state ok
  while [ $SECONDS -lt $deadline ]; do
    ok=1
    for n in "$@"; do
      state=$(sconf sinfo -h -n "$n" -o %T 2>/dev/null || true)
      [ "$state" = idle ] || ok=0
    done
    [ "$ok" = 1 ] && return 0
    sleep 0.3
  done
  sconf sinfo -N -l >&2 || true
  tail -n 20 "$DIR"/log/*.log >&2 || true
  die "nodes $* not idle within ${TIMEOUT_S}s; logs in $DIR/log"
}

running() { pid_alive "$DIR/run/slurmctld.pid" && [ -n "$(our_namespaces)" ]; }

cmd_start() {
  check_args
  install_packages
  if running; then
    log "already running (SLURM_CONF=$CONF)"
    wait_idle $(nodes)
    echo "$DIR/env.sh"
    return 0
  fi
  if [ -n "$(our_namespaces)" ] || ip link show "$BR" >/dev/null 2>&1; then
    log "leftovers of an earlier start: stopping them first"
    cmd_stop
  fi
  local t0=$SECONDS n
  rm -rf "$DIR/state" "$DIR/spool" "$DIR/run" "$DIR/hosts"
  mkdir -p "$DIR"/{state,spool,log,run,hosts}
  write_conf
  write_hosts ctl
  for n in $(nodes); do write_hosts "$n"; done
  net_up
  start_munge
  # -c: a scratch cluster starts without the jobs of an earlier run
  in_host ctl slurmctld -c -f "$CONF" || { tail -n 20 "$DIR/log/slurmctld.log" >&2 || true; die "slurmctld failed"; }
  for n in $(nodes); do start_slurmd "$n"; done
  wait_idle $(nodes)
  log "$N nodes idle in $((SECONDS - t0)) s (SLURM_CONF=$CONF)"
  echo "$DIR/env.sh"
}

kill_pidfiles() {  # SIGTERM to all at once (slurmd takes ~2 s to exit), up to 5 s, then SIGKILL what is left
  local f pid pids=() alive
  for f in "$@"; do
    if pid_alive "$f"; then pids+=("$(cat "$f")"); fi
    rm -f "$f"
  done
  [ ${#pids[@]} -eq 0 ] && return 0
  kill "${pids[@]}" 2>/dev/null || true
  for _ in $(seq 50); do
    alive=0
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ "$alive" = 0 ] && return 0
    sleep 0.1
  done
  for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
  return 0
}

kill_node_procs() {  # SIGKILL every process in host NAME's network namespace (slurmd, slurmstepd, job tasks)
  local pids
  pids=$(ip netns pids "$P-$1" 2>/dev/null || true)
  # shellcheck disable=SC2086
  if [ -n "$pids" ]; then kill -9 $pids 2>/dev/null || true; fi
  rm -f "$DIR/run/slurmd-$1.pid"
  return 0
}

cmd_stop() {
  local ns
  kill_pidfiles "$DIR"/run/slurmd-node*.pid "$DIR/run/slurmctld.pid"
  for ns in $(our_namespaces); do kill_node_procs "${ns#"$P"-}"; done
  kill_pidfiles "$DIR/munge/munged.pid"
  net_down
  log "stopped"
}

cmd_status() {
  running || die "not running"
  sconf sinfo -N -l
  sconf squeue
}

cmd="${1:-}"
[ $# -gt 0 ] && shift
case "$cmd" in
  start) cmd_start ;;
  stop) check_args; cmd_stop ;;
  status) cmd_status ;;
  exec) check_node "${1:-}"; exec_on "$@" ;;
  crash) check_node "${1:-}"; ip link set "${P}v-$1" down; kill_node_procs "$1"; log "$1: crashed (unplugged, killed)" ;;
  poweroff) check_node "${1:-}"; kill_node_procs "$1"; log "$1: powered off (every process killed)" ;;
  netdown) check_node "${1:-}"; ip link set "${P}v-$1" down; log "$1: link down" ;;
  netup) check_node "${1:-}"; ip link set "${P}v-$1" up; log "$1: link up" ;;
  restart)
    check_node "${1:-}"
    ip link set "${P}v-$1" up
    pid_alive "$DIR/run/slurmd-$1.pid" || start_slurmd "$1"
    wait_idle "$1"
    log "$1: idle"
    ;;
  hosts)
    check_node "${1:-}"
    case "${2:-}" in
      loopback | normal) write_hosts "$1" "$2"; log "$1: /etc/hosts $2" ;;
      *) die "usage: $0 hosts NODE loopback|normal" ;;
    esac
    ;;
  *)
    echo "usage: $0 start|stop|status | exec NODE CMD... | crash|poweroff|netdown|netup|restart NODE" \
      "| hosts NODE loopback|normal" >&2
    exit 2
    ;;
esac

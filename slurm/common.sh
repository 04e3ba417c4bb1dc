# shellcheck shell=bash
# Shared body of the sbatch scripts in slurm/ (sourced by them; not a job script itself).
#
# One srun task per GPU (per CPU slot for tiny_cpu.sh) runs the same SPMD program; no Ray, no launcher daemon.
# Every task finds its rank from Slurm's environment (megatron_rlvr/slurm_env.py: SLURM_PROCID, SLURM_NTASKS,
# SLURM_LOCALID) and meets the others at MASTER_ADDR:MASTER_PORT, computed here once and exported to all tasks:
#   MASTER_ADDR = the address of the first host of SLURM_JOB_NODELIST, where task 0 runs (srun
#                 --distribution=block puts tasks 0..n-1 on the first node): its NodeAddr in slurm.conf, the address
#                 Slurm itself reaches the node at, the same on every node (a host name may resolve differently on
#                 each node, e.g. to 127.0.1.1 on the node itself); its name where scontrol cannot tell
#   MASTER_PORT = 20000 + SLURM_JOB_ID % 20000 (stable across requeues, which keep the job id)
#
# Preemption / time-limit contract with the trainer (`megatron-rlvr train`):
#   * Slurm sends SIGUSR1 to every task 180 s before the time limit (#SBATCH --signal=USR1@180); a preempting
#     scheduler or scancel sends SIGTERM. On either, the trainer finishes the current step, writes a checkpoint
#     into $RLVR_RUN_DIR, and exits with code 75 (EX_TEMPFAIL, sysexits.h) on every rank.
#   * Each task runs under a small bash wrapper (RLVR_TASK_WRAPPER below) that turns exit 75 into exit 0 plus a
#     marker file in $RLVR_RUN_DIR/.requeue: srun --kill-on-bad-exit treats ANY non-zero exit as a failure, so a
#     rank that exits 75 first would otherwise get the others SIGTERMed while they still finish their checkpoint
#     shards (seen under load: "task 0: Exited with exit code 75 ... task 1: Terminated" -> srun 143 -> FAILED).
#     srun then exits 0 with markers present, and this script calls `scontrol requeue $SLURM_JOB_ID` (the job
#     needs --requeue). The job id, and so $RLVR_RUN_DIR and the log file, stay the same; the restarted trainer
#     resumes from the latest checkpoint in $RLVR_RUN_DIR. At most $RLVR_MAX_REQUEUES requeues.
#   * exit 0 = finished; any other code = failure, no requeue, the job ends FAILED with that code.
# Fail fast: srun --kill-on-bad-exit=1 kills every task as soon as one exits non-zero or dies from a signal, so
# the job ends within seconds instead of hanging in a collective; --wait=$RLVR_SRUN_WAIT_S also ends the step
# that long after the first task exits (even with code 0), so a rank that quits early cannot hang the rest.
#
# Variables (set by the calling script as defaults; every one can be overridden from the environment):
#   RLVR_HOME          repo checkout visible on all nodes      (default: $SLURM_SUBMIT_DIR, i.e. submit from it)
#   RLVR_CONFIG        run config passed to the trainer
#   RLVR_OVERRIDES     extra key=value overrides appended to the trainer command (space separated)
#   RLVR_CMD           the whole program each task runs, word-split (default: megatron-rlvr train CONFIG OVERRIDES)
#   RLVR_RUN_DIR       run directory: checkpoints, metrics, resume  (default: $RLVR_HOME/runs/<job name>-<job id>)
#   RLVR_VENV          virtualenv whose bin/ goes first on PATH (default: $RLVR_HOME/.venv if it exists;
#                      set to "" to use the container's / module's python)
#   RLVR_SETUP         shell code run before srun (module loads, NCCL_* settings), e.g. "module load cuda/12.4"
#   RLVR_MAX_REQUEUES  stop requeueing after this many restarts (default 20)
#   RLVR_SRUN_WAIT_S   srun --wait: seconds after the first task exits before the rest are killed (default 120)
#   RLVR_SRUN_EXTRA    extra srun flags, word-split (e.g. "--label --cpu-bind=none")
#   CONTAINER_IMAGE    pyxis/enroot image; when set, srun gets --container-image/--container-mounts/-workdir
#   CONTAINER_MOUNTS   pyxis mounts (default: $RLVR_HOME:$RLVR_HOME); add data and HF cache dirs here
#   CONTAINER_WORKDIR  working dir inside the container (default: $RLVR_HOME)
#   RLVR_DRY_RUN       1: print the resolved environment and srun command line, then exit 0 without running

RLVR_REQUEUE_EXIT_CODE=75

# Runs "$@" as one srun task. Exit 75 ("checkpointed, requeue me") -> marker file + exit 0 (see the header). A program
# killed by a signal makes the wrapper die by the same signal, so srun still reports "task N: Killed". Signals
# that Slurm sends to every process of the step (scancel --signal, --signal=USR1@180, SIGTERM) must not kill the
# wrapper: it traps them with a no-op (not '' = ignore, which the program would inherit) and keeps waiting.
# shellcheck disable=SC2016
RLVR_TASK_WRAPPER='trap : USR1 USR2 TERM INT HUP
"$@"
rc=$?
if [ "$rc" -eq "$RLVR_REQUEUE_EXIT_CODE" ]; then
  touch "$RLVR_RUN_DIR/.requeue/task-${SLURM_PROCID:-0}"
  exit 0
fi
if [ "$rc" -gt 128 ] && [ "$rc" -le 192 ]; then
  trap - USR1 USR2 TERM INT HUP
  kill -s "$((rc - 128))" "$$"
fi
exit "$rc"'

rlvr_log() { echo "[$(date '+%F %T')] [${SLURM_JOB_NAME:-job}-${SLURM_JOB_ID:-?}] $*"; }

rlvr_first_host() {
  # Slurm's own expansion when scontrol is reachable, else the same logic in Python (megatron_rlvr/slurm_env.py).
  local first=""
  if command -v scontrol >/dev/null 2>&1; then
    first=$(scontrol show hostnames "$1" 2>/dev/null | head -n 1 || true)
  fi
  if [ -z "$first" ]; then
    first=$(PYTHONPATH="$RLVR_HOME${PYTHONPATH:+:$PYTHONPATH}" python3 -m megatron_rlvr.slurm_env --first-host "$1")
  fi
  echo "$first"
}

rlvr_master_addr() {
  # NodeAddr of the first host (see the header), else the host's name.
  local first addr=""
  first=$(rlvr_first_host "$1")
  if command -v scontrol >/dev/null 2>&1; then
    addr=$(timeout 10 scontrol show node -o "$first" 2>/dev/null | sed -n 's/.* NodeAddr=\([^ ]*\).*/\1/p' || true)
  fi
  echo "${addr:-$first}"
}

rlvr_prepare() {
  : "${SLURM_JOB_ID:?not inside a Slurm allocation: submit with sbatch (or set RLVR_DRY_RUN=1 and SLURM_* by hand)}"
  : "${SLURM_JOB_NODELIST:?SLURM_JOB_NODELIST is not set}"
  cd "$RLVR_HOME"
  export RLVR_HOME RLVR_CONFIG
  export RLVR_RUN_DIR=${RLVR_RUN_DIR:-$RLVR_HOME/runs/${SLURM_JOB_NAME:-rlvr}-${SLURM_JOB_ID}}
  export MASTER_ADDR=${MASTER_ADDR:-$(rlvr_master_addr "$SLURM_JOB_NODELIST")}
  export MASTER_PORT=${MASTER_PORT:-$((20000 + ${SLURM_JOB_ID%%_*} % 20000))}
  export RLVR_REQUEUE_EXIT_CODE
  if [ -z "${RLVR_VENV+set}" ] && [ -x "$RLVR_HOME/.venv/bin/python" ]; then
    RLVR_VENV=$RLVR_HOME/.venv
  fi
  if [ -n "${RLVR_VENV:-}" ]; then
    export VIRTUAL_ENV=$RLVR_VENV PATH="$RLVR_VENV/bin:$PATH"
  fi
  if [ -n "${RLVR_SETUP:-}" ]; then
    eval "$RLVR_SETUP"
  fi

  local cmd_str=${RLVR_CMD:-megatron-rlvr train $RLVR_CONFIG ${RLVR_OVERRIDES:-}}
  read -r -a RLVR_PROGRAM <<<"$cmd_str"

  local nodes=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}
  SRUN=(srun --kill-on-bad-exit=1 --wait="${RLVR_SRUN_WAIT_S:-120}" --distribution=block --nodes="$nodes")
  if [ -n "${SLURM_NTASKS:-}" ]; then SRUN+=(--ntasks="$SLURM_NTASKS"); fi
  if [ -n "${SLURM_NTASKS_PER_NODE:-}" ]; then SRUN+=(--ntasks-per-node="$SLURM_NTASKS_PER_NODE"); fi
  if [ -n "${CONTAINER_IMAGE:-}" ]; then
    SRUN+=(--container-image="$CONTAINER_IMAGE"
      --container-mounts="${CONTAINER_MOUNTS:-$RLVR_HOME:$RLVR_HOME}"
      --container-workdir="${CONTAINER_WORKDIR:-$RLVR_HOME}")
  fi
  if [ -n "${RLVR_SRUN_EXTRA:-}" ]; then
    local extra
    read -r -a extra <<<"$RLVR_SRUN_EXTRA"
    SRUN+=("${extra[@]}")
  fi
  SRUN+=(bash -c "$RLVR_TASK_WRAPPER" rlvr-task "${RLVR_PROGRAM[@]}")
}

rlvr_print() {
  echo "MASTER_ADDR=$MASTER_ADDR"
  echo "MASTER_PORT=$MASTER_PORT"
  echo "RLVR_RUN_DIR=$RLVR_RUN_DIR"
  echo "RLVR_CONFIG=$RLVR_CONFIG"
  echo "SLURM_RESTART_COUNT=${SLURM_RESTART_COUNT:-0}"
  printf 'SRUN:'
  printf ' %q' "${SRUN[@]}"
  printf '\n'
}

rlvr_forward() {
  # The batch shell only sees a signal when it is sent to it explicitly (scancel --batch/--full, --signal=B:...);
  # pass it on to srun, which forwards it to every task (the trainer's handler is idempotent).
  rlvr_log "batch shell got SIG$1, forwarding to srun (pid $SRUN_PID)"
  kill -s "$1" "$SRUN_PID" 2>/dev/null || true
}

rlvr_main() {
  set -euo pipefail
  rlvr_prepare
  if [ "${RLVR_DRY_RUN:-0}" = 1 ]; then
    rlvr_print
    return 0
  fi
  mkdir -p "$RLVR_RUN_DIR"
  rm -rf "$RLVR_RUN_DIR/.requeue"
  mkdir -p "$RLVR_RUN_DIR/.requeue"
  rlvr_log "nodes=$SLURM_JOB_NODELIST tasks=${SLURM_NTASKS:-?} restart=${SLURM_RESTART_COUNT:-0}"
  rlvr_log "commit=$(git -C "$RLVR_HOME" rev-parse --short HEAD 2>/dev/null || echo unknown) run_dir=$RLVR_RUN_DIR"
  rlvr_print

  local rc
  "${SRUN[@]}" &
  SRUN_PID=$!
  trap 'rlvr_forward USR1' USR1
  trap 'rlvr_forward TERM' TERM
  while :; do
    set +e
    wait "$SRUN_PID"
    rc=$?
    set -e
    # wait returns 128+n when a trapped signal interrupts it while srun still runs: keep waiting.
    if [ "$rc" -gt 128 ] && kill -0 "$SRUN_PID" 2>/dev/null; then continue; fi
    break
  done
  trap - USR1 TERM

  local marked
  marked=$(find "$RLVR_RUN_DIR/.requeue" -maxdepth 1 -name 'task-*' 2>/dev/null | wc -l)
  if [ "$rc" -eq 0 ] && [ "$marked" -eq 0 ]; then
    rlvr_log "finished (exit 0)"
    return 0
  fi
  if [ "$rc" -eq 0 ]; then
    rc=$RLVR_REQUEUE_EXIT_CODE
    local restarts=${SLURM_RESTART_COUNT:-0} max=${RLVR_MAX_REQUEUES:-20}
    if [ "$restarts" -ge "$max" ]; then
      rlvr_log "checkpointed (exit $rc) but already restarted $restarts times (RLVR_MAX_REQUEUES=$max): not requeueing"
      return "$rc"
    fi
    rlvr_log "checkpointed (exit $rc on $marked of ${SLURM_NTASKS:-?} tasks): requeueing job $SLURM_JOB_ID (restart $((restarts + 1)))"
    scontrol requeue "$SLURM_JOB_ID"
    return 0
  fi
  rlvr_log "FAILED: srun exited with $rc"
  return "$rc"
}

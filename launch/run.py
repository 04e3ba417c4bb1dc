"""nemo-run launcher for the SPMD trainer: the same program as slurm/*.sh, submitted through nemo-run.

    python -m launch.run --config configs/mcpo_14b.yaml --executor slurm --dryrun [key=value ...]
    python -m launch.run --config configs/mcpo_14b.yaml --executor slurm --partition gpu --account proj
    python -m launch.run --config configs/tiny.yaml --executor local

--executor slurm: a nemo-run SlurmExecutor with one srun task per GPU (cluster.nodes x cluster.gpus_per_node
from the config unless --nodes / --ntasks-per-node say otherwise). Each task runs a small bash wrapper
(``task_script``) that enters the repo, activates its .venv, and runs ``megatron-rlvr train CONFIG OVERRIDES``;
the trainer finds its rank from Slurm's environment (megatron_rlvr/slurm_env.py). nemo-run's sbatch template
already runs srun with --kill-on-bad-exit=1 --wait=60 (fail fast). Preemption follows the same contract as
slurm/common.sh: SIGUSR1 180 s before the time limit (--signal=USR1@180), the trainer checkpoints and exits 75
on every rank, and rank 0's wrapper then calls ``scontrol requeue`` (nemo-run's own retry-on-any-failure is
left off: retries=0). The job is submitted with --requeue.
--executor local: a nemo-run LocalExecutor running one ``megatron-rlvr train`` process, which launches its own
ranks on this machine.
--dryrun prints the rendered sbatch script (or local command) and submits nothing; it needs no cluster.

key=value overrides are passed to the trainer; ``cluster.*`` ones also size the allocation. Before submitting, the
layout planner checks the config (when its model is one the planner knows) and refuses a layout that cannot fit
(--skip-plan to bypass). nemo-run is optional (``pip install nemo-run==0.11.1 leptonai==0.27.3``, the
``launch`` extra): this module imports without it and says how to install it when it is needed.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REQUEUE_EXIT_CODE = 75
NEMO_RUN_HINT = "nemo-run is not installed: pip install nemo-run==0.11.1 leptonai==0.27.3 (the 'launch' extra)"


def import_nemo_run():
    """nemo_run, imported on first use (it pulls ~420 MB of dependencies and takes seconds to import)."""
    try:
        import nemo_run
    except ImportError as e:
        raise RuntimeError(f"{NEMO_RUN_HINT} ({e})") from None
    return nemo_run


def load_config(path: str | Path, overrides: Sequence[str]):
    """The run config, loaded and validated by the trainer's own loader (megatron_rlvr.config) before anything is
    submitted. Files it names need not exist on the submitting machine (they are on the cluster's file system)."""
    from megatron_rlvr.config import load_run_config

    return load_run_config(str(path), list(overrides), check_files=False)


def trainer_command(config: str, overrides: Sequence[str]) -> list[str]:
    return ["megatron-rlvr", "train", config, *overrides]


def task_script(repo: Path, config: str, overrides: Sequence[str], max_requeues: int = 20) -> str:
    """Bash run by every task: repo + venv, the trainer, and rank 0's requeue when the trainer exits 75."""
    cmd = " ".join(shlex.quote(a) for a in trainer_command(config, overrides))
    r = shlex.quote(str(repo))
    return f"""set -u
cd {r}
if [ -z "${{RLVR_VENV+set}}" ] && [ -x {r}/.venv/bin/python ]; then RLVR_VENV={r}/.venv; fi
if [ -n "${{RLVR_VENV:-}}" ]; then export VIRTUAL_ENV="$RLVR_VENV" PATH="$RLVR_VENV/bin:$PATH"; fi
if [ -n "${{SLURM_JOB_ID:-}}" ]; then
  export RLVR_RUN_DIR="${{RLVR_RUN_DIR:-{r}/runs/${{SLURM_JOB_NAME:-rlvr}}-${{SLURM_JOB_ID}}}}"
fi
{cmd}
rc=$?
if [ "$rc" -eq {REQUEUE_EXIT_CODE} ] && [ "${{SLURM_PROCID:-}}" = 0 ] && [ -n "${{SLURM_JOB_ID:-}}" ]; then
  if [ "${{SLURM_RESTART_COUNT:-0}}" -lt {max_requeues} ]; then
    echo "rank 0: trainer checkpointed (exit {REQUEUE_EXIT_CODE}): scontrol requeue $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID"
  else
    echo "rank 0: trainer checkpointed but the job was already restarted {max_requeues} times: not requeueing"
  fi
fi
exit $rc
"""


def plan_check(cfg) -> tuple[bool, str]:
    """(ok, message) from the layout planner; ok when the planner cannot size the model (nothing to check)."""
    from megatron_rlvr.config import ConfigError
    from megatron_rlvr.planner import estimate_memory, plan_config_from_run

    if cfg.cluster.nodes is None:
        return True, "plan: cluster.nodes not set; layout not checked"
    try:
        plan_cfg = plan_config_from_run(cfg)
    except (ConfigError, ValueError) as e:
        return True, f"plan: layout not checked ({e})"
    plan = estimate_memory(plan_cfg)
    verdict = "fits" if plan.fits else "DOES NOT FIT"
    reasons = plan.errors + plan.reasons
    par, cl = plan_cfg.parallel, plan_cfg.cluster
    msg = f"plan: {plan_cfg.model.name} TP={par.tp} PP={par.pp} rollout TP={par.rollout_tp} "
    if par.rollout_ranks:
        msg += f"on {par.rollout_ranks} rollout ranks ({plan.engines} engines) "
    msg += f"on {cl.nodes}x{cl.gpus_per_node} GPUs: peak {plan.peak / 2**30:.1f} GiB/GPU, {verdict}"
    msg += "".join(f"\n  - {r}" for r in reasons)
    return plan.fits, msg


def build_executor(args: argparse.Namespace, cfg):
    run = import_nemo_run()
    if args.executor == "local":
        return run.LocalExecutor(ntasks_per_node=1)
    nodes = args.nodes or cfg.cluster.nodes or 1
    tasks = args.ntasks_per_node or cfg.cluster.gpus_per_node
    gpus = tasks if args.gpus_per_node is None else args.gpus_per_node
    base = Path(args.base_dir).resolve()
    return run.SlurmExecutor(
        account=args.account,  # None: no --account line (the cluster's default account)
        job_name_prefix="rlvr-",  # nemo-run otherwise derives a prefix from the account
        partition=args.partition,
        nodes=int(nodes),
        ntasks_per_node=int(tasks),
        gpus_per_node=int(gpus) or None,
        time=args.time,
        signal="USR1@180",
        exclusive=True if gpus else None,
        container_image=args.container_image,
        container_mounts=[m for m in (args.container_mounts or "").split(",") if m],
        additional_parameters={"requeue": True},
        srun_args=["--distribution=block"],
        retries=0,
        tunnel=run.LocalTunnel(job_dir=str(base / "experiments")),
        packager=run.Packager(),
    )


def rendered_dryrun(exp) -> str:
    """The sbatch script (Slurm) or command (local) nemo-run rendered in ``exp.dryrun``, without console wrapping."""
    info = getattr(exp.jobs[0], "_dryrun_info", None)
    request = getattr(info, "request", None)
    if hasattr(request, "materialize"):  # SlurmBatchRequest
        return request.materialize()
    return str(info)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m launch.run", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="run config YAML (configs/...)")
    ap.add_argument("--executor", choices=("local", "slurm"), required=True)
    ap.add_argument("--dryrun", action="store_true", help="print the rendered sbatch script / command; submit nothing")
    ap.add_argument(
        "overrides", nargs="*", help="key=value overrides passed to the trainer (cluster.* also size the job)"
    )
    ap.add_argument("--nodes", type=int, default=None, help="default: cluster.nodes of the config, else 1")
    ap.add_argument("--ntasks-per-node", type=int, default=None, help="default: cluster.gpus_per_node, else 8")
    ap.add_argument("--gpus-per-node", type=int, default=None, help="default: = tasks per node; 0 for CPU jobs")
    ap.add_argument("--partition", default=None)
    ap.add_argument("--account", default=None)
    ap.add_argument("--time", default="48:00:00")
    ap.add_argument("--name", default=None, help="job / experiment name (default: the config's file stem)")
    ap.add_argument("--container-image", default=None, help="pyxis image (srun --container-image)")
    ap.add_argument("--container-mounts", default=None, help="comma-separated pyxis mounts")
    ap.add_argument("--base-dir", default=str(REPO / "runs" / "nemo"), help="nemo-run experiment dir")
    ap.add_argument("--max-requeues", type=int, default=20)
    ap.add_argument("--skip-plan", action="store_true", help="do not refuse layouts the planner rejects")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_intermixed_args(list(sys.argv[1:] if argv is None else argv))
    for o in args.overrides:
        if "=" not in o:
            print(f"error: override {o!r} is not key=value", file=sys.stderr)
            return 2
    try:
        cfg = load_config(args.config, args.overrides)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.executor == "slurm" and args.gpus_per_node != 0:  # the planner sizes GPU memory; CPU jobs skip it
        ok, msg = plan_check(cfg)
        print(msg)
        if not ok and not args.skip_plan:
            print("refusing to launch a layout that does not fit (--skip-plan to override)", file=sys.stderr)
            return 1
    try:
        run = import_nemo_run()
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    name = args.name or Path(args.config).stem.replace("_", "-")
    script = run.Script(inline=task_script(REPO, args.config, args.overrides, args.max_requeues))
    executor = build_executor(args, cfg)
    with run.Experiment(name, executor=executor, base_dir=str(Path(args.base_dir).resolve())) as exp:
        exp.add(script, executor=executor, name=name)
        if args.dryrun:
            exp.dryrun(log=False)
            print(rendered_dryrun(exp))
            print("# ---- task script: every srun task runs this (bash) ----")
            print(script.inline)
            return 0
        # Status polling uses sacct, which needs slurmdbd; detach so a cluster without accounting still works.
        exp.run(detach=args.executor == "slurm")
    return 0


if __name__ == "__main__":
    sys.exit(main())

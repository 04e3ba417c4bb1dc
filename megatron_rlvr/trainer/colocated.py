"""The synchronous colocated schedule: every rank holds a policy side and a rollout side, and each step runs the
stages in order (the engine asleep while the policy trains):

    rollout side                      policy side                          run life
    ------------                      -----------                          --------
    rollout(step) -> RolloutBatch ->  learn -> StepResult
                                      publish -> EngineSink (own engine)
                                                                           log, end_step (signals, checkpoints)

``train(cfg)`` runs on every rank (SPMD) and wraps the steps with the run's life (megatron_rlvr.trainer.run_loop):
stop signals (checkpoint, documented exit code), periodic evaluation and checkpoints, the final checkpoint, HF
export and plot."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from megatron_rlvr.config import RunConfig
from megatron_rlvr.megatron.roles import Roles
from megatron_rlvr.models.source import resolve_on_node
from megatron_rlvr.rollout.groups import RolloutStopped
from megatron_rlvr.rundir.lock import RunLock
from megatron_rlvr.rundir.signals import StopSignals
from megatron_rlvr.trainer.diagnostics import forgetting_control, forgetting_probe
from megatron_rlvr.trainer.policy_side import PolicySide, build_policy_side
from megatron_rlvr.trainer.rollout_side import RolloutSide, build_rollout_side
from megatron_rlvr.trainer.run_life import RunLife, build_run_life, start_rank
from megatron_rlvr.trainer.run_loop import announce, end_step, finish, run_eval, warn_all_too_long
from megatron_rlvr.trainer.stages import learn, publish, rollout
from megatron_rlvr.trainer.weights import EngineSink, check_logprob_probe


@dataclass
class Colocated:
    """A colocated rank: both sides and the run's life, and the sink that is its own engine."""

    rollout: RolloutSide
    policy: PolicySide
    life: RunLife
    sink: EngineSink


def rl_step(t: Colocated, step: int) -> dict[str, float]:
    """One synchronous colocated RL step; returns the step's metrics (identical on every rank)."""
    t0 = time.perf_counter()
    probe, t.sink.probe_due = t.sink.probe_due, False  # this step samples with the weights of that sync
    rolled = rollout(t.rollout, step)
    control = forgetting_control(t.rollout, rolled, step)  # diagnostics: the probe's prompts, pre-update policy
    t.sink.sleep()  # GPU: the engine frees its memory while the policy trains
    result = learn(t.policy, rolled)
    m = dict(result.metrics)
    if probe:
        m.update(check_logprob_probe(m, t.policy.cfg.rollout.verify_logprobs_tol, t.rollout.policy_version))
    m.update(publish(t.policy, t.sink, step, changed=result.updated))
    t.rollout.policy_version = step  # the engine now holds the policy after this step (and its update, if any)
    if result.tokens:
        m.update(forgetting_probe(t.rollout, rolled, step, control))  # diagnostics: same prompts, updated policy
    m["time/step_s"] = time.perf_counter() - t0
    if result.tokens:
        m["perf/tokens_per_s"] = result.tokens / max(m["time/step_s"], 1e-9)
    return m


def setup(cfg: RunConfig, run_dir: str | None, lock: RunLock | None = None, roles: Roles | None = None) -> Colocated:
    """Build this rank's parts, resume from the newest checkpoint when there is one, and give the engine the
    policy's weights. ``lock``: the run directory's lock when this process already holds it. ``roles``: the layout
    with judge ranks (parallel.judge_ranks), whose pair groups reach the judge."""
    signals = StopSignals().install()
    d = start_rank(cfg)
    life = build_run_life(cfg, d, run_dir, lock, signals)
    policy = side = None
    try:
        source = resolve_on_node(cfg.model, d.local_rank, torch.distributed.barrier)
        policy = build_policy_side(cfg, d, source)
        links, judges = (roles.judge_links, roles.judge_global_ranks) if roles is not None else (None, None)
        side = build_rollout_side(cfg, source, d.rank, d.world_size, lambda: signals.code != 0, links, judges)
        side.policy_version = life.resume(policy.state, side.loader)
        sink = EngineSink(side.engine, side.adapter_sync, cfg.rollout.sleep_level, cfg.rollout.verify_sync)
        t = Colocated(side, policy, life, sink)
        publish(policy, t.sink, life.start_step)  # the engine starts from the (loaded) policy weights
    except BaseException:  # e.g. a refused resume: stop the engine and reward workers, free the run dir
        if side is not None:
            side.close()
        life.close()
        raise
    announce(life, policy, len(side.loader.examples), side.n_malformed)
    return t


def teardown(t: Colocated) -> None:
    t.life.close()
    t.rollout.close()


def train(cfg: RunConfig, run_dir: str | None = None, lock: RunLock | None = None, roles: Roles | None = None) -> int:
    """Run (or resume) training on this rank; returns the process exit code (0 done, else a signal's code).
    ``lock``: the run directory's lock when this process already holds it (a single-process run prepared it).
    ``roles``: the layout with judge ranks; after a clean end (the judge ranks told to stop by the rollout side's
    close) every rank meets at Roles.close."""
    code = train_steps(cfg, run_dir, lock, roles)
    if roles is not None:  # not reached after an exception: the launcher ends the job then
        roles.close(cfg.launch.collective_timeout_s)
    return code


def train_steps(cfg: RunConfig, run_dir: str | None, lock: RunLock | None, roles: Roles | None) -> int:
    """The steps of :func:`train` and their teardown."""
    t = setup(cfg, run_dir, lock, roles)
    life = t.life
    try:
        for step in range(life.start_step + 1, cfg.schedule.steps + 1):
            life.step = step
            data_state = t.rollout.loader.state_dict()
            try:
                metrics = rl_step(t, step)
            except RolloutStopped:  # a stop signal during generation or scoring: the step has not trained
                t.rollout.loader.load_state_dict(data_state)  # its prompts are drawn again on resume
                note = f" (step {step} was stopped during its rollout and runs again on resume)"
                return end_step(life, t.policy, t.rollout.loader, step - 1, note)
            warn_all_too_long(life, step, metrics)
            if life.evaluator.due(step):
                metrics.update(run_eval(life, t.rollout))
            life.logger.log(step, metrics)
            code = end_step(life, t.policy, t.rollout.loader, step)
            if code is not None:
                return code
        life.step = max(life.start_step, cfg.schedule.steps)
        if cfg.eval.at_end and life.evaluator.sets and not life.evaluator.due(life.step):
            life.logger.log(life.step, run_eval(life, t.rollout))
        finish(life, t.policy, t.rollout.loader)
        return 0
    finally:
        teardown(t)

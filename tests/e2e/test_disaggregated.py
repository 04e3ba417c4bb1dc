"""The disaggregated schedule (``parallel.rollout_ranks``): 1 training rank + 1 rollout rank of the tiny preset,
launched by ``megatron-rlvr train`` as a user runs it.

1. Layouts that do not divide are refused with the reason; staleness beyond k is dropped and counted.
2. k = 0 gives the colocated synchronous schedule's samples, loss and grad norm (same seeds, same threads).
3. k = 1 and k = 2: every trained sample is at most k updates old, most are k updates old, and the tiny preset learns.
4. SIGTERM at k = 1 saves the last trained step with the batches in flight; the resumed run repeats the
   uninterrupted run's metrics exactly and ends at its data position.
5. A SIGKILLed rollout rank ends the job with a non-zero code in under 60 s; a hung (SIGSTOPped) one once
   launch.collective_timeout_s has passed.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import process_helpers
import psutil
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = [
    "configs/tiny.yaml",
    "parallel.tp=1",
    "launch.threads_per_rank=1",
    "reward.num_workers=0",
    "checkpoint.export_hf=false",
    "checkpoint.save_every=0",
    "logging.plot_at_end=false",
    "logging.tensorboard=off",
]
DISAGG = ["parallel.rollout_ranks=1"]


def _cmd(*args):
    return [sys.executable, "-m", "megatron_rlvr.commands.cli", "train", *BASE, *args]


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _run(run_dir, *overrides, timeout=600):
    proc = subprocess.run(
        _cmd(f"logging.run_dir={run_dir}", *overrides),
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return _records(run_dir)


def _records(run_dir):
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return {r["step"]: r for r in map(json.loads, f)}


def _data_position(run_dir, step):
    with open(os.path.join(run_dir, "checkpoints", f"step_{step:09d}", "trainer_state.json")) as f:
        return json.load(f)["data"]


# ------------------------------------------------------------------------------------------------------- no ranks


def test_layouts_that_do_not_divide_are_refused_with_the_reason():
    from megatron_rlvr.config import ConfigError, check_layout, load_run_config

    cfg = load_run_config("configs/tiny.yaml", ["parallel.tp=1", *DISAGG])
    check_layout(cfg, 2)
    cases = [
        (["parallel.tp=2", *DISAGG], 2, r"tp x parallel.cp x parallel.pp = 2 does not divide the 1 training ranks"),
        (["parallel.tp=1", "parallel.rollout_ranks=2"], 2, r"leaves no training rank"),
        (["parallel.tp=1", "parallel.rollout_ranks=3", "rollout.engine=vllm", "parallel.rollout_tp=2"], 4, None),
        (["rollout.max_staleness=1"], 2, r"max_staleness=1 needs the disaggregated layout"),
        (["parallel.tp=1", *DISAGG, "diagnostics.forgetting_every=2"], 2, r"forgetting probe"),
    ]
    for overrides, world, pattern in cases:
        try:
            check_layout(load_run_config("configs/tiny.yaml", overrides), world)
        except ConfigError as e:
            assert pattern is None or __import__("re").search(pattern, str(e)), (overrides, e)
            if pattern is None:  # vllm missing here, or rollout_tp=2 not dividing 3 rollout ranks: both refuse
                assert "vLLM" in str(e) or "does not divide parallel.rollout_ranks=3" in str(e), e
        else:
            raise AssertionError(f"{overrides} at world {world} was accepted")
    with pytest.raises(ValueError, match=r"rollout_ranks must be an int >= 0"):
        load_run_config(None, ["parallel.rollout_ranks=-1"])


def test_staleness_filter_drops_and_counts_groups_older_than_k():
    from megatron_rlvr.data import Example
    from megatron_rlvr.rollout.groups import Group
    from megatron_rlvr.trainer.batch import RolloutBatch
    from megatron_rlvr.trainer.disaggregated import staleness_filter

    def group(version):
        return Group(Example(prompt="1=", answer="1", source="t", id="x"), [1], [[2], [3]], versions=[version, version])

    rolled = RolloutBatch(groups=[group(4), group(2), group(3)], kept=[0, 1, 2], rewards=None, policy_version=4)
    out, m = staleness_filter(rolled, step=6, k=1)  # the policy of step 6 is version 5: versions 4 and 5 admitted
    assert out.kept == [0] and m["async/dropped_samples"] == 4.0
    assert m["async/staleness_max"] == 1.0 and m["async/staleness_frac_1"] == 1.0
    out, m = staleness_filter(rolled, step=6, k=3)
    assert out.kept == [0, 1, 2] and m["async/dropped_samples"] == 0.0 and m["async/staleness_max"] == 3.0


# ---------------------------------------------------------------------------------------------------- end to end


def test_k0_gives_the_colocated_samples_loss_and_grad_norm(tmp_path):
    steps = ["schedule.steps=3"]
    colocated = _run(tmp_path / "colocated", "launch.nproc=1", *steps)
    disagg = _run(tmp_path / "k0", *DISAGG, "rollout.max_staleness=0", *steps)
    # the same with delta weight syncs: the rollout rank rebuilds each version from the previous one
    delta = _run(tmp_path / "delta", *DISAGG, "rollout.max_staleness=0", "rollout.weight_delta=true", *steps)
    assert sorted(colocated) == sorted(disagg) == sorted(delta) == [1, 2, 3]
    for s in colocated:
        for b in (disagg[s], delta[s]):
            a = colocated[s]
            for key in ("reward/mean", "response/length_mean", "loss/policy", "optim/grad_norm", "entropy/mean"):
                if key in a:
                    assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (s, key, a[key], b[key])
            assert b["async/staleness_max"] == 0.0 and b["async/dropped_samples"] == 0.0
            assert b["async/rollout_version"] == s - 1
        assert disagg[s]["sync/gbytes"] > 0 and disagg[s]["sync/gbps"] > 0 if s < 3 else True
        if s < 3:  # a sync after each update, as deltas: the bytes sent are the delta's share of the full sync's
            d = delta[s]
            assert d["sync/delta_resends"] == 0 and 0 <= d["sync/delta_changed_frac"] <= 1, d
            assert d["sync/gbytes"] == pytest.approx(d["sync/delta_bytes_over_full"] * disagg[s]["sync/gbytes"])
    # an update that changes the weights changes (nearly) every fp32 word at lr 1e-3 (step 1's zero-reward batch
    # may leave them all as they were: then its delta is empty)
    assert max(delta[s]["sync/delta_changed_frac"] for s in (1, 2)) > 0.9


def test_context_parallel_lora_training_ranks_match_the_colocated_run(tmp_path):
    """2 training ranks at CP = 2 with LoRA adapters + 1 rollout rank (k = 0) against the colocated CP = 1 LoRA run on
    one rank: the same samples, loss and grad norm (the CP split changes only the summation order), and the engine,
    fed the merged adapters from the CP ranks, scores the sampled tokens as the trainer does."""
    lora = ["model.lora.rank=8", "model.lora.alpha=16", "schedule.steps=2"]
    colocated = _run(tmp_path / "colocated", "launch.nproc=1", *lora)
    cp = _run(tmp_path / "cp2", *DISAGG, "parallel.cp=2", "launch.nproc=3", "rollout.max_staleness=0", *lora)
    assert sorted(colocated) == sorted(cp) == [1, 2]
    for s in colocated:
        a, b = colocated[s], cp[s]
        for key in ("reward/mean", "response/length_mean", "loss/total", "optim/grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (s, key, a[key], b[key])
        assert b["train/updates"] >= 1 and b["mismatch/abs_prob_diff_max"] < 1e-5, b


def test_steps_without_an_update_still_advance_the_version(tmp_path, monkeypatch):
    """Dynamic sampling with an all-wrong reward keeps no group: every step is skipped, and admission (which waits
    for each step's version) must not wait forever."""
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: trainer_helpers
    env = ["algorithm.preset=dapo", "reward.fn=trainer_helpers:zero_reward", "train.dynamic_sampling_max_rounds=1"]
    monkeypatch.setenv("PYTHONPATH", tests + os.pathsep + os.environ.get("PYTHONPATH", ""))
    recs = _run(tmp_path / "skipped", *DISAGG, "schedule.steps=3", *env, timeout=300)
    assert sorted(recs) == [1, 2, 3] and all(r["train/skipped"] == 1.0 for r in recs.values())


@pytest.mark.parametrize("k, seed", [(1, 1234), (2, 1234), (2, 4242)])
def test_k_trains_only_samples_within_k_updates_and_learns(tmp_path, k, seed):
    """k = 1 (one-step-off) and k = 2 (bounded async): no trained sample is more than k updates old, most steps
    train samples exactly k updates old (the rollout ranks run as far ahead as admission lets them), and the tiny
    preset still learns, k = 2 at two seeds (4242 is where an earlier k = 2 run peaked and fell back, with truncated
    answers and token ratios far above the clip; docs/results.md has the k = 0/2/4 sweep)."""
    args = (*DISAGG, f"rollout.max_staleness={k}", f"train.seed={seed}", "schedule.steps=60")
    recs = _run(tmp_path / f"k{k}", *args, timeout=900)
    assert sorted(recs) == list(range(1, 61))
    assert all(r["async/staleness_max"] <= k and r["async/dropped_samples"] == 0 for r in recs.values())
    for s, r in recs.items():  # the oldest trained sample's version is within k of the policy being trained
        assert s - 1 - k <= r["async/sample_version_min"] <= s - 1, (s, r["async/sample_version_min"])
        fracs = [r[f"async/staleness_frac_{j}"] for j in range(k + 1)]
        assert sum(fracs) == pytest.approx(1.0), (s, fracs)
        assert r["async/staleness_mean"] == pytest.approx(sum(j * f for j, f in enumerate(fracs)))
    assert sum(r[f"async/staleness_frac_{k}"] for r in recs.values()) > 30  # most steps are k behind
    for key in ("async/staleness_mean", "async/trainer_wait_s", "async/rollout_wait_s", "sync/time_s"):
        assert all(key in r for r in list(recs.values())[:-1]), key
    last = sum(recs[s]["reward/mean"] for s in range(56, 61)) / 5
    assert last >= 0.8, [round(recs[s]["reward/mean"], 2) for s in sorted(recs)]


@pytest.mark.parametrize("seed", [4242, 1])
def test_async_preset_at_k2_learns_as_the_synchronous_schedule(tmp_path, seed):
    """configs/tiny_async.yaml as shipped (k = 2, 64 prompts a step, cosine decay to half the rate): the mean reward of
    the last 5 of 80 steps is >= 0.95 at two seeds, one of them 4242 (where the tiny preset's k = 2 runs peaked and
    fell back). At the tiny preset's batch and constant rate k = 2 ended 0.988 at 4242 and 0.839-0.953 at three of
    five other seeds (docs/results.md); k = 0 with this recipe ends 0.989-0.996 at six seeds."""
    cmd = [
        sys.executable, "-m", "megatron_rlvr.commands.cli", "train", "configs/tiny_async.yaml", *BASE[1:],
        f"train.seed={seed}", f"logging.run_dir={tmp_path / 'run'}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    recs = _records(tmp_path / "run")
    assert sorted(recs) == list(range(1, 81))
    assert all(r["async/staleness_max"] <= 2 for r in recs.values())
    assert sum(r["async/staleness_frac_2"] for r in recs.values()) > 40  # most steps train samples 2 updates old
    first = sum(recs[s]["reward/mean"] for s in range(1, 6)) / 5
    last = sum(recs[s]["reward/mean"] for s in range(76, 81)) / 5
    print(f"\n[tiny_async seed {seed}] reward {first:.3f} (first 5 steps) -> {last:.3f} (last 5 steps)")
    assert first < 0.1 and last >= 0.95, [round(recs[s]["reward/mean"], 2) for s in sorted(recs)]


def test_partial_rollouts_at_k1_train_per_token_versions_within_k(tmp_path):
    """Partial rollouts end to end (chunks of 2 tokens): the oldest token of every trained sample is within k, the
    per-token staleness is logged and never above the per-sample (oldest-token) one."""
    steps = 6
    recs = _run(
        tmp_path / "partial",
        *DISAGG,
        "rollout.max_staleness=1",
        "rollout.partial_rollout_tokens=2",
        f"schedule.steps={steps}",
        timeout=300,
    )
    assert sorted(recs) == list(range(1, steps + 1))
    for r in recs.values():
        assert r["async/staleness_max"] <= 1 and r["async/dropped_samples"] == 0
        assert 0 <= r["async/token_staleness_mean"] <= r["async/staleness_mean"] + 1e-9
        assert 0 <= r["async/partial_samples"] <= r["rollout/kept_groups"] * 8


def _wait_for_step(run_dir, step, proc, timeout=300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if max(_records(run_dir) or [0]) >= step:
            return
        assert proc.poll() is None, f"the run exited with {proc.returncode}"
        time.sleep(0.2)
    raise AssertionError(f"no step {step} within {timeout} s")


VOLATILE = ("time/", "perf/", "wall_time", "reward/time_s", "sync/time_s", "sync/peak_buffer_gbytes")


def _volatile(key):
    """Timings and rates differ between any two runs; ``sync/verified`` marks each process's first weight sync
    (rollout.verify_sync=first), which a resumed run has too."""
    return key.startswith(VOLATILE) or key.endswith(("_s", "gbps")) or key == "sync/verified"


def test_sigterm_at_k1_saves_in_flight_batches_and_the_resumed_run_repeats_every_metric(tmp_path):
    """SIGTERM at k = 1 mid-run: the checkpoint of the last trained step also holds the batch generated (from the
    policy one update older) but not yet trained, and the resumed rollout rank continues the same admission
    schedule (step s rolls out with version s - 1 - k), so every non-volatile metric of every resumed step equals
    the uninterrupted run's, and both end at the same data position. Fails on the code that dropped in-flight
    batches at a stop and regenerated them with the resumed policy (rewards and losses differ from the first
    resumed step)."""
    k1 = [*DISAGG, "rollout.max_staleness=1", "schedule.steps=8", "checkpoint.save_at_end=true"]
    reference = tmp_path / "uninterrupted"
    ref = _run(reference, *k1)
    run = tmp_path / "stopped"
    with process_helpers.launched(
        _cmd(f"logging.run_dir={run}", *k1), cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    ) as proc:
        _wait_for_step(run, 3, proc)
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=120)[0].decode()
    assert proc.returncode == 0, out[-3000:]
    stopped_at = max(_records(run))
    assert stopped_at < 8 and f"checkpoint of step {stopped_at} saved" in out, out[-3000:]
    got = _run(run, *k1)
    assert sorted(got) == sorted(ref) == list(range(1, 9))
    assert _data_position(run, 8) == _data_position(reference, 8)
    for step in range(1, 9):
        a, b = ref[step], got[step]
        keys = {k for k in a if not _volatile(k)}
        assert keys == {k for k in b if not _volatile(k)}, (step, keys ^ {k for k in b if not _volatile(k)})
        diff = {k: (a[k], b[k]) for k in sorted(keys) if a[k] != b[k]}
        assert not diff, f"step {step} (stopped after step {stopped_at}) differs: {diff}"


def test_a_sigkilled_rollout_rank_ends_the_job_within_60_s(tmp_path):
    run = tmp_path / "killed"
    with process_helpers.launched(
        _cmd(f"logging.run_dir={run}", *DISAGG, "rollout.max_staleness=1", "schedule.steps=500"),
        cwd=REPO,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    ) as proc:
        _wait_for_step(run, 2, proc)
        ranks = [p for p in psutil.Process(proc.pid).children(recursive=True) if p.environ().get("RANK") == "1"]
        assert ranks, "no rollout rank process found"
        t0 = time.monotonic()
        ranks[0].send_signal(signal.SIGKILL)
        out = proc.communicate(timeout=90)[0].decode()
        assert time.monotonic() - t0 < 60
    assert proc.returncode != 0, out[-3000:]
    assert "rank 1" in out and "SIGKILL" in out, out[-3000:]


def test_a_hung_rollout_rank_ends_the_job_after_the_collective_timeout(tmp_path):
    """A rollout rank that is alive but stopped (SIGSTOP: its sockets stay open, so nothing closes) must not make the
    trainer wait forever: the data channel's receive times out after launch.collective_timeout_s (the groups between
    the roles are created with it), the trainer exits naming the lost channel and, from the heartbeats, the rank that
    stopped and its step (it said only that some collective waited too long), and the launcher kills the stopped
    rank."""
    timeout_s = 20  # it also bounds the start-up barriers between the roles: 10 s failed there on a loaded machine
    run = tmp_path / "hung"
    with process_helpers.launched(
        _cmd(
            f"logging.run_dir={run}",
            *DISAGG,
            "rollout.max_staleness=1",
            "schedule.steps=500",
            f"launch.collective_timeout_s={timeout_s}",
        ),
        cwd=REPO,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    ) as proc:
        _wait_for_step(run, 2, proc)
        ranks = [p for p in psutil.Process(proc.pid).children(recursive=True) if p.environ().get("RANK") == "1"]
        assert ranks, "no rollout rank process found"
        t0 = time.monotonic()
        ranks[0].send_signal(signal.SIGSTOP)
        try:
            out = proc.communicate(timeout=timeout_s + 90)[0].decode()
        finally:
            if ranks[0].is_running():
                ranks[0].send_signal(signal.SIGCONT)
        took = time.monotonic() - t0
        # the launcher killed the stopped rank (checked before leaving the block, which kills whatever is left)
        assert not ranks[0].is_running() or ranks[0].status() == psutil.STATUS_ZOMBIE
    assert timeout_s - 1 < took < timeout_s + 60, took  # not before the timeout (it was only stopped), not forever
    assert proc.returncode != 0, out[-3000:]
    # the documented data-channel message (it was replaced by the generic collective one), naming the stopped rank
    # and its step from the heartbeats
    channel = r"the (data channel from rollout rank 0|weight channel to the rollout ranks) failed \(.*Timed out"
    assert re.search(channel, out), out[-3000:]  # whichever wait the trainer was in
    assert re.search(r"; stopped: rank 1 \(rollout, pid \d+ on .*\) at step \d+, silent for \d+ s", out), out[-3000:]
    assert "rank 0 (pid" in out and "exited with code 1" in out, out[-3000:]  # the trainer noticed, not the launcher


def test_k1_defaults_to_decoupled_ppo_with_truncated_is_and_k0_keeps_the_colocated_loss():
    from megatron_rlvr.config import load_run_config
    from megatron_rlvr.trainer.policy_side import ASYNC_TIS_CAP, tis_cap

    def cap(*overrides):
        return tis_cap(load_run_config("configs/tiny.yaml", ["parallel.tp=1", *DISAGG, *overrides]).rollout)

    assert cap("rollout.max_staleness=0") is None
    assert cap("rollout.max_staleness=1") == ASYNC_TIS_CAP
    assert cap("rollout.max_staleness=2", "rollout.tis_cap=5.0") == 5.0  # a configured cap wins
    assert cap("rollout.max_staleness=1", "rollout.old_logprobs=rollout") is None


def test_distillation_teacher_on_pipeline_parallel_training_ranks_matches_the_colocated_run(tmp_path):
    """On-policy distillation in the disaggregated layout: 2 training ranks at PP = 2, each holding its stage of the
        frozen teacher (sampled estimator: the teacher's log-probs from its own pipelined forward), + 1 rollout rank
        (k = 0), against the colocated run on one rank: the same samples and, at both steps, the same distillation
        metrics, loss and grad norm; the teacher (another random init) differs from the student (the sampled KL estimate
    is not 0)."""
    small = ["train.prompts_per_step=4", "rollout.n=4", "train.mini_batch_prompts=null", "schedule.steps=2"]
    teacher = ["algorithm.distill.teacher=tiny", "algorithm.distill.teacher_seed=7", *small]
    colocated = _run(tmp_path / "colocated", "launch.nproc=1", *teacher)
    pp = _run(tmp_path / "pp2", *DISAGG, "parallel.pp=2", "launch.nproc=3", "rollout.max_staleness=0", *teacher)
    assert sorted(colocated) == sorted(pp) == [1, 2]
    keys = ("reward/mean", "response/length_mean", "distill/kl_per_token", "distill/teacher_logprob_mean")
    for s in colocated:
        a, b = colocated[s], pp[s]
        assert abs(a["distill/kl_per_token"]) > 1e-4, a  # the sampled estimate: may be < 0 on a small batch
        for key in (*keys, "loss/distill", "loss/total", "optim/grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (s, key, a[key], b[key])

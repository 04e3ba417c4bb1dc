"""Fault-injection matrix (listed in docs/training.md, "Failure handling"): each test injects one fault
and checks the documented outcome. Unit-level cases run in this process or in small subprocesses; the trainer-level
ones share one call of the 4-rank pool (``test_trainer_level_faults``)."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace

import process_helpers
import pytest
import trainer_helpers

from megatron_rlvr.rundir import lock as run_lock
from megatron_rlvr.rundir.lock import RunDirLocked, acquire, holder_is_stale

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: trainer_helpers
REPO = os.path.dirname(TESTS_DIR)
PY_ENV = dict(
    os.environ, PYTHONPATH=REPO + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
)


# ----------------------------------------------------------------------------------------------- run-directory lock


def _start_holder(run_dir):
    code = (
        "import sys, time; from megatron_rlvr.rundir.lock import acquire; lock = acquire(sys.argv[1]); "
        "print('locked', flush=True); time.sleep(600)"
    )
    p = subprocess.Popen([sys.executable, "-c", code, str(run_dir)], stdout=subprocess.PIPE, text=True, env=PY_ENV)
    assert p.stdout.readline().strip() == "locked"
    return p


def test_second_run_is_refused_with_the_holders_pid_and_host_and_a_dead_holder_is_taken_over(tmp_path, capsys):
    """Item 1: a live run's directory is refused (pid + host in the message, also through `train`); once the holder
    is SIGKILLed the lock is taken over, naming the dead holder."""
    from megatron_rlvr.commands.cli import main

    run = tmp_path / "run"
    holder = _start_holder(run)
    try:
        with pytest.raises(RunDirLocked) as e:
            acquire(str(run))
        assert f"pid {holder.pid} on host {socket.gethostname()}" in str(e.value)
        assert main(["train", f"logging.run_dir={run}", "--dry-run"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "is in use by another run" in err[0] and f"pid {holder.pid}" in err[0]
        assert not (run / "config.yaml").exists()  # refused before anything was written
    finally:
        holder.kill()
        holder.wait()
    lock = acquire(str(run))
    try:
        assert f"pid {holder.pid}" in lock.takeover_note() and "gone" in lock.takeover_note()
    finally:
        lock.release()


def test_ranks_keep_the_launchers_lock_after_the_launcher_dies(tmp_path):
    """The local launcher passes its locked descriptor to the ranks: with the launcher gone (its descriptor closed)
    a rank still holds the lock, and recognises it as its own (``inherited``)."""
    run = tmp_path / "run"
    lock = acquire(str(run))
    code = (
        "import os, sys, time; from megatron_rlvr.rundir.lock import inherited; "
        "print(inherited(sys.argv[1]), flush=True); time.sleep(600)"
    )
    env = dict(PY_ENV, **{run_lock.FD_ENV: str(lock.fd)})
    os.set_inheritable(lock.fd, True)
    rank = subprocess.Popen(
        [sys.executable, "-c", code, str(run)], stdout=subprocess.PIPE, text=True, env=env, pass_fds=(lock.fd,)
    )
    try:
        assert rank.stdout.readline().strip() == "True"
        os.close(lock.fd)  # the launcher is gone; the rank's inherited descriptor still holds the flock
        lock.fd = -1
        with pytest.raises(RunDirLocked):
            acquire(str(run))
    finally:
        rank.kill()
        rank.wait()
    acquire(str(run)).release()


def test_a_lock_that_cannot_be_written_is_refused_on_every_rank(tmp_path, monkeypatch):
    """A full disk or quota while writing the holder record is a clear RunDirLocked naming the lock file (raised by
    rank 0 alone as a bare OSError, the other ranks of an srun job would wait in the broadcast forever), and the
    lock is not left held."""
    run = tmp_path / "run"

    def full(fd, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(run_lock.os, "write", full)
    with pytest.raises(RunDirLocked, match=r"\.rlvr-lock: No space left on device"):
        acquire(str(run))
    sent = []
    with pytest.raises(RunDirLocked, match="No space left on device"):
        run_lock.hold_collective(str(run), 0, lambda obj: sent.append(obj) or obj)
    assert sent and "No space left" in sent[0]  # the error went through the broadcast
    monkeypatch.undo()
    acquire(str(run)).release()  # nothing left holding it


def test_stale_rules_without_flock_including_slurm_requeue():
    """File systems without flock: a dead pid on this host is stale, a live one is not; another host is stale only
    when it is an earlier attempt of the same Slurm job (a requeue runs after the old allocation ended)."""
    me = {"host": socket.gethostname(), "slurm_job_id": "77", "slurm_restart_count": 1}
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert holder_is_stale({"host": me["host"], "pid": dead.pid}, me)
    assert not holder_is_stale({"host": me["host"], "pid": os.getpid()}, me)
    assert not holder_is_stale({"host": "elsewhere", "pid": 1}, me)
    assert holder_is_stale({"host": "elsewhere", "pid": 1, "slurm_job_id": "77", "slurm_restart_count": 0}, me)
    assert not holder_is_stale({"host": "elsewhere", "pid": 1, "slurm_job_id": "77", "slurm_restart_count": 1}, me)
    assert not holder_is_stale({"host": "elsewhere", "pid": 1, "slurm_job_id": "78", "slurm_restart_count": 0}, me)


# ----------------------------------------------------------------------------------------------- resume semantics


def _fake_checkpoint(run_dir, step, files=None):
    """A complete-looking step folder (what list_checkpoints accepts), with a size manifest of ``files``."""
    from megatron_rlvr.models.checkpointing import write_manifest

    d = os.path.join(run_dir, "checkpoints", f"step_{step:09d}")
    os.makedirs(d, exist_ok=True)
    for name, data in (files or {"__0_0.distcp": b"x" * 100}).items():
        with open(os.path.join(d, name), "wb") as f:
            f.write(data)
    with open(os.path.join(d, "trainer_state.json"), "w") as f:
        json.dump({"step": step}, f)
    with open(os.path.join(d, "rlvr_meta.json"), "w") as f:
        json.dump({"step": step}, f)
    write_manifest(d)
    return d


def _prepare(config, overrides):
    """``train CONFIG_OR_RUN_DIR overrides`` up to the ranks' start (the run directory prepared and unlocked)."""
    from megatron_rlvr.commands.train_cli import prepare_run, split_config_and_overrides

    if config is not None:
        config, overrides = split_config_and_overrides([config, *overrides])
    run = prepare_run(config, overrides)
    run.lock.release()
    return run.cfg, run.config_path


def test_one_off_resume_path_is_not_persisted(tmp_path):
    """Item 2: checkpoint.resume=PATH acts once; config.yaml keeps 'auto' (a later plain resume continues from the
    newest checkpoint, not from PATH), and the ranks get the one-off on their command line."""
    from megatron_rlvr.commands.train_cli import one_off_overrides

    run = tmp_path / "run"
    old = _fake_checkpoint(str(run), 3)
    cfg, path = _prepare(None, [f"logging.run_dir={run}", f"checkpoint.resume={old}"])
    assert cfg.checkpoint.resume == old
    with open(path) as f:
        text = f.read()
    assert "resume: auto" in text and old not in text
    assert one_off_overrides(cfg) == [f"checkpoint.resume={old}"]


def test_changed_options_on_resume_are_applied_or_refused(tmp_path, capsys):
    """Item 3: on a run dir with checkpoints, algorithm.preset=dapo is refused loudly (naming the option and both
    values), applied with checkpoint.allow_changes=true; schedule.steps is applied and listed."""
    from megatron_rlvr.rundir.resume import ResumeError

    run = tmp_path / "run"
    _, path = _prepare(None, [f"logging.run_dir={run}"])
    _fake_checkpoint(str(run), 10)
    with pytest.raises(ResumeError, match=r"algorithm\.name: 'mcpo' -> 'dapo'.*checkpoint\.allow_changes=true"):
        _prepare(path, ["algorithm.preset=dapo"])
    _prepare(path, ["schedule.steps=99"])
    assert "resuming with a changed option: schedule.steps: 80 -> 99" in capsys.readouterr().out
    cfg, started = _prepare(path, ["algorithm.preset=dapo", "checkpoint.allow_changes=true"])
    assert cfg.algorithm.name == "dapo"
    with open(started) as f:  # the resume's config (config.yaml once its checkpoint has loaded)
        text = f.read()
    assert "name: dapo" in text and "allow_changes: false" in text  # applied, and the one-off not persisted


def test_a_resume_writes_config_yaml_only_once_its_checkpoint_has_loaded(tmp_path, capsys):
    """A resume's options go into the run's config.yaml only when its checkpoint has loaded. They used to be written
    before: after a resume that failed (here a checkpoint that does not load, at world size 1 through the CLI),
    config.yaml held schedule.steps=77, a plain re-run trained with it and listed no change. Now the failed resume
    leaves the run directory exactly as it was (no config change, no pending file, no TensorBoard folder), and the
    pending config becomes config.yaml on a successful load (``commit_pending_config``)."""
    from megatron_rlvr.commands.cli import main

    run = tmp_path / "run"
    _, path = _prepare(None, [f"logging.run_dir={run}", "launch.nproc=1", "parallel.tp=1", "reward.num_workers=0"])
    _fake_checkpoint(str(run), 5)  # complete-looking, but not a loadable checkpoint
    before = {p: (run / p).read_bytes() for p in ("config.yaml",)}
    listing = sorted(os.listdir(run))
    assert main(["train", str(run), "schedule.steps=77"]) == 2
    err = capsys.readouterr().err
    assert "no checkpoint of" in err and "step_000000005" in err and len(err.strip().splitlines()) == 1, err
    assert {p: (run / p).read_bytes() for p in before} == before, "a failed resume changed config.yaml"
    assert sorted(os.listdir(run)) == listing
    # the launcher's part: the ranks start on the pending config; the checkpointer makes it the run's config
    from megatron_rlvr.rundir.checkpointer import PENDING_CONFIG, commit_pending_config

    _, started = _prepare(str(run), ["schedule.steps=77"])
    assert os.path.basename(started) == PENDING_CONFIG and "steps: 77" in open(started).read()
    assert (run / "config.yaml").read_bytes() == before["config.yaml"]
    commit_pending_config(str(run))
    assert "steps: 77" in (run / "config.yaml").read_text() and not os.path.exists(started)


def _lora_meta_checkpoint(run_dir, step, lora):
    d = _fake_checkpoint(run_dir, step)
    with open(os.path.join(d, "rlvr_meta.json"), "w") as f:
        json.dump({"step": step, **({"lora": lora} if lora else {})}, f)
    return d


def test_lora_settings_are_compared_with_the_checkpoint_and_a_rank_change_is_refused(tmp_path, capsys):
    """The adapters' rank and targets are their tensors' shapes: a resume that changes them is refused in one line
    naming both values, even with checkpoint.allow_changes=true (it ended in a raw CheckpointingException ``Global
    shape mismatch ... lora_A`` after the ranks had started). The other adapter settings are compared with the
    checkpoint's metadata, not only with config.yaml: a config.yaml that says alpha 64 while the checkpoint was
    saved with alpha 8 (left by a failed resume of an earlier version) no longer hides the change."""
    import yaml

    from megatron_rlvr.rundir.resume import ResumeError

    run = tmp_path / "run"
    lora = ["model.lora.rank=4", "model.lora.alpha=8", "model.lora.targets=[qkv,proj]"]
    _, path = _prepare(None, [f"logging.run_dir={run}", *lora])
    saved = yaml.safe_load(open(path))["model"]["lora"]
    ckpt = _lora_meta_checkpoint(str(run), 5, saved)
    before = (run / "config.yaml").read_bytes()
    with pytest.raises(ResumeError) as e:
        _prepare(str(run), ["model.lora.rank=8", "model.lora.alpha=64", "checkpoint.allow_changes=true"])
    msg = str(e.value)
    assert f"model.lora.rank=8 does not fit checkpoint {ckpt}" in msg and "model.lora.rank=4" in msg, msg
    assert "allow_changes" in msg and "\n" not in msg
    with pytest.raises(ResumeError, match=r"model\.lora\.targets=\[qkv\] does not fit .*targets=\[qkv,proj\]"):
        _prepare(str(run), ["model.lora.targets=[qkv]", "checkpoint.allow_changes=true"])
    assert (run / "config.yaml").read_bytes() == before and sorted(os.listdir(run)) == [
        ".rlvr-lock",
        "checkpoints",
        "config.yaml",
    ]
    # a config.yaml that no longer says what the checkpoint was saved with
    stale = yaml.safe_load(before)
    stale["model"]["lora"]["alpha"] = 64.0
    (run / "config.yaml").write_text(yaml.safe_dump(stale, sort_keys=False))
    with pytest.raises(ResumeError, match=rf"from checkpoint {ckpt}.*model\.lora\.alpha: 8\.0 -> 64\.0"):
        _prepare(str(run), [])
    capsys.readouterr()
    _prepare(str(run), ["checkpoint.allow_changes=true"])
    assert "resuming with a changed option: model.lora.alpha: 8.0 -> 64.0" in capsys.readouterr().out
    # adapters cannot be added to or dropped from a run on resume
    with pytest.raises(ResumeError, match=r"holds LoRA adapters .* this run has no model\.lora"):
        _prepare(str(run), ["model.lora=null", "checkpoint.allow_changes=true"])
    full = tmp_path / "full"
    _prepare(None, [f"logging.run_dir={full}"])
    _lora_meta_checkpoint(str(full), 5, None)
    with pytest.raises(ResumeError, match=r"holds full weights, not LoRA adapters"):
        _prepare(str(full), [*lora, "checkpoint.allow_changes=true"])


def _cli(*args):
    """``megatron-rlvr ARGS`` in a subprocess (a launcher keeps its run directory locked until it exits)."""
    return subprocess.run(
        [sys.executable, "-m", "megatron_rlvr.commands.cli", *args], env=PY_ENV, capture_output=True, text=True
    )


@pytest.mark.slow
def test_an_moe_run_saved_at_ep2_resumes_at_ep1(tmp_path):
    """``train configs/tiny_moe.yaml`` at EP=2, then ``train RUN parallel.ep=1``: the checkpoint reshards (it ended in
    158 lines of per-rank ``KeyError: optimizer.state.exp_avg... not in state dict: ['chained_0.optimizer...``
    tracebacks, the CheckpointException escaping the CLI's handler); the run continues from its checkpoint and its
    config.yaml records the new layout once the checkpoint has loaded."""
    run = tmp_path / "moe"
    cfg = os.path.join(REPO, "configs", "tiny_moe.yaml")
    quiet = ["reward.num_workers=0", "logging.plot_at_end=false", "checkpoint.export_hf=false"]
    first = _cli("train", cfg, f"logging.run_dir={run}", "schedule.steps=4", "checkpoint.save_every=2", *quiet)
    assert first.returncode == 0, first.stderr[-2000:]
    resumed = _cli("train", str(run), "parallel.ep=1", "schedule.steps=6")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "parallel.ep: 2 -> 1" in resumed.stdout and "resumed from step 4" in resumed.stdout
    assert [r["step"] for r in trainer_helpers.records(run)] == [1, 2, 3, 4, 5, 6]
    text = (run / "config.yaml").read_text()
    assert "  ep: 1\n" in text and "  steps: 6\n" in text and not (run / ".config.pending.yaml").exists()


@pytest.mark.slow
def test_a_lora_run_resumed_with_another_rank_is_refused_and_left_unchanged(tmp_path):
    """A real LoRA run (rank 4, alpha 8), resumed with ``model.lora.rank=8 model.lora.alpha=64
    checkpoint.allow_changes=true``: one line naming both ranks and rc 2 before any rank starts (it ended in a raw
    ``CheckpointingException: Global shape mismatch ... lora_A``, and config.yaml kept rank 8 and alpha 64, so the
    partial repair ``model.lora.rank=4`` then trained at alpha 64). config.yaml is unchanged, and the repair that
    only fixes the rank is a plain resume."""
    run = tmp_path / "lora"
    lora = ["model.lora.rank=4", "model.lora.alpha=8", "launch.nproc=1", "parallel.tp=1"]
    first = _cli("train", f"logging.run_dir={run}", *lora, *trainer_helpers.SMALL, "checkpoint.save_at_end=true")
    assert first.returncode == 0, first.stderr[-2000:]
    before = (run / "config.yaml").read_bytes()
    bad = _cli("train", str(run), "model.lora.rank=8", "model.lora.alpha=64", "checkpoint.allow_changes=true")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr[-2000:]
    assert "model.lora.rank=8 does not fit checkpoint" in bad.stderr and "model.lora.rank=4" in bad.stderr
    assert (run / "config.yaml").read_bytes() == before
    fixed = _cli("train", str(run), "model.lora.rank=4", "schedule.steps=3")
    assert fixed.returncode == 0, fixed.stderr[-2000:]
    assert [r["step"] for r in trainer_helpers.records(run)] == [1, 2, 3]
    assert "alpha: 8.0" in (run / "config.yaml").read_text()


def test_a_changed_reward_function_on_resume_is_refused(tmp_path):
    """The reward function (and how answers are extracted) defines the run: changing it on resume is refused like an
    algorithm change, while the reward workers' resources are applied."""
    from megatron_rlvr.rundir.resume import ResumeError

    run = tmp_path / "run"
    _prepare(None, [f"logging.run_dir={run}"])
    _fake_checkpoint(str(run), 10)
    with pytest.raises(ResumeError, match=r"reward\.fn: 'exact_stop' -> 'math'"):
        _prepare(str(run), ["reward.fn=math"])
    with pytest.raises(ResumeError, match=r"reward\.extraction: 'full' -> 'boxed'"):
        _prepare(str(run), ["reward.extraction=boxed"])
    cfg, _ = _prepare(str(run), ["reward.timeout_s=5", "reward.num_workers=2"])
    assert cfg.reward.timeout_s == 5 and cfg.reward.num_workers == 2


def test_resume_of_a_run_dir_written_before_an_option_existed(tmp_path, capsys):
    """A config.yaml written by an older version lacks the options added since. A plain resume must not be refused
    for them when they hold their defaults (nothing was changed); a non-default value is still a refused change."""
    import yaml

    from megatron_rlvr.rundir.resume import ResumeError

    run = tmp_path / "run"
    _, path = _prepare(None, [f"logging.run_dir={run}"])
    _fake_checkpoint(str(run), 10)
    with open(path) as f:
        old = yaml.safe_load(f)
    assert old["train"].pop("old_logprobs_from_update") is True and old["reward"].pop("max_error_frac") == 0.5
    with open(path, "w") as f:
        yaml.safe_dump(old, f, sort_keys=False)
    with pytest.raises(ResumeError, match=r"train\.old_logprobs_from_update: '<unset>' -> False"):
        _prepare(None, [f"logging.run_dir={run}", "train.old_logprobs_from_update=false"])
    with open(path, "w") as f:
        yaml.safe_dump(old, f, sort_keys=False)
    _prepare(None, [f"logging.run_dir={run}"])
    assert "train.old_logprobs_from_update: '<unset>' -> True" in capsys.readouterr().out


def test_a_run_is_resumed_where_its_config_is_not_where_it_was_started(tmp_path, monkeypatch, capsys):
    """A copied, moved or relatively-named run directory resumes in place: the logging.run_dir recorded in its
    config.yaml used to win, so training a copy wrote into (and pruned the checkpoints of) the original, and a moved
    run started over at its old path. ``logging.run_dir=`` on the command line still wins."""
    import shutil

    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    _prepare(None, [f"logging.run_dir={a}"])
    _fake_checkpoint(str(a), 5)
    shutil.copytree(a, b)
    before = (a / "config.yaml").read_text()
    cfg, path = _prepare(str(b), ["algorithm.preset=dapo", "checkpoint.allow_changes=true"])
    assert os.path.dirname(path) == str(b) and cfg.logging.run_dir == str(b)
    assert (a / "config.yaml").read_text() == before and "name: dapo" in open(path).read()
    shutil.move(str(a), str(c))
    cfg, path = _prepare(str(c / "config.yaml"), [])
    assert cfg.logging.run_dir == str(c) and not a.exists()
    assert f"logging.run_dir: '{a}' -> '{c}'" in capsys.readouterr().out  # resumed (changes compared), in place
    monkeypatch.chdir(tmp_path)
    _prepare(None, ["logging.run_dir=rel"])
    _fake_checkpoint("rel", 5)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    cfg, _ = _prepare("../rel", [])
    assert cfg.logging.run_dir == "../rel" and not (tmp_path / "elsewhere" / "rel").exists()
    cfg, _ = _prepare("../rel", [f"logging.run_dir={tmp_path / 'new'}"])
    assert cfg.logging.run_dir == str(tmp_path / "new")


def test_starting_over_sets_the_previous_run_aside(tmp_path, capsys):
    """checkpoint.resume=never on a run directory that holds a run: its checkpoints, metrics and config are moved
    into a previous-run-* folder (they used to stay mixed with the new run's: metrics.jsonl truncated, the old newer
    checkpoints resumed by the next plain resume, the new ones pruned by keep-last). A plain resume after that
    continues the new run."""
    from megatron_rlvr.models.checkpointing import list_checkpoints

    run = tmp_path / "run"
    _prepare(None, [f"logging.run_dir={run}"])
    _fake_checkpoint(str(run), 18)
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": i}) + "\n" for i in range(1, 19)))
    _prepare(str(run), ["checkpoint.resume=never", "train.seed=7"])  # a new run: nothing compared, nothing refused
    out = capsys.readouterr().out
    aside = [p for p in os.listdir(run) if p.startswith("previous-run-")]
    assert len(aside) == 1 and f"moved to {run / aside[0]}" in out
    old = run / aside[0]
    assert len((old / "metrics.jsonl").read_text().splitlines()) == 18
    assert "seed: 1234" in (old / "config.yaml").read_text()
    assert [s for s, _ in list_checkpoints(str(old / "checkpoints"))] == [18]
    assert not (run / "checkpoints").exists() and not (run / "metrics.jsonl").exists()
    assert "seed: 7" in (run / "config.yaml").read_text()
    _prepare(str(run), ["checkpoint.resume=never"])  # nothing of a run there yet: nothing set aside
    assert len([p for p in os.listdir(run) if p.startswith("previous-run-")]) == 1


def test_a_dry_run_on_an_existing_run_changes_nothing(tmp_path, capsys):
    """`train RUN_DIR k=v checkpoint.allow_changes=true --dry-run` wrote the change into config.yaml (so the next
    resume listed no change and ran with it); it now only checks and lists. `--dry-run` may stand anywhere."""
    from megatron_rlvr.commands.cli import main

    run = tmp_path / "run"
    _prepare(None, [f"logging.run_dir={run}"])
    _fake_checkpoint(str(run), 5)
    (run / "metrics.jsonl").write_text('{"step": 5}\n')
    before = {p: (run / p).read_bytes() for p in ("config.yaml", "metrics.jsonl")}
    assert main(["train", str(run), "--dry-run", "rollout.n=4", "checkpoint.allow_changes=true"]) == 0
    assert main(["train", str(run), "--dry-run", "checkpoint.resume=never"]) == 0
    out = capsys.readouterr().out
    assert "rollout.n: 8 -> 4" in out and "config.yaml left unchanged" in out
    assert {p: (run / p).read_bytes() for p in before} == before and (run / "checkpoints").is_dir()
    assert sorted(os.listdir(run)) == sorted([".rlvr-lock", "checkpoints", "config.yaml", "metrics.jsonl"])


def test_an_unreadable_config_yaml_on_resume_is_refused_on_every_rank(tmp_path):
    """Under torchrun / srun rank 0 reads the run's config.yaml: a YAML error there must reach every rank as a
    ResumeError naming the file (raised on rank 0 alone, the others would wait in the broadcast forever)."""
    from megatron_rlvr.config import load_run_config
    from megatron_rlvr.rundir.checkpointer import ResumeError
    from megatron_rlvr.rundir.prepare import prepare_run_dir_on_ranks

    run = tmp_path / "run"
    _fake_checkpoint(str(run), 3)
    (run / "config.yaml").write_text("train: [unclosed\n")
    cfg = load_run_config(None, [f"logging.run_dir={run}"])
    sent = []
    with pytest.raises(ResumeError, match=r"config\.yaml: .*Error"):
        prepare_run_dir_on_ranks(cfg, str(run), 0, lambda obj: sent.append(obj) or obj)
    assert isinstance(sent[-1], ResumeError)
    acquire(str(run)).release()  # the lock was released


def test_preset_override_on_a_resolved_config_takes_effect(tmp_path):
    """Item 3: algorithm.preset=X on a resolved config (expanded fields, no preset key) used to keep the old
    algorithm; now it is the new preset, refined by algorithm.* overrides given with it (in any order)."""
    from megatron_rlvr.algorithms import preset
    from megatron_rlvr.config import dump_yaml, load_run_config

    path = str(tmp_path / "resolved.yaml")
    dump_yaml(load_run_config(None, []), path)
    assert load_run_config(path, ["algorithm.preset=dapo"]).algorithm == preset("dapo")
    cfg = load_run_config(path, ["algorithm.policy_loss.eps_high=0.3", "algorithm.preset=dapo"])
    assert cfg.algorithm.name == "dapo" and cfg.algorithm.policy_loss.eps_high == 0.3


def test_corrupt_newest_checkpoint_is_named_and_the_previous_one_used(tmp_path):
    """Item 4: a truncated shard in the newest checkpoint is reported by path, the previous complete one is chosen;
    with fallback off the error names the folder and both ways out."""
    from megatron_rlvr.rundir.checkpointer import ResumeError, candidates, choose_checkpoint

    run = str(tmp_path / "run")
    _fake_checkpoint(run, 1)
    newest = _fake_checkpoint(run, 2)
    shard = os.path.join(newest, "__0_0.distcp")
    with open(shard, "r+b") as f:
        f.truncate(10)
    warnings = []
    path, skipped = choose_checkpoint(candidates(os.path.join(run, "checkpoints")), True, warn=warnings.append)
    assert path.endswith("step_000000001") and skipped == [newest]
    assert len(warnings) == 1 and shard in warnings[0] and "10 bytes, 100 when saved" in warnings[0]
    with pytest.raises(ResumeError, match=r"step_000000002 is corrupt.*checkpoint\.fallback=true"):
        choose_checkpoint(candidates(os.path.join(run, "checkpoints")), False)


def test_after_a_fallback_the_damaged_step_is_saved_again(tmp_path, monkeypatch):
    """Resumed from step 1 because step 2 is damaged: training step 2 again must replace the damaged folder (save
    used to return early because step_2 was "already the newest checkpoint", so a SIGTERM at step 2 claimed a save
    that never happened and every later resume fell back to step 1). Re-saving the step that was resumed from stays
    a no-op."""
    from megatron_rlvr.models import checkpointing
    from megatron_rlvr.rundir import checkpointer as ckpt

    run = str(tmp_path / "run")
    _fake_checkpoint(run, 1)
    newest = _fake_checkpoint(run, 2)
    with open(os.path.join(newest, "__0_0.distcp"), "r+b") as f:
        f.truncate(10)
    saved = []

    def fake_save(cfg, step, **kw):
        saved.append(step)
        return _fake_checkpoint(run, step)

    monkeypatch.setattr(checkpointing, "save_checkpoint", fake_save)
    section = SimpleNamespace(keep_last=0, sharding_type="fully_reshardable", save_every=0)
    saver = ckpt.Checkpointer(run, section, pg=None, rank=0, algorithm="grpo", last_step=10, resumed_from=1)
    policy = ckpt.PolicyState(model=None, optimizer=None, scheduler=None, args=None)
    loader = SimpleNamespace(state_dict=lambda: {})
    assert saver.save(2, policy, loader) == newest and saved == [2]
    with open(os.path.join(newest, "__0_0.distcp"), "rb") as f:
        assert len(f.read()) == 100  # the damaged shard was replaced
    saver.resumed_from = 2  # a run resumed from its final checkpoint saves at the end: nothing to write
    assert saver.save(2, policy, loader) == newest and saved == [2]


def test_a_full_disk_during_a_save_is_one_line_naming_enospc_and_the_path(tmp_path, monkeypatch, capsys):
    """A full disk while saving: torch's CheckpointException (a BaseException, so it passed `except Exception` and
    printed every rank's traceback) or a short write without errno (``unexpected pos``) becomes one line naming
    ENOSPC, the step folder and the intact previous checkpoint; the partial ``.tmp-step_N`` folder is removed."""
    import errno

    from torch.distributed.checkpoint.api import CheckpointException

    from megatron_rlvr.commands import cli
    from megatron_rlvr.models import checkpointing
    from megatron_rlvr.rundir import checkpointer as ckpt

    run = str(tmp_path / "run")
    previous = _fake_checkpoint(run, 5)
    tmp = os.path.join(run, "checkpoints", ".tmp-step_000000010")
    failure = [CheckpointException("save failed", {1: (OSError(errno.ENOSPC, "No space left on device"), None)})]

    def full_disk(cfg, step, **kw):
        os.makedirs(tmp, exist_ok=True)
        raise failure[0]

    monkeypatch.setattr(checkpointing, "save_checkpoint", full_disk)
    section = SimpleNamespace(keep_last=2, sharding_type="fully_reshardable", save_every=5)
    saver = ckpt.Checkpointer(run, section, pg=None, rank=0, algorithm="grpo", last_step=20)
    policy = ckpt.PolicyState(model=None, optimizer=None, scheduler=None, args=None)
    loader = SimpleNamespace(state_dict=lambda: {})
    with pytest.raises(ckpt.CheckpointSaveError) as e:
        saver.save(10, policy, loader)
    msg = str(e.value)
    assert "No space left on device [ENOSPC]" in msg and "step_000000010" in msg and previous in msg
    assert not os.path.exists(tmp) and len(msg.splitlines()) == 1
    cli._report("train", e.value)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "ENOSPC" in err[0] and "Traceback (most recent call last)" not in err[0]
    kept = re.search(r"\(traceback in (\S+)\)$", err[0])  # the details go to a file, as for an internal error
    assert kept and "CheckpointException" in open(kept.group(1)).read(), err
    os.remove(kept.group(1))
    # torch's zip writer loses the errno of a short write: a nearly full file system is named as the cause
    failure[0] = RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 704 vs 598")
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda p: SimpleNamespace(free=1 << 20))
    with pytest.raises(ckpt.CheckpointSaveError, match=r"No space left on device \[ENOSPC\].*unexpected pos"):
        saver.save(10, policy, loader)
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda p: SimpleNamespace(free=100 << 30))
    with pytest.raises(ckpt.CheckpointSaveError) as e:
        saver.save(10, policy, loader)
    assert "ENOSPC" not in str(e.value) and "RuntimeError: [enforce fail" in str(e.value)


def test_a_full_disk_outside_a_checkpoint_save_is_a_user_error(monkeypatch, capsys):
    """A conversion (or any command) that meets a full disk is the user's to fix: one line with the cause and what to
    do, exit 2. It took the unexpected-error path (rc 1 and a traceback file), also when the OSError was the cause
    of another exception."""
    import errno

    from megatron_rlvr.commands import cli, convert_cli

    def full(argv):
        try:
            raise OSError(errno.ENOSPC, "No space left on device", "/out/model-00001-of-00002.safetensors")
        except OSError as e:
            raise RuntimeError("shard write failed") from e

    monkeypatch.setattr(convert_cli, "convert_main", full)
    assert cli.main(["convert", "to-hf", "--ckpt", "x", "--out", "y"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "shard write failed" in err[0] and "No space left on device" in err[0], err
    assert "model-00001-of-00002.safetensors" in err[0] and "free space" in err[0], err
    assert "traceback" not in err[0]


# ----------------------------------------------------------------------------------------------- reward failures


def raising_reward(response: str, ground_truth: str, **metadata) -> float:
    if response == "raise":
        raise RuntimeError("raising_reward: bad response")
    if response == "hang":
        time.sleep(600)
    if response == "nan":
        return float("nan")
    return 1.0


def noisy_reward(response: str, ground_truth: str, **metadata) -> float:
    print("x" * (1 << 20))  # 1 MiB of debugging output per item
    os.write(2, b"y" * (1 << 20))  # and as C code would write it
    return 1.0


def test_reward_function_output_is_capped_per_worker(capfd):
    """A reward function printing per item wrote 512 MB of log in two steps; each worker now forwards at most
    OUTPUT_CAP_BYTES of stdout and of stderr (prints and raw writes alike), then one note, and keeps scoring."""
    from megatron_rlvr.rewards import RewardConfig, RewardManager

    cap = 1 << 20  # OUTPUT_CAP_BYTES
    with RewardManager(RewardConfig(fn=f"{__name__}:noisy_reward", num_workers=1)) as rm:
        rewards, _ = rm.score(["a"] * 4, ["1"] * 4)
    assert rewards == [1.0] * 4
    out, err = capfd.readouterr()
    assert out.count("x") == cap and err.count("y") == cap  # not 4 MiB each
    assert "stdout capped at 1 MiB" in out and "stderr capped at 1 MiB" in err


def test_first_failure_of_each_kind_is_reported_once_with_traceback_and_prompt_id():
    """Item 5: the first exception (and the first NaN) is shown with the prompt id and the traceback; later ones of
    the same kind are only counted."""
    from megatron_rlvr.rewards import RewardConfig, RewardManager

    reports = []
    cfg = RewardConfig(fn=f"{__name__}:raising_reward", num_workers=1)
    with RewardManager(cfg, report=reports.append) as rm:
        _, stats = rm.score(["raise", "raise", "nan", "ok", "nan"], ["1"] * 5, ids=["p1", "p2", "p3", "p4", "p5"])
    assert stats["reward/n_error"] == 2 and stats["reward/n_nonfinite"] == 2
    assert len(reports) == 2
    assert "prompt p1" in reports[0] and "RuntimeError: raising_reward: bad response" in reports[0]
    assert "Traceback" in reports[0] and "raising_reward" in reports[0] and "reward/n_error" in reports[0]
    assert "prompt p3" in reports[1] and "non-finite" in reports[1] and "reward/n_nonfinite" in reports[1]


def test_a_hanging_function_is_reported_at_its_first_timeout():
    """Item 5: the warning comes at the first timeout (with the option to change), not after the whole batch (whose
    other three items time out together, one timeout later)."""
    from megatron_rlvr.rewards import RewardConfig, RewardManager

    seen = []
    cfg = RewardConfig(fn=f"{__name__}:raising_reward", num_workers=1, timeout_s=0.5, kill_grace_s=0.5)
    with RewardManager(cfg, report=lambda text: seen.append((time.monotonic(), text))) as rm:
        assert rm.score(["ok"], ["1"])[0] == [1.0]  # the worker is up (its start-up is not part of the timing)
        t0 = time.monotonic()
        _, stats = rm.score(["hang"] * 4, ["1"] * 4, ids=["a", "b", "c", "d"])
        done = time.monotonic()
    assert stats["reward/n_timeout"] == 4 and len(seen) == 1
    first_at, text = seen[0]
    assert done - t0 >= 0.95 and first_at - t0 < done - t0 - 0.4  # reported at the first timeout, not the last
    assert "prompt a" in text and "reward.timeout_s=0.5" in text


def test_too_many_failed_rewards_fail_the_step_and_counts_show_on_the_progress_line():
    from megatron_rlvr.rewards.manager import RewardFailure, check_failure_fraction
    from megatron_rlvr.rundir.metrics_log import RunLogger

    check_failure_fraction({"reward/n_items": 10, "reward/n_error": 5}, 0.5, "f")  # exactly the limit: fine
    with pytest.raises(RewardFailure, match=r"6 of 10 rewards.*errors 3, timeouts 2, non-finite 1.*max_error_frac"):
        check_failure_fraction(
            {"reward/n_items": 10, "reward/n_error": 3, "reward/n_timeout": 2, "reward/n_nonfinite": 1}, 0.5, "f"
        )
    log = RunLogger("/nonexistent", enabled=False, total_steps=3)
    line = log.progress_line(1, {"reward/mean": 0.5, "reward/n_error": 3.0, "reward/n_timeout": 0.0})
    assert "reward fn: 3 errors" in line and "timeouts" not in line
    assert "reward fn" not in log.progress_line(2, {"reward/mean": 0.5, "reward/n_error": 0.0})


def test_a_hanging_reward_fails_the_step_once_the_limit_is_passed_not_after_every_item():
    """A hanging function fails the step after the timeouts that pass reward.max_error_frac, not one timeout per item
    of the step (79 s at timeout_s=1 for the tiny preset); the items not reached are counted as not scored."""
    from megatron_rlvr.data import Example
    from megatron_rlvr.rewards import RewardConfig, RewardManager
    from megatron_rlvr.rewards.manager import RewardFailure
    from megatron_rlvr.rollout.engine import Completion, RolloutOutput, SamplingParams
    from megatron_rlvr.rollout.groups import Generator, Round, engine_info, generate_groups

    class HangingTexts:
        def generate(self, prompts, params, prompt_keys=None):
            return [RolloutOutput(p, [Completion([1], [0.0], "stop", text="hang")] * params.n) for p in prompts]

    examples = [Example(prompt="x", answer="1", source="t", id=f"p{i}") for i in range(4)]
    cfg = RewardConfig(fn=f"{__name__}:raising_reward", num_workers=1, timeout_s=0.3, kill_grace_s=0.5)
    with RewardManager(cfg, report=lambda text: None) as rm:
        assert rm.score(["ok"], ["1"])[0] == [1.0]  # the worker is up (its start-up is not part of the timing)
        with pytest.raises(RewardFailure) as e:
            generate_groups(
                Generator(HangingTexts(), rm, None, engine_info(0, 1, 1), lambda obj: [obj]),
                Round(examples, [[1]] * 4, SamplingParams(n=4, max_tokens=2), seed=0, step=1, round_idx=0,
                      reward_max_error_frac=0.25, reward_fn=cfg.fn),
            )  # fmt: skip
        assert rm.score(["ok"], ["1"])[0] == [1.0]  # the pool is usable afterwards
    # 5 timeouts pass 0.25 of 16 items: the other 11 are never sent to a worker (no timeout each; counts, not wall
    # time, so a loaded machine cannot flake it)
    assert "5 of 16 rewards" in str(e.value) and "timeouts 5" in str(e.value) and "11 not scored" in str(e.value)
    with RewardManager(RewardConfig(fn=cfg.fn, num_workers=0), report=lambda text: None) as rm:  # in-process too
        _, stats = rm.score(["raise"] * 3 + ["ok"] * 5, ["1"] * 8, max_error_frac=0.25)
    assert stats["reward/n_error"] == 3 and stats["reward/n_unscored"] == 5


# ----------------------------------------------------------------------------------------------- errors, launcher


def test_user_errors_are_one_line_naming_the_input(tmp_path, capsys):
    """Item 10: train / eval / convert / plan errors are one line, exit 2; no traceback."""
    from megatron_rlvr.commands.cli import main

    blocker = tmp_path / "file"
    blocker.write_text("x")
    cases = [
        (["train", str(tmp_path / "missing.yaml")], "config file not found"),
        (["train", f"logging.run_dir={blocker}/run", "--dry-run"], str(blocker)),  # a file where a folder must be
        (["eval", str(tmp_path), "--files", "x.jsonl"], "neither an HF model folder"),
        (["convert", "to-hf", "--ckpt", str(tmp_path), "--out", str(tmp_path / "o")], "--ckpt"),
        (["plan", str(tmp_path / "missing.yaml")], "missing.yaml"),
    ]
    for argv, needle in cases:
        assert main(argv) == 2, argv
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert len(err) == 1 and needle in err[0] and "Traceback" not in err[0], (argv, err)


def test_unexpected_errors_keep_their_traceback_in_a_file_and_debug_shows_it(monkeypatch, capsys):
    from megatron_rlvr.commands import cli

    def boom(ns):
        raise RuntimeError("internal bug")

    monkeypatch.setattr(cli, "cmd_plot", boom)
    assert cli.main(["plot", "x"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "RuntimeError: internal bug" in err
    path = err.split("traceback in ")[1].split(";")[0]
    with open(path) as f:
        assert "Traceback" in f.read()
    os.remove(path)
    # "0" is off; recording it here makes monkeypatch restore the original (unset) value at teardown, although
    # --debug sets RLVR_DEBUG=1 in os.environ for the ranks it launches (it leaked into later tests before)
    monkeypatch.setenv("RLVR_DEBUG", "0")
    with pytest.raises(RuntimeError, match="internal bug"):
        cli.main(["plot", "x", "--debug"])


def test_launcher_names_the_dead_rank_and_its_signal(monkeypatch, capsys):
    """Item 10: a rank killed by SIGKILL is named with its pid and signal; the survivor is stopped (fail fast); the
    line points up to the rank's own error, printed before it."""
    from megatron_rlvr.rundir import local_ranks as launch

    monkeypatch.setattr(launch, "FAIL_FAST_GRACE_S", 0.5)
    dead = subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
    survivor = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    code = launch._supervise([survivor, dead])
    assert code == 128 + signal.SIGKILL and survivor.poll() is not None
    err = capsys.readouterr().err
    assert f"rank 1 (pid {dead.pid}) was killed by SIGKILL" in err
    # the failing rank printed its error before this line (fail-fast said "the other ranks' errors below")
    assert "below" not in err and "printed above" in err


_HUP_RANK = """
import sys, time
from megatron_rlvr.rundir.signals import StopSignals, exit_code_for
s = StopSignals().install()
print("ready", flush=True)
while not s.code:
    time.sleep(0.05)
print("the terminal is gone; this must not fail the checkpoint", flush=True)
open(sys.argv[1], "w").write(StopSignals.name(s.code))
sys.exit(exit_code_for(s.code, None, None))
"""

_HUP_LAUNCHER = """
import sys
from megatron_rlvr.rundir import local_ranks
local_ranks.rank_command = lambda args: [sys.executable, "-c", sys.argv[1], *args]
sys.exit(local_ranks.launch_local([sys.argv[2]], 1, master_addr="127.0.0.1", master_port=1, threads=1))
"""


def test_a_hangup_checkpoints_like_sigterm_and_nohup_is_respected(tmp_path):
    """SIGHUP (a closed terminal, a dropped ssh session) killed the launcher without a checkpoint: it is now
    forwarded to the ranks, which stop after the step with a checkpoint (exit 129); the console they wrote to is
    gone (here: the read end of their stdout pipe is closed, as when `| tee` dies), so their later prints must not
    fail. Under nohup (SIGHUP ignored) it stays ignored."""
    from megatron_rlvr.rundir.signals import StopSignals

    done = tmp_path / "stopped_by"
    cmd = [sys.executable, "-c", _HUP_LAUNCHER, _HUP_RANK, str(done)]
    with process_helpers.launched(cmd, stdout=subprocess.PIPE, text=True, env=PY_ENV) as launcher:
        assert launcher.stdout.readline().strip() == "ready"
        launcher.stdout.close()
        launcher.send_signal(signal.SIGHUP)
        assert launcher.wait(timeout=30) == 128 + signal.SIGHUP
    assert done.read_text() == "SIGHUP"
    old = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # what nohup does
    try:
        s = StopSignals().install()
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
        s.uninstall()
    finally:
        signal.signal(signal.SIGHUP, old)


def test_sigterm_during_a_hanging_rewards_scoring_checkpoints_the_last_step_within_seconds(tmp_path):
    """A SIGTERM (scancel, a pre-emption's grace period) waited for the scoring of the whole step: with a reward
    function that hangs, 674 s at the defaults, and the step then failed with no checkpoint. Now the ranks abandon
    the step's scoring within a fraction of a second, agree, checkpoint the last completed step with the data
    position of that step (the interrupted step's prompts are drawn again on resume) and exit 0. The bound is half of
    reward.timeout_s (600 s; nothing times out meanwhile): waiting for the scoring takes at least that long, while
    abandoning it took under 60 s in earlier CI runs and 115 s at load 36 (the checkpoint's write and the
    ranks' exit are what a loaded machine slows)."""
    run, hang = tmp_path / "run", tmp_path / "hang"
    cmd = [
        sys.executable, "-m", "megatron_rlvr.commands.cli", "train", f"logging.run_dir={run}", "schedule.steps=50",
        "reward.fn=trainer_helpers:hang_once_told", "reward.timeout_s=600", "checkpoint.save_every=0",
        "checkpoint.export_hf=false", "logging.plot_at_end=false", "logging.tensorboard=off",
    ]  # fmt: skip
    env = dict(PY_ENV, RLVR_HANG_FILE=str(hang), PYTHONPATH=os.pathsep.join([TESTS_DIR, PY_ENV["PYTHONPATH"]]))
    log = tmp_path / "log"
    with open(log, "w") as out, process_helpers.launched(cmd, cwd=REPO, env=env, stdout=out, stderr=out) as proc:
        deadline = time.monotonic() + 600
        while not (run / "metrics.jsonl").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        hang.write_text("")  # from now on every reward call hangs
        while hang.read_text().count("scoring") < 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)  # both ranks' workers are inside the reward function
        assert proc.poll() is None, log.read_text()[-3000:]
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=300)
        took = time.monotonic() - t0
    text = log.read_text()
    last = max(json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines())
    assert code == 0, text[-3000:]
    assert f"SIGTERM: checkpoint of step {last} saved" in text, text[-3000:]
    assert f"(step {last + 1} was stopped during its rollout and runs again on resume)" in text, text[-3000:]
    assert took < 300, took
    with open(run / "checkpoints" / f"step_{last:09d}" / "trainer_state.json") as f:
        position = json.load(f)["data"]["position"]
    assert position == 32 * last  # train.prompts_per_step of the tiny preset, per completed step


_LEAKY_RANK = """
import os, subprocess, sys, time
from megatron_rlvr.rundir.local_ranks import start_parent_watchdog
start_parent_watchdog()
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # holds the launcher's stdout
with open(sys.argv[1] + os.environ["RANK"], "w") as f:
    f.write(f"{os.getpid()} {child.pid}")
print("ready", flush=True)
if os.environ["RANK"] == "1" and sys.argv[2] == "die":
    os.kill(os.getpid(), 9)
time.sleep(600)
"""

_LEAKY_LAUNCHER = """
import sys
from megatron_rlvr.rundir import local_ranks
local_ranks.FAIL_FAST_GRACE_S = 0.5
local_ranks.rank_command = lambda args: [sys.executable, "-c", sys.argv[1], *args]
sys.exit(local_ranks.launch_local(sys.argv[2:], 2, master_addr="127.0.0.1", master_port=1, threads=1))
"""


@pytest.mark.parametrize("how", ["a rank is killed", "the launcher is killed"])
def test_nothing_a_dead_rank_started_outlives_the_run(tmp_path, how):
    """A SIGKILLed rank (the OOM killer, fail-fast) or launcher left the rank's children (megatron-core's checkpoint
    writer and its resource tracker) running for good, holding memory and the console's pipe, so `train | tee log`
    never returned. Each rank's whole process group is ended: the pipe closes, no child is left."""
    pids = str(tmp_path / "pids")
    launcher = process_helpers.start(
        [sys.executable, "-c", _LEAKY_LAUNCHER, _LEAKY_RANK, pids, "die" if how == "a rank is killed" else "live"],
        stdout=subprocess.PIPE,
        text=True,
        env=PY_ENV,
    )
    started = []
    try:
        assert [launcher.stdout.readline().strip() for _ in range(2)] == ["ready", "ready"]
        started = [int(p) for r in range(2) for p in open(pids + str(r)).read().split()]
        if how == "the launcher is killed":
            launcher.kill()
        launcher.communicate(timeout=20)  # EOF: nobody holds the pipe any more (raised TimeoutExpired before)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(_alive(p) for p in started):
            time.sleep(0.1)
        assert not [p for p in started if _alive(p)]
    finally:
        process_helpers.end_session(launcher)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_ranks_import_the_launchers_installation_not_a_checkout_in_the_cwd(tmp_path):
    """Item 13: a `megatron_rlvr` folder in the cwd shadowed the installation under `python -m`; the rank command
    imports the launcher's package (and the cwd still serves user modules)."""
    from megatron_rlvr.rundir.local_ranks import rank_command

    shadow = tmp_path / "megatron_rlvr"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("print('SHADOW CHECKOUT IMPORTED')\n")
    (shadow / "cli.py").write_text("def main():\n    return 0\n")
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    before = subprocess.run(
        [sys.executable, "-m", "megatron_rlvr.commands.cli", "plot", "--help"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
    )
    assert b"SHADOW" in before.stdout  # the old launch command: the cwd's copy wins
    out = subprocess.run(rank_command(["plot", "--help"]), cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0 and "SHADOW" not in out.stdout and "run directories" in out.stdout


# ----------------------------------------------------------------------------------------------- items 7, 8, 9, 11


def test_eval_refuses_a_folder_without_tokenizer_and_uses_the_runs_settings(tmp_path, capsys):
    """Item 7: no silently empty tokenizer; a run directory's reward / extraction / template are eval's defaults
    (explicit flags still win)."""
    from megatron_rlvr.commands.cli import main
    from megatron_rlvr.commands.eval_cli import resolve_settings

    hf = tmp_path / "run" / "hf"
    hf.mkdir(parents=True)
    (hf / "config.json").write_text("{}")
    bench = tmp_path / "b.jsonl"
    bench.write_text('{"problem": "1=", "answer": "1"}\n')
    assert main(["eval", str(hf), "--files", str(bench)]) == 2
    assert "has no tokenizer files" in capsys.readouterr().err
    (tmp_path / "run" / "config.yaml").write_text(
        "reward: {fn: gsm8k, extraction: lenient}\ndata: {template: plain, prompt_template: '{problem}'}\n"
    )
    ns = SimpleNamespace(model=str(tmp_path / "run"), reward=None, extraction=None, template=None, prompt_template=None)
    got, notes = resolve_settings(ns)
    assert got == {"reward": "gsm8k", "extraction": "lenient", "template": "plain", "prompt_template": "{problem}"}
    assert len(notes) == 4
    ns.model, ns.extraction = str(hf), "boxed"
    assert resolve_settings(ns)[0]["extraction"] == "boxed" and resolve_settings(ns)[0]["reward"] == "gsm8k"


def test_eval_checks_its_benchmarks_and_out_before_loading_the_model(tmp_path, monkeypatch, capsys):
    """A benchmark without usable rows or an unwritable --out failed only after the model was loaded and every
    other benchmark generated; both are now refused first (exit 2, one line)."""
    import transformers

    from megatron_rlvr.commands.cli import main

    def no_model(*a, **k):
        raise AssertionError("the model was loaded before the inputs were checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_model)
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "tokenizer.json").write_text("{}")
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    good.write_text('{"problem": "1=", "answer": "1"}\n')
    bad.write_text('{"question_text": "1="}\n')
    assert main(["eval", str(hf), "--files", str(good), str(bad), "--reward", "gsm8k"]) == 2
    assert "bad.jsonl" in capsys.readouterr().err
    out = tmp_path / "no_such_dir" / "eval.json"
    assert main(["eval", str(hf), "--files", str(good), "--reward", "gsm8k", "--out", str(out)]) == 2
    assert "no_such_dir does not exist" in capsys.readouterr().err


def test_command_line_mistakes_say_what_to_type_instead(tmp_path, monkeypatch, capsys):
    """One line each, exit 2, saying what to type, before anything starts. Before: ``train schedule.steps 5`` and
    ``train EMPTY_DIR`` said "config file not found"; ``eval --files DIR`` "not found"; ``eval --engine vllm --tp 3``
    started 3 ranks and vLLM's multi-line error came after ~27 s; ``--gpu-memory-utilization 5`` was reported under
    vLLM's class name; ``parallel.tp=2`` with one KV head and LoRA fc1/fc2 adapters on an MoE model passed
    ``--dry-run`` and every rank refused them after launch; ``model.lora.sync=adapter`` with the transformers engine
    likewise; ``logging.wandb.enabled=true`` without an API key failed after the first step."""
    import transformers

    from megatron_rlvr.commands.cli import main
    from megatron_rlvr.families.tiny import save_tiny_tokenizer, tiny_hf_config

    def no_model(*a, **k):
        raise AssertionError("the model was loaded before the inputs were checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_model)
    monkeypatch.chdir(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "problems.jsonl").write_text('{"problem": "1=", "answer": "1"}\n')
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"num_attention_heads": 4, "num_key_value_heads": 1}))
    (hf / "tokenizer.json").write_text("{}")
    good = tmp_path / "good.jsonl"
    good.write_text('{"problem": "1=", "answer": "1"}\n')
    one_kv = tmp_path / "one_kv.json"  # the tiny model with 4 query heads sharing one key/value head
    one_kv.write_text(json.dumps({**tiny_hf_config(), "num_attention_heads": 4, "num_key_value_heads": 1}))
    tok = save_tiny_tokenizer(tmp_path / "tok")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no_netrc"))
    monkeypatch.setenv("HOME", str(tmp_path))
    cases = {
        ("train", "schedule.steps", "5"): "options are given as key=value, one word: schedule.steps=5",
        ("train", "configs/tiny.yaml", "schedule.steps", "5"): "not key=value.*e.g. schedule.steps=5",
        ("train", str(empty)): "is a folder with no config.yaml in it",
        ("eval", str(hf), "--files", str(empty)): r"--files: .*empty is a folder.*--files .*/\*.jsonl.*problems.jsonl",
        ("eval", str(hf), "--files", str(good), "--engine", "vllm", "--gpu-memory-utilization", "5"): (
            r"--gpu-memory-utilization is a fraction of the GPU's memory in \(0, 1\], got 5"
        ),
        ("eval", str(hf), "--files", str(good), "--engine", "vllm", "--tp", "3"): (
            "--tp=3 does not divide the model's num_attention_heads=4"
        ),
        ("train", "--dry-run", f"model.hf_config={one_kv}", f"model.tokenizer={tok}", "parallel.tp=2"): (
            "parallel.tp=2 does not divide the model's num_key_value_heads=1"
        ),
        ("train", "--dry-run", os.path.join(REPO, "configs", "tiny_moe.yaml"), "model.lora.rank=4"): (
            r"model.lora.targets=\[qkv,proj,fc1,fc2\]: fc1/fc2 adapters on the experts .*targets=\[qkv,proj\]"
        ),
        ("train", "--dry-run", "model.lora.rank=4", "model.lora.sync=adapter", "rollout.engine=hf"): (
            "model.lora.sync=adapter needs the vLLM engine.*model.lora.sync=merged"
        ),
        ("train", "--dry-run", "logging.wandb.enabled=true"): "no W&B API key.*logging.wandb.mode=offline",
    }
    for argv, pattern in cases.items():
        code = main(list(argv))
        err = capsys.readouterr().err
        assert code == 2 and len(err.strip().splitlines()) == 1, (argv, err)
        assert re.search(pattern, err), (argv, err)
    assert not (tmp_path / "runs").exists()  # no dry run got as far as writing a run directory
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert main(["train", "--dry-run", "logging.wandb.enabled=true", f"logging.run_dir={tmp_path / 'w'}"]) == 0


def test_sampling_errors_name_the_config_key_or_flag_not_the_internal_field(tmp_path, monkeypatch, capsys):
    """`rollout.stop: [""]`, `eval.top_p: 0` and `eval --max-tokens 0` passed the checks and failed later (in the
    ranks, at the first evaluation, after the model was loaded) as "SamplingParams.stop / top_p / max_tokens"."""
    import transformers

    from megatron_rlvr.commands.cli import main
    from megatron_rlvr.config import load_run_config

    with pytest.raises(ValueError, match=r"rollout\.stop must be a list of non-empty strings"):
        load_run_config(None, ["rollout.stop=['']"])
    with pytest.raises(ValueError, match=r"eval\.top_p must be in \(0, 1\]"):
        load_run_config(None, ["eval.top_p=0"])

    def no_model(*a, **k):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_model)
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "tokenizer.json").write_text("{}")
    bench = tmp_path / "b.jsonl"
    bench.write_text('{"problem": "1=", "answer": "1"}\n')
    for flags, name in ((["--max-tokens", "0"], "--max-tokens"), (["--top-p", "0"], "--top-p")):
        assert main(["eval", str(hf), "--files", str(bench), "--reward", "gsm8k", *flags]) == 2
        err = capsys.readouterr().err
        assert f"{name} must be" in err and "SamplingParams" not in err, err


def test_plot_names_a_binary_metrics_file_or_config(tmp_path):
    """`plot` on a run whose metrics.jsonl or config.yaml is binary said only "'utf-8' codec can't decode byte"; it
    now names the file. A garbled line among good ones is skipped like a line cut by a crash."""
    from megatron_rlvr.rundir.metrics_log import read_metrics
    from megatron_rlvr.rundir.plot import read_run

    garbage = bytes(range(128, 256)) * 8
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "metrics.jsonl").write_bytes(garbage)
    with pytest.raises(ValueError, match=r"a/metrics\.jsonl: no step records"):
        read_run(str(tmp_path / "a"))
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "metrics.jsonl").write_bytes(b'{"step": 1, "x": 1.0}\n' + garbage + b'\n{"step": 2, "x": 2.0}\n')
    assert [r["step"] for r in read_metrics(str(tmp_path / "b" / "metrics.jsonl"))] == [1, 2]
    (tmp_path / "b" / "config.yaml").write_bytes(garbage)
    with pytest.raises(ValueError, match=r"b/config\.yaml: not a readable config"):
        read_run(str(tmp_path / "b"))


def test_a_vllm_kv_cache_error_names_the_runs_keys(monkeypatch):
    """vLLM's start-up error for a too-small KV cache says "Try increasing `gpu_memory_utilization` ... decreasing
    `max_model_len`", flags of vLLM's own API; it now names rollout.kv_cache_gb and the run's lengths."""
    from megatron_rlvr.config import load_run_config
    from megatron_rlvr.trainer import engine_setup

    said = (
        "To serve at least one request with the model's max seq len (4096), (0.05 GiB KV cache is needed, which is "
        "larger than the available KV cache memory (0.01 GiB). Try increasing `gpu_memory_utilization` (which also "
        "controls CPU memory on the CPU backend) or decreasing `max_model_len` when initializing the engine."
    )

    class TooSmall:
        def __init__(self, *a, **k):
            raise ValueError(said)

    monkeypatch.setattr(engine_setup, "VLLMRolloutEngine", TooSmall)
    cfg = load_run_config(None, ["rollout.kv_cache_gb=0.01"])
    from megatron_rlvr.models.source import ModelSource

    source = ModelSource(hf_config={}, weights_dir=None, tokenizer_dir=None, is_tiny=True)
    with pytest.raises(ValueError) as e:
        engine_setup.ENGINE_BUILDERS["vllm"](cfg, source, None, None)
    msg = str(e.value)
    seq = cfg.rollout.max_prompt_len + cfg.rollout.max_response_len  # the tiny preset's
    assert "rollout.kv_cache_gb (now 0.01)" in msg and f"max_response_len = {seq} tokens" in msg
    assert "0.05 GiB KV cache is needed" in msg and "Try increasing" not in msg

    class Other:
        def __init__(self, *a, **k):
            raise ValueError("hf_config needs 'architectures'")

    monkeypatch.setattr(engine_setup, "VLLMRolloutEngine", Other)
    with pytest.raises(ValueError, match=r"^hf_config needs 'architectures'$"):  # other errors pass unchanged
        engine_setup.ENGINE_BUILDERS["vllm"](cfg, source, None, None)


def test_an_empty_config_says_the_default_model_is_the_tiny_toy(tmp_path):
    """An empty YAML gets model.name=tiny (64 positions) and rollout lengths 1024 + 1024: the error said only that
    2048 exceeds 64; it now says where the mismatch comes from and what to do."""
    from megatron_rlvr.config import ConfigError, load_run_config

    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    with pytest.raises(ConfigError) as e:
        load_run_config(str(empty), [])
    msg = str(e.value)
    assert "1024 + 1024 = 2048 exceeds the model's max_position_embeddings=64" in msg
    assert "model.name=tiny (the default model)" in msg and "configs/tiny.yaml" in msg and "model.hf_path" in msg


def test_a_missing_relative_path_says_it_was_looked_for_from_the_working_directory():
    """Relative paths in a config resolve from the working directory, not the config file's folder (docs/training.md);
    the not-found error said neither."""
    from megatron_rlvr.config import ConfigError, load_run_config

    with pytest.raises(ConfigError, match=r"not found: rel/x\.jsonl \(relative paths are resolved from the working"):
        load_run_config(None, ["data.train_files=[rel/x.jsonl]"])
    with pytest.raises(ConfigError, match=r"model\.hf_path: not found: rel/m \(relative paths are resolved"):
        load_run_config(None, ["model.hf_path=rel/m"])


def test_convert_accepts_a_run_dir_and_names_the_overwrite_flag(tmp_path):
    """Item 8: `--ckpt RUN_DIR` resolves to its newest checkpoint; an existing --out (to-hf) or OUT/step_N
    (to-megatron) names `--overwrite`."""
    from megatron_rlvr.commands.convert_cli import convert_main
    from megatron_rlvr.models.convert import resolve_checkpoint

    run = str(tmp_path / "run")
    _fake_checkpoint(run, 4)
    newest = _fake_checkpoint(run, 8)
    assert resolve_checkpoint(run) == newest
    assert resolve_checkpoint(os.path.join(run, "checkpoints")) == newest
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="pass --overwrite"):
        convert_main(["to-hf", "--ckpt", run, "--out", str(out)])
    # to-megatron refuses an existing OUT/step_N the same way (it replaced it silently)
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"already holds step 8 .*step_000000008.*pass --overwrite"):
        convert_main(["to-megatron", "--hf", str(hf), "--out", run + "/checkpoints", "--step", "8"])


def test_exported_weights_are_readable_by_the_group_like_any_new_file(tmp_path):
    """safetensors writes 0600: an exported hf/ on a shared file system was unreadable for teammates. The shards get
    the mode the umask gives any new file."""
    import torch

    from megatron_rlvr.models.export import save_shard

    old = os.umask(0o022)
    try:
        save_shard({"w": torch.zeros(2)}, str(tmp_path / "a.safetensors"))
        os.umask(0o027)
        save_shard({"w": torch.zeros(2)}, str(tmp_path / "b.safetensors"))
    finally:
        os.umask(old)
    assert os.stat(tmp_path / "a.safetensors").st_mode & 0o777 == 0o644
    assert os.stat(tmp_path / "b.safetensors").st_mode & 0o777 == 0o640


def test_a_reward_module_in_the_working_directory_is_found_by_the_installed_script(tmp_path, monkeypatch):
    """The installed `megatron-rlvr` script's sys.path starts with its bin/ folder, not the working directory: a
    reward.fn next to the config was "cannot import module". It is now found (appended: installed packages win), and
    a module that is nowhere names the working directory and PYTHONPATH."""
    from megatron_rlvr.rewards.scorers import load_reward_fn

    (tmp_path / "cwd_reward_mod.py").write_text("def fn(response, ground_truth, **metadata):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    assert load_reward_fn("cwd_reward_mod:fn")("a", "b") == 1.0
    assert sys.path[-1] == str(tmp_path)
    with pytest.raises(ValueError, match=r"working directory \(.*\) and on PYTHONPATH"):
        load_reward_fn("no_such_reward_mod:fn")
    sys.modules.pop("cwd_reward_mod", None)


def test_non_utf8_row_names_file_and_line_and_can_be_skipped(tmp_path):
    """Item 9."""
    from megatron_rlvr.data.files import load_examples
    from megatron_rlvr.data.records import MalformedRowError

    p = tmp_path / "d.jsonl"
    p.write_bytes(b'{"problem": "1=", "answer": "1"}\n{"problem": "\xff\xfe", "answer": "2"}\n')
    with pytest.raises(MalformedRowError, match=rf"{p}:2: not valid UTF-8 \(byte 0xff at column 14\)"):
        load_examples(str(p))
    ds = load_examples(str(p), skip_malformed=True)
    assert len(ds) == 1 and ds.n_malformed == 1


def test_group_relative_preset_with_one_rollout_is_refused():
    """Item 11: rollout.n=1 gives every sample advantage 0 under every (group-relative) estimator."""
    from megatron_rlvr.config import ConfigError, load_run_config

    with pytest.raises(ConfigError, match=r"rollout\.n=1: .*group-relative.*rollout\.n >= 2"):
        load_run_config(None, ["rollout.n=1"])


# ----------------------------------------------------------------------------------------------- trainer level

SMALL = trainer_helpers.SMALL


def _trainer_faults(root, overrides):
    """Rank function: the trainer-level fault cases in one pool call (each returns what the test asserts on)."""
    import torch

    from megatron_rlvr.config import load_run_config
    from megatron_rlvr.models.convert import to_hf_on_rank
    from megatron_rlvr.rewards.manager import RewardFailure
    from megatron_rlvr.rundir.resume import ResumeError
    from megatron_rlvr.trainer.colocated import rl_step, setup, teardown, train

    sys.path.insert(0, TESTS_DIR)  # trainer_helpers' reward functions
    out = {}

    def steps(name, extra, n):
        t = setup(load_run_config(None, [*overrides, *extra]), os.path.join(root, name))
        try:
            return [rl_step(t, s) for s in range(1, n + 1)]
        finally:
            teardown(t)

    # item 14a: the reference model is not the policy: after one update their KL is clearly non-zero
    # (a reward with variance: with all-zero rewards only Adam's amplification of rounding moved the policy)
    grpo = ["algorithm.preset=grpo", "reward.fn=trainer_helpers:even_digit_reward"]
    out["ref_kl"] = [m.get("loss/ref_kl") for m in steps("grpo", grpo, 2)]
    # item 14b: MCPO with two mini-batches on a batch with mastered prompts: the hinge sees them and is active in
    # the second mini-batch (the policy moved in the first)
    mcpo = ["algorithm.preset=mcpo", "train.mini_batch_prompts=2", "reward.fn=trainer_helpers:mastery_mix_reward"]
    # a first mini-batch that moves the policy past delta = 0.01 on mastered tokens: a large step, and 8 rollouts so
    # that the non-mastered groups are mixed (non-zero advantages)
    mcpo += ["optimizer.lr=1e-2", "rollout.n=8"]
    out["mcpo"] = steps("mcpo", mcpo, 1)[0]
    # item 6: every prompt too long
    out["too_long"] = steps("too_long", ["rollout.max_prompt_len=1"], 1)[0]
    # item 5: a reward function that always raises fails the step on every rank
    try:
        steps("broken", ["reward.fn=trainer_helpers:broken_reward"], 1)
        out["broken"] = None
    except RewardFailure as e:
        out["broken"] = str(e)
    # item 4: truncated shard in the newest checkpoint -> resume from the previous one; strict mode refuses
    run = os.path.join(root, "ckpt")
    ck = ["checkpoint.save_every=1", "checkpoint.save_at_end=true", "checkpoint.keep_last=3"]
    out["train_code"] = train(load_run_config(None, [*overrides, *ck]), run)
    # item 3 under torchrun / srun (no launcher): rank 0 compares with config.yaml, every rank raises
    try:
        setup(load_run_config(None, [*overrides, *ck, "algorithm.preset=dapo"]), run)
        out["changed"] = None
    except ResumeError as e:
        out["changed"] = str(e)
    # item 8: `convert to-hf --ckpt RUN_DIR` of a tiny run writes the tokenizer (the run dir is resolved too)
    hf = os.path.join(root, "hf_of_run")
    to_hf_on_rank(run, hf)
    torch.distributed.barrier()
    out["hf_files"] = sorted(os.listdir(hf))
    out["hf_mode"] = os.stat(os.path.join(hf, "model.safetensors")).st_mode & 0o777
    if torch.distributed.get_rank() == 0:
        step2 = os.path.join(run, "checkpoints", "step_000000002")
        shard = max((os.path.join(step2, n) for n in os.listdir(step2)), key=os.path.getsize)
        with open(shard, "r+b") as f:
            f.truncate(os.path.getsize(shard) // 2)
    torch.distributed.barrier()
    t = setup(load_run_config(None, [*overrides, *ck, "schedule.steps=3"]), run)
    out["resumed_from"] = t.life.start_step
    teardown(t)
    try:
        setup(load_run_config(None, [*overrides, *ck, "schedule.steps=3", "checkpoint.fallback=false"]), run)
        out["strict"] = None
    except ResumeError as e:
        out["strict"] = str(e)
    return out


def test_trainer_level_faults(dist_pool, tmp_path):
    """Items 4, 5, 6, 8, 14 through the real training step at TP = 2 x DP = 2."""
    outs = dist_pool.run(_trainer_faults, tp=2, args=(str(tmp_path), SMALL), timeout=600)
    for o in outs:
        # 14a: with the policy as "reference" the KL was ~1e-14 at step 2; the reference model gives >> 0
        assert o["ref_kl"][1] is not None and o["ref_kl"][1] > 1e-6, o["ref_kl"]
        # 14b: mastered sequences reach the loss (mastered=False everywhere gives 0 here) and the hinge is active
        m = o["mcpo"]
        assert m["train/updates"] == 2, m
        assert m["mcpo/mastered_token_frac"] > 0 and m["mcpo/hinge_active_frac"] > 0 and m["mcpo/hinge_kl"] > 0, m
        # 6: skipped with the reason, not silently
        assert o["too_long"]["train/skipped_all_too_long"] == 1 and o["too_long"]["data/prompts_too_long"] == 4
        # 5: a broken reward function stops the run with the counts and the option
        assert o["broken"] is not None and "of 16 rewards" in o["broken"] and "max_error_frac" in o["broken"]
        # 4
        assert o["train_code"] == 0 and o["resumed_from"] == 1
        assert o["strict"] is not None and "step_000000002" in o["strict"] and "checkpoint.fallback=true" in o["strict"]
        assert o["changed"] is not None and "algorithm.name: 'mcpo' -> 'dapo'" in o["changed"]
        # 8
        assert "tokenizer.json" in o["hf_files"] and "model.safetensors" in o["hf_files"]
        umask = os.umask(0)
        os.umask(umask)
        assert o["hf_mode"] == 0o666 & ~umask, oct(o["hf_mode"])  # not safetensors' 0600


def test_fault_docs_list_this_matrix():
    """docs/training.md lists every test of this file with what it guarantees."""
    with open(os.path.join(REPO, "docs", "training.md")) as f:
        doc = f.read()
    names = [ln.split("(")[0][4:] for ln in open(__file__).read().splitlines() if ln.startswith("def test_")]
    missing = [n for n in names if n not in doc]
    assert not missing, f"docs/training.md does not list: {missing}"


if __name__ == "__main__":  # pragma: no cover
    print(textwrap.dedent(__doc__))

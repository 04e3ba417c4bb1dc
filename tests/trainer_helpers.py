"""Reward functions for the trainer's bad-input tests (imported by dotted path inside reward worker processes).

Responses of the tiny model are 1-2 characters over digits, operators and '='."""

import json
import os
import time

QUIET = [
    "reward.num_workers=0",
    "checkpoint.save_every=0",
    "checkpoint.save_at_end=false",
    "checkpoint.export_hf=false",
    "logging.progress=false",
    "logging.tensorboard=off",
    "logging.plot_at_end=false",
]
"""Overrides of the in-process trainer tests: rewards inline, no checkpoints, exports, progress lines or plots."""
DENSE_TINY = [
    "rollout.max_response_len=2",
    "reward.fn=gsm8k",
    "reward.extraction=lenient",
    "train.mini_batch_prompts=null",
    "schedule.warmup_steps=0",
    "algorithm.entropy.coef=0",
]
"""The tiny preset's task and loop that the trainer-mechanics tests were written for: responses of at most 2 tokens
scored on their last number, whether or not they stopped (a random policy is right ~7% of the time, so a 16-sample
step has reward variance; the preset's own exact_stop reward is right well under 1% of the time), one update per
step whatever train.prompts_per_step a test sets (a test that wants mini-batches sets train.mini_batch_prompts), the
full learning rate from the first step and no entropy bonus (the preset warms the learning rate up over 20 steps and
adds a 0.01 bonus; these tests look at one step's update and loss)."""
SMALL = ["schedule.steps=2", "train.prompts_per_step=4", "rollout.n=4", *DENSE_TINY, *QUIET]
"""A 2-step, 4-prompt x 4-rollout tiny run with DENSE_TINY and QUIET."""


def flaky_reward(response: str, ground_truth: str, **metadata) -> float:
    """Raises when the response contains '1', hangs (far past any test timeout) when it starts with '3', else 1.0
    for an exact answer."""
    if "1" in response:
        raise RuntimeError("flaky_reward: refusing responses with a 1")
    if response.startswith("3"):
        time.sleep(600)
    return 1.0 if response.strip() == ground_truth else 0.0


def hang_once_told(response: str, ground_truth: str, **metadata) -> float:
    """Exact answer; once the file $RLVR_HANG_FILE exists, every call marks it (appends a line) and hangs asleep far
    past any test timeout."""
    path = os.environ.get("RLVR_HANG_FILE")
    if path and os.path.exists(path):
        with open(path, "a") as f:
            f.write("scoring\n")
        time.sleep(3600)
    return 1.0 if response.strip() == ground_truth else 0.0


def zero_reward(response: str, ground_truth: str, **metadata) -> float:
    """Every response is wrong: every group has zero variance (nothing for dynamic sampling to keep)."""
    return 0.0


def mastery_mix_reward(response: str, ground_truth: str, **metadata) -> float:
    """Prompts with an even answer are always right (mastered groups); the others are right when the response starts
    with an even digit (about a quarter of a random policy's samples: mixed groups, non-zero advantages, so the first
    mini-batch moves the policy)."""
    if ground_truth.strip() in ("0", "2", "4", "6", "8"):
        return 1.0
    return 1.0 if response[:1] in ("0", "2", "4", "6", "8") else 0.0


def broken_reward(response: str, ground_truth: str, **metadata) -> float:
    """Every call raises (a reward function with a bug)."""
    raise KeyError("broken_reward: no such field")


def even_digit_reward(response: str, ground_truth: str, **metadata) -> float:
    """1.0 when the response starts with an even digit: about a quarter of a random policy's samples, so a 16-sample
    step has reward variance (a non-zero update) for any model initialisation, unlike the ~6% exact-copy reward."""
    return 1.0 if response[:1] in ("0", "2", "4", "6", "8") else 0.0


def grads_vector(model):
    """Every parameter's gradient (megatron's ``main_grad`` when there is one) as one flat tensor copy."""
    import torch

    parts = []
    for p in model.parameters():
        g = getattr(p, "main_grad", None)
        g = p.grad if g is None else g
        parts.append(g.detach().reshape(-1).clone())
    return torch.cat(parts)


NOT_COMPARED = ("time/", "perf/tokens_per_s", "sync/")
"""Metric prefixes two runs of one step cannot share: wall-clock times, and the weight sync's timing / buffer peak."""


def step_once_per_setting(t, settings, apply, spy):
    """Step 1 on trainer ``t`` once per setting, each time with the prompts rewound and the optimizer step replaced
    by a gradient recorder, so every setting sees the same weights, prompts and rollouts; tears ``t`` down.

    ``apply(t, setting)`` switches the setting; ``spy(record)`` starts recording into a list and returns its undo.
    Returns {setting: (metrics without NOT_COMPARED keys, recorded gradients, the spy's record)}."""
    from megatron_rlvr.trainer.colocated import rl_step, teardown

    grads = []

    def record():
        grads.append(grads_vector(t.policy.model))
        return True, None, None

    t.policy.optimizer.step = record
    data_state = t.rollout.loader.state_dict()
    out = {}
    try:
        for setting in settings:
            apply(t, setting)
            t.rollout.loader.load_state_dict(data_state)
            grads.clear()
            seen: list = []
            undo = spy(seen)
            try:
                m = rl_step(t, 1)
            finally:
                undo()
            out[setting] = ({k: v for k, v in m.items() if not k.startswith(NOT_COMPARED)}, list(grads), seen)
    finally:
        teardown(t)
    return out


def records(run_dir):
    """Every line of a run's metrics.jsonl, in order."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def train_runs(config, run_root, runs, overrides):
    """In-process training runs from the YAML file ``config``: ``runs`` is {run name: extra overrides}; each run goes
    to ``run_root/<name>``. Returns {run name: train's exit code}."""
    from megatron_rlvr.config import load_run_config
    from megatron_rlvr.trainer.colocated import train

    return {name: train(load_run_config(config, [*overrides, *extra]), os.path.join(run_root, name))
            for name, extra in runs.items()}  # fmt: skip


def scripted_env(setup):
    """A multi-turn environment for the trainer tests (agent.environment=trainer_helpers:scripted_env): a turn ends at
    '=' (or EOS); the first action is answered with the observation "=7?" (ids of the tiny tokenizer), the second
    ends the episode."""
    from megatron_rlvr.agentic.environment import Environment, Episode, Observation

    ids = tuple(setup.tokenizer("=7?", add_special_tokens=False)["input_ids"])

    class _Episode(Episode):
        def __init__(self):
            self.turns = 0

        def step(self, action):
            self.turns += 1
            return Observation(done=True) if self.turns >= 2 else Observation(ids)

    class _Env(Environment):
        stop = ("=",)

        def start(self, example):
            return _Episode()

    return _Env()

"""RewardConfig: which correctness reward to compute and how the worker processes run it."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_rlvr.rewards.builtin import REWARD_FNS
from megatron_rlvr.rewards.code_reward import CODE_TEST_MODES
from megatron_rlvr.rewards.extract import EXTRACTION_MODES
from megatron_rlvr.rewards.judge_config import MODEL_REWARD_FNS, JudgeConfig, MixTerm

__all__ = ["RewardConfig"]


@dataclass
class RewardConfig:
    fn: str = "math"
    """Reward function: a built-in name ("math": math-verify equivalence; "gsm8k": exact numeric match;
    "reasoning_gym": the reasoning-gym task's own scorer; "exact_stop": the answer exactly, and the response ended
    by itself, not cut at rollout.max_response_len; "code": the response's program against the example's test cases
    in the sandbox, see code_tests) or a user function's dotted path ("my_pkg.my_mod:fn" or
    "my_pkg.my_mod.fn") with signature fn(response: str, ground_truth: str, **metadata) -> float. The metadata are
    the example's fields plus the sample's ``finish_reason``: "stop" (EOS or a stop string) or "length" (cut at the
    generation limit). "judge": the ``judge`` model's reward (a generative judge's parsed verdict or a reward
    model's score). "mix": the weighted sum of the ``mix`` terms."""

    judge: JudgeConfig | None = None
    """The judge or reward model of fn "judge" and of a "judge" term of ``mix`` (None: no model is loaded)."""

    mix: list[MixTerm] = field(default_factory=list)
    """fn "mix" only: the terms [{fn, weight}, ...]; the reward is the sum of weight x term. The rule terms of an
    item are scored together in one reward worker (one timeout); the "judge" term in the rank's process. A term that
    fails adds 0 and the item is counted once, under the first failed part's counter (rule terms first)."""

    extraction: str = "boxed"
    """How built-in rewards take the answer from a response: "boxed" (last \\boxed{}/\\fbox{}), "lenient" (boxed,
    else an "Answer: X" line, "#### X", "final answer is X", else the whole response), or "full" (the whole
    response is the answer). Ignored by user functions, which get the raw response."""

    num_workers: int = 2
    """Worker processes scoring in parallel; they are started once and reused across batches. 0 scores in the
    calling process: no crash isolation and the timeout only interrupts Python code (main thread only)."""

    timeout_s: float = 10.0
    """Per-item limit in seconds. The worker interrupts the item at this time (SIGALRM); the item gets reward 0 and
    is counted in reward/n_timeout."""

    kill_grace_s: float = 2.0
    """Extra seconds after timeout_s before the parent kills a worker stuck in code that ignores the interrupt
    (C loops, swallowed exceptions) and starts a replacement."""

    start_timeout_s: float = 120.0
    """Seconds a new worker may take to import and warm up its reward function before start-up is an error."""

    code_tests: str = "fraction"
    """reward fn "code": "fraction" (the share of the example's test cases passed) or "all" (1.0 only when every
    test passes)."""

    code_test_timeout_s: float = 2.0
    """reward fn "code": wall and CPU seconds of one test case's run. The tests of one response share 80% of
    timeout_s in all (tests left when it is spent fail), so a looping program scores 0 instead of timing out."""

    code_memory_mb: int = 1024
    """reward fn "code": address space of a test case's program in MiB."""

    max_error_frac: float = 0.5
    """A step fails the run (a clear error) when more than this fraction of its rewards could not be computed
    (errors, timeouts, non-finite values): a broken reward function must not train on zeros. 1.0: never."""

    def __post_init__(self) -> None:
        if not isinstance(self.fn, str) or not self.fn.strip():
            raise ValueError(
                f"reward.fn must be a built-in {sorted(REWARD_FNS)}, 'judge', 'mix' or a dotted path, got {self.fn!r}"
            )
        self._check_model_rewards()
        for fn in self.rule_fns():
            if fn not in REWARD_FNS:
                # Fail before any rank starts: import the user's module now (clear error naming the path).
                from megatron_rlvr.rewards.scorers import load_reward_fn

                load_reward_fn(fn)
        if self.extraction not in EXTRACTION_MODES:
            raise ValueError(f"reward.extraction must be one of {EXTRACTION_MODES}, got {self.extraction!r}")
        if not isinstance(self.num_workers, int) or self.num_workers < 0:
            raise ValueError(f"reward.num_workers must be an int >= 0, got {self.num_workers!r}")
        if not isinstance(self.max_error_frac, (int, float)) or not 0.0 <= self.max_error_frac <= 1.0:
            raise ValueError(f"reward.max_error_frac must be a number in [0, 1], got {self.max_error_frac!r}")
        for name in ("timeout_s", "kill_grace_s", "start_timeout_s", "code_test_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"reward.{name} must be a number > 0, got {value!r}")
        if self.code_tests not in CODE_TEST_MODES:
            raise ValueError(f"reward.code_tests must be one of {CODE_TEST_MODES}, got {self.code_tests!r}")
        if self.fn == "code" and self.code_test_timeout_s >= 0.8 * self.timeout_s:
            raise ValueError(
                f"reward.code_test_timeout_s={self.code_test_timeout_s:g} must be below 80% of reward.timeout_s="
                f"{self.timeout_s:g} (the tests of one response share that time)"
            )
        if (
            isinstance(self.code_memory_mb, bool)
            or not isinstance(self.code_memory_mb, int)
            or self.code_memory_mb < 64
        ):
            raise ValueError(f"reward.code_memory_mb must be an int >= 64, got {self.code_memory_mb!r}")

    def check_files(self) -> None:
        """The judge's checkpoint folder exists (``config.loader.check_run_files``)."""
        if self.judge is not None:
            self.judge.check_files()

    def _check_model_rewards(self) -> None:
        terms = [t.fn for t in self.mix]
        if self.fn == "mix" and not self.mix:
            raise ValueError("reward.fn=mix needs reward.mix: a list of {fn, weight} terms")
        if self.mix and self.fn != "mix":
            raise ValueError(f"reward.mix is set but reward.fn={self.fn!r}: set reward.fn: mix to use it")
        if len(set(terms)) != len(terms):
            raise ValueError(f"reward.mix names a term twice: {terms}")
        uses_judge = self.fn in MODEL_REWARD_FNS or any(t in MODEL_REWARD_FNS for t in terms)
        if uses_judge and self.judge is None:
            raise ValueError("reward.fn=judge (or a 'judge' term of reward.mix) needs a reward.judge section")
        if self.judge is not None and not uses_judge:
            raise ValueError(
                f"reward.judge is set but unused (reward.fn={self.fn!r}): set reward.fn: judge, or add "
                "{fn: judge, weight: ...} to reward.mix"
            )

    @property
    def uses_judge(self) -> bool:
        """Some of the reward comes from the ``judge`` model (scored in the rank's own process)."""
        return self.fn in MODEL_REWARD_FNS or any(t.fn in MODEL_REWARD_FNS for t in self.mix)

    def rule_fns(self) -> list[str]:
        """The rule rewards (built-ins and user functions) scored in the reward workers."""
        if self.fn == "mix":
            return [t.fn for t in self.mix if t.fn not in MODEL_REWARD_FNS]
        return [] if self.fn in MODEL_REWARD_FNS else [self.fn]

    @property
    def worker_fn(self) -> str | None:
        """What the reward workers score: ``fn``, "mix" (the weighted rule terms of a mix), or None (no rule
        reward: the workers are not started)."""
        rules = self.rule_fns()
        if not rules:
            return None
        return "mix" if self.fn == "mix" else self.fn

    def judge_weight(self) -> float:
        """The weight of the judge's reward in the total (0 when the judge is not used)."""
        if self.fn in MODEL_REWARD_FNS:
            return 1.0
        return sum(t.weight for t in self.mix if t.fn in MODEL_REWARD_FNS)

    def scorer_options(self, fn: str | None = None) -> dict:
        """The settings a built-in reward is built with besides the extraction (the "code" reward's; for "mix", the
        rule terms as {"terms": [(fn, weight, options)]}); {} else."""
        fn = self.fn if fn is None else fn
        if fn == "mix":
            rules = [t for t in self.mix if t.fn not in MODEL_REWARD_FNS]
            return {"terms": [(t.fn, float(t.weight), self.scorer_options(t.fn)) for t in rules]}
        if fn != "code":
            return {}
        return {
            "tests": self.code_tests,
            "test_timeout_s": self.code_test_timeout_s,
            "memory_mb": self.code_memory_mb,
            "budget_s": 0.8 * self.timeout_s,
        }

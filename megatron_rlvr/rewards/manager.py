"""RewardManager: the batch API the trainer and evaluator call."""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable, Sequence

from megatron_rlvr.rewards.builtin import REWARD_FNS
from megatron_rlvr.rewards.judge import Judge
from megatron_rlvr.rewards.pool import ItemResult, ScoringPool, ScoringStopped, score_inline
from megatron_rlvr.rewards.reward_config import RewardConfig
from megatron_rlvr.rewards.scorers import build_scorer

__all__ = ["RewardFailure", "RewardManager", "ScoringStopped", "check_failure_fraction"]


FAILURE_COUNTS = ("reward/n_error", "reward/n_timeout", "reward/n_nonfinite", "reward/n_judge_unparsed")
"""Counters of rewards that could not be computed (scored 0; ``reward.max_error_frac`` bounds their sum)."""

STATUS_COUNTERS = {
    "timeout": "reward/n_timeout",
    "nonfinite": "reward/n_nonfinite",
    "unparsed": "reward/n_judge_unparsed",
    "unscored": "reward/n_unscored",
}
"""ItemResult status -> its counter (any other failure: reward/n_error)."""


class RewardFailure(RuntimeError):
    """Too many rewards of one step could not be computed (reward.max_error_frac)."""

    speaker: bool | None = None
    """Every rank that scored the step raises it alike, and one of them says it: None means global rank 0 (the
    colocated schedule, where every rank scores); True / False mark the one rank of the scoring ranks that says it
    (the disaggregated schedule scores on the rollout ranks only, where rank 0 is a training rank)."""


def check_failure_fraction(stats: dict[str, float], max_frac: float, fn: str) -> None:
    """Raise RewardFailure when errors + timeouts + non-finite rewards exceed ``max_frac`` of ``reward/n_items``,
    or when scoring was stopped early (``reward/n_unscored`` > 0: more than ``max_frac`` of one scorer's share had
    failed)."""
    n = stats.get("reward/n_items", 0.0)
    bad = sum(stats.get(k, 0.0) for k in FAILURE_COUNTS)
    unscored = stats.get("reward/n_unscored", 0.0)
    if n > 0 and (bad / n > max_frac or unscored > 0):
        stopped = (
            f"; scoring stopped early once more than that fraction had failed, {unscored:.0f} not scored"
            if unscored
            else ""
        )
        raise RewardFailure(
            f"reward fn {fn!r}: {bad:.0f} of {n:.0f} rewards of this step failed (errors "
            f"{stats.get('reward/n_error', 0):.0f}, timeouts {stats.get('reward/n_timeout', 0):.0f}, non-finite "
            f"{stats.get('reward/n_nonfinite', 0):.0f}, unreadable judge replies "
            f"{stats.get('reward/n_judge_unparsed', 0):.0f}), more than reward.max_error_frac={max_frac:g}{stopped}; "
            "the first failure of each kind is printed above. Fix the function (or raise reward.max_error_frac)"
        )


def failure_kind(r: ItemResult) -> str:
    if r.status != "error":
        return r.status
    return r.error.split(":", 1)[0] if r.error else "error"


class RewardManager:
    """Scores batches of responses against ground truths with the configured reward function.

    Worker processes start in the constructor (they import and warm up while the caller does other work) and are
    reused for every batch. Use as a context manager or call :meth:`close`; workers are also stopped at interpreter
    exit and exit on their own if this process dies.

    Timeouts make rewards depend on machine load, so with several data-parallel ranks score each response once (on
    one rank, or on disjoint shards) and share the rewards, rather than scoring the same batch on every rank.
    """

    def __init__(self, cfg: RewardConfig, report=None, report_now: bool | None = None, judge: Judge | None = None):
        self.cfg = cfg
        if cfg.uses_judge and judge is None:
            raise ValueError(
                f"reward.fn={cfg.fn!r} uses reward.judge, which is served on the rollout side of a training run "
                "(rollout.judge_engine.build_judge); this command does not build it"
            )
        self.judge = judge
        """The judge (``rewards.judge.Judge``: in the rank's process, or on judge ranks of its own), or None."""
        self.report_now = os.environ.get("RANK", "0") == "0" if report_now is None else report_now
        """Print a first failure at once (global rank 0, or one process); else keep it for :meth:`take_pending`, so
        that rank 0 prints each kind once for the whole job."""
        self.pending: list[tuple[str, str]] = []
        self._pool: ScoringPool | None = None
        self._scorer = None
        self.reported: set[str] = set()
        """Failure kinds already printed (the first of each kind is shown in full, later ones only counted)."""
        self._report = report or (lambda text: print(text, file=sys.stderr, flush=True))
        self._batch_ids: Sequence | None = None
        worker_fn = cfg.worker_fn
        if worker_fn is None:  # the judge alone: no rule reward, no workers
            pass
        elif cfg.num_workers > 0:
            self._pool = ScoringPool(
                worker_fn,
                cfg.extraction,
                cfg.num_workers,
                cfg.timeout_s,
                cfg.kill_grace_s,
                start_timeout_s=cfg.start_timeout_s,
                on_failure=self._on_failure,
                options=cfg.scorer_options(),
            )
        else:
            self._scorer = build_scorer(worker_fn, cfg.extraction, cfg.scorer_options())
        self._closed = False

    @property
    def worker_pids(self) -> list[int]:
        """PIDs of the current worker processes (empty with num_workers=0)."""
        return self._pool.pids if self._pool is not None else []

    def _on_failure(self, idx: int, r: ItemResult) -> None:
        """Print the first failure of each kind at once (a hanging function is reported at its first timeout)."""
        kind = failure_kind(r)
        if kind in self.reported:
            return
        self.reported.add(kind)
        ids = self._batch_ids
        where = f"prompt {ids[idx]}" if ids is not None and idx < len(ids) else f"item {idx}"
        counter = STATUS_COUNTERS.get(r.status, "reward/n_error")
        lines = [f"megatron-rlvr: reward fn {self.cfg.fn!r} failed on {where}: {r.error} (scored 0)"]
        if r.status == "timeout" and "reward.judge" not in r.error:
            lines.append(
                f"  it ran past reward.timeout_s={self.cfg.timeout_s:g} s; each hanging item holds a worker for up to "
                f"{self.cfg.timeout_s + self.cfg.kill_grace_s:g} s, so steps slow down: fix the function or lower "
                "reward.timeout_s"
            )
        if r.detail:
            lines.append("  " + r.detail.rstrip().replace("\n", "\n  "))
        lines.append(f"  (the first failure of this kind; later ones are only counted in {counter})")
        if self.report_now:
            self._report("\n".join(lines))
        else:
            self.pending.append((kind, "\n".join(lines)))

    def take_pending(self) -> list[tuple[str, str]]:
        """First failures this (non-reporting) manager saw since the last call: [(kind, text)]."""
        out, self.pending = self.pending, []
        return out

    def report_gathered(self, items: list[tuple[str, str]]) -> None:
        """Print other ranks' first failures of kinds this manager has not reported yet."""
        for kind, text in items:
            if kind not in self.reported:
                self.reported.add(kind)
                self._report(text)

    def score_detailed(
        self,
        responses: Sequence[str],
        ground_truths: Sequence[str],
        metas: Sequence[dict | None] | None = None,
        ids: Sequence | None = None,
        max_error_frac: float | None = None,
        should_stop: Callable[[], bool] | None = None,
        questions: Sequence[str] | None = None,
    ) -> list[ItemResult]:
        """Per-item results (reward, status "ok"/"timeout"/"error"/"nonfinite"/"unscored", error text), in input
        order. ``ids``: the items' prompt ids, named when a failure is reported. ``max_error_frac``: stop scoring once
        more than this fraction of the batch has failed; the rest is "unscored" (the step fails anyway: a hanging
        function must not hold it for one timeout per item). ``should_stop``: asked every fraction of a second;
        when it returns True the batch is abandoned and ScoringStopped is raised. ``questions``: each item's question
        text, for the judge's prompt (empty when not given)."""
        if self._closed:
            raise RuntimeError("RewardManager is closed")
        if len(responses) != len(ground_truths):
            raise ValueError(f"got {len(responses)} responses but {len(ground_truths)} ground truths")
        if metas is None:
            metas = [None] * len(responses)
        elif len(metas) != len(responses):
            raise ValueError(f"got {len(responses)} responses but {len(metas)} metadata dicts")
        for i, (r, g) in enumerate(zip(responses, ground_truths)):
            if not isinstance(r, str) or not isinstance(g, str):
                raise ValueError(
                    f"item {i}: response and ground truth must be str, got {type(r).__name__}/{type(g).__name__}"
                )
        items = [(r, g, m) for r, g, m in zip(responses, ground_truths, metas)]
        if not items:
            return []
        if questions is None:
            questions = [""] * len(items)
        elif len(questions) != len(items):
            raise ValueError(f"got {len(responses)} responses but {len(questions)} questions")
        self._batch_ids = ids
        try:
            rules = None
            if self._pool is not None:
                rules = self._pool.score(items, max_error_frac, should_stop)
            elif self._scorer is not None:
                rules = score_inline(self._scorer, self.cfg.timeout_s, items, max_error_frac, should_stop)
                for i, r in enumerate(rules):
                    if r.status not in ("ok", "unscored"):
                        self._on_failure(i, r)
            if self.judge is None:
                return rules
            judged = self.judge.score(list(questions), list(responses), list(ground_truths), should_stop)
            for i, r in enumerate(judged):
                if r.status != "ok":
                    self._on_failure(i, r)
            return self._combine(rules, judged)
        finally:
            self._batch_ids = None

    def _combine(self, rules: list[ItemResult] | None, judged: list[ItemResult]) -> list[ItemResult]:
        """Rule part (already the weighted sum of the rule terms) + judge weight x judge reward, per item; a failed
        part adds 0 and the item takes the first failed part's status (rules first)."""
        w = self.cfg.judge_weight()
        out = []
        for k, j in enumerate(judged):
            parts = [rules[k], j] if rules is not None else [j]
            reward = (rules[k].reward if rules is not None and rules[k].status == "ok" else 0.0) + (
                w * j.reward if j.status == "ok" else 0.0
            )
            failed = next((p for p in parts if p.status != "ok"), None)
            if failed is None:
                out.append(ItemResult(reward, "ok"))
            else:
                out.append(ItemResult(reward, failed.status, failed.error, failed.detail))
        return out

    def score(
        self,
        responses: Sequence[str],
        ground_truths: Sequence[str],
        metas: Sequence[dict | None] | None = None,
        ids: Sequence | None = None,
        max_error_frac: float | None = None,
        should_stop: Callable[[], bool] | None = None,
        questions: Sequence[str] | None = None,
    ) -> tuple[list[float], dict[str, float]]:
        """Rewards for a batch and namespaced stats; ``max_error_frac`` and ``should_stop`` as in
        :meth:`score_detailed`, as is ``questions``.

        Stats: ``reward/mean``, ``reward/n_items``, ``reward/n_timeout``, ``reward/n_error``, ``reward/n_nonfinite``
        (NaN / inf returned), ``reward/n_judge_unparsed`` (a judge reply the parser cannot read; these four score
        0), ``reward/n_unscored`` (not scored: stopped early),
        ``reward/n_no_answer`` (built-in rewards: no answer could be extracted; 0 for user functions),
        ``reward/workers_restarted`` (in this batch), ``reward/time_s``. An empty batch gives no rewards and
        ``reward/mean`` = NaN (there is no mean of nothing).
        """
        t0 = time.perf_counter()
        restarts_before = self._pool.restarts if self._pool is not None else 0
        results = self.score_detailed(responses, ground_truths, metas, ids, max_error_frac, should_stop, questions)
        rewards = [r.reward for r in results]
        n_no_answer = 0
        if self.cfg.fn in REWARD_FNS:
            has_answer = REWARD_FNS[self.cfg.fn].has_answer  # the scorer's own fallbacks (lenient: last number)
            n_no_answer = sum(not has_answer(r, self.cfg.extraction) for r in responses)
        stats = {
            "reward/mean": sum(rewards) / len(rewards) if rewards else math.nan,
            "reward/n_items": float(len(results)),
            "reward/n_timeout": float(sum(r.status == "timeout" for r in results)),
            "reward/n_error": float(sum(r.status == "error" for r in results)),
            "reward/n_nonfinite": float(sum(r.status == "nonfinite" for r in results)),
            "reward/n_unscored": float(sum(r.status == "unscored" for r in results)),
            "reward/n_judge_unparsed": float(sum(r.status == "unparsed" for r in results)),
            "reward/n_no_answer": float(n_no_answer),
            "reward/workers_restarted": float((self._pool.restarts if self._pool is not None else 0) - restarts_before),
            "reward/time_s": time.perf_counter() - t0,
        }
        return rewards, stats

    def close(self) -> None:
        """Shut the worker processes down; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._pool is not None:
            self._pool.close()
        if self.judge is not None:
            self.judge.close()

    def __enter__(self) -> RewardManager:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

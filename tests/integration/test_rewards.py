"""Rewards: answer extraction, math-verify equivalence and GSM8K exact numbers scored in worker processes, and the
failure handling: a reward function that raises, hangs (interruptible or not), kills its worker or returns NaN
gives reward 0 and is counted, the pool keeps working, and shutdown leaves no processes behind."""

from __future__ import annotations

import math
import os
import signal
import time
from fractions import Fraction
from pathlib import Path

import psutil
import pytest

from megatron_rlvr.rewards import (
    NumericReward,
    RewardConfig,
    RewardManager,
    extract_answer,
    last_boxed,
    load_reward_fn,
    parse_number,
)

SHARED_DATA = Path(os.environ.get("MEGATRON_RLVR_SHARED_DATA", Path(__file__).resolve().parents[3] / "shared" / "data"))


# ---------------------------------------------------------------- user reward functions, imported by the workers
def misbehaving_reward(response: str, ground_truth: str, **metadata) -> float:
    """Exact string match, except for responses that ask it to misbehave."""
    if response == "raise":
        raise RuntimeError("user reward exploded")
    if response == "sleep":  # interruptible hang: the worker's SIGALRM stops it
        time.sleep(600)
    if response == "stubborn":  # swallows the interrupt: only the parent's kill stops it
        signal.signal(signal.SIGALRM, signal.SIG_IGN)
        while True:
            try:
                time.sleep(600)
            except BaseException:
                pass
    if response == "spin":  # computes for 0.1 s of CPU time; the reward is when it started (wall clock)
        start, t0 = time.time(), time.process_time()
        while time.process_time() - t0 < 0.1:
            pass
        return start
    if response == "exit":
        os._exit(7)
    if response == "die":  # a real crash (segfault, OOM kill): the worker is gone
        os.kill(os.getpid(), signal.SIGKILL)
    if response == "str":
        return "1.0"
    if response == "fork":  # a child of the reward fn (the multiprocessing "fork" method ends it with os._exit)
        import multiprocessing

        child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(0.01,))
        child.start()
        child.join(5)
        return float(child.exitcode == 0)
    if response == "nan":
        return math.nan
    if response == "meta":
        return float(metadata["level"]) + (100.0 if "other" in metadata else 0.0)
    return float(response.strip() == ground_truth.strip())


def level_only_reward(response: str, ground_truth: str, level: int = 0) -> float:
    """No **metadata: the manager passes only the keys it names."""
    return float(level)


NOT_A_FUNCTION = 3


# ------------------------------------------------------------------------------------------------------ extraction
@pytest.mark.parametrize(
    "text,expected",
    [
        (r"so \boxed{\frac{1}{2}} done", r"\frac{1}{2}"),
        (r"\boxed{1} then \boxed{\left( 3, \frac{\pi}{2} \right)}", r"\left( 3, \frac{\pi}{2} \right)"),
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),  # escaped braces are not counted
        (r"\fbox{42}", "42"),
        (r"\boxed 5$", "5"),
        (r"\boxed{7} and a truncated \boxed{\frac{1", "7"),  # unclosed last box -> previous complete one
        (r"\boxed{{a}{b}}", "{a}{b}"),
        ("no box here", None),
        (r"\boxedx{3}", None),
    ],
)
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


def test_extract_answer_modes():
    r = "Work...\n#### 1,234\nAnswer: 17\n"
    assert extract_answer(r, "boxed") is None
    assert extract_answer(r, "lenient") == "17"
    assert extract_answer("so #### 1,234", "lenient") == "1,234"
    assert extract_answer(r"Answer: 3 but \boxed{4}", "lenient") == "4"  # boxed wins
    assert extract_answer("The final answer is 12.", "lenient") == "12"
    assert extract_answer("  8 \n", "full") == "8"
    with pytest.raises(ValueError, match="extraction mode"):
        extract_answer("x", "regex")


@pytest.mark.parametrize(
    "text,expected",
    [
        ("18", Fraction(18)),
        ("$1,000", Fraction(1000)),
        ("\\$1,234,567.50", Fraction(123456750, 100)),
        ("18 dollars", Fraction(18)),
        ("18.00", Fraction(18)),
        ("x = 5", Fraction(5)),
        ("-7", Fraction(-7)),
        ("3/4", Fraction(3, 4)),
        ("\\frac{3}{4}", Fraction(3, 4)),
        ("50\\%", Fraction(50)),
        ("12 \\text{ cm}^2", Fraction(12)),
        ("\\boxed{9}", Fraction(9)),
        ("3 4", None),
        ("5 x 3", None),
        ("seven", None),
        ("", None),
        ("1/0", None),
    ],
)
def test_parse_number(text, expected):
    assert parse_number(text) == expected


def test_numeric_reward_gsm8k_style():
    """Exact numbers: commas, $, units stripped; 18.5 != 18; lenient mode falls back on the last number."""
    boxed, lenient = NumericReward("boxed"), NumericReward("lenient")
    assert boxed(r"She earns \boxed{\$1,080}.", "1080") == 1.0
    assert boxed(r"\boxed{18.00 dollars}", "18") == 1.0
    assert boxed(r"\boxed{18.5}", "18") == 0.0
    assert boxed("The answer is 18", "18") == 0.0  # boxed mode needs a box
    assert lenient("The answer is 18", "18") == 1.0
    assert lenient("Janet makes 9 * 2 = 18 dollars.\n#### 18", "18") == 1.0
    assert lenient("no number", "18") == 0.0
    with pytest.raises(ValueError, match="not a number"):
        boxed(r"\boxed{1}", r"\frac{\pi}{2}")


def test_exact_stop_reward_needs_the_answer_and_a_stop():
    """exact_stop: 1 only for exactly the answer (stripped) in a response that ended by itself; a response cut at the
    length limit scores 0 even when its text is the answer; a caller that does not say how the sample ended is an
    error, not a silent 0."""
    from megatron_rlvr.rewards import ExactStopReward

    full, lenient = ExactStopReward("full"), ExactStopReward("lenient")
    assert full("7", "7", finish_reason="stop") == 1.0
    assert full(" 7 ", "7", finish_reason="stop") == 1.0
    assert full("7", "7", finish_reason="length") == 0.0
    assert full("77", "7", finish_reason="stop") == 0.0
    assert full("=7", "7", finish_reason="stop") == 0.0  # the exact answer, not the last number
    assert full("", "7", finish_reason="stop") == 0.0
    assert lenient("so \\boxed{7}", "7", finish_reason="stop") == 1.0
    assert lenient("Answer: 7", "7", finish_reason="length") == 0.0
    assert lenient("7", "7", finish_reason="stop") == 1.0  # nothing to extract: the whole response
    with pytest.raises(ValueError, match="finish_reason"):
        full("7", "7")


def test_tiny_preset_reward_requires_eos():
    """The default run's reward, on the tiny tokenizer's own samples as the trainer's rollout step hands them over
    (text decoded without special tokens, the engine's finish reason with the metadata). Hand-computed: prompt "7=",
    answer "7", rollout.max_response_len = 4:

    - "7" EOS: stopped, exactly the answer -> 1
    - "7" <pad> <pad> <pad>: decodes to the same text "7", but cut at 4 tokens -> 0
    - "7777": cut -> 0
    - "8" EOS: stopped, wrong digit -> 0
    - EOS: stopped, empty -> 0
    """
    import dataclasses

    from megatron_rlvr.config import load_run_config
    from megatron_rlvr.data import Example
    from megatron_rlvr.families.tiny import tiny_tokenizer
    from megatron_rlvr.rollout.engine import Completion, RolloutOutput, SamplingParams
    from megatron_rlvr.rollout.groups import Generator, Round, engine_info, generate_groups

    cfg = load_run_config(None, [], check_files=False)
    assert (cfg.reward.fn, cfg.reward.extraction, cfg.rollout.max_response_len) == ("exact_stop", "full", 4)
    tok = tiny_tokenizer()
    eos, pad = tok.eos_token_id, tok.pad_token_id
    d7, d8 = tok.convert_tokens_to_ids("7"), tok.convert_tokens_to_ids("8")
    samples = [([d7, eos], "stop"), ([d7, pad, pad, pad], "length"), ([d7] * 4, "length"), ([d8, eos], "stop")]
    samples.append(([eos], "stop"))
    expected = [1.0, 0.0, 0.0, 0.0, 0.0]

    class ScriptedEngine:
        def generate(self, prompts, params, prompt_keys=None):
            assert params.max_tokens == 4
            comps = [
                Completion(ids, [0.0] * len(ids), why, None, tok.decode(ids, skip_special_tokens=True))
                for ids, why in samples
            ]
            return [RolloutOutput(list(prompts[0]), comps)]

    texts = [tok.decode(ids, skip_special_tokens=True) for ids, _ in samples]
    assert texts == ["7", "7", "7777", "8", ""]  # the text alone cannot tell the first two apart
    with RewardManager(dataclasses.replace(cfg.reward, num_workers=0)) as rm:
        rnd = Round(
            [Example("7=", "7", "procedural:copy", "copy-0-0", {"level": 1})],
            [tok("7=", add_special_tokens=False)["input_ids"]],
            SamplingParams(n=len(samples), max_tokens=cfg.rollout.max_response_len),
            seed=0,
            step=1,
            round_idx=0,
        )
        gen = Generator(ScriptedEngine(), rm, tok, engine_info(rank=0, world_size=1, rollout_tp=1), lambda obj: [obj])
        groups, _ = generate_groups(gen, rnd)
    assert groups[0].rewards == expected


# --------------------------------------------------------------------------------------- RewardManager, math-verify
@pytest.fixture(scope="module")
def math_rm():
    with RewardManager(RewardConfig(fn="math", num_workers=2, timeout_s=20.0)) as rm:
        yield rm


MATH_CASES = [
    (r"so \boxed{0.5}", r"\frac{1}{2}", 1.0),
    (r"\boxed{\frac{2}{4}}", "0.5", 1.0),
    (r"The point is \boxed{(3, pi/2)}", r"\left( 3, \frac{\pi}{2} \right)", 1.0),
    (r"\boxed{\left( 3, \frac{\pi}{2} \right)}", r"\left( 3, \frac{\pi}{2} \right)", 1.0),
    (r"\boxed{(3, \frac{\pi}{3})}", r"\left( 3, \frac{\pi}{2} \right)", 0.0),
    (r"\boxed{-q + p}", "p - q", 1.0),
    (r"\boxed{p + q}", "p - q", 0.0),
    (r"\boxed{\frac{1}{\sqrt{2}}}", r"\frac{\sqrt{2}}{2}", 1.0),
    (r"\fbox{27}", "27", 1.0),
    (r"\boxed{28}", "27", 0.0),
    (r"\boxed{0.49}", r"\frac{1}{2}", 0.0),
    ("I think it is 0.5", r"\frac{1}{2}", 0.0),  # no box: no answer under 'boxed'
]


def test_math_verify_equivalence(math_rm):
    responses, truths, expected = zip(*MATH_CASES)
    rewards, stats = math_rm.score(list(responses), list(truths))
    assert rewards == list(expected)
    assert stats["reward/n_items"] == len(MATH_CASES)
    assert stats["reward/n_no_answer"] == 1 and stats["reward/n_timeout"] == 0 and stats["reward/n_error"] == 0
    assert stats["reward/mean"] == pytest.approx(sum(expected) / len(expected))


@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="shared data not found")
def test_math_verify_on_real_answers(math_rm):
    """Every MATH-500 gold answer parses and matches itself when boxed; the workers are reused across batches."""
    from megatron_rlvr.data import load_examples

    pids = math_rm.worker_pids
    exs = load_examples(str(SHARED_DATA / "math500/test.jsonl"))[:40]
    rewards, stats = math_rm.score([f"Thus \\boxed{{{e.answer}}}." for e in exs], [e.answer for e in exs])
    assert rewards == [1.0] * len(exs), [e.answer for e, r in zip(exs, rewards) if r != 1.0]
    assert math_rm.worker_pids == pids and stats["reward/workers_restarted"] == 0


def test_math_verify_hang_on_adversarial_answer_times_out():
    """A power tower makes sympy evaluate for minutes: the item times out (reward 0, counted) and the next item in
    the same batch is still scored."""
    with RewardManager(RewardConfig(fn="math", num_workers=1, timeout_s=1.0, kill_grace_s=2.0)) as rm:
        rewards, stats = rm.score([r"\boxed{9^{9^{9^{9}}}}", r"\boxed{7}"], ["7", "7"])
    assert rewards == [0.0, 1.0] and stats["reward/n_timeout"] == 1 and stats["reward/n_error"] == 0


def test_math_lenient_mode_reads_dapo_answer_lines():
    """DAPO-Math-17k prompts ask for a last line "Answer: X"; lenient extraction scores it, boxed does not."""
    from megatron_rlvr.rewards import MathVerifyReward

    lenient, boxed = MathVerifyReward("lenient"), MathVerifyReward("boxed")
    response = "Adding the halves...\nAnswer: $\\frac{1}{2}$"
    assert lenient(response, "0.5") == 1.0 and boxed(response, "0.5") == 0.0
    assert lenient("Answer: 34", "35") == 0.0
    assert lenient("so we get $x = 5$ in the end", "5") == 1.0  # no marker: math-verify reads the whole response
    with pytest.raises(ValueError, match="cannot parse the ground truth"):
        lenient("Answer: 1", "}{")


def test_gsm8k_inline_mode():
    """num_workers=0 scores in-process (no pool) with the same results."""
    with RewardManager(RewardConfig(fn="gsm8k", num_workers=0, extraction="lenient")) as rm:
        assert rm.worker_pids == []
        rewards, stats = rm.score(["#### 1,000", r"\boxed{72}", "it is 71"], ["1000", "72", "72"])
    assert rewards == [1.0, 1.0, 0.0] and stats["reward/n_error"] == 0


def test_no_answer_counts_only_responses_the_scorer_found_no_answer_in():
    """reward/n_no_answer counted what the strict extractor missed, even where the lenient scorer found (and
    rewarded) an answer: the tiny preset logged every response as "no answer" at reward 0.99."""
    from megatron_rlvr.rewards.builtin import MathVerifyReward

    with RewardManager(RewardConfig(fn="gsm8k", num_workers=0, extraction="lenient")) as rm:
        rewards, stats = rm.score(["7", "it is 71", "no idea", r"\boxed{3}"], ["7", "72", "1", "3"])
    assert rewards == [1.0, 0.0, 0.0, 1.0] and stats["reward/n_no_answer"] == 1
    with RewardManager(RewardConfig(fn="gsm8k", num_workers=0, extraction="boxed")) as rm:
        assert rm.score(["7", r"\boxed{7}"], ["7", "7"])[1]["reward/n_no_answer"] == 1
    assert MathVerifyReward.has_answer(r"so $x = \frac{1}{2}$", "lenient")
    assert not MathVerifyReward.has_answer("no idea", "lenient") and not MathVerifyReward.has_answer("7", "boxed")


# ------------------------------------------------------------------------------------------------ failure handling
@pytest.fixture(scope="module")
def user_rm():
    cfg = RewardConfig(fn=f"{__name__}:misbehaving_reward", num_workers=2, timeout_s=1.0, kill_grace_s=1.5)
    rm = RewardManager(cfg)
    yield rm
    rm.close()


def test_user_fn_raise_and_nan_are_counted(user_rm):
    pids = user_rm.worker_pids
    rewards, stats = user_rm.score(["4", "raise", "nan", "5"], ["4", "4", "4", "4"])
    assert rewards == [1.0, 0.0, 0.0, 0.0]
    # NaN is counted on its own (reward/n_nonfinite), not as an error: a scorer's NaN is a bug of its own kind
    assert stats["reward/n_error"] == 1 and stats["reward/n_nonfinite"] == 1 and stats["reward/n_timeout"] == 0
    details = user_rm.score_detailed(["raise", "nan"], ["1", "1"])
    assert details[0].status == "error" and "RuntimeError: user reward exploded" in details[0].error
    assert "misbehaving_reward" in details[0].detail  # the traceback travels with the result
    assert details[1].status == "nonfinite" and "non-finite" in details[1].error
    assert user_rm.worker_pids == pids  # an exception does not cost a worker


def test_user_fn_metadata_passthrough(user_rm):
    rewards, _ = user_rm.score(["meta", "meta"], ["", ""], [{"level": 3}, {"level": 5, "other": 1}])
    assert rewards == [3.0, 105.0]
    with RewardManager(RewardConfig(fn=f"{__name__}.level_only_reward", num_workers=0)) as rm:
        assert rm.score(["x"], ["y"], [{"level": 4, "subject": "algebra"}])[0] == [4.0]


def test_interruptible_hang_times_out_without_losing_the_worker(user_rm):
    pids = user_rm.worker_pids
    t0 = time.monotonic()
    rewards, stats = user_rm.score(["sleep", "1", "2"], ["1", "1", "1"])
    elapsed = time.monotonic() - t0
    assert rewards == [0.0, 1.0, 0.0]
    assert stats["reward/n_timeout"] == 1 and stats["reward/workers_restarted"] == 0
    # Stopped by the worker's own 1.0 s timer (same worker processes, none restarted), before the 2.5 s kill.
    assert 0.95 < elapsed < 2.5
    assert user_rm.worker_pids == pids


def test_stuck_worker_is_killed_and_replaced(user_rm):
    """A function that ignores the interrupt is killed at timeout_s + kill_grace_s; its worker process is gone, a
    new one takes its place, the other items are scored, and the pool works afterwards."""
    old = set(user_rm.worker_pids)
    t0 = time.monotonic()
    rewards, stats = user_rm.score(["stubborn", "1", "1", "1"], ["1", "1", "1", "1"])
    elapsed = time.monotonic() - t0
    assert rewards == [0.0, 1.0, 1.0, 1.0]
    assert stats["reward/n_timeout"] == 1 and stats["reward/workers_restarted"] == 1
    assert 2.5 <= elapsed < 15  # killed at timeout_s + kill_grace_s = 2.5 s, not earlier
    new = set(user_rm.worker_pids)
    killed = old - new
    assert len(killed) == 1 and len(new) == 2
    assert not _alive(killed.pop())
    rewards, stats = user_rm.score(["7", "8"], ["7", "7"])
    assert rewards == [1.0, 0.0] and stats["reward/n_timeout"] == 0


def test_worker_death_is_an_error_and_replaced(user_rm):
    rewards, stats = user_rm.score(["die", "3"], ["3", "3"])
    assert rewards == [0.0, 1.0]
    assert stats["reward/n_error"] == 1 and stats["reward/workers_restarted"] == 1
    detail = user_rm.score_detailed(["die"], ["3"])[0]
    assert detail.status == "error" and "exit code -9" in detail.error
    assert user_rm.score(["3"], ["3"])[0] == [1.0]


def test_os_exit_in_the_reward_fn_is_an_error_without_a_worker_restart(user_rm):
    """Issue 14 item 5: os._exit used to end the worker, and each replacement costs seconds of imports (steps 40x
    slower). In a worker it now raises: an error naming the call, the same worker processes."""
    pids = user_rm.worker_pids
    rewards, stats = user_rm.score(["exit", "3", "exit"], ["3", "3", "3"])
    assert rewards == [0.0, 1.0, 0.0]
    assert stats["reward/n_error"] == 2 and stats["reward/workers_restarted"] == 0
    detail = user_rm.score_detailed(["exit"], ["3"])[0]
    assert detail.status == "error" and "os._exit(7)" in detail.error
    assert user_rm.worker_pids == pids


def test_forked_child_of_the_reward_fn_still_exits(user_rm):
    """os._exit raises only in the worker itself: a child forked by the reward function (multiprocessing "fork",
    which ends the child with os._exit) must exit, not carry on as a second reader of the worker's pipe."""
    pids = user_rm.worker_pids
    details = user_rm.score_detailed(["fork", "3", "fork", "3"], ["3", "3", "3", "3"])
    assert [(d.status, d.reward) for d in details] == [("ok", 1.0)] * 4, details
    assert user_rm.worker_pids == pids
    assert user_rm.score(["3", "x"], ["3", "3"])[0] == [1.0, 0.0]


@pytest.fixture(scope="module")
def one_worker_rm():
    """One worker: its items come in chunks, so every failure below happens with items queued behind it."""
    cfg = RewardConfig(fn=f"{__name__}:misbehaving_reward", num_workers=1, timeout_s=1.0, kill_grace_s=1.5)
    rm = RewardManager(cfg)
    yield rm
    rm.close()


def test_items_queued_behind_a_failure_in_a_chunk_are_scored(one_worker_rm):
    """An error, a NaN and an interrupted hang in the middle of a worker's chunk: the items after each are scored
    by the same worker (after the timeout, in forked copies of it: no worker is replaced), and the batch takes the
    one timeout plus the forks (tens of ms each on a busy machine)."""
    rm = one_worker_rm
    pids = rm.worker_pids
    responses = ["1", "raise", "2", "sleep", "1", "nan", "1"] + ["1", "2"] * 20
    t0 = time.monotonic()
    details = rm.score_detailed(responses, ["1"] * len(responses))
    elapsed = time.monotonic() - t0
    want = {"raise": ("error", 0.0), "sleep": ("timeout", 0.0), "nan": ("nonfinite", 0.0), "2": ("ok", 0.0)}
    assert [(d.status, d.reward) for d in details] == [want.get(r, ("ok", 1.0)) for r in responses]
    assert 0.95 < elapsed < 8 and rm.worker_pids == pids


def test_a_batch_that_hangs_everywhere_ends_in_about_one_timeout_whatever_its_size(one_worker_rm):
    """Items used to time out one after another on their worker: 64 hanging items on one worker at timeout_s=1
    took 64 s (at the defaults, one tiny-preset step with a sleeping reward took 664 s). After the first timeout the
    rest of the batch is scored at once, each item in its own forked process: every item times out, its worker
    survives, and the batch ends within the first timeout + one more (timeout + kill grace) + the forks."""
    rm = one_worker_rm
    pids = rm.worker_pids
    n = 64
    t0 = time.monotonic()
    details = rm.score_detailed(["sleep"] * n, ["1"] * n)
    elapsed = time.monotonic() - t0
    assert [d.status for d in details] == ["timeout"] * n
    assert elapsed < 1.0 + 2.5 + 0.3 * n, elapsed  # 64 s in order
    assert rm.worker_pids == pids
    assert rm.score(["1", "2"], ["1", "1"])[0] == [1.0, 0.0]


def test_items_that_compute_after_a_timeout_get_the_cpu_in_turn():
    """Scoring at once is for items that hang asleep: items that compute, started together after a timeout, would
    share the worker's CPU and each take many times its CPU time in wall time, past the limit (false timeouts). An
    item starts only while no other one computes: 10 items of 0.1 s of CPU each start at least 0.1 s apart (started
    together they start a fork apart, milliseconds) and all score (a 3 s limit: 30x the CPU time, for busy
    machines)."""
    cfg = RewardConfig(fn=f"{__name__}:misbehaving_reward", num_workers=1, timeout_s=3.0, kill_grace_s=1.0)
    with RewardManager(cfg) as rm:
        details = rm.score_detailed(["sleep"] + ["spin"] * 10, ["1"] * 11)
    assert details[0].status == "timeout"
    assert [d.status for d in details[1:]] == ["ok"] * 10
    starts = sorted(d.reward for d in details[1:])
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert min(gaps) >= 0.1, gaps


def test_item_processes_that_ignore_the_interrupt_are_killed_and_leave_nothing(one_worker_rm):
    """Scoring at once: an item that swallows SIGALRM is killed at timeout_s + kill_grace_s (its process, not the
    worker), one that kills itself is an error, and no item process is left behind."""
    rm = one_worker_rm
    pids = rm.worker_pids
    details = rm.score_detailed(["sleep", "stubborn", "die", "1", "stubborn", "2"], ["1"] * 6)
    assert [d.status for d in details] == ["timeout", "timeout", "error", "ok", "timeout", "ok"]
    assert "killed 2.5 s after its start" in details[1].error and "exit code -9" in details[2].error
    assert rm.worker_pids == pids
    assert psutil.Process(pids[0]).children() == []


def test_should_stop_abandons_a_hanging_batch_within_a_second(one_worker_rm):
    """A stop signal (SIGTERM before a Slurm pre-emption) waited for every hanging item of the batch. With
    ``should_stop`` the pool asks it every 0.2 s: True after 0.5 s raises ScoringStopped well before the 1 s
    timeout, the busy worker is replaced and the next batch is scored normally."""
    from megatron_rlvr.rewards.manager import ScoringStopped

    rm = one_worker_rm
    t0 = time.monotonic()
    with pytest.raises(ScoringStopped):
        rm.score(["sleep"] * 20, ["1"] * 20, should_stop=lambda: time.monotonic() - t0 > 0.5)
    assert time.monotonic() - t0 < 0.9
    assert rm.score(["1", "2"], ["1", "1"])[0] == [1.0, 0.0]
    # stopped while scoring at once (after the first timeout): the items' processes, here ones that swallow their
    # interrupt, die with their replaced worker
    seen = []

    def stop_once_forked():
        kids = psutil.Process(rm.worker_pids[0]).children()
        seen.extend(k for k in kids if k.pid not in {s.pid for s in seen})
        return len(seen) >= 3

    with pytest.raises(ScoringStopped):
        rm.score(["sleep"] + ["stubborn"] * 5, ["1"] * 6, should_stop=stop_once_forked)
    gone, alive = psutil.wait_procs(seen, timeout=5)
    assert len(seen) >= 3 and not alive
    with RewardManager(RewardConfig(fn=f"{__name__}:misbehaving_reward", num_workers=0)) as inline:
        with pytest.raises(ScoringStopped):
            inline.score(["1"] * 3, ["1"] * 3, should_stop=lambda: True)


def test_a_killed_or_dead_workers_unstarted_items_go_back_to_the_queue(one_worker_rm):
    """The worker is killed on a stuck item (or dies on one) with more of its chunk still to do: those items are
    scored by the replacement, none is lost or scored twice."""
    rm = one_worker_rm
    for bad, status in (("stubborn", "timeout"), ("die", "error")):
        responses = [bad, "1", "2", "1", "1", "2"]
        details = rm.score_detailed(responses, ["1"] * len(responses))
        assert details[0].status == status
        assert [(d.status, d.reward) for d in details[1:]] == [("ok", float(r == "1")) for r in responses[1:]]
    assert rm.score(["1", "2"], ["1", "1"])[0] == [1.0, 0.0]


def test_non_numeric_return_is_rejected_with_the_value(user_rm):
    """A string "1.0" used to be converted silently; it is an error that shows the value."""
    detail = user_rm.score_detailed(["str"], ["1"])[0]
    assert detail.status == "error" and detail.reward == 0.0
    assert "returned str '1.0'" in detail.error and "must return a number" in detail.error


def test_bad_inputs(user_rm):
    with pytest.raises(ValueError, match="2 responses but 1 ground truths"):
        user_rm.score(["a", "b"], ["a"])
    with pytest.raises(ValueError, match="must be str"):
        user_rm.score([None], ["a"])
    rewards, stats = user_rm.score([], [])
    assert rewards == [] and math.isnan(stats["reward/mean"])
    unpicklable = [{"level": 1, "fn": lambda: 0}]
    details = user_rm.score_detailed(["meta"], [""], unpicklable)
    assert details[0].status == "error" and "cannot send item" in details[0].error


def test_close_leaves_no_processes():
    rm = RewardManager(RewardConfig(fn=f"{__name__}:misbehaving_reward", num_workers=2))
    assert rm.score(["1"], ["1"])[0] == [1.0]
    pids = rm.worker_pids
    assert all(_alive(p) for p in pids)
    rm.close()
    rm.close()  # idempotent
    assert not any(psutil.pid_exists(p) for p in pids)  # stopped and reaped
    with pytest.raises(RuntimeError, match="closed"):
        rm.score(["1"], ["1"])


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _manager_in_daemonic_child(queue) -> None:
    with RewardManager(RewardConfig(fn="gsm8k", num_workers=2)) as rm:
        queue.put((rm.score([r"\boxed{3}", "4"], ["3", "3"])[0], rm.worker_pids))
        time.sleep(600)  # until the test kills this process


def test_workers_inside_a_daemonic_process_exit_when_it_is_killed():
    """A RewardManager works inside a daemonic process (a rank of the multi-process harness), and its workers exit
    by themselves when that process is SIGKILLed (no cleanup code runs there): no orphans."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_manager_in_daemonic_child, args=(queue,), daemon=True)
    proc.start()
    try:
        rewards, pids = queue.get(timeout=60)
        assert rewards == [1.0, 0.0] and len(pids) == 2 and all(_alive(p) for p in pids)
    finally:
        proc.kill()
        proc.join()
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids)


def test_unguarded_main_script_is_not_reimported(tmp_path):
    """Workers do not re-run the caller's __main__ (multiprocessing's spawn would, once per worker): a script with
    no `if __name__ == "__main__":` guard runs its body exactly once and scores."""
    import subprocess
    import sys

    marker = tmp_path / "runs.txt"
    script = tmp_path / "train_like.py"
    script.write_text(
        "from megatron_rlvr.rewards import RewardConfig, RewardManager\n"
        f"open({str(marker)!r}, 'a').write('ran\\n')\n"
        "rm = RewardManager(RewardConfig(fn='gsm8k', num_workers=2))\n"
        "print(rm.score([r'\\boxed{5}'], ['5'])[0])\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[1.0]" and marker.read_text() == "ran\n"


# ------------------------------------------------------------------------------------------------ dotted-path errors
@pytest.mark.parametrize(
    "spec,message",
    [
        ("no_such_pkg_xyz.mod:fn", "cannot import module 'no_such_pkg_xyz.mod': ModuleNotFoundError"),
        (f"{__name__}:no_such_fn", f"module '{__name__}' has no attribute 'no_such_fn'"),
        (f"{__name__}.NOT_A_FUNCTION", "is not callable (got int)"),
        ("mathh", "neither a built-in"),
        (f"{__name__}:", "both parts non-empty"),
        ("os.path:join", None),  # importable and callable with two positional args: accepted
    ],
)
def test_dotted_path_errors(spec, message):
    if message is None:
        assert callable(load_reward_fn(spec))
        return
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        RewardConfig(fn=spec)


def test_reward_config_validation():
    with pytest.raises(ValueError, match="reward.extraction"):
        RewardConfig(extraction="last")
    with pytest.raises(ValueError, match="reward.num_workers"):
        RewardConfig(num_workers=-1)
    with pytest.raises(ValueError, match="reward.timeout_s"):
        RewardConfig(timeout_s=0)
    with pytest.raises(ValueError, match="signature"):
        load_reward_fn(f"{__name__}:_one_arg")


def _one_arg(response):
    return 0.0

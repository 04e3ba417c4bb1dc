"""Model-judged rewards (rewards/judge.py, trainer/judge_setup.py) and weighted mixes (reward.fn=mix): the verdict
parser, per-item failure counting (unreadable replies, a judge past its wall-clock limit, a judge engine that
raises: each scores 0 and is counted, never a crash), a generative judge on the transformers engine against
transformers' own greedy decode, a scalar reward model against unpadded per-item forwards in float64, mixes
against hand-computed sums, and one clear line per bad option."""

import math

import judge_helpers
import pytest
import torch

from megatron_rlvr.rewards import RewardConfig, RewardManager
from megatron_rlvr.rewards.judge import GenerativeJudge, ScalarRewardModel, parse_verdict, render_judge_input
from megatron_rlvr.rewards.judge_config import JudgeConfig, MixTerm
from megatron_rlvr.rewards.manager import FAILURE_COUNTS, RewardFailure, ScoringStopped, check_failure_fraction
from megatron_rlvr.rollout.groups import REWARD_COUNTS
from megatron_rlvr.trainer.judge_setup import build_judge

PLAIN = dict(template="{question}{response}", chat=False)
"""Judge input = question text + response: the tiny tokenizer has no letters for the default template."""


@pytest.fixture(scope="module")
def judges(tmp_path_factory):
    root = tmp_path_factory.mktemp("judges")
    return {
        "last7_generative": judge_helpers.save_last_token_judge(root / "g7", "generative"),
        "last7_scalar": judge_helpers.save_last_token_judge(root / "s7", "scalar"),
        "random_generative": judge_helpers.save_random_judge(root / "rg", "generative", seed=3),
        "random_scalar": judge_helpers.save_random_judge(root / "rs", "scalar", seed=4),
    }


class FakeTokenizer:
    """Characters as ids (no chat template): enough for judges whose engine is scripted."""

    chat_template = None

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) for c in text]}


def scripted_judge(generate, clock=None, **cfg):
    cfg = JudgeConfig(model="unused", **{**PLAIN, "parse": "verdict", **cfg})
    kw = {} if clock is None else {"clock": clock}
    return GenerativeJudge(cfg, FakeTokenizer(), generate, **kw)


def manager(judge, fn="judge", **cfg):
    jc = judge.cfg
    return RewardManager(RewardConfig(fn=fn, judge=jc, num_workers=0, **cfg), report=lambda text: None, judge=judge)


def test_parse_verdict_reads_the_last_verdict_and_refuses_what_it_cannot_read():
    """Hand-made replies: the LAST verdict counts (a judge may quote the format first), scores must lie in [0, 1],
    "number" needs the whole reply to be one number; anything else is None (unparsed)."""
    quoted = 'Answer with "Verdict: correct" or "Verdict: incorrect".\nThe sum is wrong.\nVerdict: Incorrect'
    assert parse_verdict(quoted, "verdict") == 0.0
    assert parse_verdict("steps...\nverdict: CORRECT\n", "verdict") == 1.0
    assert parse_verdict("**Verdict:** correct", "verdict") == 1.0  # markdown bold around the label
    assert parse_verdict("Verdict: **correct**", "verdict") == 1.0
    assert parse_verdict("I think it is correct", "verdict") is None
    assert parse_verdict("Score: 0.2 ... Score: 0.75", "score") == 0.75
    assert parse_verdict("Score: 1.5", "score") is None
    assert parse_verdict("Score: -0.1", "score") is None
    assert parse_verdict("no score", "score") is None
    assert parse_verdict(" 1\n", "number") == 1.0
    assert parse_verdict("0.25", "number") == 0.25
    assert parse_verdict("1 0", "number") is None
    assert parse_verdict("", "number") is None
    assert parse_verdict("2", "number") is None


def test_template_shows_the_reference_only_where_there_is_one():
    """The default template's {reference_block} is a labelled paragraph with the ground truth, or nothing."""
    t = JudgeConfig(model="unused").template
    with_ref = render_judge_input(t, "What is 2+2?", "It is 4", "4")
    without = render_judge_input(t, "What is 2+2?", "It is 4", "  ")
    assert "Reference answer:\n4\n\n" in with_ref and "Reference answer" not in without
    assert "Question:\nWhat is 2+2?" in with_ref and "Response:\nIt is 4" in without


def test_unreadable_replies_a_raising_engine_and_a_late_judge_score_0_and_are_counted_per_item():
    """Scripted judge replies through the RewardManager: each unreadable reply scores 0 in reward/n_judge_unparsed
    while readable ones keep their verdict; an engine that raises gives every item 0 in reward/n_error; a judge
    that answers after reward.judge.timeout_s (a clock that jumps during the call, the check a non-interruptible
    engine gets) gives every item 0 in reward/n_timeout. None of them raises; the step's failure rule then counts
    all three kinds against reward.max_error_frac."""
    replies = ["Verdict: correct", "hmm", "Verdict: incorrect", "Verdict: maybe", "verdict: correct"]
    calls = []

    def scripted(ids, stop):
        calls.append(len(ids))
        return list(replies)

    j = scripted_judge(scripted)
    with manager(j) as rm:
        rewards, stats = rm.score(["r"] * 5, ["g"] * 5, questions=["q"] * 5)
    assert calls == [5]  # one generate call for the whole batch
    assert rewards == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert stats["reward/n_judge_unparsed"] == 2 and stats["reward/n_error"] == 0 and stats["reward/n_timeout"] == 0
    check_failure_fraction(stats, 0.5, "judge")  # 2 of 5 is within 0.5
    with pytest.raises(RewardFailure, match="unreadable judge replies 2"):
        check_failure_fraction(stats, 0.3, "judge")

    def unreachable(ids, stop):
        raise ConnectionError("judge engine unreachable")

    with manager(scripted_judge(unreachable)) as rm:
        rewards, stats = rm.score(["a", "b", "c"], ["1", "2", "3"])
        detail = rm.score_detailed(["a"], ["1"])[0]
    assert rewards == [0.0, 0.0, 0.0] and stats["reward/n_error"] == 3 and stats["reward/n_judge_unparsed"] == 0
    assert detail.status == "error" and "judge engine unreachable" in detail.error

    now = [0.0]

    def slow(ids, stop):
        now[0] += 11.0  # the call took 11 s against a limit of 10 s
        return ["Verdict: correct"] * len(ids)

    with manager(scripted_judge(slow, clock=lambda: now[0], timeout_s=10.0)) as rm:
        rewards, stats = rm.score(["a", "b"], ["1", "2"])
    assert rewards == [0.0, 0.0] and stats["reward/n_timeout"] == 2
    with pytest.raises(RewardFailure):
        check_failure_fraction(stats, 0.5, "judge")


def test_new_failure_counter_is_merged_over_engines_and_bounded_by_max_error_frac():
    """Every counter the step's failure rule reads is one the rollout side sums over engines."""
    assert set(FAILURE_COUNTS) <= set(REWARD_COUNTS)


def test_a_stop_request_during_judging_raises_scoring_stopped():
    """A stop signal is not a judge failure: the batch is abandoned with ScoringStopped (as the reward workers do)."""

    def interrupted(ids, stop):
        assert stop()  # the engine asks between decode steps
        return None

    with manager(scripted_judge(interrupted)) as rm:
        with pytest.raises(ScoringStopped):
            rm.score(["a"], ["1"], should_stop=lambda: True)


def test_transformers_engine_judge_is_interrupted_at_its_wall_clock_limit(judges, monkeypatch):
    """A real transformers-engine judge with a limit far below one decode step: the engine itself is interrupted
    between decode steps (it raises GenerationStopped, seen by a spy) and every item scores 0 in reward/n_timeout
    (no crash, no reply)."""
    from megatron_rlvr.rollout.engine import GenerationStopped
    from megatron_rlvr.rollout.hf_engine import HFRolloutEngine

    stopped = []
    real = HFRolloutEngine.generate

    def spy(self, *a, **kw):
        try:
            return real(self, *a, **kw)
        except GenerationStopped:
            stopped.append(True)
            raise

    monkeypatch.setattr(HFRolloutEngine, "generate", spy)
    jc = JudgeConfig(model=judges["random_generative"], parse="number", max_tokens=40, timeout_s=1e-4, **PLAIN)
    cfg = RewardConfig(fn="judge", judge=jc, num_workers=0)
    judge = build_judge(cfg, torch.device("cpu"))
    with RewardManager(cfg, report=lambda text: None, judge=judge) as rm:
        rewards, stats = rm.score(["12", "3"], ["1", "3"], questions=["1=", "3="])
    assert stopped == [True]
    assert rewards == [0.0, 0.0] and stats["reward/n_timeout"] == 2 and judge.last_replies == [None, None]


def test_generative_judge_replies_are_transformers_greedy_decodes_of_the_same_weights(judges):
    """The judge's prompt ids, batched through the transformers rollout engine (greedy, max_tokens), give exactly
    the replies of ``model.generate`` run on each prompt alone, and the rewards are the parser's reading of them
    (a random model's digits: some readable as a number in [0, 1], most not)."""
    jc = JudgeConfig(model=judges["random_generative"], parse="number", max_tokens=3, **PLAIN)
    cfg = RewardConfig(fn="judge", judge=jc, num_workers=0)
    judge = build_judge(cfg, torch.device("cpu"))
    questions = ["1=", "23=", "4+5=", "6=", "7*8=", "9="]
    responses = ["1", "23", "9", "", "56", "99 "]
    with RewardManager(cfg, report=lambda text: None, judge=judge) as rm:
        rewards, stats = rm.score(responses, ["0"] * 6, questions=questions)

    expected = judge_helpers.greedy_replies(jc.model, questions, responses)
    assert judge.last_replies == expected
    want = [parse_verdict(x, "number") for x in expected]
    assert rewards == [0.0 if w is None else w for w in want]
    assert stats["reward/n_judge_unparsed"] == sum(w is None for w in want)


def test_last_token_judges_prefer_responses_ending_in_7(judges):
    """The hand-built judges of judge_helpers: the generative one (engine, max_tokens=1, parse number) and the
    scalar one both give 1 exactly when the judge input (question + response) ends in "7", else 0."""
    questions = ["3=", "7=", "1=", "2=", "5="]
    responses = ["7", "3", "17", "", "71"]
    want = [1.0 if (q + r).endswith("7") else 0.0 for q, r in zip(questions, responses)]
    assert want == [1.0, 0.0, 1.0, 0.0, 0.0]
    for name, extra in (
        ("last7_generative", dict(parse="number", max_tokens=1)),
        ("last7_scalar", dict(kind="scalar")),
    ):
        cfg = RewardConfig(fn="judge", judge=JudgeConfig(model=judges[name], **PLAIN, **extra), num_workers=0)
        with RewardManager(cfg, judge=build_judge(cfg, torch.device("cpu"))) as rm:
            rewards, stats = rm.score(responses, ["0"] * 5, questions=questions)
        assert rewards == pytest.approx(want, abs=1e-4), name
        assert stats["reward/n_judge_unparsed"] == 0 and stats["reward/n_error"] == 0


def test_scalar_reward_model_matches_unpadded_float64_forwards_of_the_same_weights(judges):
    """Batched, right-padded scoring (chunks of 2 rows, inputs of different lengths) equals ``scale`` x the logit of
    a direct float64 forward of each input alone through AutoModelForSequenceClassification; an input that ends in
    the pad id (0, '<pad>' here, which the model's pooling skips) too."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    jc = JudgeConfig(model=judges["random_scalar"], kind="scalar", scale=3.0, max_batch_rows=2, **PLAIN)
    rm_model = ScalarRewardModel.from_pretrained(jc)
    questions = ["1=", "23=", "4+5=", "6=", "7*8="]
    responses = ["1", "23", "9 9 9", "", "56<pad>"]
    results = rm_model.score(questions, responses, [""] * 5)
    assert [r.status for r in results] == ["ok"] * 5

    tok = AutoTokenizer.from_pretrained(jc.model)
    ref = AutoModelForSequenceClassification.from_pretrained(jc.model, dtype=torch.float64).eval()
    with torch.no_grad():
        want = [
            3.0 * float(ref(torch.tensor([tok(q + r)["input_ids"]])).logits[0, 0]) for q, r in zip(questions, responses)
        ]
    assert len(set(round(w, 6) for w in want)) == 5  # the inputs are told apart
    assert [r.reward for r in results] == pytest.approx(want, abs=1e-5)


def test_mix_adds_weighted_terms_and_a_failed_term_adds_0():
    """reward.fn=mix with exact_stop (weight 1.0), gsm8k (weight 2.0) and a scripted judge (weight 0.5): each item's
    reward is the hand-computed weighted sum; an item whose judge reply is unreadable keeps its rule terms, adds 0
    for the judge, and is counted once in reward/n_judge_unparsed."""
    verdicts = {"7": "Verdict: correct", "8": "Verdict: incorrect", "9": "??"}

    def scripted(ids, stop):
        return [verdicts[chr(x[-1])] for x in ids]

    judge = scripted_judge(scripted)
    mix = [MixTerm("exact_stop", 1.0), MixTerm("gsm8k", 2.0), MixTerm("judge", 0.5)]
    cfg = RewardConfig(fn="mix", mix=mix, judge=judge.cfg, extraction="full", num_workers=0)
    metas = [
        {"finish_reason": "stop"},
        {"finish_reason": "length"},
        {"finish_reason": "stop"},
        {"finish_reason": "stop"},
    ]
    with RewardManager(cfg, report=lambda text: None, judge=judge) as rm:
        rewards, stats = rm.score(["7", "7", "8", "9"], ["7", "7", "8", "8"], metas, questions=[""] * 4)
    # exact_stop (needs "stop"), gsm8k (numbers only), judge verdict
    want = [1 * 1 + 2 * 1 + 0.5 * 1, 1 * 0 + 2 * 1 + 0.5 * 1, 1 * 1 + 2 * 1 + 0.5 * 0, 1 * 0 + 2 * 0 + 0.5 * 0]
    assert rewards == pytest.approx(want)
    assert stats["reward/n_judge_unparsed"] == 1 and stats["reward/n_error"] == 0


def test_mix_with_a_failing_rule_term_counts_the_item_once_under_the_rule_failure():
    """A rule term that raises (gsm8k on a non-numeric ground truth) fails the item's rule part: the judge's weighted
    reward is still added, the item is counted once, in reward/n_error."""
    judge = scripted_judge(lambda ids, stop: ["Verdict: correct"] * len(ids))
    cfg = RewardConfig(
        fn="mix", mix=[MixTerm("gsm8k", 1.0), MixTerm("judge", 0.25)], judge=judge.cfg, extraction="full", num_workers=0
    )
    with RewardManager(cfg, report=lambda text: None, judge=judge) as rm:
        rewards, stats = rm.score(["3", "3"], ["3", "x"])
    assert rewards == pytest.approx([1.25, 0.25])
    assert stats["reward/n_error"] == 1 and stats["reward/n_judge_unparsed"] == 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(fn="judge"), r"reward.fn=judge .* needs a reward.judge section"),
        (dict(fn="mix"), r"reward.fn=mix needs reward.mix"),
        (dict(fn="math", mix=[MixTerm("math", 1.0)]), r"reward.mix is set but reward.fn='math'"),
        (dict(fn="mix", mix=[MixTerm("math", 1.0), MixTerm("math", 2.0)]), r"names a term twice"),
        (dict(fn="mix", mix=[MixTerm("judge", 1.0)]), r"needs a reward.judge section"),
        (dict(fn="math", judge="J"), r"reward.judge is set but unused"),
        (dict(fn="mix", mix=[MixTerm("no_such_mod:fn", 1.0)]), r"cannot import module 'no_such_mod'"),
    ],
)
def test_bad_reward_options_are_refused_in_one_line(kwargs, message):
    """Each inconsistent reward option gets one line naming it."""
    if kwargs.get("judge") == "J":
        kwargs = {**kwargs, "judge": JudgeConfig(model="x")}
    with pytest.raises(ValueError, match=message) as e:
        RewardConfig(**kwargs)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(model=""), r"reward.judge.model must name"),
        (dict(kind="pairwise"), r"reward.judge.kind must be one of"),
        (dict(parse="yes"), r"reward.judge.parse must be one of"),
        (dict(engine="sglang"), r"reward.judge.engine must be one of \('hf', 'vllm'\)"),
        (dict(kind="scalar", engine="vllm"), r"reward.judge.engine and reward.judge.isolate apply to generative"),
        (dict(kind="scalar", isolate=True), r"reward.judge.engine and reward.judge.isolate apply to generative"),
        (dict(isolate="yes"), r"reward.judge.isolate must be true or false"),
        (dict(gpu_memory_utilization=1.0), r"reward.judge.gpu_memory_utilization must be a number in \(0, 1\)"),
        (dict(start_timeout_s=0), r"reward.judge.start_timeout_s must be a number > 0"),
        (dict(max_restarts=0), r"reward.judge.max_restarts must be an int >= 1"),
        (dict(template="no response here"), r"must contain the \{response\} placeholder"),
        (dict(template="{response} {answer}"), r"reward.judge.template: bad placeholder 'answer'"),
        (dict(max_tokens=0), r"reward.judge.max_tokens must be an int >= 1"),
        (dict(temperature=-1.0), r"reward.judge.temperature must be a number >= 0"),
        (dict(timeout_s=0), r"reward.judge.timeout_s must be a number > 0"),
        (dict(scale=math.inf), r"reward.judge.scale must be a finite number"),
        (dict(dtype="float16"), r"reward.judge.dtype must be"),
    ],
)
def test_bad_judge_options_are_refused_in_one_line(kwargs, message):
    """Each bad reward.judge option gets one line naming it."""
    with pytest.raises(ValueError, match=message) as e:
        JudgeConfig(**{"model": "x", **kwargs})
    assert "\n" not in str(e.value)


def test_mix_term_weight_must_be_a_finite_number():
    """A term's weight is checked where the term is read."""
    with pytest.raises(ValueError, match=r"reward.mix: term 'judge' needs a finite number as weight"):
        MixTerm("judge", math.nan)


def test_judge_folder_is_checked_where_the_run_starts(tmp_path):
    """A judge folder without config.json is refused by check_files (train), not by validation (plan)."""
    cfg = RewardConfig(fn="judge", judge=JudgeConfig(model=str(tmp_path)))
    with pytest.raises(ValueError, match=r"reward.judge.model=.* is not a checkpoint folder"):
        cfg.check_files()


def test_judge_run_config_loads_from_overrides(judges):
    """The typed sections load through the run config (OmegaConf): reward.judge and a reward.mix list."""
    from megatron_rlvr.config import load_run_config

    cfg = load_run_config(
        None,
        [
            "reward.fn=mix",
            "reward.mix=[{fn: exact_stop, weight: 1.0}, {fn: judge, weight: 0.5}]",
            f"reward.judge.model={judges['last7_scalar']}",
            "reward.judge.kind=scalar",
        ],
    )
    assert [(t.fn, t.weight) for t in cfg.reward.mix] == [("exact_stop", 1.0), ("judge", 0.5)]
    assert cfg.reward.judge.kind == "scalar" and cfg.reward.judge_weight() == 0.5
    assert cfg.reward.worker_fn == "mix" and cfg.reward.rule_fns() == ["exact_stop"]


def test_rollout_side_hands_the_question_to_the_judge_and_sums_unparsed_over_engines():
    """generate_groups with a scripted engine and two engines' results gathered (the same share twice): the judge
    sees each example's question (chat prompts: the last user message) with the response, the rewards land on the
    samples, and reward/n_judge_unparsed is summed over the engines like the other counters."""
    from megatron_rlvr.data import Example
    from megatron_rlvr.rollout.engine import Completion, RolloutOutput, SamplingParams
    from megatron_rlvr.rollout.groups import Generator, Round, engine_info, generate_groups

    class TwoSamples:
        interruptible = False

        def generate(self, prompts, params, prompt_keys=None):
            return [RolloutOutput(list(p), [Completion([3], [0.0], "stop", None, t) for t in "7x"]) for p in prompts]

    seen = []

    def scripted(ids, stop):
        texts = ["".join(map(chr, x)) for x in ids]
        seen.extend(texts)
        return ["Verdict: correct" if t.endswith("7") else "no verdict" for t in texts]

    judge = scripted_judge(scripted)
    examples = [
        Example(prompt="3=", answer="3", source="t", id="p0"),
        Example(
            prompt=[{"role": "system", "content": "s"}, {"role": "user", "content": "5="}],
            answer="5",
            source="t",
            id="p1",
        ),
    ]
    rnd = Round(examples, [[1], [2]], SamplingParams(n=2, max_tokens=2), seed=0, step=1, round_idx=0)
    with manager(judge) as rm:
        gen = Generator(TwoSamples(), rm, None, engine_info(0, 1, 1), lambda obj: [obj, obj])
        groups, stats = generate_groups(gen, rnd)
    assert seen == ["3=7", "3=x", "5=7", "5=x"]
    assert [g.rewards for g in groups] == [[1.0, 0.0], [1.0, 0.0]] * 2
    assert stats["reward/n_judge_unparsed"] == 2 * 2 and stats["reward/n_items"] == 2 * 4


def test_a_reward_failure_is_said_once_by_the_scoring_rank_that_scoring_named(monkeypatch, capsys):
    """Every scoring rank raises a step's RewardFailure alike and one line says it. Colocated (no speaker set):
    global rank 0 says it. Disaggregated: the rollout ranks score, and global rank 0 is a training rank that only
    sees its data channel close; the first engine's leader (``speaker``) says it. Before, every rollout rank kept
    quiet (RANK != 0) and the run ended with the channel error alone."""
    from megatron_rlvr.commands import cli

    def said(rank: str, speaker) -> bool:
        monkeypatch.setenv("RANK", rank)
        e = RewardFailure("reward fn 'judge': 3 of 4 rewards of this step failed")
        if speaker is not None:
            e.speaker = speaker
        cli._report("train", e)
        err = capsys.readouterr().err
        assert err in ("", "megatron-rlvr train: error: reward fn 'judge': 3 of 4 rewards of this step failed\n"), err
        return bool(err)

    assert said("0", None) and not said("1", None)
    assert said("1", True) and not said("2", False) and not said("0", False)

"""Off-policy guidance (``agent.guidance``): the environment's demonstration as a trajectory (rollout/multiturn.py
``demonstrate``), where it goes into a group (rollout/groups.py ``guide``), the on-policy metrics
(trainer/batch.py ``on_policy_metrics``) and the configurations refused.

References: the tiny_tools tokenizer's ids of hand-written token strings, a trajectory the real rollout loop builds
from a scripted engine that writes the same text, and hand-computed accuracies."""

import math

import pytest
import torch

from megatron_rlvr.agentic.agent_config import AgentConfig
from megatron_rlvr.agentic.registry import build_environment
from megatron_rlvr.algorithms.algorithm_config import AdvantageConfig
from megatron_rlvr.config.run import ConfigError, check_guidance
from megatron_rlvr.data.records import Example
from megatron_rlvr.families.tiny import tiny_tokenizer
from megatron_rlvr.rewards import RewardManager
from megatron_rlvr.rewards.reward_config import RewardConfig
from megatron_rlvr.rollout.engine import Completion, RolloutOutput, SamplingParams
from megatron_rlvr.rollout.groups import Round, _score, _trajectory_group, decode_action, guide
from megatron_rlvr.rollout.mismatch import MismatchCorrectionConfig
from megatron_rlvr.rollout.multiturn import MultiTurn, demonstrate, roll_out
from megatron_rlvr.trainer.batch import GroupRewards, batch_metrics
from megatron_rlvr.trainer.microbatch import Sequence, build_microbatch, importance_weights

TOK = tiny_tokenizer("tiny_tools")
THRESHOLD = AdvantageConfig().correct_threshold


def _multi(max_turns=2, budget=24, turn_tokens=8):
    env = build_environment(AgentConfig(environment="arithmetic_tools", tools=["calculator"]), TOK)
    return MultiTurn.build(env, TOK, max_turns=max_turns, budget=budget, max_turn_tokens=turn_tokens)


def _decode(ids):
    return decode_action(TOK, ids)


def _ex(prompt="37*58=", answer="2146", i="0"):
    return Example(prompt=prompt, answer=answer, source="t", id=i)


class ScriptedEngine:
    """Writes scripted turns: ``scripts[prompt][sample]`` is that trajectory's list of turn texts, each tokenized
    on its own (a turn that ends the trajectory with EOS appended), as a sampler that drew exactly these tokens
    would return them."""

    def __init__(self, scripts, eos_last=True):
        self.scripts = scripts
        self.eos_last = eos_last
        self.turn_of: dict[int, int] = {}

    def _completion(self, turns, t):
        ids = list(TOK(turns[t], add_special_tokens=False)["input_ids"])
        if self.eos_last and t == len(turns) - 1:
            ids.append(TOK.eos_token_id)
        return Completion(ids, [-0.5] * len(ids), "stop")

    def generate(self, prompts, params, prompt_keys=None, **kw):
        out = []
        for p, key in zip(prompts, prompt_keys):
            if params.n > 1 or key not in self.turn_of:  # the first turn: n samples of prompt `key`
                comps = []
                for j in range(params.n):
                    self.turn_of[key * params.n + j] = 1
                    comps.append(self._completion(self.scripts[key][j], 0))
                out.append(RolloutOutput(list(p), comps))
            else:
                i, j = divmod(key, len(self.scripts[0]))
                t = self.turn_of[key]
                self.turn_of[key] = t + 1
                out.append(RolloutOutput(list(p), [self._completion(self.scripts[i][j], t)]))
        return out


TOOL_PATH = ["<tool_call>37*58</tool_call>", "2146"]


def test_demonstration_ids_and_mask_are_those_of_a_sampled_trajectory_with_the_same_text():
    """The demonstration of "37*58=" is the hand-written token sequence (call, observation of the real calculator,
    answer, EOS) with loss mask 1 on the assistant's tokens and 0 on the observation's, and it equals, id for id
    and mask for mask (and in reward terms and tool calls), the trajectory the rollout loop builds when an engine
    samples the same two turns."""
    multi = _multi()
    demo = demonstrate(multi, _ex(), TOK, _decode)
    call = ["<tool_call>", "3", "7", "*", "5", "8", "</tool_call>"]
    obs = ["<tool_response>", "2", "1", "4", "6", "</tool_response>"]
    answer = ["2", "1", "4", "6", TOK.eos_token]
    want = TOK.convert_tokens_to_ids(call + obs + answer)
    assert TOK.unk_token_id not in want
    assert demo.response_ids == want
    assert demo.loss_mask == [1] * len(call) + [0] * len(obs) + [1] * len(answer)
    assert demo.turns == 2 and demo.cut == "" and demo.final_text == "2146"
    params = SamplingParams(n=1, temperature=1.0, max_tokens=24, seed=0)
    prompt = TOK("37*58=", add_special_tokens=False)["input_ids"]
    [[sampled]] = roll_out(ScriptedEngine([[TOOL_PATH]]), multi, [_ex()], [prompt], params, [0], decode=_decode)
    assert sampled.response_ids == demo.response_ids
    assert sampled.loss_mask == demo.loss_mask
    assert sampled.reward_terms == demo.reward_terms and demo.reward_terms  # the shaping terms of the tool path
    assert [c.status for c in sampled.tool_calls] == [c.status for c in demo.tool_calls] == ["ok"]
    assert demo.logprobs == [0.0] * len(want)  # placeholders: no engine sampled them


def test_demonstration_that_does_not_end_its_episode_is_refused():
    """With one turn allowed, the two-turn demonstration would be cut (max_turns): one ValueError naming
    agent.guidance and the example."""
    with pytest.raises(ValueError, match=r"agent.guidance: .*example '0'.*max_turns"):
        demonstrate(_multi(max_turns=1), _ex(), TOK, _decode)


def _groups(scripts, examples):
    """Groups from the rollout loop on scripted turns, scored by exact_stop plus the environment's terms."""
    multi = _multi()
    prompts = [TOK(ex.prompt, add_special_tokens=False)["input_ids"] for ex in examples]
    n = len(scripts[0])
    params = SamplingParams(n=n, temperature=1.0, max_tokens=24, seed=0)
    outs = roll_out(ScriptedEngine(scripts), multi, examples, prompts, params, list(range(len(examples))), _decode)
    rnd = Round(examples, prompts, params, seed=0, step=1, round_idx=0)
    groups = [_trajectory_group(rnd, i, t) for i, t in enumerate(outs)]
    rm = RewardManager(RewardConfig(fn="exact_stop", extraction="full", num_workers=0))
    _score(rm, groups, None)
    return groups, multi, rm


WRONG = ["<tool_call>37558</tool_call>", "7"]
"""A wrong tool path: a 5-digit body (the call runs), then a wrong answer."""


def test_all_wrong_group_gets_exactly_one_demonstration_and_a_group_with_a_success_none():
    """Group 0 (37*58: three wrong samples) gets exactly one demonstration, in its last sample, with reward 1 +
    the tool path's shaping terms (0.4) and the demonstration's ids; group 1 (12*34: one of three right) is left as
    sampled."""
    ex = [_ex(), _ex("12*34=", "408", "1")]
    right = ["<tool_call>12*34</tool_call>", "408"]
    groups, multi, rm = _groups([[WRONG] * 3, [WRONG, right, WRONG]], ex)
    assert max(groups[0].rewards) < THRESHOLD and max(groups[1].rewards) >= THRESHOLD
    before = [list(r) for r in groups[1].response_ids], list(groups[1].rewards)
    guide(groups, multi, TOK, rm, THRESHOLD)
    assert groups[0].demos == [False, False, True]
    assert groups[1].demos == [False, False, False]
    assert groups[0].rewards[2] == pytest.approx(1.4)
    assert groups[0].response_ids[2] == demonstrate(multi, ex[0], TOK, _decode).response_ids
    assert groups[0].texts[2] == "2146" and groups[0].logprobs[2] == [0.0] * len(groups[0].response_ids[2])
    assert ([list(r) for r in groups[1].response_ids], list(groups[1].rewards)) == before


def test_accuracy_and_agent_metrics_count_the_policys_samples_only():
    """Two groups of three: group 0 all wrong (its last sample becomes the demonstration), group 1 one right of
    three. On-policy: 1 right of the 5 sampled -> reward/accuracy 0.2 (with the demonstration it would be 2/6);
    reward/raw_mean = (group 0's two wrong samples' shaping + group 1's three) / 5, computed by hand from the
    rewards before guidance; one demonstration of 6 samples; agent/turns_mean 2 over the 5 sampled."""
    ex = [_ex(), _ex("12*34=", "408", "1")]
    right = ["<tool_call>12*34</tool_call>", "408"]
    groups, multi, rm = _groups([[WRONG] * 3, [WRONG, right, WRONG]], ex)
    sampled = groups[0].rewards[:2] + groups[1].rewards
    guide(groups, multi, TOK, rm, THRESHOLD)
    raw = torch.tensor([g.rewards for g in groups], dtype=torch.float64)
    lengths = torch.tensor([[len(r) for r in g.response_ids] for g in groups])
    rewards = GroupRewards(raw, raw >= THRESHOLD, lengths)
    m = batch_metrics(groups, rewards, {"reward/mean": float(raw.mean())})
    assert m["reward/accuracy"] == pytest.approx(1 / 5)
    assert m["reward/raw_mean"] == pytest.approx(sum(sampled) / 5)
    assert m["reward/mean"] == pytest.approx(sum(sampled) / 5)
    assert m["guidance/demos"] == 1.0 and m["guidance/demo_frac"] == pytest.approx(1 / 6)
    assert m["agent/turns_mean"] == 2.0 and m["agent/calls_calculator"] == 5.0


class _Cfg:
    """The sections check_guidance reads."""

    def __init__(self, **kw):
        from megatron_rlvr.config.sections import RolloutConfig, TrainConfig

        self.agent = AgentConfig(
            environment=kw.pop("environment", "arithmetic_tools"), tools=["calculator"], guidance="all_wrong"
        )
        self.rollout = RolloutConfig(**{k: v for k, v in kw.items() if k != "routing_replay"})
        self.train = TrainConfig(routing_replay=kw.get("routing_replay", "none"))


@pytest.mark.parametrize(
    "kw, msg",
    [
        ({"environment": ""}, r"^agent.guidance=all_wrong needs agent.environment"),
        ({"old_logprobs": "rollout"}, r"^agent.guidance=all_wrong needs rollout.old_logprobs=recompute"),
        ({"routing_replay": "r3"}, r"^agent.guidance=all_wrong with train.routing_replay=r3"),
    ],
)
def test_guidance_refuses_what_cannot_train_a_demonstration_in_one_line(kw, msg):
    """Each combination that cannot train a demonstration (no environment, engine log-probs as behaviour, engine
    routes) is one ConfigError line naming the options."""
    with pytest.raises(ConfigError, match=msg) as e:
        check_guidance(_Cfg(**kw))
    assert "\n" not in str(e.value)


def test_guidance_mode_is_validated():
    """An unknown agent.guidance is one line naming the field and the modes."""
    with pytest.raises(ValueError, match=r"agent.guidance must be one of \('none', 'all_wrong'\), got 'always'"):
        AgentConfig(environment="tools", tools=["calculator"], guidance="always")


def test_a_correction_by_engine_log_probs_weighs_a_demonstration_by_one():
    """Under rollout.tis_cap or the staleness correction (rollout.max_staleness > 0) a sampled sequence's tokens get
    min(pi_old / pi_rollout, C) and a demonstration's get 1: its engine log-probs are 0.0 placeholders (nothing
    sampled it), which would otherwise give it weights pi_old < 1. Hand-computed weights, unpacked and packed rows."""
    correction = MismatchCorrectionConfig(tis_cap=1.5)
    sampled = Sequence(tokens=[1, 2, 3, 4], prompt_len=2, rollout_logprobs=[-1.0, -1.0])
    demo = Sequence(tokens=[1, 2, 5, 6], prompt_len=2, rollout_logprobs=[0.0, 0.0], demo=True)
    old = [torch.tensor([-0.5, -2.0]), torch.tensor([-3.0, -0.2])]
    want_sampled = [1.0, min(math.exp(0.5), 1.5), math.exp(-1.0), 1.0]  # 1 outside the response
    for rows in (None, [[0, 1]]):
        s = 4 if rows is None else 8
        mb = build_microbatch([sampled, demo], 2, s, 0, old_logp=old, correction=correction, rows=rows)
        assert mb.is_weight[0, :4].tolist() == pytest.approx(want_sampled)
        assert mb.is_weight[1].tolist() == [1.0] * s, mb.is_weight[1]
        assert mb.demo.tolist() == [False, True]
    # the weights the loss computes from the update's own forward (train.old_logprobs_from_update) do the same
    mask = torch.tensor([[False, True, True, False]] * 2)
    rollout = torch.tensor([[0.0, -1.0, -1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    old_bs = torch.tensor([[0.0, -0.5, -2.0, 0.0], [0.0, -3.0, -0.2, 0.0]])
    w = importance_weights(old_bs, rollout, mask, correction, torch.tensor([False, True]))
    assert w[0].tolist() == pytest.approx(want_sampled) and w[1].tolist() == [1.0] * 4
    # without the demonstration flag the placeholder would have weighed it by pi_old: the case the flag prevents
    assert importance_weights(old_bs, rollout, mask, correction)[1, 1:3].tolist() == pytest.approx(
        [math.exp(-3.0), math.exp(-0.2)]
    )


@pytest.mark.parametrize("kw", [{"tis_cap": 2.0}, {"max_staleness": 1}, {"max_staleness": 2, "tis_cap": 2.0}])
def test_guidance_is_accepted_with_a_correction_by_engine_log_probs(kw):
    """A demonstration's correction weight is 1 (test above), so the train/inference and staleness corrections are
    allowed with guidance (the disaggregated schedule at any staleness)."""
    check_guidance(_Cfg(**kw))

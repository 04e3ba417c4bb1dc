"""Multi-turn token-in / token-out trajectories (rollout/multiturn.py) on the transformers engine, against
independent references: the ids each ``generate`` call received and returned (recorded by a wrapper), the
environment's observation ids, and one full fp64 forward of the finished trajectory for the engine's log-probs.

The tokenizer is a small BPE whose merges join a turn's last token with the observation's first ("1" + "2" -> "12"),
so decoding a conversation and encoding it again changes its ids; the test shows that it would, and that the
trajectory never does."""

import pytest
import torch
from tokenizers import Tokenizer, decoders, models
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

from megatron_rlvr.agentic.environment import Action, Environment, Episode, Observation, ToolCallRecord
from megatron_rlvr.data.records import Example
from megatron_rlvr.rollout.engine import SamplingParams
from megatron_rlvr.rollout.groups import decode_action
from megatron_rlvr.rollout.hf_engine import HFRolloutEngine
from megatron_rlvr.rollout.multiturn import MultiTurn, roll_out

ALPHABET = list("0123456789abcdefghijklmnopqrstuvwxyz=+*")
MERGES = [("1", "2"), ("3", "2"), ("5", "2"), ("7", "2"), ("9", "2")]
"""An odd digit followed by "2" is one token when encoded: a turn ending in an odd digit and an observation starting
with "2" re-encode differently."""


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def bpe_tokenizer():
    vocab = {"<eos>": 0, "<pad>": 1}
    for c in ALPHABET:
        vocab[c] = len(vocab)
    for a, b in MERGES:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=MERGES))
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")


class Recorder:
    """Wraps an engine and keeps every generate call's prompts and returned completions."""

    def __init__(self, engine):
        self.engine = engine
        self.calls = []

    def generate(self, prompts, params, prompt_keys=None, **kw):
        out = self.engine.generate(prompts, params, prompt_keys=prompt_keys, **kw)
        self.calls.append(([list(p) for p in prompts], params, out))
        return out


class ScriptedEnv(Environment):
    """Each action is answered with the observation "2ab" (its own ids) until the episode's last turn; the
    ``answer_on`` turn (1-based) ends it. Turns end at an odd digit (stop strings)."""

    stop = ("1", "3", "5", "7", "9")

    def __init__(self, tokenizer, answer_on: int, text: str = "2ab"):
        self.ids = tuple(tokenizer(text, add_special_tokens=False)["input_ids"])
        self.answer_on = answer_on
        self.observed: list[tuple[int, ...]] = []

    def start(self, example):
        env = self

        class _Ep(Episode):
            turn = 0

            def step(self, action: Action) -> Observation:
                self.turn += 1
                env.observed.append(action.token_ids)
                if self.turn >= env.answer_on:
                    return Observation(done=True, reward_terms={"turns": 0.25})
                return Observation(self_ids(), tool_calls=(ToolCallRecord("echo", "ok"),))

        def self_ids():
            return env.ids

        return _Ep()


def make_engine(tok, seed=0):
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
    )
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    return HFRolloutEngine(model, tok), model


def run(tok, env, budget=120, max_turns=4, turn_tokens=24, n=4, seed=3):
    engine, model = make_engine(tok)
    rec = Recorder(engine)
    multi = MultiTurn.build(env, tok, max_turns=max_turns, budget=budget, max_turn_tokens=turn_tokens)
    prompts = [tok("ab=", add_special_tokens=False)["input_ids"], tok("c+d=", add_special_tokens=False)["input_ids"]]
    examples = [Example(prompt="p", answer="", source="t", id=str(i)) for i in range(2)]
    params = SamplingParams(n=n, temperature=1.0, max_tokens=turn_tokens, seed=seed)
    trajs = roll_out(rec, multi, examples, prompts, params, [0, 1], decode=lambda ids: decode_action(tok, ids))
    return trajs, prompts, rec, model


def test_trajectories_are_the_engine_ids_and_observations_never_re_encoded():
    """Every later turn's prompt is exactly prompt + everything so far (ids, not text); a trajectory is the
    concatenation of the engine's sampled ids and the environment's observation ids, with mask 1 exactly on the
    sampled ones; and for at least one trajectory decoding and re-encoding it would have changed its ids."""
    tok = bpe_tokenizer()
    env = ScriptedEnv(tok, answer_on=3)
    trajs, prompts, rec, _ = run(tok, env)
    flat = [t for per in trajs for t in per]
    assert len(flat) == 8
    # rebuild each trajectory from the recorded calls: call 0 samples n per prompt, later calls one per trajectory
    first = [c for out in rec.calls[0][2] for c in out.completions]
    rebuilt = [list(c.token_ids) for c in first]
    masks = [[1] * len(c.token_ids) for c in first]
    prompt_of = [prompts[i // 4] for i in range(8)]
    for prompts_k, params_k, outs in rec.calls[1:]:
        assert params_k.n == 1
        for p, out in zip(prompts_k, outs):
            # which trajectory continues: the one whose prompt + observation-extended ids equal this prompt
            matches = [
                i for i in range(8) if prompt_of[i] + rebuilt[i] + list(env.ids) == p and len(p) > len(prompt_of[i])
            ]
            assert len(matches) == 1, "a continuation's prompt is not exactly a trajectory's ids so far"
            i = matches[0]
            rebuilt[i] += list(env.ids) + list(out.completions[0].token_ids)
            masks[i] += [0] * len(env.ids) + [1] * len(out.completions[0].token_ids)
    re_encoded_differs = 0
    for i, t in enumerate(flat):
        assert t.response_ids == rebuilt[i]
        assert t.loss_mask == masks[i]
        assert len(t.logprobs) == len(t.response_ids)
        assert all(lp == 0.0 for lp, m in zip(t.logprobs, t.loss_mask) if not m)
        full = prompt_of[i] + t.response_ids
        if tok(tok.decode(full), add_special_tokens=False)["input_ids"] != full:
            re_encoded_differs += 1
    print(f"token fidelity: {len(flat)} trajectories are the engine's ids; re-encoding changes {re_encoded_differs}")
    assert re_encoded_differs >= 1, "the constructed case must show that re-encoding would change the ids"
    assert sum(t.turns for t in flat) == sum(len(c[0]) for c in rec.calls[1:]) + 8


def test_engine_logprobs_of_sampled_tokens_match_a_full_fp64_forward():
    """Turns after the first are generated from the trajectory so far; their log-probs equal log_softmax of one
    full fp64 forward of the finished trajectory at the sampled positions (so the engine saw exactly these ids)."""
    tok = bpe_tokenizer()
    trajs, prompts, _, model = run(tok, ScriptedEnv(tok, answer_on=3))
    ref = model.double()
    worst, checked = 0.0, 0
    for i, per in enumerate(trajs):
        for t in per:
            full = torch.tensor([prompts[i] + t.response_ids])
            with torch.no_grad():
                logits = ref(full).logits[0].double()
            lp = torch.log_softmax(logits, dim=-1)
            P = len(prompts[i])
            for k, (tokn, m) in enumerate(zip(t.response_ids, t.loss_mask)):
                if m:
                    worst = max(worst, abs(float(lp[P + k - 1, tokn]) - t.logprobs[k]))
                    checked += 1
    print(f"engine vs fp64 forward: {checked} sampled tokens, max |log-prob diff| {worst:.2e}")
    assert checked > 50
    assert worst < 1e-5, worst


def test_limits_end_trajectories_and_say_which():
    """max_turns: still acting after the last turn -> cut 'max_turns', its observation not appended; the budget:
    an observation that does not fit ends it with finish reason 'length'; a turn at its token limit -> 'length'."""
    tok = bpe_tokenizer()
    trajs, _, _, _ = run(tok, ScriptedEnv(tok, answer_on=99), max_turns=2, budget=500, turn_tokens=200)
    flat = [t for per in trajs for t in per]
    for t in flat:
        if t.cut == "max_turns":
            assert t.turns == 2 and t.loss_mask[-1] == 1  # ends on the action, no observation after it
    assert any(t.cut == "max_turns" for t in flat)
    trajs, _, _, _ = run(tok, ScriptedEnv(tok, answer_on=99), max_turns=50, budget=30, turn_tokens=30)
    flat = [t for per in trajs for t in per]
    assert all(len(t.response_ids) <= 30 for t in flat)
    assert all(t.cut in ("budget", "turn_tokens") and t.finish_reason == "length" for t in flat)
    assert any(t.cut == "budget" for t in flat)
    trajs, _, _, _ = run(tok, ScriptedEnv(tok, answer_on=1), max_turns=4, budget=200, turn_tokens=1, seed=5)
    flat = [t for per in trajs for t in per]
    assert any(t.cut == "turn_tokens" and len(t.response_ids) == 1 for t in flat)


def test_reward_terms_sum_over_turns_and_calls_are_recorded():
    """The environment's per-turn reward terms are summed per trajectory; tool-call records are kept in order."""
    tok = bpe_tokenizer()
    trajs, _, _, _ = run(tok, ScriptedEnv(tok, answer_on=2), budget=200, turn_tokens=40)
    flat = [t for per in trajs for t in per]
    done = [t for t in flat if not t.cut]
    assert done
    for t in done:
        assert t.turns == 2 and t.reward_terms == {"turns": 0.25}
        assert [c.tool for c in t.tool_calls] == ["echo"]

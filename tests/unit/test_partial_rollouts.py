"""Partial rollouts (megatron_rlvr.rollout.partial): a weight update lands in the middle of a generation, forced
deterministically (the transformers engine, chunks of 2 tokens, the update applied at the first chunk boundary).

Reference: two separate transformers models holding version 0's and version 1's weights; each token's behaviour
log-prob must equal log_softmax(logits / T) of one full fp64 forward of prompt + response by the model of the
version that produced it (and differ from the other version's)."""

import math

import pytest
import torch
from test_rollout_engine import PROMPTS, ToyTokenizer, llama_config, reference_logprobs
from transformers import AutoModelForCausalLM

from megatron_rlvr.rollout.engine import SamplingParams
from megatron_rlvr.rollout.hf_engine import HFRolloutEngine
from megatron_rlvr.rollout.partial import PartialRolloutEngine

CHUNK, MAX_TOKENS, T = 2, 8, 0.8


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _model(seed):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(llama_config(), dtype=torch.float32)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(4.0)
    return model.eval()


@pytest.fixture(scope="module")
def versions():
    """The weights of version 0 and version 1 (two unrelated random models of one architecture)."""
    return _model(0), _model(1)


class Updater:
    """Engine at version 0; at the ``at``-th chunk boundary it loads version 1 (as a rollout rank would when the
    trainer's weights arrive mid-generation)."""

    def __init__(self, versions, at=1, tokenizer=None):
        self.v0, self.v1 = versions
        self.engine = HFRolloutEngine(_model(0), tokenizer)
        self.version, self.calls, self.at = 0, 0, at
        self.partial = PartialRolloutEngine(self.engine, CHUNK, lambda: self.version, self.between, tokenizer)

    def between(self):
        self.calls += 1
        if self.calls == self.at:
            self.engine.update_weights(list(self.v1.state_dict().items()))
            self.version = 1


def test_an_update_mid_generation_gives_per_token_versions_and_each_segment_the_logprobs_of_its_weights(versions):
    params = SamplingParams(n=2, temperature=T, max_tokens=MAX_TOKENS, seed=11, ignore_eos=True)
    up = Updater(versions)
    out = up.partial.generate(PROMPTS, params, prompt_keys=[4, 5, 6])
    assert up.calls == math.ceil(MAX_TOKENS / CHUNK) - 1  # every boundary, whether samples still run or not
    v0, v1 = versions
    for o, prompt in zip(out, PROMPTS):
        assert o.prompt_token_ids == prompt and len(o.completions) == 2
        for c in o.completions:
            assert len(c.token_ids) == MAX_TOKENS and c.finish_reason == "length"
            assert c.versions == [0] * CHUNK + [1] * (MAX_TOKENS - CHUNK)
            lp = torch.tensor(c.logprobs, dtype=torch.float64)
            ref0, _ = reference_logprobs(v0, prompt, c.token_ids, T)
            ref1, _ = reference_logprobs(v1, prompt, c.token_ids, T)
            assert (lp[:CHUNK] - ref0[:CHUNK]).abs().max() < 1e-5
            assert (lp[CHUNK:] - ref1[CHUNK:]).abs().max() < 1e-5
            # the segments really differ between the versions (the check above could not pass by accident)
            assert (lp[:CHUNK] - ref1[:CHUNK]).abs().max() > 1e-2 and (lp[CHUNK:] - ref0[CHUNK:]).abs().max() > 1e-2
    # deterministic: the same request from the same weights gives the same samples
    again = Updater(versions).partial.generate(PROMPTS, params, prompt_keys=[4, 5, 6])
    assert [[c.token_ids for c in o.completions] for o in again] == [[c.token_ids for c in o.completions] for o in out]
    # chunk 0 is the unchunked generation's first chunk (same seed, keys, weights)
    plain = HFRolloutEngine(_model(0)).generate(PROMPTS, params, prompt_keys=[4, 5, 6])
    for o, p in zip(out, plain):
        for c, q in zip(o.completions, p.completions):
            assert c.token_ids[:CHUNK] == q.token_ids[:CHUNK]


def test_eos_and_stop_strings_spanning_chunks_end_a_sample_where_they_complete(versions):
    tok = ToyTokenizer()
    base = SamplingParams(n=1, temperature=T, max_tokens=MAX_TOKENS, seed=5, ignore_eos=True)
    full = Updater(versions, tokenizer=tok).partial.generate([PROMPTS[1]], base)[0].completions[0]
    # a stop string made of tokens 1 and 2: it spans the boundary between chunk 0 (tokens 0, 1) and chunk 1
    stop = tok.decode(full.token_ids[1:3])
    assert stop not in tok.decode(full.token_ids[:2])
    params = SamplingParams(n=1, temperature=T, max_tokens=MAX_TOKENS, seed=5, ignore_eos=True, stop=(stop,))
    c = Updater(versions, tokenizer=tok).partial.generate([PROMPTS[1]], params)[0].completions[0]
    cut = tok.decode(full.token_ids[:3]).find(stop)
    assert c.token_ids == full.token_ids[:3] and c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == tok.decode(full.token_ids[:3])[:cut] and c.versions == [0, 0, 1]
    assert c.logprobs == full.logprobs[:3]
    # EOS (id 1) is left to the engine: samples end at it, in whichever chunk it comes
    out = Updater(versions, tokenizer=tok).partial.generate(
        PROMPTS, SamplingParams(n=4, temperature=1.5, max_tokens=MAX_TOKENS, seed=2)
    )
    for o in out:
        for c in o.completions:
            assert len(c.versions) == len(c.token_ids) == len(c.logprobs) <= MAX_TOKENS
            ended = c.token_ids[-1] == 1
            assert c.finish_reason == ("stop" if ended else "length") and 1 not in c.token_ids[:-1]


def test_a_rank_without_prompts_still_calls_between_chunks_as_often():
    calls = []
    eng = PartialRolloutEngine(object(), 3, lambda: 0, lambda: calls.append(1))
    assert eng.generate([], SamplingParams(n=2, max_tokens=10, seed=0)) == [] and len(calls) == 3
    with pytest.raises(ValueError, match="chunk_tokens must be a positive int"):
        PartialRolloutEngine(object(), 0, lambda: 0, lambda: None)


def test_admission_uses_the_oldest_token_and_staleness_is_also_per_token():
    from megatron_rlvr.data import Example
    from megatron_rlvr.rollout.groups import Group
    from megatron_rlvr.trainer.batch import RolloutBatch
    from megatron_rlvr.trainer.disaggregated import staleness_filter

    def group(token_versions):
        return Group(
            Example(prompt="1=", answer="1", source="t", id="x"),
            [1],
            [[2] * len(tv) for tv in token_versions],
            versions=[min(tv) for tv in token_versions],
            token_versions=token_versions,
        )

    # policy of step 6 = version 5, k = 1: group 0's first sample started at version 3 (2 behind) -> dropped, even
    # though most of its tokens are from version 4 and 5
    rolled = RolloutBatch(
        groups=[group([[3, 4, 5], [4, 4]]), group([[4, 4, 5, 5], [5, 5]])], kept=[0, 1], rewards=None, policy_version=3
    )
    out, m = staleness_filter(rolled, step=6, k=1)
    assert out.kept == [1] and m["async/dropped_samples"] == 2.0
    assert m["async/staleness_max"] == 1.0 and m["async/staleness_mean"] == 0.5
    assert m["async/token_staleness_mean"] == pytest.approx(2 / 6) and m["async/partial_samples"] == 1.0


def test_the_option_is_validated():
    from megatron_rlvr.config import ConfigError, check_layout, load_run_config

    with pytest.raises(ValueError, match=r"rollout.partial_rollout_tokens must be an int >= 0"):
        load_run_config(None, ["rollout.partial_rollout_tokens=-2"])
    cfg = load_run_config("configs/tiny.yaml", ["parallel.tp=1", "parallel.rollout_ranks=1"])
    check_layout(cfg, 2)
    for overrides in (["parallel.rollout_ranks=1"], []):
        with pytest.raises(ConfigError, match=r"partial_rollout_tokens=4 needs the disaggregated layout"):
            cfg = load_run_config(
                "configs/tiny.yaml", ["parallel.tp=1", "rollout.partial_rollout_tokens=4", *overrides]
            )
            check_layout(cfg, 2)
    ok = ["parallel.tp=1", "parallel.rollout_ranks=1", "rollout.max_staleness=1", "rollout.partial_rollout_tokens=4"]
    check_layout(load_run_config("configs/tiny.yaml", ok), 2)

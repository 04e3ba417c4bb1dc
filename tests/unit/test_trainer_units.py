"""Pure (single-process, no Megatron) pieces of the trainer: run-config validation, micro-batch packing and layout,
metric reduction, the signal exit-code contract, pass@k, and the tiny tokenizer/model config."""

import math
import os
import random
import signal
from types import SimpleNamespace

import pytest
import torch

from megatron_rlvr.config import (
    ConfigError,
    build_run_config,
    check_layout,
    load_run_config,
    resolved_dict,
)
from megatron_rlvr.eval.benchmarks import format_table, pass_at_k, summarize
from megatron_rlvr.rollout.mismatch import MismatchCorrectionConfig
from megatron_rlvr.rundir.signals import exit_code_for
from megatron_rlvr.trainer.loss_metrics import LossMetrics
from megatron_rlvr.trainer.microbatch import Sequence, build_microbatch, pack, response_values

# ------------------------------------------------------------------------------------------------ config


def test_default_config_is_the_tiny_preset():
    cfg = load_run_config()
    assert cfg.model.is_tiny and cfg.algorithm.name == "mcpo" and cfg.parallel.tp == 2
    assert cfg.logging.name == "tiny"
    assert cfg.algorithm.hinge_kl.enabled and cfg.algorithm.advantage.mcpo_query_weight


@pytest.mark.parametrize(
    "override, expected",
    [
        ("traIn.steps=3", "unknown config key 'traIn'; did you mean train?"),
        ("train.prompt_per_step=3", "did you mean train.prompts_per_step?"),
        ("algorithm.hinge_kl.betta=2", "did you mean algorithm.hinge_kl.beta?"),
        ("algorithm.preset=mcpp", "unknown preset 'mcpp'; did you mean 'mcpo'?"),
        ("data.procedural.tsk=copy", "data.procedural.task"),
        ("train.prompts_per_step=abc", "train.prompts_per_step must be an integer"),
        ("train.mini_batch_prompts=5", "train.mini_batch_prompts=5 does not divide train.prompts_per_step=32"),
        ("train.micro_batch_tokens=4", "cannot hold one sequence"),
        ("rollout.max_response_len=100", "exceeds the model's max_position_embeddings=64"),
        ("eval.every=5", "eval.every > 0 needs eval.files"),
        ("data.train_files=[missing.jsonl]", "file not found: missing.jsonl"),
        ("reward.fn=no_such_module.fn", "no_such_module"),
        ("parallel.sequence_parallel=true parallel.tp=1", "sequence_parallel needs parallel.tp > 1"),
        ("algorithm.ref_kl.coef=0.1 train.ref_model=false", "needs a reference model"),
        ("train.routing_replay_weights=maybe", "train.routing_replay_weights must be true or false, got 'maybe'"),
        (
            "model.name=tiny_moe train.routing_replay=r2 train.routing_replay_weights=true",
            "train.routing_replay_weights replays the rollout engine's gate weights with its routes: it needs "
            "train.routing_replay=r3 (got r2)",
        ),
    ],
)
def test_bad_config_errors_name_the_key(override, expected):
    with pytest.raises(ConfigError) as e:
        load_run_config(None, override.split(" "))
    assert expected in str(e.value)


def test_overrides_are_yaml_typed_and_numbers_in_e_notation_parse():
    cfg = load_run_config(None, ["optimizer.lr=1e-2", "rollout.stop=[ab, cd]", "train.ref_model=null"])
    assert cfg.optimizer.lr == 0.01 and cfg.rollout.stop == ["ab", "cd"] and cfg.train.ref_model is None


def test_preset_overrides_apply_on_top_of_the_preset():
    cfg = load_run_config(None, ["algorithm.preset=dapo", "algorithm.policy_loss.eps_high=0.3"])
    assert cfg.algorithm.name == "dapo" and cfg.algorithm.policy_loss.eps_high == 0.3
    assert cfg.algorithm.dapo.dynamic_sampling  # the rest of the preset is kept
    assert cfg.needs_ref_model is False
    assert load_run_config(None, ["algorithm.preset=grpo"]).needs_ref_model  # GRPO's k3 KL, beta 0.04


def test_resolved_config_round_trips():
    cfg = load_run_config(None, ["algorithm.preset=cpgd", "schedule.steps=7", "rollout.stop=[x]"])
    again = build_run_config(resolved_dict(cfg))
    assert resolved_dict(again) == resolved_dict(cfg)


def test_layout_must_divide():
    cfg = load_run_config()
    check_layout(cfg, 2)
    check_layout(cfg, 4)  # TP=2 x DP=2
    with pytest.raises(ConfigError, match="does not divide the world size 3"):
        check_layout(cfg, 3)
    with pytest.raises(ConfigError, match="does not divide the model's num_attention_heads=2"):
        check_layout(load_run_config(None, ["parallel.tp=8"]), 8)
    with pytest.raises(ConfigError, match="does not divide the model's num_hidden_layers=2"):
        check_layout(load_run_config(None, ["parallel.tp=1", "parallel.pp=4"]), 4)


# ------------------------------------------------------------------------------------------------ micro-batches


def test_pack_respects_the_token_budget_and_covers_every_sequence():
    rng = random.Random(0)
    lengths = [rng.randint(1, 40) for _ in range(57)]
    for budget in (None, 40, 64, 300):
        plan = pack(lengths, budget, uniform=False)
        seen = sorted(i for idx, _, _ in plan for i in idx)
        assert seen == list(range(len(lengths)))
        for idx, b, s in plan:
            assert b == len(idx) and s == max(lengths[i] for i in idx)
            assert budget is None and b == 1 or b * s <= budget
    plan = pack(lengths, 100, uniform=True, multiple=4)
    assert {(b, s) for _, b, s in plan} == {(2, 40)}  # one shape for pipeline parallelism, s rounded to 4
    assert sorted(i for idx, _, _ in plan for i in idx) == list(range(len(lengths)))


def test_microbatch_scores_response_tokens_at_the_previous_position():
    # prompt [5, 6, 7], response [8, 9]: logits at positions 2 and 3 predict tokens 8 and 9
    q = Sequence(tokens=[5, 6, 7, 8, 9], prompt_len=3, adv=0.5, mastered=True, rollout_logprobs=[-0.1, -0.2])
    empty = Sequence(tokens=[5, 6], prompt_len=2)  # no response: contributes nothing
    mb = build_microbatch([q, empty], 3, 6, pad_id=0, old_logp=[torch.tensor([-1.0, -2.0]), None], ids=[4, 7])
    assert mb.tokens.tolist() == [[5, 6, 7, 8, 9, 0], [5, 6, 0, 0, 0, 0], [0] * 6]
    assert mb.labels[0].tolist() == [6, 7, 8, 9, 0, 0]
    assert mb.mask.tolist() == [[False, False, True, True, False, False], [False] * 6, [False] * 6]
    assert mb.old_logp[0].tolist() == [0, 0, -1.0, -2.0, 0, 0]
    assert mb.rollout_logp[0, 2:4].tolist() == pytest.approx([-0.1, -0.2])
    assert mb.adv.tolist() == [0.5, 0.0, 0.0] and mb.mastered.tolist() == [True, False, False]
    assert mb.seq_ids.tolist() == [4, 7, -1]
    back = response_values(mb.old_logp, [q])
    assert back[0].tolist() == [-1.0, -2.0]
    frozen = Sequence(tokens=[5, 6, 7, 8], prompt_len=3, train=False)  # e.g. truncated under DAPO overlong filtering
    assert not build_microbatch([frozen], 1, 4, pad_id=0).mask.any()


def test_microbatch_refuses_values_longer_than_the_row():
    q = Sequence(tokens=[5, 6, 7, 8], prompt_len=3, rollout_logprobs=[-0.1, -0.2, -0.3])  # 3 values, 1 response token
    with pytest.raises(ValueError, match="rollout log-probs: 3 values from position 2"):
        build_microbatch([q], 1, 4, pad_id=0)


def test_normalizer_counts_from_lengths_equal_the_loss_mask_counts():
    """The update counts its loss normalisers from sequence lengths; they must be what the algorithms' own
    local_normalizer_counts gives on the micro-batch loss masks (tokens, non-empty sequences, mastered ones)."""
    from megatron_rlvr.algorithms import local_normalizer_counts
    from megatron_rlvr.trainer.update import normalizer_counts

    rng = random.Random(3)
    seqs = []
    for _ in range(40):
        P, R = rng.randint(1, 5), rng.choice([0, 0, 1, 3, 7])
        seqs.append(Sequence(tokens=[1] * (P + R), prompt_len=P, mastered=rng.random() < 0.4, train=rng.random() < 0.8))
    s = max(q.length for q in seqs)
    mb = build_microbatch(seqs, len(seqs), s, pad_id=0)
    expected = local_normalizer_counts(mb.mask, mb.mastered)
    got = normalizer_counts(seqs)
    assert got.dtype == torch.float64 and got.tolist() == expected.tolist()
    assert 0 < got[2] < got[1] < got[0]  # the random case exercises all three counts


def test_token_stats_use_the_configured_implementation(monkeypatch):
    """train.fused_statistics reaches the ops through StatsSpec (no process-wide default involved): the compiled
    and eager implementations give the same statistics, and the call names the one the spec asks for."""
    from megatron_rlvr.trainer import token_loss

    seen = []
    real = token_loss.vocab_parallel_token_stats

    def spy(*a, **k):
        seen.append(k["impl"])
        return real(*a, **k)

    monkeypatch.setattr(token_loss, "vocab_parallel_token_stats", spy)
    torch.manual_seed(0)
    logits, labels = torch.randn(2, 3, 300), torch.randint(0, 300, (2, 3))
    out = {}
    for impl in ("eager", "compiled"):
        spec = token_loss.StatsSpec(tp_group=None, vocab_size=300, temperature=0.7, chunk_size=64, impl=impl)
        out[impl], bad = token_loss.token_stats(logits, labels, spec, ("logprob", "entropy"))
        assert not bad
    assert seen == ["eager", "compiled"]
    for k in ("logprob", "entropy"):
        torch.testing.assert_close(out["compiled"][k], out["eager"][k], rtol=1e-5, atol=1e-5)


def test_truncated_importance_weights_are_capped_ratios():
    q = Sequence(tokens=[1, 2, 3, 4], prompt_len=2, rollout_logprobs=[-1.0, -1.0])
    correction = MismatchCorrectionConfig(tis_cap=1.5)
    mb = build_microbatch([q], 1, 4, 0, old_logp=[torch.tensor([-0.5, -2.0])], correction=correction)
    w = mb.is_weight[0].tolist()
    assert w[1] == pytest.approx(min(math.exp(0.5), 1.5)) and w[2] == pytest.approx(math.exp(-1.0))
    assert w[0] == 1.0 and w[3] == 1.0  # outside the response


# ------------------------------------------------------------------------------------------------ metrics


def test_loss_metrics_sum_shares_and_weight_means_by_tokens():
    rank0, rank1 = LossMetrics(), LossMetrics()
    # one mini-batch update split into three micro-batches over two ranks
    rank0.add({"loss/total": 0.2, "loss/num_tokens": 10, "loss/clip_frac_high": 0.1, "loss/ratio_max": 1.2})
    rank0.add({"loss/total": 0.1, "loss/num_tokens": 30, "loss/clip_frac_high": 0.5, "loss/ratio_max": 1.1})
    rank1.add({"loss/total": 0.3, "loss/num_tokens": 60, "loss/clip_frac_high": 0.0, "loss/ratio_min": 0.7})
    out = LossMetrics.merge([rank0.state(), rank1.state()], num_updates=1)
    assert out["loss/total"] == pytest.approx(0.6)  # shares of the global loss add up
    assert out["loss/num_tokens"] == 100
    assert out["loss/clip_frac_high"] == pytest.approx((0.1 * 10 + 0.5 * 30 + 0.0 * 60) / 100)
    assert out["loss/ratio_max"] == 1.2 and out["loss/ratio_min"] == 0.7
    two_updates = LossMetrics.merge([rank0.state(), rank1.state()], num_updates=2)
    assert two_updates["loss/total"] == pytest.approx(0.3)  # mean over updates


def test_loss_metrics_reduce_each_key_as_the_table_says():
    """LossMetrics follows megatron_rlvr.algorithms.reductions: a share adds up, an extreme takes the extreme, a key
    not in the table is a token-weighted mean, whatever was imported before."""
    a, b = LossMetrics(), LossMetrics()
    a.add(
        {"mcpo/hinge_kl": 0.25, "train/nonfinite": 0.0, "mismatch/ratio_min": 0.9, "x/frac": 1.0, "loss/num_tokens": 10}
    )
    b.add(
        {"mcpo/hinge_kl": 0.5, "train/nonfinite": 1.0, "mismatch/ratio_min": 0.7, "x/frac": 0.0, "loss/num_tokens": 30}
    )
    out = LossMetrics.merge([a.state(), b.state()], num_updates=1)
    assert out["mcpo/hinge_kl"] == pytest.approx(0.75) and out["train/nonfinite"] == 1.0
    assert out["mismatch/ratio_min"] == 0.7 and out["x/frac"] == pytest.approx(10 / 40)


# Every metric the loss code and the step emit, with the reduction its meaning requires (written out here, not
# derived from the code under test): extremes as max / min, loss terms normalised by GLOBAL counts as shares.
EXPECTED_REDUCTION = {
    "loss/policy": "share",
    "loss/total": "share",
    "loss/ref_kl": "share",
    "loss/entropy_bonus": "share",
    "loss/num_tokens": "share",
    "drift/kl": "share",
    "mcpo/hinge_kl": "share",
    "loss/ratio_max": "max",
    "loss/ratio_min": "min",
    "credit/weight_max": "max",
    "focal/weight_min": "min",
    "mismatch/abs_prob_diff_max": "max",
    "mismatch/ratio_max": "max",
    "mismatch/ratio_min": "min",
    "ratio/abs_log_ratio_max": "max",
    "train/nonfinite": "max",
}


def _emitted_loss_metric_keys() -> set[str]:
    """The metric keys compute_policy_loss returns over every preset, each with every optional term switched on."""
    from megatron_rlvr.algorithms import (
        PRESETS,
        AlgorithmConfig,
        LossNormalizers,
        PolicyLossInputs,
        compute_policy_loss,
        preset,
    )

    keys: set[str] = set()
    extras = [{}, {"ref_kl": {"coef": 0.1}, "entropy": {"coef": 0.01}, "drift": {"coef": 0.01}}]
    for name in PRESETS:
        for extra in extras:
            cfg = AlgorithmConfig.from_dict(extra, base=preset(name))
            g = torch.Generator().manual_seed(0)
            logp = torch.randn(2, 3, dtype=torch.float64, generator=g).requires_grad_()
            inp = PolicyLossInputs(
                logp,
                logp.detach() + 0.3 * torch.randn(2, 3, dtype=torch.float64, generator=g),
                torch.ones(2, 3, dtype=torch.bool),
                adv_B=torch.tensor([1.0, -1.0], dtype=torch.float64),
                ref_logp_BT=logp.detach() - 0.1,
                entropy_BT=torch.ones(2, 3, dtype=torch.float64),
                margin_BT=torch.ones(2, 3, dtype=torch.float64),
                mastered_B=torch.tensor([True, False]),
            )
            _, metrics = compute_policy_loss(cfg, inp, LossNormalizers(num_tokens=6, num_seqs=2, num_mastered_seqs=1))
            keys |= set(metrics)
    return keys


def test_every_metric_has_the_reduction_its_meaning_requires():
    """Each key's reduction, not two samples: a `*_max` reduced as a sum or a mean, or a loss share averaged, would
    pass a test of two keys. Every key emitted by the loss over all presets is checked, and every key named in
    EXPECTED_REDUCTION; keys not listed there must not look like extremes and are token-weighted means."""
    import contextlib
    import importlib

    from megatron_rlvr.algorithms.reductions import reduction_of

    for module in (
        "megatron_rlvr.rollout.mismatch",
        "megatron_rlvr.trainer.diagnostics",
        "megatron_rlvr.trainer.token_loss",
    ):
        with contextlib.suppress(ImportError):  # where a producer still declares its keys on import
            importlib.import_module(module)
    emitted = _emitted_loss_metric_keys()
    assert {"loss/policy", "loss/ratio_max", "mcpo/hinge_kl", "drift/kl", "loss/ref_kl"} <= emitted
    wrong = {}
    for key in sorted(emitted | set(EXPECTED_REDUCTION)):
        want = EXPECTED_REDUCTION.get(key, "mean")
        assert key in EXPECTED_REDUCTION or not key.endswith(("_max", "_min")), f"{key}: add it to the table"
        if reduction_of(key) != want:
            wrong[key] = (reduction_of(key), want)
    assert not wrong, f"(reduced as, must be): {wrong}"


# ------------------------------------------------------------------------------------------------ signals


def test_signal_exit_code_contract():
    from megatron_rlvr.rundir.signals import _CODES

    usr1, term, intr = _CODES[signal.SIGUSR1], _CODES[signal.SIGTERM], _CODES[signal.SIGINT]
    assert exit_code_for(term, None, None, environ={}) == 0
    assert exit_code_for(usr1, None, None, environ={}) == 75
    assert exit_code_for(intr, None, None, environ={}) == 130
    slurm = {"RLVR_REQUEUE_EXIT_CODE": "75"}  # exported by slurm/common.sh
    assert exit_code_for(term, None, None, environ=slurm) == 0  # scancel: saved and stopped, never requeued
    assert exit_code_for(usr1, None, None, environ=slurm) == 75
    assert exit_code_for(term, 0, 9, environ=slurm) == 0 and exit_code_for(usr1, 0, 9, environ=slurm) == 9


def test_second_ctrl_c_interrupts_immediately():
    from megatron_rlvr.rundir.signals import StopSignals

    s = StopSignals()
    s._handle(signal.SIGTERM, None)
    s._handle(signal.SIGUSR1, None)
    assert StopSignals.name(s.code) == "SIGUSR1"  # the requeue request wins
    s2 = StopSignals()
    s2._handle(signal.SIGINT, None)
    with pytest.raises(KeyboardInterrupt):
        s2._handle(signal.SIGINT, None)


# ------------------------------------------------------------------------------------------------ evaluation


def test_pass_at_k_matches_the_combinatorial_definition():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                ref = 1.0 - math.comb(n - c, k) / math.comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(ref, abs=1e-12)
    assert pass_at_k(4, 1, 1) == 0.25 and pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0


def test_summary_table():
    r = summarize("toy", [[True, False, False, False], [True, True, True, True]], [[1, 2, 3, 4], [1, 1, 1, 1]])
    assert r.avg_at_k == pytest.approx(5 / 8)
    assert r.pass_at_k[1] == pytest.approx((0.25 + 1) / 2) and r.pass_at_k[4] == 1.0
    assert r.mean_length == pytest.approx(14 / 8)
    table = format_table([r])
    assert "pass@2" in table and "toy" in table and "0.6250" in table


# ------------------------------------------------------------------------------------------------ tiny model


def test_tiny_tokenizer_is_character_level_and_round_trips(tmp_path):
    from transformers import AutoTokenizer

    from megatron_rlvr.families.tiny import save_tiny_tokenizer, tiny_hf_config, tiny_tokenizer

    tok = tiny_tokenizer()
    ids = tok("12+3=", add_special_tokens=False)["input_ids"]
    assert len(ids) == 5 and tok.decode(ids) == "12+3="
    assert tok.decode(ids + [tok.eos_token_id], skip_special_tokens=True) == "12+3="
    cfg = tiny_hf_config(tok)
    assert cfg["vocab_size"] == len(tok) == 19 and cfg["eos_token_id"] == tok.eos_token_id
    again = AutoTokenizer.from_pretrained(save_tiny_tokenizer(os.fspath(tmp_path / "tok")))
    assert again("7=", add_special_tokens=False)["input_ids"] == tok("7=", add_special_tokens=False)["input_ids"]


# ------------------------------------------------------------------------------------------------ shipped configs

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs")


@pytest.mark.parametrize("name", ["dapo_7b", "mcpo_7b", "mcpo_14b", "smollm2_gsm8k", "cpgd_qwen2_5_vl_7b"])
def test_shipped_configs_validate(name):
    """Every key of the GPU / real-model presets is known and valid. The model, engine, lengths and files are
    swapped for the tiny model's (no GPU, no weights, no data on a CI machine); everything else is built as written."""
    from megatron_rlvr.config import expand_env, read_yaml

    raw = expand_env(read_yaml(os.path.join(CONFIGS, f"{name}.yaml")))
    raw["model"] = {"name": "tiny"}
    raw["rollout"].update(engine="hf", max_prompt_len=8, max_response_len=8)
    raw["data"]["train_files"] = []
    raw.pop("eval", None)
    raw["train"]["micro_batch_tokens"] = 64
    raw["parallel"].update(sequence_parallel=False, rollout_tp=1)
    cfg = build_run_config(raw)
    if name == "cpgd_qwen2_5_vl_7b":
        assert cfg.algorithm.name == "cpgd" and cfg.optimizer.lr == 1e-6 and cfg.rollout.n == 8
    elif name != "smollm2_gsm8k":  # the papers' settings (lr 1e-6, constant schedule)
        assert cfg.optimizer.lr == 1e-6 and cfg.schedule.lr_decay == "constant"
        assert (cfg.train.prompts_per_step, cfg.train.mini_batch_prompts, cfg.rollout.n) == (128, 64, 16)
        assert (cfg.algorithm.policy_loss.eps_low, cfg.algorithm.policy_loss.eps_high) == (0.2, 0.28)
        assert cfg.algorithm.dapo.overlong_buffer_len == 4096 and cfg.rollout.temperature == 1.0
        if name.startswith("mcpo"):
            assert cfg.algorithm.hinge_kl.enabled and cfg.algorithm.hinge_kl.beta == 1.0
            assert cfg.algorithm.hinge_kl.delta == 0.01 and cfg.algorithm.advantage.mcpo_query_weight


def test_env_references_expand_with_defaults(monkeypatch):
    from megatron_rlvr.config import expand_env

    monkeypatch.setenv("RLVR_TEST_DIR", "/x")
    monkeypatch.delenv("RLVR_UNSET_VAR", raising=False)
    got = expand_env({"a": ["${RLVR_TEST_DIR}/f", "${RLVR_UNSET_VAR:-/d}/g"], "b": 3})
    assert got == {"a": ["/x/f", "/d/g"], "b": 3}
    with pytest.raises(ConfigError, match="data.train_files.0.: environment variable RLVR_UNSET_VAR is not set"):
        expand_env({"data": {"train_files": ["${RLVR_UNSET_VAR}/x"]}})


def test_every_rank_of_a_rollout_tp_group_calls_generate():
    """vLLM with rollout TP > 1 is SPMD: a non-leader rank must enter generate with its leader (or the leader hangs),
    but it neither scores nor contributes the outputs (the leader does, once)."""
    from megatron_rlvr.data import Example
    from megatron_rlvr.rollout.engine import SamplingParams
    from megatron_rlvr.rollout.groups import Generator, Round, engine_info, generate_groups

    calls = []

    class RecordingEngine:
        def generate(self, prompts, params, prompt_keys=None):
            calls.append(list(prompt_keys))
            return [None] * len(prompts)  # a non-leader must not look at these

    class NoRewards:
        def score(self, *a, **k):
            raise AssertionError("only the engine's leader scores")

    info = engine_info(rank=1, world_size=2, rollout_tp=2)
    assert (info.index, info.count, info.leader) == (0, 1, False)
    examples = [Example(prompt=str(i), answer="1", source="t", id=f"p{i}") for i in range(2)]
    rnd = Round(examples, [[1], [2]], SamplingParams(max_tokens=2), seed=0, step=1, round_idx=0)
    groups, _ = generate_groups(Generator(RecordingEngine(), NoRewards(), None, info, lambda obj: [obj]), rnd)
    assert calls == [[0, 1]] and groups == []


def test_a_stop_during_a_ranks_scoring_stops_every_rank_after_the_gather():
    """A stop signal during scoring must end the rollout on every rank together: a rank that raised alone would
    leave the others waiting in the all-gather. The rank whose ``should_stop`` fires abandons its scoring and still
    enters the gather; every rank (here: one whose own check never fires, told by the gathered flag) raises
    RolloutStopped after it."""
    from megatron_rlvr.data import Example
    from megatron_rlvr.rewards.manager import ScoringStopped
    from megatron_rlvr.rollout.engine import Completion, RolloutOutput, SamplingParams
    from megatron_rlvr.rollout.groups import Generator, RolloutStopped, Round, engine_info, generate_groups

    class OneSample:
        interruptible = False  # generation is not where this stop arrives

        def generate(self, prompts, params, prompt_keys=None):
            return [RolloutOutput(list(p), [Completion([3], [0.0], "stop", None, "3")]) for p in prompts]

    class StopsWhenAsked:
        report_now = True

        def score(self, texts, gts, metas, ids, max_error_frac, should_stop=None, questions=None):
            if should_stop is not None and should_stop():
                raise ScoringStopped("stop")
            return [1.0] * len(texts), {"reward/n_items": float(len(texts))}

        def take_pending(self):
            return []

        def report_gathered(self, items):
            pass

    example = Example(prompt="3=", answer="3", source="t", id="p0")
    gathered = []

    def gather(obj):
        gathered.append(obj)
        return gathered[-2:] if len(gathered) == 2 else [obj]

    rnd = Round([example], [[1]], SamplingParams(max_tokens=2), seed=0, step=5, round_idx=0)

    def gen(g, stop):
        return Generator(OneSample(), StopsWhenAsked(), None, engine_info(0, 1, 1), g, stop)

    with pytest.raises(RolloutStopped, match="step 5"):  # this rank was signalled: it gathers, then raises
        generate_groups(gen(gather, lambda: True), rnd)
    assert gathered[0][4] is True and gathered[0][0] == []
    with pytest.raises(RolloutStopped):  # a rank not signalled yet raises too, from the gathered flag
        generate_groups(gen(gather, lambda: False), rnd)
    groups, _ = generate_groups(gen(lambda o: [o], lambda: False), rnd)
    assert [g.rewards for g in groups] == [[1.0]]


def test_hinge_kl_with_dynamic_sampling_is_refused():
    """Dynamic sampling drops every mastered group, so the hinge-KL would silently never act: refused, naming both
    options (found reading trainer/batch.py: informative)."""
    with pytest.raises(ValueError) as e:
        load_run_config(None, ["algorithm.preset=dapo", "algorithm.hinge_kl.enabled=true"])
    assert "algorithm.dapo.dynamic_sampling=false" in str(e.value) and "hinge_kl" in str(e.value)
    cfg = load_run_config(
        None, ["algorithm.preset=dapo", "algorithm.hinge_kl.enabled=true", "algorithm.dapo.dynamic_sampling=false"]
    )
    assert cfg.algorithm.hinge_kl.enabled and not cfg.algorithm.dapo.dynamic_sampling


def test_grads_finite_is_exact_through_the_sum_shortcut():
    """grads_finite tests sums first: a NaN or inf anywhere is caught, and finite values whose sum
    overflows fp32 are still finite (the per-element fallback); megatron DDP's flat buffers are read when present,
    never nn.Module.buffers (a method on a plain module)."""

    from megatron_rlvr.megatron.optimizer_step import grads_finite as _grads_finite

    lin = torch.nn.Linear(4, 3)
    lin.weight.grad = torch.ones(3, 4)
    lin.bias.grad = torch.zeros(3)
    assert _grads_finite(lin)
    lin.bias.grad[1] = float("nan")
    assert not _grads_finite(lin)
    lin.bias.grad[1] = float("-inf")
    assert not _grads_finite(lin)
    lin.bias.grad = torch.full((3,), 3e38)  # finite, but the fp32 sum is inf
    assert torch.isinf(lin.bias.grad.sum()) and _grads_finite(lin)
    flat = torch.zeros(10)
    ddp = SimpleNamespace(buffers=[SimpleNamespace(grad_data=flat)], expert_parallel_buffers=[])
    assert _grads_finite(ddp)
    flat[7] = float("inf")
    assert not _grads_finite(ddp)


def test_tensorboard_gets_every_finite_metric_of_every_step(tmp_path):
    """One event per step holds the step's scalars: TensorBoard reads them as add_scalar's (tag, step, float32)."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megatron_rlvr.rundir.metrics_log import RunLogger

    log = RunLogger(str(tmp_path), enabled=True, tensorboard="on", progress=False)
    steps = {1: {"loss/total": 0.25, "reward/mean": 1 / 3, "optim/grad_norm": math.nan}, 2: {"loss/total": -1e-9}}
    for step, m in steps.items():
        log.log(step, m)
    log.close()
    acc = EventAccumulator(log.tb_dir)
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == ["loss/total", "reward/mean"]  # non-finite values are left out
    got = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    f32 = lambda v: torch.tensor(v, dtype=torch.float32).item()  # noqa: E731
    assert got == {"loss/total": [(1, 0.25), (2, f32(-1e-9))], "reward/mean": [(1, f32(1 / 3))]}


def test_teacher_logprobs_are_scattered_to_the_response_positions():
    """build_microbatch's ``teacher_logp``: each sequence's response-aligned values at positions [P - 1, L - 1) of
    its row (one sequence per row, in both the unpacked and the packed layout), 0 elsewhere and on dummy rows (by
    hand); without it the field is None."""
    seqs = [Sequence(tokens=[1, 2, 3, 4], prompt_len=2), Sequence(tokens=[5, 6, 7], prompt_len=1)]
    teacher = [torch.tensor([-0.5, -1.5]), torch.tensor([-0.25, -0.75])]
    want = torch.tensor([[0.0, -0.5, -1.5, 0.0, 0.0], [-0.25, -0.75, 0.0, 0.0, 0.0], [0.0] * 5])
    flat = build_microbatch(seqs, 3, 5, pad_id=0, teacher_logp=teacher)
    assert torch.equal(flat.teacher_logp, want)
    assert torch.equal(flat.teacher_logp != 0, flat.mask)
    packed = build_microbatch(seqs, 1, 8, pad_id=0, teacher_logp=teacher, rows=[[0, 1]])
    want8 = torch.zeros(2, 8)
    want8[0, 1:3], want8[1, 0:2] = teacher[0], teacher[1]
    assert torch.equal(packed.teacher_logp, want8)
    assert build_microbatch(seqs, 2, 5, pad_id=0).teacher_logp is None


def test_replayed_gate_weights_replace_the_value_and_keep_the_gradient():
    """Routing replay with the engine's gate weights (megatron.routing's router hook): the router's probabilities
    [N, E] take the engine's weights at the replayed experts (NaN: the router's own value kept), stay 0 elsewhere,
    and the gradient reaching the router's probabilities is the one of its own (identity: d sum(c * out) / d probs
    = c), checked against tensors built by hand. Without target weights the hook leaves the output alone."""
    from megatron_rlvr.megatron.routing import _replay_weights_hook

    idx = torch.tensor([[2, 0], [1, 3], [3, 2]])
    own = torch.tensor([[0.6, 0.0, 0.4, 0.0], [0.0, 0.7, 0.0, 0.3], [0.0, 0.0, 0.55, 0.45]], requires_grad=True)
    rmap = own.detach() > 0
    replay = SimpleNamespace(target_topk_idx=idx, target_weights=None)
    hook = _replay_weights_hook(replay)
    assert hook(None, (), (own, rmap)) is None
    replay.target_weights = torch.tensor([[0.5, 0.5], [0.25, 0.75], [float("nan"), float("nan")]])
    out, out_map = hook(None, (), (own, rmap))
    want = torch.tensor([[0.5, 0.0, 0.5, 0.0], [0.0, 0.25, 0.0, 0.75], [0.0, 0.0, 0.55, 0.45]])
    assert out_map is rmap
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    c = torch.arange(12, dtype=torch.float32).view(3, 4)
    (out * c).sum().backward()
    assert torch.equal(own.grad, c)

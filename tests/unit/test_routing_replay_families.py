"""Routing replay R3 for GPT-OSS (top-k of the router logits, router bias included, then a softmax over the k chosen
logits) and GLM-4.5 (sigmoid scores, a score-correction bias for the choice only, a group limit, renormalised top-k
weights times ``routed_scaling_factor``, as DeepSeek-V3), in one process:

- the transformers engine (``return_routes``) returns, per token and MoE layer, the experts its router chose and the
  weights it multiplied their outputs by; both are recomputed here in fp64 from the router inputs of one full forward;
- a megatron ``TopKRouter`` built from the trainer's own config of the family (``model_args_for`` of the tiny preset)
  with PERTURBED weights chooses other experts for many tokens by itself; with the project's replay instance
  (megatron_rlvr/megatron/routing.py) replaying the engine's routes it routes every token to the engine's experts,
  and its gate weights are the family's function of ITS OWN logits at those experts (fp64 reference); with the
  engine's gate weights replayed too (``train.routing_replay_weights``) they are the engine's values.
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13], [14, 4]]  # the tiny vocabulary has 19 ids


def _engine(name: str, seed: int):
    """The family's tiny model in a transformers engine that returns routes, with sharp random routers (and for
    GLM-4.5 a random score-correction bias): ties never decide the test."""
    from megatron_rlvr.families.tiny import tiny_hf_config
    from megatron_rlvr.models.hf_config import hf_config_object
    from megatron_rlvr.rollout.hf_engine import HFEngineConfig, HFRolloutEngine

    hf = tiny_hf_config(name=name)
    torch.manual_seed(seed)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(hf_config_object(hf), dtype=torch.float32)
    eng = HFRolloutEngine(model, None, config=HFEngineConfig(max_batch_rows=4, return_routes=True), eos_token_ids=[1])
    routers = [m for m in model.modules() if type(m).__name__.lower().endswith("topkrouter")]
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for r in routers:
            r.weight.normal_(0.0, 1.0, generator=g)
            if getattr(r, "bias", None) is not None:
                r.bias.normal_(0.0, 1.0, generator=g)
            if hasattr(r, "e_score_correction_bias"):
                r.e_score_correction_bias.copy_(0.5 * torch.randn(r.weight.shape[0], generator=g))
    return hf, eng, routers


def _gpt_oss_route(x, weight, bias, k):
    """GPT-OSS in fp64: logits = x W^T + b; the k largest logits; weights = softmax over those k logits."""
    logits = x.double() @ weight.double().t() + bias.double()
    return logits.topk(k, -1).indices, logits


def _gpt_oss_weights(logits, idx):
    return logits.gather(1, idx).softmax(-1)


def _glm_route(x, weight, bias, k, groups, topk_group):
    """GLM-4.5 in fp64: scores = sigmoid(x W^T); the choice is the top-k of scores + bias within the best
    ``topk_group`` groups (a group scored by the sum of its two best biased scores)."""
    scores = torch.sigmoid(x.double() @ weight.double().t())
    choice = scores + bias.double()
    n, e = choice.shape
    group_scores = choice.view(n, groups, e // groups).topk(2, -1).values.sum(-1)
    best = group_scores.topk(topk_group, -1).indices
    keep = torch.zeros(n, groups, dtype=torch.bool).scatter(1, best, True).repeat_interleave(e // groups, 1)
    return choice.masked_fill(~keep, -math.inf).topk(k, -1).indices, scores


def _glm_weights(scores, idx, scale):
    """The UNBIASED sigmoid scores at the chosen experts, renormalised over the k, times the scaling factor."""
    at = scores.gather(1, idx)
    return scale * at / at.sum(-1, keepdim=True)


def _trainer_router(name: str):
    """A megatron TopKRouter with the trainer's config of the tiny family (the router of layer 2, the model's
    MoE layer), outside any process group (forward only: the groups serve the aux losses)."""
    from types import SimpleNamespace

    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_rlvr.config import ModelConfig, ParallelConfig, TrainConfig
    from megatron_rlvr.megatron.cpu_shims import apply_cpu_shims
    from megatron_rlvr.megatron.policy import model_args_for
    from megatron_rlvr.models.source import resolve_model_source

    apply_cpu_shims()
    mcfg = ModelConfig(name=name)
    args = model_args_for(resolve_model_source(mcfg), mcfg, ParallelConfig(), TrainConfig(recompute="none"))
    groups = SimpleNamespace(tp=None, cp=None, tp_cp=None, tp_dp_cp=None)
    router = TopKRouter(args.config, pg_collection=groups).eval()
    return router, args.config


def _check_family(name: str, seed: int) -> dict:
    """Generate with the family's engine, then run the perturbed trainer router on each reply's last-MoE-layer router
    inputs without replay, recording (R2), replaying the engine's routes (R3) and replaying its gate weights too;
    returns the counts and largest errors the test asserts on."""
    from megatron_rlvr.megatron.routing import _replay_class, _replay_weights_hook
    from megatron_rlvr.rollout.engine import SamplingParams

    hf, eng, hf_routers = _engine(name, seed)
    k = hf["num_experts_per_tok"]
    gpt_oss = hf["model_type"] == "gpt_oss"
    out = eng.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_tokens=4, seed=5))

    router, mcfg = _trainer_router(name)
    assert router.topk == k
    hf_r = hf_routers[-1]  # the last MoE layer
    g = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():  # the trainer's router: the engine's weights moved by a perturbation
        router.weight.copy_(hf_r.weight + 1.5 * torch.randn(hf_r.weight.shape, generator=g))
        if gpt_oss:
            router.bias.copy_(hf_r.bias + 1.5 * torch.randn(hf_r.bias.shape, generator=g))
        else:
            router.expert_bias.copy_(hf_r.e_score_correction_bias)
    cls, action = _replay_class()
    replay = cls()
    router.router_replay = replay
    router.register_forward_hook(_replay_weights_hook(replay))

    res = {"tokens": 0, "natural_differs": 0, "engine_differs": 0, "replay_exact": True}
    res["own_weights_err"] = res["engine_weights_err"] = res["engine_ref_err"] = 0.0
    for o, p in zip(out, PROMPTS):
        for c in o.completions:
            ids = torch.tensor([p + c.token_ids[:-1]])
            inputs = []
            h = hf_r.register_forward_pre_hook(lambda m, a, seen=inputs: seen.append(a[0].flatten(0, -2)))
            with torch.no_grad():
                eng.model(ids)
            h.remove()
            x = inputs[0]  # [T, H]
            routes = c.routes[-1].long()  # [T, k] the engine's experts in the last MoE layer
            weights = c.route_weights[-1]
            # the engine's routes and gate weights are the family's (fp64 from the router inputs)
            if gpt_oss:
                ref_idx, ref_logits = _gpt_oss_route(x, hf_r.weight, hf_r.bias, k)
                ref_w = _gpt_oss_weights(ref_logits, routes)
            else:
                ref_idx, ref_scores = _glm_route(x, hf_r.weight, hf_r.e_score_correction_bias, k, hf["n_group"],
                                                 hf["topk_group"])  # fmt: skip
                ref_w = _glm_weights(ref_scores, routes, hf["routed_scaling_factor"])
            res["engine_differs"] += int((ref_idx.sort(-1).values != routes.sort(-1).values).any(-1).sum())
            res["engine_ref_err"] = max(res["engine_ref_err"], float((weights.double() - ref_w).abs().max()))

            # the trainer's router on the same inputs: [s, b, H]
            xin = x.unsqueeze(1)
            T = x.shape[0]
            with torch.no_grad():
                _, natural_map = router(xin)  # no replay: the perturbed router's own choice
            natural = natural_map.nonzero()[:, 1].view(T, k)
            replay.clear_indices()  # R2 records the router's own (for GLM-4.5: bias-corrected) choice
            replay.set_router_replay_action(action.RECORD)
            with torch.no_grad():
                router(xin)
            res["recorded_exact"] = res.get("recorded_exact", True) and bool(
                torch.equal(replay.get_recorded_indices().sort(-1).values, natural)
            )
            res["natural_differs"] += int((natural != routes.sort(-1).values).any(-1).sum())
            res["tokens"] += T

            replay.clear_indices()
            replay.set_target_indices(routes)
            replay.valid = torch.ones(T, dtype=torch.bool)
            replay.counted = False
            replay.set_router_replay_action(action.REPLAY_FORWARD)
            with torch.no_grad():
                probs, routing_map = router(xin)
                replayed = routing_map.nonzero()[:, 1].view(T, k)
                res["replay_exact"] &= bool(torch.equal(replayed, routes.sort(-1).values))
                # the gate weights: the family's function of the trainer's OWN logits at the engine's experts
                own_w = probs.double().gather(1, routes)
                w = router.weight.double()
                if gpt_oss:
                    trainer_logits = x.double() @ w.t() + router.bias.double()
                    want = _gpt_oss_weights(trainer_logits, routes)
                else:
                    want = _glm_weights(torch.sigmoid(x.double() @ w.t()), routes, hf["routed_scaling_factor"])
                res["own_weights_err"] = max(res["own_weights_err"], float((own_w - want).abs().max()))
                res["own_vs_engine"] = max(res.get("own_vs_engine", 0.0), float((own_w - weights.double()).abs().max()))
                replay.target_weights = weights  # R3 with the engine's gate weights
                probs_w, _ = router(xin)
                err = float((probs_w.double().gather(1, routes) - weights.double()).abs().max())
                res["engine_weights_err"] = max(res["engine_weights_err"], err)
                replay.target_weights = None
            replay.clear_router_replay_action()
    res["counted"] = replay.counts["update"].tolist()
    res["score_function"] = mcfg.moe_router_score_function
    return res


@pytest.mark.parametrize("name", ["tiny_gpt_oss", "tiny_glm4_moe"])
def test_r3_replays_the_engine_routes_and_weights_the_family_way(name):
    """GPT-OSS and GLM-4.5: the engine's routes and gate weights are the family's routing in fp64; the perturbed
    trainer router's own choice differs from them for many tokens (and is what R2 records), its replayed choice equals
    them for every token, its replayed gate weights are the family's function of its own logits (not the engine's
    values: they differ), and with the engine's weights replayed they are the engine's. The replay instance counts
    the disagreement."""
    res = _check_family(name, seed=3)
    assert res["score_function"] == ("softmax" if name == "tiny_gpt_oss" else "sigmoid")
    assert res["engine_differs"] == 0, res  # the engine routed as the family does
    assert res["engine_ref_err"] < 5e-6, res  # fp32 engine values up to 2.5 (GLM-4.5 scaled)
    assert res["natural_differs"] > 0.2 * res["tokens"], res  # the perturbation moved many routes
    assert res["recorded_exact"], res  # R2: what is recorded is the router's own choice
    assert res["replay_exact"], res  # replayed: the engine's experts for every token
    assert res["own_weights_err"] < 5e-6, res  # the family's gate weights from the trainer's own logits
    assert res["own_vs_engine"] > 1e-2, res  # ...which are not the engine's values
    assert res["engine_weights_err"] < 5e-6, res  # with routing_replay_weights: the engine's values
    tokens, differ, _ = res["counted"]
    assert tokens == res["tokens"] and differ == res["natural_differs"], res


@pytest.mark.parametrize("name", ["tiny_gpt_oss", "tiny_glm4_moe"])
def test_config_accepts_r2_and_r3_with_gate_weights(name):
    """The run config takes R2 and R3 with the engine's gate weights for both families (their transformers routers
    return the final gate weights, checked above); the weights still need r3."""
    from megatron_rlvr.config import ConfigError, load_run_config

    base = [f"model.name={name}", "parallel.ep=2", "rollout.engine=hf"]
    cfg = load_run_config(None, base + ["train.routing_replay=r3", "train.routing_replay_weights=true"])
    assert cfg.train.routing_replay == "r3" and cfg.train.routing_replay_weights
    assert load_run_config(None, base + ["train.routing_replay=r2"]).train.routing_replay == "r2"
    with pytest.raises(ConfigError, match="needs train.routing_replay=r3"):
        load_run_config(None, base + ["train.routing_replay=r2", "train.routing_replay_weights=true"])

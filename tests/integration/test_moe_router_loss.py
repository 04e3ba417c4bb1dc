"""The router's load-balancing aux loss and z-loss (megatron_rlvr/megatron/router_loss.py) on the tiny MoE model at
TP = 2 (sequence parallel) x EP = 2 on the 4 pooled gloo ranks, built from ``train.moe_aux_loss_coeff`` /
``train.moe_z_loss_coeff`` as the trainer builds it.

Reference, independent of megatron's router code: forward hooks keep every router's input, the TP shards are
gathered, and the full micro-batch's logits x W^T are recomputed in fp64; the Switch aux loss E / (k T^2) sum_i c_i
sum_t p_ti and the z-loss mean_t logsumexp^2 follow from them. The logged metric must equal their mean over
micro-batches, data-parallel ranks and layers; the LAST layer's router gradient must change by exactly
coeff / micro-batches x d(term)/dW (earlier routers also get the term's gradient through later layers' inputs, so
they are only checked to move); with both coefficients 0 nothing is tracked or logged."""

from __future__ import annotations

import pytest
import torch

LENGTHS = [[5, 9], [7, 10, 6]]  # this rank's two micro-batches
AUX, Z = 0.1, 0.05


def _reference(xs: list[torch.Tensor], weight: torch.Tensor, k: int, n_micro: int):
    """fp64 terms and the gradient of coeff=1 x (their sum over micro-batches / n_micro) w.r.t. the router weight.
    ``xs``: the router's full-sequence inputs [T, h] of each micro-batch."""
    w = weight.detach().double().clone().requires_grad_(True)
    aux_sum = z_sum = 0
    aux_vals, z_vals = [], []
    for x in xs:
        logits = x.double() @ w.t()  # [T, E]
        T, E = logits.shape
        p = logits.softmax(-1)
        counts = torch.zeros(E, dtype=torch.float64).scatter_add_(
            0, logits.topk(k, -1).indices.reshape(-1), torch.ones(T * k, dtype=torch.float64)
        )
        aux = E / (k * T * T) * (counts * p.sum(0)).sum()
        z = logits.logsumexp(-1).pow(2).mean()
        aux_vals.append(float(aux))
        z_vals.append(float(z))
        aux_sum = aux_sum + aux
        z_sum = z_sum + z
    (g_aux,) = torch.autograd.grad(aux_sum / n_micro, w, retain_graph=True)
    (g_z,) = torch.autograd.grad(z_sum / n_micro, w)
    return aux_vals, z_vals, g_aux, g_z


def _rank_router_loss():
    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_rlvr.config import ModelConfig, ParallelConfig, TrainConfig
    from megatron_rlvr.megatron.policy import build_model, model_args_for
    from megatron_rlvr.megatron.router_loss import reset_router_loss_tracker, router_loss_metrics
    from megatron_rlvr.megatron.schedule import run_microbatches
    from megatron_rlvr.models.build import unwrap
    from megatron_rlvr.models.source import resolve_model_source
    from megatron_rlvr.trainer.microbatch import Sequence, build_microbatch

    pg = ProcessGroupCollection.use_mpu_process_groups()
    source = resolve_model_source(ModelConfig(name="tiny_moe"))
    g = torch.Generator().manual_seed(100 + pg.dp.rank())
    mbs = []
    for lengths in LENGTHS:
        seqs = [Sequence(tokens=torch.randint(3, 19, (n,), generator=g).tolist(), prompt_len=2) for n in lengths]
        mbs.append(build_microbatch(seqs, len(seqs), 10, 0, ids=list(range(len(seqs)))))

    def run(aux: float, z: float):
        train = TrainConfig(recompute="none", moe_aux_loss_coeff=aux, moe_z_loss_coeff=z)
        args = model_args_for(source, ModelConfig(name="tiny_moe"), ParallelConfig(tp=2, ep=2), train)
        model = build_model(args, source, seed=7, pg=pg)
        model.train()
        routers = [m for m in unwrap(model).modules() if isinstance(m, TopKRouter)]
        seen = {
            "config": (args.config.moe_aux_loss_coeff, args.config.moe_z_loss_coeff),
            "router_config": (routers[0].config.moe_aux_loss_coeff, routers[0].config.moe_z_loss_coeff),
        }
        inputs: list[list[torch.Tensor]] = [[] for _ in routers]
        hooks = [
            r.register_forward_hook(lambda mod, inp, out, i=i: inputs[i].append(inp[0].detach().clone()))
            for i, r in enumerate(routers)
        ]
        reset_router_loss_tracker()
        run_microbatches(
            model, mbs, lambda mb, out: (out.float().pow(2).mean(), {}), pg=pg, forward_only=False, device="cpu"
        )
        for h in hooks:
            h.remove()
        seen["tracked"] = sorted(n for n, v in get_moe_layer_wise_logging_tracker().items() if v["values"].any())
        seen["metrics"] = router_loss_metrics(model, len(mbs), pg)
        grads = []
        for r in routers:  # sequence parallel: each TP rank holds its positions' part of the router gradient
            gr = r.weight.grad.detach().double().clone()
            dist.all_reduce(gr, group=pg.tp)
            grads.append(gr)
        seen["grads"] = grads
        full_inputs = []
        for layer in inputs:  # [s / tp, b, h] per micro-batch -> [s * b, h]: the whole micro-batch
            per_mb = []
            for x in layer:
                parts = [torch.empty_like(x) for _ in range(pg.tp.size())]
                dist.all_gather(parts, x.contiguous(), group=pg.tp)
                per_mb.append(torch.cat(parts).reshape(-1, x.shape[-1]))
            full_inputs.append(per_mb)
        seen["inputs"] = full_inputs
        seen["weights"] = [r.weight.detach().clone() for r in routers]
        seen["k"] = routers[0].topk
        return seen

    base, with_aux, with_z = run(0.0, 0.0), run(AUX, 0.0), run(0.0, Z)
    refs = [_reference(xs, w, base["k"], len(mbs)) for xs, w in zip(base["inputs"], base["weights"])]
    n_layers = len(refs)
    return {
        "configs": [s["config"] for s in (base, with_aux, with_z)],
        "router_configs": [s["router_config"] for s in (base, with_aux, with_z)],
        "tracked": [s["tracked"] for s in (base, with_aux, with_z)],
        "metrics": [s["metrics"] for s in (base, with_aux, with_z)],
        # this data-parallel rank's reference: mean over its micro-batches and the layers
        "aux_ref": sum(sum(r[0]) for r in refs) / (len(mbs) * n_layers),
        "z_ref": sum(sum(r[1]) for r in refs) / (len(mbs) * n_layers),
        "aux_diff": [(with_aux["grads"][i] - base["grads"][i]) for i in range(n_layers)],
        "z_diff": [(with_z["grads"][i] - base["grads"][i]) for i in range(n_layers)],
        "aux_expected_last": AUX * refs[-1][2],
        "z_expected_last": Z * refs[-1][3],
        "same_inputs": all(
            torch.equal(a, b) for la, lb in zip(base["inputs"], with_aux["inputs"]) for a, b in zip(la, lb)
        ),
    }


@pytest.mark.slow
def test_router_aux_and_z_loss_reach_the_gradient_and_the_metrics(dist_pool):
    res = dist_pool.run(_rank_router_loss, tp=2, ep=2, timeout=300)
    r0 = res[0]
    assert r0["configs"] == [(0.0, None), (AUX, None), (0.0, Z)]  # TransformerConfig: z-loss None = off
    assert r0["router_configs"] == r0["configs"]
    assert r0["tracked"] == [[], ["load_balancing_loss"], ["z_loss"]]
    assert r0["metrics"][0] == {}
    # the metric: the mean over micro-batches of every data-parallel rank (TP pairs (0, 1), (2, 3) share theirs)
    aux_ref = sum(r["aux_ref"] for r in res) / len(res)
    z_ref = sum(r["z_ref"] for r in res) / len(res)
    for r in res:
        assert set(r["metrics"][1]) == {"moe/aux_loss"} and set(r["metrics"][2]) == {"moe/z_loss"}
        assert r["metrics"][1]["moe/aux_loss"] == pytest.approx(aux_ref, rel=1e-5)
        assert r["metrics"][2]["moe/z_loss"] == pytest.approx(z_ref, rel=1e-5)
        assert r["same_inputs"]  # the terms change the gradient, never the forward
        # the last router: exactly coeff x the term's gradient; every router moved
        for diff, expected in ((r["aux_diff"], r["aux_expected_last"]), (r["z_diff"], r["z_expected_last"])):
            assert expected.abs().max() > 0
            torch.testing.assert_close(diff[-1], expected, rtol=2e-3, atol=2e-3 * float(expected.abs().max()))
            assert all(float(d.abs().max()) > 1e-3 * float(expected.abs().max()) for d in diff)
    # the aux loss of a balanced router is 1 (k experts per token, E experts): a sanity bound on the scale
    assert 0.9 < aux_ref < 4.0

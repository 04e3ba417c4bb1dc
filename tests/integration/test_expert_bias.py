"""The aux-loss-free expert-bias update (``train.moe_expert_bias_update_rate``) of the tiny DeepSeek-V3 model
(``tiny_dsv3``: 2 MoE layers of 8 sigmoid-scored experts) at EP = 2 on the 4 pooled gloo ranks (DP = 4), built as the
trainer builds it (model_args_for, build_model, wrap_ddp, build_optimizer, run_microbatches, apply_gradients).

Reference, independent of megatron's counters and update: forward hooks keep every router's routing map (which
experts each token of each micro-batch went to), the per-expert loads are summed over the micro-batches of the
optimizer step and all-reduced over the ranks, and the published rule (arXiv:2408.15664, DeepSeek-V3 sec. 2.1.2),
bias_i += rate * sign(mean_j load_j - load_i) per layer, is computed in fp64 from the bias before the step. The
step's ``moe/expert_bias_*`` and ``moe/load_imbalance*`` metrics must equal the same loads' fp64 values. A training
checkpoint saved after the first step and loaded into a fresh model (another seed, zero bias) must give back the
bias exactly, and the resumed second step must land on the uninterrupted run's bias and weights exactly.
"""

from __future__ import annotations

import os

import pytest
import torch

RATE = 1e-2
LENGTHS = [[5, 9, 7], [7, 10, 6, 4]]  # this rank's two micro-batches of a step


def _microbatches(step: int, dp_rank: int):
    from megatron_rlvr.trainer.microbatch import Sequence, build_microbatch

    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    mbs = []
    for lengths in LENGTHS:
        seqs = [Sequence(tokens=torch.randint(3, 19, (n,), generator=g).tolist(), prompt_len=2) for n in lengths]
        mbs.append(build_microbatch(seqs, len(seqs), 10, 0, ids=list(range(len(seqs)))))
    return mbs


def _rank_expert_bias(root: str, rate: float):
    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_rlvr.config import ModelConfig, OptimizerConfig, ParallelConfig, ScheduleConfig, TrainConfig
    from megatron_rlvr.megatron.optimizer_step import apply_gradients, zero_grads
    from megatron_rlvr.megatron.parallel import all_reduce_max
    from megatron_rlvr.megatron.policy import build_model, build_optimizer, model_args_for, wrap_ddp
    from megatron_rlvr.megatron.router_loss import expert_bias_metrics, expert_bias_routers
    from megatron_rlvr.megatron.schedule import run_microbatches
    from megatron_rlvr.models.build import unwrap
    from megatron_rlvr.models.checkpointing import CheckpointConfig, latest_checkpoint, load_checkpoint, save_checkpoint
    from megatron_rlvr.models.source import resolve_model_source

    pg = ProcessGroupCollection.use_mpu_process_groups()
    mcfg = ModelConfig(name="tiny_dsv3")
    source = resolve_model_source(mcfg)
    par = ParallelConfig(ep=2, distributed_optimizer=False)
    train = TrainConfig(recompute="none", moe_expert_bias_update_rate=rate)
    args = model_args_for(source, mcfg, par, train)

    def setup(seed: int):  # its own TransformerConfig: wrap_ddp puts the DDP's hooks on it
        args = model_args_for(source, mcfg, par, train)
        ddp = wrap_ddp(build_model(args, source, seed=seed, pg=pg), distributed_optimizer=False)
        opt, sched = build_optimizer(ddp, OptimizerConfig(lr=1e-2), ScheduleConfig(steps=4), par, "float32")
        return ddp, opt, sched

    def biases(ddp) -> torch.Tensor:
        return torch.stack([r.expert_bias.detach().clone() for r in expert_bias_routers(unwrap(ddp))])

    def step(ddp, opt, sched, k: int):
        """One optimizer step on step k's micro-batches; returns the all-ranks loads [layers, E] the hooks saw."""
        routers = expert_bias_routers(unwrap(ddp))
        loads = torch.zeros(len(routers), routers[0].config.num_moe_experts, dtype=torch.float64)

        def hook(i):
            def fn(mod, inp, out):
                loads[i] += out[1].detach().double().sum(0)  # routing map [tokens, E]: each token's chosen experts

            return fn

        hooks = [r.register_forward_hook(hook(i)) for i, r in enumerate(routers)]
        zero_grads(ddp, opt)
        run_microbatches(
            ddp,
            _microbatches(k, pg.dp.rank()),
            lambda mb, out: (out.float().pow(2).mean(), {}),
            pg=pg,
            forward_only=False,
            device="cpu",
        )
        for h in hooks:
            h.remove()
        assert apply_gradients(ddp, opt, local_nonfinite=False, all_reduce_max=all_reduce_max).applied
        sched.step(1)
        dist.all_reduce(loads)  # TP = 1: the world is TP x CP x DP
        return loads

    out = {"layout": (args.config.expert_model_parallel_size, pg.dp.size())}
    ddp, opt, sched = setup(seed=7)
    g = torch.Generator().manual_seed(5)
    for r in expert_bias_routers(unwrap(ddp)):  # a random start (the same on every rank): not transformers' zeros
        r.expert_bias.copy_(0.05 * torch.randn(r.expert_bias.shape, generator=g))
    out["bias0"] = biases(ddp)
    out["loads0"] = step(ddp, opt, sched, 0)
    out["bias1"] = biases(ddp)
    out["metrics1"] = expert_bias_metrics(ddp, pg)
    cfg = CheckpointConfig(os.path.join(root, "ckpt"), keep_last=2, write_processes=1)
    save_checkpoint(cfg, 1, model=ddp, optimizer=opt, scheduler=sched, trainer_state={"step": 1}, model_args=args)
    out["loads1"] = step(ddp, opt, sched, 1)
    out["bias2"] = biases(ddp)
    out["metrics2"] = expert_bias_metrics(ddp, pg)
    out["weights2"] = {k: v.detach().clone() for k, v in unwrap(ddp).state_dict().items() if torch.is_tensor(v)}

    ddp, opt, sched = setup(seed=99)  # another init, zero bias: everything must come from the checkpoint
    out["fresh_bias"] = biases(ddp)
    load_checkpoint(latest_checkpoint(cfg.save_dir), model=ddp, optimizer=opt, scheduler=sched)
    out["resumed_bias1"] = biases(ddp)
    step(ddp, opt, sched, 1)
    out["resumed_bias2"] = biases(ddp)
    out["resumed_weights2"] = {k: v.detach().clone() for k, v in unwrap(ddp).state_dict().items() if torch.is_tensor(v)}
    return out


def _rule(bias: torch.Tensor, loads: torch.Tensor, rate: float) -> torch.Tensor:
    """fp64: bias_i + rate * sign(mean_j load_j - load_i), per layer (rows)."""
    return bias.double() + rate * torch.sign(loads.mean(-1, keepdim=True) - loads)


def _imbalance(loads_list) -> tuple[float, float]:
    values = torch.cat([(ld.amax(-1) / ld.mean(-1)) for ld in loads_list])
    return float(values.mean()), float(values.max())


@pytest.mark.slow
def test_expert_bias_update_follows_the_rule_and_survives_resume(dist_pool, tmp_path):
    res = dist_pool.run(_rank_expert_bias, ep=2, args=(str(tmp_path), RATE), timeout=300)
    r0 = res[0]
    assert r0["layout"] == (2, 4)  # EP = 2 x DP = 4: each rank holds 4 of a layer's 8 experts
    for r in res:  # the bias is replicated: every rank applies the same update
        for k in ("bias1", "bias2"):
            assert torch.equal(r[k], r0[k])
    for before, loads, after in (("bias0", "loads0", "bias1"), ("bias1", "loads1", "bias2")):
        loads_LE = r0[loads]
        assert loads_LE.shape == (2, 8) and (loads_LE.sum(-1) == loads_LE.sum(-1)[0]).all()
        assert len(set(loads_LE.flatten().tolist())) > 2  # not balanced: the rule has signs to follow
        expected = _rule(r0[before], loads_LE, RATE)
        torch.testing.assert_close(r0[after].double(), expected, rtol=0, atol=1e-7)
        moved = (r0[after].double() - r0[before].double()).abs()
        assert int((moved > 0.5 * RATE).sum()) >= 8  # the update is not idle
    for key, loads, bias in (("metrics1", ["loads0"], "bias1"), ("metrics2", ["loads1"], "bias2")):
        mean, worst = _imbalance([r0[x] for x in loads])
        m = r0[key]
        assert m["moe/load_imbalance"] == pytest.approx(mean, rel=1e-12)
        assert m["moe/load_imbalance_max"] == pytest.approx(worst, rel=1e-12)
        assert m["moe/expert_bias_abs_mean"] == pytest.approx(float(r0[bias].double().abs().mean()), rel=1e-12)
        assert m["moe/expert_bias_abs_max"] == pytest.approx(float(r0[bias].double().abs().max()), rel=1e-12)
        assert m["moe/load_imbalance"] > 1.0
    # resume: the checkpoint holds the bias (a fresh model starts at 0) and the next step matches exactly
    for r in res:
        assert not torch.equal(r["fresh_bias"], r["bias1"])
        assert torch.equal(r["resumed_bias1"], r["bias1"])
        assert torch.equal(r["resumed_bias2"], r["bias2"])
        assert sorted(r["resumed_weights2"]) == sorted(r["weights2"])
        assert [k for k in r["weights2"] if not torch.equal(r["weights2"][k], r["resumed_weights2"][k])] == []


def test_expert_bias_update_rate_is_checked():
    """The option is validated and refused (one line naming it) for a model whose routers have no expert bias."""
    from megatron_rlvr.config import ModelConfig, ParallelConfig, TrainConfig
    from megatron_rlvr.megatron.policy import model_args_for
    from megatron_rlvr.models.source import resolve_model_source

    with pytest.raises(ValueError, match="train.moe_expert_bias_update_rate must be a finite number >= 0"):
        TrainConfig(moe_expert_bias_update_rate=-1e-3)
    with pytest.raises(ValueError, match="train.moe_expert_bias_update_rate > 0 needs routers with an expert bias"):
        model_args_for(
            resolve_model_source(ModelConfig(name="tiny_moe")),
            ModelConfig(name="tiny_moe"),
            ParallelConfig(),
            TrainConfig(moe_expert_bias_update_rate=1e-3),
        )
    args = model_args_for(
        resolve_model_source(ModelConfig(name="tiny_dsv3")),
        ModelConfig(name="tiny_dsv3"),
        ParallelConfig(),
        TrainConfig(moe_expert_bias_update_rate=1e-3),
    )
    assert args.config.moe_router_enable_expert_bias and args.config.moe_router_bias_update_rate == 1e-3

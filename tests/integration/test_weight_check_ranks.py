"""Verified weight syncs through the trainer's real publish on gloo ranks: one expert written wrong into one rank's
engine at EP=2 (the failure class of a mis-sharded expert layout), and one LoRA-adapted weight written wrong. With
``rollout.verify_sync=every`` the rank whose engine holds the wrong tensor stops with its name; with verification off
(``never``, as the code before it) the same corruption passes silently."""

from __future__ import annotations

import os

import pytest

EXPERT = "model.layers.1.mlp.experts.3.down_proj.weight"
ADAPTED = "model.layers.0.self_attn.q_proj.weight"


def _publish_with_one_corrupted_tensor(run_dir: str, config: str | None, overrides: list, target: str, bad_rank: int):
    """Set up a colocated trainer, corrupt ``target`` as rank ``bad_rank``'s engine loads it, publish once; the
    error text (None: the publish passed) and whether the corruption happened."""
    import torch
    import torch.distributed as dist

    from megatron_rlvr.config import load_run_config
    from megatron_rlvr.rollout.weight_check import WeightSyncError
    from megatron_rlvr.trainer.colocated import setup, teardown
    from megatron_rlvr.trainer.stages import publish

    t = setup(load_run_config(config, overrides), os.path.join(run_dir, f"run-{len(overrides)}"))
    engine = t.rollout.engine
    real = type(engine)._load_pairs
    hit = []

    def corrupting(pairs, params, received):
        n = real(pairs, params, received)
        if dist.get_rank() == bad_rank:
            with torch.no_grad():
                for name, _ in pairs:
                    if name == target:
                        params[name].view(-1)[0] += 1.0
                        hit.append(name)
        return n

    engine._load_pairs = corrupting
    try:
        publish(t.policy, t.sink, 1)
        return None, bool(hit)
    except WeightSyncError as e:
        return str(e), bool(hit)
    finally:
        teardown(t)


@pytest.mark.parametrize(
    "config,overrides,target",
    [
        ("configs/tiny_moe.yaml", ["parallel.ep=2", "parallel.tp=1"], EXPERT),
        (None, ["parallel.tp=2", "model.lora.rank=4", "model.lora.targets=[qkv]"], ADAPTED),
    ],
    ids=["expert_at_ep2", "lora_adapted_weight"],
)
def test_a_corrupted_engine_tensor_stops_the_sync_naming_it(dist_pool, tmp_path, config, overrides, target):
    tp = 2 if "parallel.tp=2" in overrides else 1
    ep = 2 if "parallel.ep=2" in overrides else 1
    common = [*overrides, "checkpoint.export_hf=false", "logging.plot_at_end=false", "rollout.engine=hf"]
    on = dist_pool.run(
        _publish_with_one_corrupted_tensor,
        tp=tp,
        ep=ep,
        args=(str(tmp_path / "on"), config, [*common, "rollout.verify_sync=every"], target, 1),
        timeout=600,
    )
    assert on[1][1], "the corruption was injected on rank 1"
    assert on[1][0] is not None and f"this rank's engine: {target} has digest" in on[1][0], on[1][0]
    assert all(err is None for r, (err, _) in enumerate(on) if r != 1)  # the other engines hold the right weights
    off = dist_pool.run(
        _publish_with_one_corrupted_tensor,
        tp=tp,
        ep=ep,
        args=(str(tmp_path / "off"), config, [*common, "rollout.verify_sync=never"], target, 1),
        timeout=600,
    )
    assert off[1][1] and all(err is None for err, _ in off)  # unverified: nothing notices

"""Prompt split -> rollout groups -> gather -> training DP shards: pure functions checked by hand, and a 4-rank gloo
run showing that every training rank receives exactly the samples a single engine produces for its prompts (same
seed), whatever the rollout TP (1, 2, 4) and training DP (4, 2), with each prompt's samples kept together."""

import pytest
import torch

from megatron_rlvr.rollout.dataflow import RolloutLayout, merge_shards, shard_range, training_shard
from megatron_rlvr.rollout.engine import Completion, RolloutOutput


def test_shard_range_balanced_contiguous():
    assert [shard_range(7, 3, i) for i in range(3)] == [(0, 3), (3, 5), (5, 7)]
    assert [shard_range(2, 4, i) for i in range(4)] == [(0, 1), (1, 2), (2, 2), (2, 2)]
    assert [shard_range(8, 4, i) for i in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    for n in range(0, 13):
        for k in range(1, 6):
            spans = [shard_range(n, k, i) for i in range(k)]
            assert spans[0][0] == 0 and spans[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
            sizes = [b - a for a, b in spans]
            assert max(sizes) - min(sizes) <= 1
    with pytest.raises(ValueError, match="outside"):
        shard_range(5, 2, 2)
    with pytest.raises(ValueError, match="n_shards"):
        shard_range(5, 0, 0)


def test_rollout_layout_groups_consecutive_ranks():
    lay = [RolloutLayout(8, r, 4) for r in range(8)]
    assert [x.dp_rank for x in lay] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [x.is_leader for x in lay] == [True, False, False, False, True, False, False, False]
    assert lay[5].dp_size == 2 and lay[5].prompt_range(5) == (3, 5)
    with pytest.raises(ValueError, match="rollout_tp"):
        RolloutLayout(6, 0, 4)
    with pytest.raises(ValueError, match="outside"):
        RolloutLayout(4, 4, 1)


def _out(i):
    return RolloutOutput([i], [Completion([i, i], [-1.0, -1.0], "length")])


def test_merge_and_training_shard():
    merged = merge_shards([[(2, _out(2)), (3, _out(3))], None, [(0, _out(0)), (1, _out(1))]], 4)
    assert [o.prompt_token_ids for o in merged] == [[0], [1], [2], [3]]
    idx, mine = training_shard(merged, 3, 0)
    assert list(idx) == [0, 1] and [o.prompt_token_ids for o in mine] == [[0], [1]]
    with pytest.raises(ValueError, match="twice"):
        merge_shards([[(0, _out(0))], [(0, _out(0))]], 1)
    with pytest.raises(ValueError, match="missing"):
        merge_shards([[(0, _out(0))]], 2)


PROMPTS = [[5, 6], [7], [8, 9, 10], [11], [12, 13], [14], [15, 16, 17]]  # 7: not divisible by 2 or 4


def _tiny_engine():
    from transformers import LlamaConfig

    from megatron_rlvr.rollout.hf_engine import HFRolloutEngine

    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    return HFRolloutEngine.from_config(cfg)


def _rank_dataflow():
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_rlvr.rollout.dataflow import RolloutLayout, run_rollout
    from megatron_rlvr.rollout.engine import SamplingParams

    engine = _tiny_engine()
    params = SamplingParams(n=2, temperature=1.0, max_tokens=5, seed=5)
    reference = engine.generate(PROMPTS, params)  # one engine, all prompts: the expected samples
    ref_tokens = [[c.token_ids for c in o.completions] for o in reference]
    dp_size, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    out = {}
    for rollout_tp in (1, 2, 4):
        layout = RolloutLayout(dist.get_world_size(), dist.get_rank(), rollout_tp)
        shard = run_rollout(engine, PROMPTS, params, layout=layout, train_dp_size=dp_size, train_dp_rank=dp_rank)
        out[rollout_tp] = dict(
            indices=list(shard.prompt_indices),
            tokens=[[c.token_ids for c in o.completions] for o in shard.outputs],
            prompts=[o.prompt_token_ids for o in shard.outputs],
            expected=[ref_tokens[i] for i in shard.prompt_indices],
        )
    other_seed = run_rollout(
        engine,
        PROMPTS,
        SamplingParams(n=2, temperature=1.0, max_tokens=5, seed=6),
        layout=RolloutLayout(dist.get_world_size(), dist.get_rank(), 2),
        train_dp_size=dp_size,
        train_dp_rank=dp_rank,
    )
    out["other_seed"] = [[c.token_ids for c in o.completions] for o in other_seed.outputs]
    out["dp"] = (dp_size, dp_rank)
    return out


@pytest.mark.parametrize("tp", [1, 2])
def test_rollout_dataflow_on_gloo(dist_pool, tp):
    results = dist_pool.run(_rank_dataflow, tp=tp, pp=1, timeout=240)
    dp_size = 4 // tp
    for rollout_tp in (1, 2, 4):
        covered = []
        for rank, res in enumerate(results):
            r = res[rollout_tp]
            assert r["tokens"] == r["expected"], f"rank {rank} rollout_tp={rollout_tp}: samples differ from reference"
            assert r["prompts"] == [PROMPTS[i] for i in r["indices"]]
            assert all(len(t) == 2 for t in r["tokens"]), "each prompt keeps its n=2 samples together"
            covered.append((res["dp"][1], tuple(r["indices"])))
        per_dp = dict(covered)
        assert len(per_dp) == dp_size and len(set(covered)) == dp_size, "ranks of one DP rank must agree"
        assert sorted(i for idx in per_dp.values() for i in idx) == list(range(len(PROMPTS)))
    assert any(res["other_seed"] != res[2]["tokens"] for res in results), "another seed must give other samples"

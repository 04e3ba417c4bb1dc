"""Row packing (train.pack_sequences): several sequences share a micro-batch row under a block-diagonal causal mask.

Pure checks first (the packing plan and the packed micro-batch against a hand-worked case), then the trainer at
TP = 2 x DP = 2 and TP = 2 x PP = 2: for every algorithm preset one step with packed rows gives the metrics and
gradients of the same step with one sequence per row, to float32 noise. The reference is the unpacked path, whose
exactness the rest of the suite establishes (fp64 full-vocabulary references, layout invariance)."""

import dataclasses
import os
import sys

import pytest
import torch
import trainer_helpers

from megatron_rlvr.algorithms import PRESETS
from megatron_rlvr.trainer.microbatch import Sequence, build_microbatch, pack_packed, pack_rows, unpack_values

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: trainer_helpers
SMALL = [
    "train.prompts_per_step=4",
    "rollout.n=4",
    *trainer_helpers.DENSE_TINY,
    *trainer_helpers.QUIET,
    "optimizer.lr=1e-2",
    "reward.fn=trainer_helpers:even_digit_reward",  # reward variance in every batch: a gradient to compare
    "train.micro_batch_tokens=40",  # several micro-batches, several sequences per row
]


def test_pack_rows_places_every_sequence_once_within_the_capacity():
    lengths = [7, 3, 5, 2, 2, 6, 1, 4, 8, 3]
    rows = pack_rows(lengths, 8)
    assert sorted(i for r in rows for i in r) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in r) <= 8 for r in rows)
    assert len(rows) == 6  # first-fit decreasing: 41 tokens in rows of 8 need at least 6
    assert rows[0] == [8]  # the longest sequence opens the first row
    with pytest.raises(ValueError, match="exceeds the row capacity 8"):
        pack_rows([9], 8)
    plan = pack_packed(lengths, budget=40, uniform=False)  # rows of 2 x 8 = 16: 41 tokens in 3 rows, 2 per batch
    assert [(len(r), b, s) for r, b, s in plan] == [(2, 2, 16), (1, 1, 16)]
    assert all(sum(lengths[i] for i in row) <= 16 for r, _, _ in plan for row in r)
    uniform = pack_packed(lengths, budget=40, uniform=True, multiple=3)  # s = 18 (multiple of 3), b = 2
    assert [(len(r), b, s) for r, b, s in uniform] == [(2, 2, 18), (1, 2, 18)]
    assert pack_packed(lengths, budget=10, uniform=False)[0][1:] == (1, 10)  # s capped by the budget
    assert pack_packed(lengths, budget=4, uniform=False)[0][1:] == (1, 8)  # never below the longest


def test_packed_microbatch_matches_a_hand_worked_case():
    """Sequences of lengths 4, 3 and 2 in rows of 5: row 0 = seq 0, row 1 = seq 1 then seq 2 (FFD). The model
    inputs are packed; every loss input equals the unpacked micro-batch's; ``unpack`` maps (sequence, position) to
    the packed flat position, so the packed labels, gathered through it, are the unpacked labels on the mask."""
    seqs = [
        Sequence(tokens=[1, 2, 3, 4], prompt_len=2, adv=0.5, rollout_logprobs=[-0.1, -0.2]),
        Sequence(tokens=[5, 6, 7], prompt_len=1, adv=-1.0, mastered=True, rollout_logprobs=[-0.3, -0.4]),
        Sequence(tokens=[8, 9], prompt_len=1, adv=2.0, rollout_logprobs=[-0.5]),
    ]
    old = [torch.tensor([-1.0, -2.0]), torch.tensor([-3.0, -4.0]), torch.tensor([-5.0])]
    rows = pack_rows([q.length for q in seqs], 5)
    assert rows == [[0], [1, 2]]
    packed = build_microbatch(seqs, 3, 5, pad_id=0, old_logp=old, ids=[10, 11, 12], rows=rows)
    flat = build_microbatch(seqs, 3, 5, pad_id=0, old_logp=old, ids=[10, 11, 12])
    assert packed.tokens.tolist() == [[1, 2, 3, 4, 0], [5, 6, 7, 8, 9], [0, 0, 0, 0, 0]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 0, 1], [0, 1, 2, 3, 4]]
    assert packed.labels.tolist() == [[2, 3, 4, 0, 0], [6, 7, 0, 9, 0], [0, 0, 0, 0, 0]]
    attends = ~packed.attention_mask[:, 0]  # [b, s, s]: query row x key column
    assert attends[1].int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [0, 0, 0, 1, 0],  # seq 2's first token sees only itself, not seq 1
        [0, 0, 0, 1, 1],
    ]
    assert attends[0].int().tolist()[4] == [0, 0, 0, 0, 1]  # padding attends to padding only
    assert packed.unpack.tolist() == [[0, 1, 2, 3, 0], [5, 6, 7, 0, 0], [8, 9, 0, 0, 0]]
    for key in ("mask", "adv", "mastered", "rollout_logp", "old_logp", "ref_logp", "seq_ids"):
        assert torch.equal(getattr(packed, key), getattr(flat, key)), key
    got = unpack_values(packed.labels, packed)
    assert torch.equal(got[flat.mask], flat.labels[flat.mask])
    with pytest.raises(ValueError, match="exactly once"):
        build_microbatch(seqs, 3, 5, pad_id=0, rows=[[0], [1]])
    with pytest.raises(ValueError, match="needs 6 tokens"):
        build_microbatch(seqs, 2, 5, pad_id=0, rows=[[1], [0, 2]])


def _spy_packing(record):
    """Record (sequences, packed rows) of every packed micro-batch the update builds."""
    from megatron_rlvr.trainer import update

    real = update._microbatches

    def spy(*a, **k):
        mbs, members = real(*a, **k)
        for mb, chosen in zip(mbs, members):
            if mb.unpack is not None:
                s = mb.tokens.shape[1]
                record.append((len(chosen), len(set((mb.unpack[:, 0] // s).tolist()))))
        return mbs, members

    update._microbatches = spy
    return lambda: setattr(update, "_microbatches", real)


def _packed_vs_rows(run_root, runs, overrides):
    """Per run (name: (preset, extra overrides)): step 1 twice on one trainer, one sequence per row then packed rows
    (trainer_helpers.step_once_per_setting: same weights, prompts and rollouts)."""
    from megatron_rlvr.config import load_run_config
    from megatron_rlvr.trainer.colocated import setup

    sys.path.insert(0, TESTS_DIR)  # reward.fn=trainer_helpers:...
    out = {}
    for name, (preset, extra) in runs.items():
        over = [*overrides, f"algorithm.preset={preset}", *extra]
        t = setup(load_run_config(None, over), os.path.join(run_root, name))
        assert t.policy.settings.pack_rows  # the CPU model takes the block mask
        layout = (t.policy.dist.tp_size, t.policy.dist.pp_size)

        def apply(t, packed):
            t.policy.settings = dataclasses.replace(t.policy.settings, pack_rows=packed)

        out[name] = trainer_helpers.step_once_per_setting(t, (False, True), apply, _spy_packing)
        out[name]["layout"] = layout
    return out


def _assert_same(m_packed, m_rows, g_packed, g_rows, where):
    assert set(m_packed) == set(m_rows), (where, set(m_packed) ^ set(m_rows))
    for k, v in m_rows.items():
        assert m_packed[k] == pytest.approx(v, rel=1e-5, abs=1e-6), (where, k, v, m_packed[k])
    assert len(g_rows) == len(g_packed) >= 1, where
    for a, b in zip(g_packed, g_rows):
        diff = float((a - b).norm())
        assert diff <= 1e-4 * float(b.norm()) + 1e-9, f"{where}: gradients differ by {diff}"


def test_packed_rows_match_one_sequence_per_row_for_every_preset(dist_pool, tmp_path):
    """TP = 2 x DP = 2, every preset: losses, ratios, entropies, KL terms, mismatch and non-finite flags, and the
    gradients of a packed step equal the unpacked step's; packing really put several sequences in a row. Plus the
    exact reference KL, whose reference forward must get the packed mask too."""
    runs = {name: (name, []) for name in PRESETS}
    runs["grpo_exact_kl"] = ("grpo", ["algorithm.ref_kl.coef=0.1", "algorithm.ref_kl.estimator=exact"])
    names = list(runs)
    per_rank = dist_pool.run(_packed_vs_rows, tp=2, args=(str(tmp_path), runs, [*SMALL, "parallel.tp=2"]), timeout=900)
    for rank, out in enumerate(per_rank):
        for name in names:
            assert out[name]["layout"] == (2, 1), name
            (m_rows, g_rows, seen_rows), (m_packed, g_packed, seen_packed) = out[name][False], out[name][True]
            assert seen_rows == [] and seen_packed, name
            n_seqs = sum(n for n, _ in seen_packed)
            n_rows = sum(r for _, r in seen_packed)
            assert n_rows < n_seqs, f"{name}: packing put one sequence per row ({n_rows} rows, {n_seqs} sequences)"
            _assert_same(m_packed, m_rows, g_packed, g_rows, f"{name} rank {rank}")
            if m_rows.get("adv/abs_mean", 0) > 0:
                assert g_rows[0].abs().sum() > 0, name


def test_packed_rows_match_one_sequence_per_row_through_the_pipeline(dist_pool, tmp_path):
    """TP = 2 x PP = 2 (every micro-batch padded to one [b, s]; the mask travels to both stages), 2 mini-batches x
    2 epochs, with a k3 reference KL (the reference model's log-prob pass is packed too)."""
    over = [
        *SMALL,
        "parallel.tp=2",
        "parallel.pp=2",
        "train.mini_batch_prompts=2",
        "train.ppo_epochs=2",
        "algorithm.ref_kl.coef=0.1",
        "algorithm.ref_kl.estimator=k3",
    ]
    runs = {"grpo": ("grpo", [])}
    per_rank = dist_pool.run(_packed_vs_rows, tp=2, pp=2, args=(str(tmp_path), runs, over), timeout=900)
    for rank, out in enumerate(per_rank):
        assert out["grpo"]["layout"] == (2, 2)
        (m_rows, g_rows, _), (m_packed, g_packed, seen) = out["grpo"][False], out["grpo"][True]
        assert seen and sum(r for _, r in seen) < sum(n for n, _ in seen)
        assert m_rows["train/updates"] == 4 and m_rows["loss/ref_kl"] > 0
        _assert_same(m_packed, m_rows, g_packed, g_rows, f"pp2 rank {rank}")


def test_packed_rows_match_one_sequence_per_row_with_sequence_parallelism(dist_pool, tmp_path):
    """TP = 2 with sequence parallelism: packed rows are rounded up to a multiple of TP like unpacked ones."""
    over = [*SMALL, "parallel.tp=2", "parallel.sequence_parallel=true"]
    runs = {"grpo": ("grpo", [])}
    per_rank = dist_pool.run(_packed_vs_rows, tp=2, args=(str(tmp_path), runs, over), timeout=900)
    for rank, out in enumerate(per_rank):
        assert out["grpo"]["layout"] == (2, 1)
        (m_rows, g_rows, _), (m_packed, g_packed, seen) = out["grpo"][False], out["grpo"][True]
        assert seen and sum(r for _, r in seen) < sum(n for n, _ in seen)
        _assert_same(m_packed, m_rows, g_packed, g_rows, f"seqpar rank {rank}")

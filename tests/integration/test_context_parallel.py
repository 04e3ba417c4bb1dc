"""Context parallelism (parallel.cp): a CP = 2 run of the trainer's update path equals the CP = 1 run of the same
batch, to fp32 rounding, for a tiny GQA model on the shared 4-rank gloo pool: the logits (gathered over CP and put
back in global order), the per-token log-probs and entropies of the behaviour pass, and for several algorithms (every
aggregation mode, GSPO's sequence ratio, the CPGD drift, MCPO's margin credit and hinge-KL, the k3 reference KL and the
entropy bonus) the loss and every parameter gradient after megatron's DDP reduction over data x context parallel.

The reference is the same code at CP = 1, whose exactness the rest of the suite establishes (fp64 references of the
ops and losses, TP / PP / packing invariance). Sequence lengths are not multiples of 2 x CP (padding) and one
sequence is shorter than the 2 x CP chunks. A control runs CP = 2 with the per-sequence sums NOT completed over the
CP group: every algorithm with a per-sequence sum then differs by O(1e-2) or more, the token sums do not."""

import glob
import os

import pytest
import torch
from safetensors.torch import load_file

from megatron_rlvr.algorithms import preset

ALGOS = {
    "grpo": dict(entropy={"coef": 0.01}),  # seq-mean-token-mean, k3 reference KL, entropy bonus
    "dr_grpo": {},  # seq-mean-token-sum-norm
    "dapo": {},  # token-mean
    "gspo": {},  # sequence ratio
    "cpgd": {},  # drift
    "mcpo_margin": {},  # margin credit, hinge-KL over mastered sequences
}
PER_SEQUENCE = ("grpo", "gspo", "cpgd", "mcpo_margin")
"""Algorithms whose loss needs a per-sequence sum over the whole sequence (the control's victims): |y_i| of
seq-mean-token-mean (GRPO, GSPO, CPGD), GSPO's mean log-ratio, margin credit's per-sequence mean, MCPO's hinge-KL
length. Dr.GRPO and DAPO only sum tokens over global counts."""
SPLIT_DEPENDENT = ("ratio/q", "mcpo/mastered_abs_d", "mcpo/hinge_active_frac", "mcpo/mastered_token_frac")
"""Metrics whose merge over micro-batches depends on how the batch is split, with or without CP: quantiles are per
micro-batch, and these MCPO means have their own denominators (mastered tokens) but are merged weighted by response
tokens, so a CP split changes them as a DP or micro-batch split does. The reference's data-parallel size (world / CP)
gives it other micro-batches anyway."""
LENGTHS = [13, 3, 9, 6, 11, 7, 10, 5]  # 2 groups of 4; none a multiple of 4, one shorter than 2 x CP chunks
PROMPT = [4, 1, 3, 2, 5, 3, 4, 2]


def _sequences():
    from megatron_rlvr.trainer.microbatch import Sequence

    g = torch.Generator().manual_seed(11)
    out = []
    for i, (n, p) in enumerate(zip(LENGTHS, PROMPT)):
        tokens = torch.randint(3, 19, (n,), generator=g).tolist()
        adv = float(torch.randn((), generator=g))
        out.append(Sequence(tokens=tokens, prompt_len=p, adv=adv, mastered=i < 4, rollout_logprobs=[]))
    return out


def _global_logits(model, mb, pg, s: int):
    """[b, s, V] logits of a (split) micro-batch, gathered over TP and CP and put back in global order."""
    from megatron_rlvr.megatron.context_parallel import zigzag_positions
    from megatron_rlvr.models.build import gather_vocab_parallel

    with torch.no_grad():
        mask = mb.attention_mask
        out = model(mb.tokens, mb.position_ids, mask)
    out = gather_vocab_parallel(out.float(), pg.tp)
    cp = pg.cp.size()
    if cp == 1:
        return out
    parts = [torch.empty_like(out) for _ in range(cp)]
    torch.distributed.all_gather(parts, out.contiguous(), group=pg.cp)
    full = torch.empty(out.shape[0], s, out.shape[2])
    for r, part in enumerate(parts):
        full[:, zigzag_positions(s, cp, r)] = part
    return full


def _setup(pack_rows: bool, distributed_optimizer: bool = False, seed: int = 5):
    """This rank's tiny GQA policy (weights a function of the seed only), wrapped in megatron's DDP, and the update
    settings of the current layout."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_rlvr.families.tiny import tiny_hf_config
    from megatron_rlvr.megatron.policy import build_model, wrap_ddp
    from megatron_rlvr.models.hf_config import megatron_model_args
    from megatron_rlvr.models.source import ModelSource
    from megatron_rlvr.rollout.mismatch import MismatchCorrectionConfig
    from megatron_rlvr.trainer import update
    from megatron_rlvr.trainer.token_loss import StatsSpec

    pg = ProcessGroupCollection.use_mpu_process_groups()
    cp, tp = pg.cp.size(), pg.tp.size()
    hf = {**tiny_hf_config(), "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
    args = megatron_model_args(hf, tp_size=tp, pp_size=pg.pp.size(), cp_size=cp)
    model = build_model(args, ModelSource(hf, None, None, True), seed=seed, pg=pg)
    model = wrap_ddp(model, distributed_optimizer=distributed_optimizer)
    spec = StatsSpec(
        tp_group=pg.tp if tp > 1 else None,
        vocab_size=args.dims.vocab_size,
        temperature=1.0,
        chunk_size=64,
        cp_group=pg.cp if cp > 1 else None,
    )
    ctx = update.UpdateSettings(
        algo=preset("grpo"),
        spec=spec,
        pg=pg,
        device=torch.device("cpu"),
        pad_id=0,
        micro_batch_tokens=40 if pack_rows else 32,  # several micro-batches, several sequences in some
        seq_multiple=2 * cp if cp > 1 else 1,
        n_per_group=4,
        num_mini_batches=1,
        ppo_epochs=1,
        correction=MismatchCorrectionConfig(tis_cap=None),
        skip_nonfinite=False,
        pack_rows=pack_rows,
    )
    return pg, args, model, ctx


def _behaviour(ctx, model, seqs, ids):
    """(log-probs, entropies) of this rank's sequences, and old / reference log-probs off them by noise that is a
    function of the sequence only (ratios off 1: clipping and the drift cap act)."""
    from megatron_rlvr.trainer import update

    logp, ent, bad = update.compute_logprobs(ctx, model, seqs, ids, with_entropy=True)
    assert bad == 0.0

    def noise(i, scale):
        return scale * torch.randn(logp[i].shape, generator=torch.Generator().manual_seed(100 * i + int(10 * scale)))

    return logp, ent, {i: logp[i] + noise(i, 0.3) for i in logp}, {i: logp[i] + noise(i, 0.2) for i in logp}


def _backward(ctx, model, algo, seqs, ids, old, ref):
    """One mini-batch's forward / backward of the trainer (its micro-batches, megatron/schedule.py, DDP): this
    rank's share of the loss ([] before the last pipeline stage)."""
    from megatron_rlvr.algorithms import LossNormalizers
    from megatron_rlvr.megatron.schedule import run_microbatches
    from megatron_rlvr.trainer import update
    from megatron_rlvr.trainer.loss_metrics import LossMetrics
    from megatron_rlvr.trainer.token_loss import policy_loss_fn

    norms = LossNormalizers.from_counts(update.normalizer_counts(seqs))
    mbs, _ = update._microbatches(ctx, seqs, ids, old, ref)
    model.zero_grad_buffer()
    loss_fn = policy_loss_fn(algo, norms, ctx.spec)
    infos = run_microbatches(model, mbs, loss_fn, pg=ctx.pg, forward_only=False, device=ctx.device)
    acc = LossMetrics()
    for i in infos:
        acc.add(i.metrics)
    return sum(i.metrics["loss/total"] for i in infos), acc.state()


def _cp_parity_rank(pack_rows: bool, skip_cp_seq_sum: bool):
    """On every rank of the current layout: logits, log-probs / entropies and, per algorithm, the loss and
    gradients of one update of the trainer."""
    from megatron_rlvr.trainer import token_loss, update

    pg, args, model, ctx = _setup(pack_rows)
    cp = pg.cp.size()
    seqs = _sequences()
    ids = update.my_sequence_ids(ctx, len(seqs))
    last = pg.pp.rank() == pg.pp.size() - 1
    out = {"cp": cp, "mp_rank": (pg.pp.rank(), pg.tp.rank()), "last": last, "logits": {}, "loss": {}, "grads": {}}
    out["metrics"] = {}
    if not pack_rows and pg.pp.size() == 1:
        mbs, members = update._microbatches(ctx, seqs, ids)
        for mb, chosen in zip(mbs, members):
            s = mb.tokens.shape[1] * cp
            full = _global_logits(model, mb, pg, s)
            for r, i in enumerate(chosen):
                out["logits"][i] = full[r, : seqs[i].length].clone()
    out["logp"], out["entropy"], old, ref = _behaviour(ctx, model, seqs, ids)
    real_sequence_sum = token_loss.sequence_sum
    if skip_cp_seq_sum:  # the control: per-sequence sums left rank-local
        token_loss.sequence_sum = lambda group: None
    try:
        for name, over in ALGOS.items():
            out["loss"][name], out["metrics"][name] = _backward(ctx, model, preset(name, **over), seqs, ids, old, ref)
            out["grads"][name] = {n: p.main_grad.detach().clone() for n, p in model.named_parameters()}
    finally:
        token_loss.sequence_sum = real_sequence_sum
    return out


def _cp_resume_rank(root: str, save: bool):
    """Two optimizer steps of GRPO with megatron's distributed optimizer (state sharded over data x context
    parallel). ``save``: step, save a checkpoint and export an HF folder, step again; else: a model with other
    weights loads that checkpoint at the current layout, then takes the second step. Returns the full HF-named
    weights after loading (or saving), after the second step, and (saving) the exported folder's tensors."""
    from megatron_rlvr.config import OptimizerConfig, ParallelConfig, ScheduleConfig
    from megatron_rlvr.megatron.optimizer_step import apply_gradients
    from megatron_rlvr.megatron.parallel import all_reduce_max
    from megatron_rlvr.megatron.policy import build_optimizer
    from megatron_rlvr.models.checkpointing import CheckpointConfig, load_checkpoint, save_checkpoint
    from megatron_rlvr.models.export import export_hf, iter_hf_tensors
    from megatron_rlvr.trainer import update

    pg, args, model, ctx = _setup(False, distributed_optimizer=True, seed=5 if save else 9)
    par = ParallelConfig(cp=pg.cp.size(), distributed_optimizer=True)
    optimizer, scheduler = build_optimizer(model, OptimizerConfig(lr=1e-2), ScheduleConfig(steps=10), par, "float32")
    seqs = _sequences()
    ids = update.my_sequence_ids(ctx, len(seqs))

    def step():
        _, _, old, ref = _behaviour(ctx, model, seqs, ids)
        _backward(ctx, model, preset("grpo"), seqs, ids, old, ref)
        assert apply_gradients(model, optimizer, local_nonfinite=False, all_reduce_max=all_reduce_max).applied
        scheduler.step(1)

    def weights():
        return {k: v.detach().clone() for k, v in iter_hf_tensors(model, args)}

    cfg = CheckpointConfig(os.path.join(root, "ckpt"), write_processes=1)
    exported = {}
    if save:
        step()
        export_hf(model, args, os.path.join(root, "hf"), dtype=torch.float32)  # one CP rank writes
        if torch.distributed.get_rank() == 0:
            for f in glob.glob(os.path.join(root, "hf", "*.safetensors")):
                exported.update(load_file(f))
        save_checkpoint(
            cfg, 1, model=model, optimizer=optimizer, scheduler=scheduler, trainer_state={}, model_args=args
        )
    else:
        load_checkpoint(cfg.save_dir, model=model, optimizer=optimizer, scheduler=scheduler)
    at_checkpoint = weights()
    step()
    return at_checkpoint, weights(), exported


def _merged(per_rank, key):
    """{sequence id: value} over ranks (CP ranks of one data-parallel rank must agree exactly in value)."""
    out = {}
    for r in per_rank:
        for i, v in r[key].items():
            if i in out:
                assert torch.equal(out[i], v), (key, i)
            out[i] = v
    return out


def _total_loss(per_rank, name):
    """The step's loss: the sum of the shares of every data- and context-parallel rank (TP rank 0 of the last
    pipeline stage of each)."""
    return sum(r["loss"][name] for r in per_rank if r["mp_rank"][1] == 0 and r["last"])


def _step_metrics(per_rank, name):
    """The loss metrics of the update merged over ranks as the trainer merges them (trainer/update.py)."""
    from megatron_rlvr.trainer.loss_metrics import LossMetrics

    return LossMetrics.merge([r["metrics"][name] for r in per_rank if r["mp_rank"][1] == 0 and r["last"]], 1)


def _max_grad_err(a, b):
    """max |a - b| over every parameter of two ranks' gradient dicts, and the largest |b|."""
    err = max(float((a[n] - b[n]).abs().max()) for n in b)
    return err, max(float(b[n].abs().max()) for n in b)


def _compare(ref, got, logits: bool, control: bool = False) -> dict:
    """The parity table of one layout (max abs errors) and the checks; ``control``: per-sequence algorithms must
    differ, the others still match."""
    table = {}
    if logits:
        lr, lg = _merged(ref, "logits"), _merged(got, "logits")
        assert set(lr) == set(lg) == set(range(len(LENGTHS)))
        table["logits"] = max(float((lg[i] - lr[i]).abs().max()) for i in lr)
        assert table["logits"] < 1e-5, table
    for key in ("logp", "entropy"):
        a, b = _merged([r for r in ref if r["last"]], key), _merged([r for r in got if r["last"]], key)
        assert set(a) == set(b) == set(range(len(LENGTHS)))
        table[key] = max(float((b[i] - a[i]).abs().max()) for i in a)
        assert table[key] < 1e-5, (key, table)
    by_mp = {r["mp_rank"]: r for r in ref}  # the same (PP, TP) shard of the parameters
    for name in ALGOS:
        lr, lg = _total_loss(ref, name), _total_loss(got, name)
        gerr, gscale = max(_max_grad_err(r["grads"][name], by_mp[r["mp_rank"]]["grads"][name]) for r in got)
        table[f"loss {name}"], table[f"grads {name}"] = abs(lg - lr), gerr
        assert gscale > 1e-5, (name, gscale)  # a real gradient to compare (Dr.GRPO divides by a large constant)
        exact = abs(lg - lr) <= 1e-5 * max(1.0, abs(lr)) and gerr <= 1e-5 * gscale
        if control and name in PER_SEQUENCE:
            assert not exact and (abs(lg - lr) > 1e-3 or gerr > 1e-3 * gscale), (name, table)
            continue
        assert exact, (name, lr, lg, gerr, gscale)
        mr, mg = _step_metrics(ref, name), _step_metrics(got, name)
        assert set(mr) == set(mg), (name, set(mr) ^ set(mg))
        keys = [k for k in mr if not k.startswith(SPLIT_DEPENDENT)]
        off = {k: (mr[k], mg[k]) for k in keys if abs(mg[k] - mr[k]) > 1e-5 * max(1.0, abs(mr[k]))}
        assert not off, (name, off)
        table[f"metrics {name}"] = max(abs(mg[k] - mr[k]) for k in keys)
    return table


def test_cp2_matches_cp1(dist_pool):
    """CP = 2 x DP = 2 against CP = 1 x DP = 4 (gradients reduced over data x context parallel), one sequence per
    row and packed rows (block-diagonal mask split on its query rows), and the control without the CP sums."""
    ref = dist_pool.run(_cp_parity_rank, args=(False, False), timeout=600)
    got = dist_pool.run(_cp_parity_rank, cp=2, args=(False, False), timeout=600)
    assert {r["cp"] for r in got} == {2} and {r["cp"] for r in ref} == {1}
    table = {"cp2": _compare(ref, got, logits=True)}
    ref_p = dist_pool.run(_cp_parity_rank, args=(True, False), timeout=600)
    got_p = dist_pool.run(_cp_parity_rank, cp=2, args=(True, False), timeout=600)
    table["cp2 packed"] = _compare(ref_p, got_p, logits=False)
    control = dist_pool.run(_cp_parity_rank, cp=2, args=(False, True), timeout=600)
    table["cp2 control"] = _compare(ref, control, logits=True, control=True)
    print(table)


def test_cp2_tp2_matches_cp1_tp2(dist_pool):
    """CP = 2 x TP = 2 against CP = 1 x TP = 2 x DP = 2 (vocabulary-sharded logits, TP shard by TP shard)."""
    ref = dist_pool.run(_cp_parity_rank, tp=2, args=(False, False), timeout=600)
    got = dist_pool.run(_cp_parity_rank, tp=2, cp=2, args=(False, False), timeout=600)
    print({"cp2 x tp2": _compare(ref, got, logits=True)})


def test_cp2_pp2_matches_cp1_pp2(dist_pool):
    """CP = 2 x PP = 2 against CP = 1 x PP = 2 x DP = 2 (1F1B: the schedule gets the global length for its p2p
    shapes, every micro-batch padded to one [b, s])."""
    ref = dist_pool.run(_cp_parity_rank, pp=2, args=(False, False), timeout=600)
    got = dist_pool.run(_cp_parity_rank, pp=2, cp=2, args=(False, False), timeout=600)
    print({"cp2 x pp2": _compare(ref, got, logits=False)})


@pytest.mark.parametrize("saved_cp, resumed_cp", [(2, 1), (1, 2)])
def test_resume_at_another_context_parallel_size(dist_pool, tmp_path, saved_cp, resumed_cp):
    """A checkpoint written at CP = 2 x DP = 2 (distributed optimizer sharded over dp x cp = 4) resumes at CP = 1 x
    DP = 4, and one written at CP = 1 x DP = 4 resumes at CP = 2 x DP = 2: the weights are restored exactly and the
    next step (Adam moments and step count from the checkpoint) lands where the uninterrupted run's did, to fp32
    rounding. The HF export holds every tensor once (at CP = 2: written by one CP rank), equal to the model's."""
    ref = dist_pool.run(_cp_resume_rank, cp=saved_cp, args=(str(tmp_path), True), timeout=600)
    got = dist_pool.run(_cp_resume_rank, cp=resumed_cp, args=(str(tmp_path), False), timeout=600)
    (saved, ref_next, exported), (loaded, got_next, _) = ref[0], got[0]
    assert sorted(exported) == sorted(saved) and all(torch.equal(exported[k], saved[k]) for k in saved)
    assert sorted(saved) == sorted(loaded)
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)
    moved = max(float((ref_next[k] - saved[k]).abs().max()) for k in saved)
    err = max(float((got_next[k] - ref_next[k]).abs().max()) for k in saved)
    print({f"resume cp{saved_cp} -> cp{resumed_cp}": {"step moved": moved, "next step abs err": err}})
    # Adam's first steps are ~lr sign(g) where |g| is tiny, so fp32 rounding of such gradients shows up at ~1e-5 of
    # a 1e-2 step; a lost optimizer state (a fresh Adam step) or lost scheduler step would be O(lr)
    assert moved > 1e-3 and err < 1e-2 * moved, (moved, err)

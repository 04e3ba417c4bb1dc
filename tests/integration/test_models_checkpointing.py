"""Training checkpoints (megatron dist_checkpointing) reshard across layouts, save atomically and keep the last K.

A tiny Qwen2-style model (QKV bias, tied embeddings, 4 layers) takes one Adam step at TP=2 x DP=2 and is saved;
it is reloaded at TP=1 x PP=2 x DP=2 and at TP=1 x DP=4. Checked against the run that never stopped:
- logits after loading == logits at save time (the model state is restored);
- the NEXT optimizer step gives the same parameters as the uninterrupted run (so Adam's moments and step count were
  restored: a fresh Adam would move every weight by ~lr instead), for megatron's plain optimizer and for its
  DistributedOptimizer ('fully_reshardable'); 'dp_reshardable' restores at the saved layout and refuses another TP/PP;
- trainer state round-trips; RNG states are restored at the same layout.
Atomic save: a failure before the final rename (and the debris of a killed save) leaves the previous checkpoint the
newest loadable one; keep_last=2 deletes older checkpoints.
"""

from __future__ import annotations

import os

import pytest
import torch

VOCAB, SEQ, GLOBAL_BATCH, LR = 300, 10, 4, 1e-2


def _hf_config():
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=4,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        architectures=["Qwen2ForCausalLM"],
    ).to_dict()


def _batch(i, vocab=VOCAB):
    g = torch.Generator().manual_seed(1000 + i)
    tokens = torch.randint(0, vocab, (GLOBAL_BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _setup(args, distributed_optimizer, seed=7, hf_folder=None):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_rlvr.models.build import build_gpt_model
    from megatron_rlvr.models.hf_loading import load_hf_weights

    torch.manual_seed(seed)
    model = build_gpt_model(args, pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    if hf_folder is not None:
        load_hf_weights(model, args, hf_folder)
    ddp = DistributedDataParallel(
        model.config,
        DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=distributed_optimizer
        ),
        model,
    )
    opt = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=LR,
            min_lr=0.0,
            weight_decay=0.01,
            use_distributed_optimizer=distributed_optimizer,
            bf16=False,
        ),
        [ddp],
    )
    ddp.config.finalize_model_grads_func = finalize_model_grads
    ddp.config.no_sync_func = ddp.no_sync
    # linear decay: a resumed run that lost the scheduler's step count would use a different lr on the next step
    sched = OptimizerParamScheduler(
        opt,
        init_lr=LR,
        max_lr=LR,
        min_lr=0.0,
        lr_warmup_steps=0,
        lr_decay_steps=20,
        lr_decay_style="linear",
        start_wd=0.01,
        end_wd=0.01,
        wd_incr_steps=20,
        wd_incr_style="constant",
    )
    return ddp, opt, sched


def _train_step(ddp, opt, sched, i, vocab=VOCAB):
    """One step on global batch i: each DP rank takes its contiguous slice, one sequence per micro-batch."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    tokens, labels = _batch(i, vocab)
    per = GLOBAL_BATCH // dp
    micro = [(tokens[j : j + 1], labels[j : j + 1]) for j in range(dp_rank * per, (dp_rank + 1) * per)]
    pos = torch.arange(SEQ).unsqueeze(0)

    def forward_step(it, model):
        t, lab = next(it)
        out = model(t, pos, None, labels=lab)
        return out, lambda loss_bs: (loss_bs.float().mean(), {"loss": loss_bs.detach().float().mean().clone()})

    ddp.zero_grad_buffer()
    opt.zero_grad()
    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(micro),
        model=[ddp],
        num_microbatches=len(micro),
        seq_length=SEQ,
        micro_batch_size=1,
        forward_only=False,
    )
    ok, _, _ = opt.step()
    assert ok
    sched.step(1)


def _snapshot(ddp, args, vocab=VOCAB):
    """(logits of global batch 9 on the last stage or None, {hf_name: tensor} of this stage's weights)."""
    from megatron.core import parallel_state as ps

    from megatron_rlvr.models.build import forward_logits
    from megatron_rlvr.models.export import iter_hf_tensors

    ddp.eval()
    logits = forward_logits(ddp, _batch(9, vocab)[0], vocab_size=vocab)
    ddp.train()
    weights = {k: v.clone() for k, v in iter_hf_tensors(ddp, args)}  # (may alias the parameters)
    return (None if logits is None else logits[0]), (weights if ps.get_tensor_model_parallel_rank() == 0 else {})


KINDS = {  # name: (distributed optimizer, sharding type)
    "plain": (False, "fully_reshardable"),
    "distopt": (True, "fully_reshardable"),
    "dp_reshardable": (True, "dp_reshardable"),
}


def _rank_save(hf_folder, root):
    """TP=2 x DP=2: load HF weights, step on batch 0, save, step on batch 1; report snapshots."""
    from megatron_rlvr.models.checkpointing import CheckpointConfig, save_checkpoint
    from megatron_rlvr.models.hf_config import megatron_model_args

    out = {}
    for kind, (dist_opt, sharding) in KINDS.items():
        args = megatron_model_args(hf_folder, tp_size=2, pp_size=1)
        ddp, opt, sched = _setup(args, dist_opt, hf_folder=hf_folder)
        _train_step(ddp, opt, sched, 0)
        out[kind, "saved"] = _snapshot(ddp, args)
        cfg = CheckpointConfig(
            os.path.join(root, kind), keep_last=2, distrib_optim_sharding_type=sharding, write_processes=1
        )
        save_checkpoint(
            cfg, 1, model=ddp, optimizer=opt, scheduler=sched, trainer_state={"step": 1, "kind": kind}, model_args=args
        )
        out[kind, "rng_after_save"] = torch.rand(3)  # the RNG continues from here in the uninterrupted run
        _train_step(ddp, opt, sched, 1)
        out[kind, "next"] = _snapshot(ddp, args)
    return out


def _rank_load(root, kinds, same_layout):
    """At the current layout: fresh model + optimizer, load, snapshot, step on batch 1, snapshot."""
    from megatron.core import parallel_state as ps

    from megatron_rlvr.models.checkpointing import checkpoint_model_args, latest_checkpoint, load_checkpoint

    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    out = {}
    for kind in kinds:
        ckpt = latest_checkpoint(os.path.join(root, kind))
        args = checkpoint_model_args(ckpt, tp_size=tp, pp_size=pp)
        ddp, opt, sched = _setup(args, KINDS[kind][0], seed=99)  # other random init: everything must come from disk
        torch.manual_seed(12345)  # RNG differs from the saving run unless restored
        out[kind, "state"] = load_checkpoint(ckpt, model=ddp, optimizer=opt, scheduler=sched)
        out[kind, "sched_steps"] = sched.num_steps
        out[kind, "rng_after_load"] = torch.rand(3)
        out[kind, "loaded"] = _snapshot(ddp, args)
        _train_step(ddp, opt, sched, 1)
        out[kind, "next"] = _snapshot(ddp, args)
        out[kind, "padded_vocab"] = args.dims.padded_vocab_size
    if not same_layout:
        ckpt = latest_checkpoint(os.path.join(root, "dp_reshardable"))
        args = checkpoint_model_args(ckpt, tp_size=tp, pp_size=pp)
        ddp, opt, _ = _setup(args, True)
        try:
            load_checkpoint(ckpt, model=ddp, optimizer=opt)
            out["dp_reshardable_error"] = None
        except ValueError as e:
            out["dp_reshardable_error"] = str(e)
    return out


def _merge_weights(results, kind, key):
    merged = {}
    for r in results:
        merged.update(r[kind, key][1])
    return merged


def _last_logits(results, kind, key):
    return [r[kind, key][0] for r in results if r[kind, key][0] is not None]


@pytest.fixture(scope="module")
def saved(dist_pool, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("hf_qwen2_ckpt")
    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(_config_obj()).save_pretrained(folder)
    root = tmp_path_factory.mktemp("ckpts")
    results = dist_pool.run(_rank_save, tp=2, pp=1, args=(str(folder), str(root)), timeout=240)
    return str(root), results


def _config_obj():
    from transformers import Qwen2Config

    return Qwen2Config(**_hf_config())


@pytest.mark.parametrize("tp,pp", [(1, 2), (1, 1), (2, 1)])
def test_checkpoint_reshards_model_and_optimizer(dist_pool, saved, tp, pp):
    root, ref = saved
    same_layout = (tp, pp) == (2, 1)
    # TP=2 -> TP=1 x PP=2: both optimizers; -> TP=1 x DP=4: the DistributedOptimizer (its shards move between DP ranks)
    kinds = {(2, 1): ["dp_reshardable"], (1, 2): ["plain", "distopt"], (1, 1): ["distopt"]}[tp, pp]
    res = dist_pool.run(_rank_load, tp=tp, pp=pp, args=(root, kinds, same_layout), timeout=240)
    for kind in kinds:
        assert all(r[kind, "state"] == {"step": 1, "kind": kind} for r in res)
        assert all(r[kind, "sched_steps"] == 1 for r in res), "lr scheduler state must be restored"
        assert res[0][kind, "padded_vocab"] == 512, "the saved padded vocabulary must be kept at TP=1"
        # model: logits and weights as saved
        want = _last_logits(ref, kind, "saved")[0]
        for got in _last_logits(res, kind, "loaded"):
            err = ((got - want).norm() / want.norm()).item()
            assert err < 1e-5, f"{kind} TP={tp} PP={pp}: logits after load differ by {err:.2e}"
        w_saved, w_loaded = _merge_weights(ref, kind, "saved"), _merge_weights(res, kind, "loaded")
        assert sorted(w_saved) == sorted(w_loaded)
        for k in w_saved:
            assert torch.equal(w_saved[k], w_loaded[k]), f"{kind}: {k} not restored exactly"
        # optimizer: the next step lands where the uninterrupted run landed
        w_next_ref, w_next = _merge_weights(ref, kind, "next"), _merge_weights(res, kind, "next")
        worst = max((w_next[k] - w_next_ref[k]).abs().max().item() for k in w_next_ref)
        moved = max((w_next_ref[k] - w_saved[k]).abs().max().item() for k in w_next_ref)
        assert moved > 100 * 1e-5, "the reference step must move the weights measurably"
        assert worst < 1e-5, f"{kind} TP={tp} PP={pp}: step after resume differs by {worst:.2e} (optimizer state?)"
        if same_layout:  # per-rank RNG streams restored
            for r_ref, r in zip(ref, res):
                assert torch.equal(r[kind, "rng_after_load"], r_ref[kind, "rng_after_save"])
    if not same_layout:
        errs = [r["dp_reshardable_error"] for r in res]
        assert all(e and "dp_reshardable" in e and "fully_reshardable" in e for e in errs), errs


def _moe_args():
    from megatron.core import parallel_state as ps

    from megatron_rlvr.families.tiny import TINY_MOE_NAME, tiny_hf_config
    from megatron_rlvr.models.convert import expert_layout_kwargs
    from megatron_rlvr.models.hf_config import megatron_model_args

    hf = tiny_hf_config(name=TINY_MOE_NAME)
    tp = ps.get_tensor_model_parallel_world_size()
    return megatron_model_args(hf, tp_size=tp, pp_size=1, **expert_layout_kwargs(hf)), hf["vocab_size"]


def _rank_moe(root, kinds, save):
    """The tiny MoE model at the pool's layout. ``save``: step on batch 0, save, step on batch 1. Else: a fresh
    model and optimizer (another init) load the checkpoint and step on batch 1. Snapshots of each."""
    from megatron.core import parallel_state as ps

    from megatron_rlvr.models.checkpointing import CheckpointConfig, latest_checkpoint, load_checkpoint, save_checkpoint

    out = {"ep": ps.get_expert_model_parallel_world_size()}
    for kind in kinds:
        dist_opt, sharding = KINDS[kind]
        args, vocab = _moe_args()  # (DDP sets hooks on the model's config: one per model)
        ddp, opt, sched = _setup(args, dist_opt, seed=7 if save else 99)
        out[kind, "chained"] = len(getattr(opt, "chained_optimizers", [opt]))
        if save:
            _train_step(ddp, opt, sched, 0, vocab)
            out[kind, "saved"] = _snapshot(ddp, args, vocab)
            cfg = CheckpointConfig(os.path.join(root, kind), distrib_optim_sharding_type=sharding, write_processes=1)
            save_checkpoint(cfg, 1, model=ddp, optimizer=opt, scheduler=sched, trainer_state={"step": 1})
        else:
            load_checkpoint(latest_checkpoint(os.path.join(root, kind)), model=ddp, optimizer=opt, scheduler=sched)
            out[kind, "loaded"] = _snapshot(ddp, args, vocab)
        _train_step(ddp, opt, sched, 1, vocab)
        out[kind, "next"] = _snapshot(ddp, args, vocab)
    return out


@pytest.mark.parametrize("saved_ep,loaded_ep", [(2, 1), (1, 2)])
def test_moe_checkpoint_reshards_across_expert_parallelism(dist_pool, tmp_path, saved_ep, loaded_ep):
    """A mixture-of-experts checkpoint changes EP like TP/PP: at EP=2 megatron chains one optimizer for the dense
    parameters and one for the experts, at EP=1 there is one; the resumed run's weights are the saved ones exactly
    and its next Adam step lands where the uninterrupted run's did (so moments and step count were restored, for
    the expert parameters too), with the plain and the distributed optimizer. Before the optimizer state was stored
    per parameter, loading EP=2 at EP=1 failed with torch's CheckpointException (``KeyError: optimizer.state.exp_avg
    ... not in state dict: ['chained_0.optimizer.state...``) and EP=1 at EP=2 with the converse KeyError."""
    kinds = ["plain", "distopt"]
    ref = dist_pool.run(_rank_moe, ep=saved_ep, args=(str(tmp_path), kinds, True), timeout=300)
    res = dist_pool.run(_rank_moe, ep=loaded_ep, args=(str(tmp_path), kinds, False), timeout=300)
    assert ref[0]["ep"] == saved_ep and res[0]["ep"] == loaded_ep
    assert {ref[0][k, "chained"] for k in kinds} == {saved_ep}  # EP=2: dense + expert optimizer; EP=1: one
    assert {res[0][k, "chained"] for k in kinds} == {loaded_ep}
    for kind in kinds:
        w_saved, w_loaded = _merge_weights(ref, kind, "saved"), _merge_weights(res, kind, "loaded")
        assert sorted(w_saved) == sorted(w_loaded) and any(".experts." in k for k in w_saved)
        for k in w_saved:
            assert torch.equal(w_saved[k], w_loaded[k]), f"{kind}: {k} not restored exactly"
        w_next_ref, w_next = _merge_weights(ref, kind, "next"), _merge_weights(res, kind, "next")
        for k in w_next_ref:
            moved = (w_next_ref[k] - w_saved[k]).abs().max().item()
            worst = (w_next[k] - w_next_ref[k]).abs().max().item()
            assert moved > 1e-3, f"{kind}: the reference step must move {k} measurably"
            assert worst < 1e-5, f"{kind}: {k} after the step that follows the resume differs by {worst:.2e}"


def _rank_atomic(root):
    from megatron.core import parallel_state as ps

    from megatron_rlvr.models import checkpointing as ck
    from megatron_rlvr.models.build import build_gpt_model, forward_logits
    from megatron_rlvr.models.hf_config import megatron_model_args

    args = megatron_model_args(_hf_config(), tp_size=ps.get_tensor_model_parallel_world_size(), pp_size=2)
    model = build_gpt_model(args)
    cfg = ck.CheckpointConfig(root, keep_last=2, write_processes=1)
    out = {}
    for step in (1, 2, 3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * step)
        ck.save_checkpoint(cfg, step, model=model, trainer_state={"step": step}, model_args=args)
    out["after_three"] = [s for s, _ in ck.list_checkpoints(root)]
    out["latest_file"] = open(os.path.join(root, ck.LATEST_FILE)).read().strip()
    model.eval()
    out["logits3"] = forward_logits(model, _batch(0)[0][:2])
    # crash 1: the save dies after all shards are written, before the rename (injected on rank 0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    real_replace = os.replace

    def failing_replace(src, dst):
        if os.path.basename(dst).startswith("step_"):
            raise OSError("injected crash before rename")
        return real_replace(src, dst)

    os.replace = failing_replace
    try:
        ck.save_checkpoint(cfg, 4, model=model, trainer_state={"step": 4}, model_args=args)
        out["crash_error"] = None
    except RuntimeError as e:
        out["crash_error"] = str(e)
    finally:
        os.replace = real_replace
    torch.distributed.barrier()
    # crash 2: debris of a killed save: a half-written temp folder and a step folder without metadata
    if torch.distributed.get_rank() == 0:
        os.makedirs(os.path.join(root, ".tmp-step_000000005"), exist_ok=True)
        with open(os.path.join(root, ".tmp-step_000000005", "__0_0.distcp"), "wb") as f:
            f.write(b"\0" * 10)
        os.makedirs(os.path.join(root, "step_000000006"), exist_ok=True)
    torch.distributed.barrier()
    out["listing"] = sorted(os.listdir(root))
    out["after_crash"] = [s for s, _ in ck.list_checkpoints(root)]
    fresh = build_gpt_model(args)
    state = ck.load_checkpoint(root, model=fresh)  # the save_dir: newest complete checkpoint
    out["loaded_state"] = state
    fresh.eval()
    out["logits_loaded"] = forward_logits(fresh, _batch(0)[0][:2])
    # the next good save cleans the debris and prunes to keep_last
    ck.save_checkpoint(cfg, 7, model=fresh, trainer_state={"step": 7}, model_args=args)
    out["final_listing"] = sorted(os.listdir(root))
    return out


def test_atomic_save_and_keep_last(dist_pool, tmp_path):
    root = str(tmp_path / "run")
    res = dist_pool.run(_rank_atomic, tp=2, pp=2, args=(root,), timeout=240)
    r0 = res[0]
    assert r0["after_three"] == [2, 3], "keep_last=2 must delete step 1"
    assert r0["latest_file"] == "step_000000003"
    assert all("injected crash before rename" in r["crash_error"] for r in res), "every rank must see the failure"
    assert ".tmp-step_000000004" in r0["listing"] and "step_000000004" not in r0["listing"]
    assert r0["after_crash"] == [2, 3], "incomplete folders must never count as checkpoints"
    assert all(r["loaded_state"] == {"step": 3} for r in res)
    for r in res:
        if r["logits3"] is not None:
            assert torch.equal(r["logits_loaded"][0], r["logits3"][0]), "step 3 must load intact"
    # debris removed, step 2 pruned (keep_last=2); a step folder without metadata is not ours to delete
    assert r0["final_listing"] == ["latest", "step_000000003", "step_000000006", "step_000000007"]


def test_checkpoint_config_validation():
    from megatron_rlvr.models.checkpointing import CheckpointConfig

    with pytest.raises(ValueError, match="keep_last"):
        CheckpointConfig("/tmp/x", keep_last=-1)
    with pytest.raises(ValueError, match="distrib_optim_sharding_type"):
        CheckpointConfig("/tmp/x", distrib_optim_sharding_type="nope")
    with pytest.raises(ValueError, match="save_dir"):
        CheckpointConfig("")

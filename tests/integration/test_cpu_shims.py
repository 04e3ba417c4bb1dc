"""megatron-core on CPU/gloo through `megatron_rlvr.megatron.cpu_shims`: every parallel layout computes the same
function.

A tiny GPTModel gets weights that depend only on each parameter's GLOBAL name and full shape (never on the layout or
on RNG order), so TP=1/PP=1 is the reference for every other layout:
- TP=2 (with and without sequence parallel) logits == TP=1 logits;
- the 1F1B pipeline schedule at PP=2 (and TP=2 x PP=2) gives the PP=1 loss;
- one step of Megatron's optimizer (DistributedOptimizer at TP=2 x DP=2, plain at TP=1 x DP=4) gives the same
  post-step loss;
- a dist_checkpointing save at TP=2 loads at TP=1 and PP=2 with identical logits.
"""

import pytest
import torch

VOCAB, HIDDEN, HEADS, LAYERS, SEQ, MBS, N_MICRO = 256, 64, 4, 4, 16, 2, 4


def _build(tp, pp, sp=False):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_query_groups=2,
        ffn_hidden_size=4 * HIDDEN,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=sp,
        normalization="RMSNorm",
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        pipeline_dtype=torch.float32,
        params_dtype=torch.float32,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
    )
    model = GPTModel(
        config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
    )
    _deterministic_weights(model, LAYERS // pp * ps.get_pipeline_model_parallel_rank())
    return model


def _deterministic_weights(model, layer_offset):
    """Overwrite every parameter with a function of its global name: contiguous TP chunks of one full tensor."""
    from megatron.core import parallel_state as ps

    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, p in model.named_parameters():
            parts = name.split(".")
            if "layers" in parts:
                i = parts.index("layers") + 1
                parts[i] = str(int(parts[i]) + layer_offset)
            gname = ".".join(parts)
            shape = list(p.shape)
            dim = getattr(p, "partition_dim", -1) if getattr(p, "tensor_model_parallel", False) else -1
            if dim >= 0:
                shape[dim] *= tp
            g = torch.Generator().manual_seed(sum(ord(c) * (i + 1) for i, c in enumerate(gname)) % (2**31))
            full = torch.randn(shape, generator=g) * (0.02 if "norm" not in gname else 0.1) + (
                1.0 if "norm" in gname else 0.0
            )
            p.copy_(full.chunk(tp, dim=dim)[rank] if dim >= 0 else full)


def _batch(i):
    g = torch.Generator().manual_seed(100 + i)
    tokens = torch.randint(0, VOCAB, (MBS, SEQ), generator=g)
    return tokens, torch.roll(tokens, -1, dims=1)


def _full_logits(model):
    """Forward (TP/PP=1 stage view) and all-gather the vocab shards: [B, S, V]."""
    from megatron.core import parallel_state as ps

    tokens, _ = _batch(0)
    pos = torch.arange(SEQ).unsqueeze(0).expand(MBS, -1)
    with torch.no_grad():
        logits = model(tokens, pos, attention_mask=None)  # [B, S, V/tp]
    shards = [torch.empty_like(logits) for _ in range(ps.get_tensor_model_parallel_world_size())]
    torch.distributed.all_gather(shards, logits.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(shards, dim=-1)


def _pipeline_loss(model_chunks, forward_only=True):
    """Mean token loss over N_MICRO micro-batches through megatron's schedule (1F1B when PP > 1)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    pos = torch.arange(SEQ).unsqueeze(0).expand(MBS, -1)

    def forward_step(data_iterator, model):
        tokens, labels = next(data_iterator)
        out = model(tokens, pos, attention_mask=None, labels=labels)

        def loss_func(loss_BS):
            loss = loss_BS.float().mean()
            # The schedule divides the returned loss in place by num_microbatches: report a clone.
            return loss, {"loss": loss.detach().clone()}

        return out, loss_func

    out = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter([_batch(i) for i in range(N_MICRO)]),
        model=model_chunks,
        num_microbatches=N_MICRO,
        seq_length=SEQ,
        micro_batch_size=MBS,
        forward_only=forward_only,
    )
    loss = torch.tensor([0.0])
    if ps.is_pipeline_last_stage():
        loss[0] = sum(d["loss"] for d in out) / N_MICRO
    # Every rank reports the loss: broadcast it from the last stage.
    torch.distributed.all_reduce(loss, group=ps.get_pipeline_model_parallel_group())
    return loss.item()


def _train_step(tp, pp, distributed_optimizer, sp=False, fused_adam=False):
    """One optimizer step; returns the post-step loss (``fused_adam``: torch's fused CPU AdamW, as the trainer)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    model = _build(tp, pp, sp)
    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=distributed_optimizer
    )
    model = DistributedDataParallel(model.config, ddp_cfg, model)
    opt = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=1e-2, clip_grad=1.0, use_distributed_optimizer=distributed_optimizer, bf16=False
        ),
        [model],
    )
    if fused_adam:
        from megatron_rlvr.megatron.policy import _torch_optimizers, _use_fused_cpu_adam

        _use_fused_cpu_adam(opt)
        assert all(g["fused"] for o in _torch_optimizers(opt) for g in o.param_groups)
    model.config.finalize_model_grads_func = finalize_model_grads
    model.config.no_sync_func = model.no_sync
    model.zero_grad_buffer()
    opt.zero_grad()
    start = torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])
    before = _pipeline_loss([model], forward_only=False)
    ok, grad_norm, _ = opt.step()
    assert ok, "optimizer step reported failure"
    after = _pipeline_loss([model], forward_only=True)
    inner = getattr(opt, "chained_optimizers", [opt])  # megatron may wrap param groups in a ChainedOptimizer
    params = torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])
    return dict(
        before=before,
        after=after,
        grad_norm=float(grad_norm),
        opt=[type(o).__name__ for o in inner],
        params=params,
        start=start,
    )


def _layout_checks(ckpt_dir, tp, pp, sp, save):
    from megatron.core import dist_checkpointing

    out = {}
    model = _build(tp, pp, sp)
    if pp == 1:
        out["logits"] = _full_logits(model)
    out["loss"] = _pipeline_loss([model])
    if save:
        dist_checkpointing.save(model.sharded_state_dict(), ckpt_dir)
    return out


def _load_checks(ckpt_dir, tp, pp):
    from megatron.core import dist_checkpointing

    model = _build(tp, pp)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()  # make sure what we read below comes from the checkpoint
    state = dist_checkpointing.load(model.sharded_state_dict(), ckpt_dir)
    model.load_state_dict(state)
    out = {"loss": _pipeline_loss([model])}
    if pp == 1:
        out["logits"] = _full_logits(model)
    return out


@pytest.fixture(scope="module")
def reference(dist_pool):
    return dist_pool.run(_layout_checks, tp=1, pp=1, args=(None, 1, 1, False, False))[0]


def test_shims_apply_only_without_cuda():
    from megatron_rlvr.megatron import cpu_shims

    assert cpu_shims.apply_cpu_shims() is (not torch.cuda.is_available())


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-seqpar"])
def test_tensor_parallel_logits_match(dist_pool, reference, sp, tmp_path):
    outs = dist_pool.run(_layout_checks, tp=2, pp=1, args=(None, 2, 1, sp, False))
    for o in outs:
        torch.testing.assert_close(o["logits"], reference["logits"], rtol=1e-5, atol=1e-5)
        assert abs(o["loss"] - reference["loss"]) < 1e-5


@pytest.mark.parametrize("tp", [1, 2])
def test_pipeline_1f1b_loss_matches(dist_pool, reference, tp):
    outs = dist_pool.run(_layout_checks, tp=tp, pp=2, args=(None, tp, 2, False, False))
    for o in outs:
        assert abs(o["loss"] - reference["loss"]) < 1e-5, (o["loss"], reference["loss"])


def test_optimizer_step_same_across_layouts(dist_pool):
    ref = dist_pool.run(_train_step, tp=1, pp=1, args=(1, 1, False))
    dist = dist_pool.run(_train_step, tp=2, pp=1, args=(2, 1, True))
    pipe = dist_pool.run(_train_step, tp=1, pp=2, args=(1, 2, True))
    seqpar = dist_pool.run(_train_step, tp=2, pp=1, args=(2, 1, False, True))
    assert set(dist[0]["opt"]) == {"DistributedOptimizer"} and "DistributedOptimizer" not in ref[0]["opt"]
    r = ref[0]
    assert r["after"] < r["before"], "one Adam step on the training batch must lower its loss"
    for o in dist + pipe + seqpar:
        assert abs(o["before"] - r["before"]) < 1e-5
        assert abs(o["grad_norm"] - r["grad_norm"]) < 1e-4 * r["grad_norm"]
        assert abs(o["after"] - r["after"]) < 1e-5


def test_fused_cpu_adam_takes_the_same_step_as_torchs_loop_adam(dist_pool):
    """The trainer swaps megatron's CPU fallback (torch AdamW, per-parameter loop) for torch's fused CPU kernel: the
    same update up to float rounding, for the plain optimizer and the DistributedOptimizer."""
    loop = dist_pool.run(_train_step, tp=1, pp=1, args=(1, 1, False))[0]
    fused = dist_pool.run(_train_step, tp=1, pp=1, args=(1, 1, False, False, True))[0]
    dist_fused = dist_pool.run(_train_step, tp=2, pp=1, args=(2, 1, True, False, True))
    moved = (loop["params"] - loop["start"]).abs().max()
    assert moved > 1e-4, "the step must move the weights for the comparison to mean anything"
    torch.testing.assert_close(fused["params"], loop["params"], rtol=1e-6, atol=1e-7)
    assert abs(fused["after"] - loop["after"]) < 1e-6
    for o in dist_fused:
        assert abs(o["after"] - loop["after"]) < 1e-5


def test_dist_checkpoint_tp2_loads_at_tp1_and_pp2(dist_pool, reference, tmp_path):
    (tmp_path / "ckpt").mkdir()
    ckpt = str(tmp_path / "ckpt")
    saved = dist_pool.run(_layout_checks, tp=2, pp=1, args=(ckpt, 2, 1, False, True))
    at_tp1 = dist_pool.run(_load_checks, tp=1, pp=1, args=(ckpt, 1, 1))
    at_pp2 = dist_pool.run(_load_checks, tp=1, pp=2, args=(ckpt, 1, 2))
    for o in at_tp1:
        torch.testing.assert_close(o["logits"], saved[0]["logits"], rtol=1e-6, atol=1e-6)
    for o in at_pp2:
        assert abs(o["loss"] - reference["loss"]) < 1e-5

"""LoRA adapters on megatron's parallel linears (models/lora.py): a tiny random Qwen3 (GQA, q/k norms, head_dim !=
hidden/heads) with adapters on qkv, proj, fc1 and fc2 gives the same logits and the same adapter gradients (fp32,
relative 1e-5) at TP=1, TP=2 and TP=2 with sequence parallelism, per target module; the forward with the adapters
merged into the weights equals the hooked forward; adapters disabled give exactly the base model (the reference
policy without a second model); megatron's DDP and optimizer hold the adapters only."""

from __future__ import annotations

import pytest
import torch

from megatron_rlvr.config.lora_config import LORA_TARGETS, LoRAConfig

VOCAB = 300
SEQ = 12
RANK = 4


def _hf_config():
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        num_hidden_layers=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        architectures=["Qwen3ForCausalLM"],
    )


@pytest.fixture(scope="module")
def base_folder(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(_hf_config(), dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(
                (1.0 + 0.2 * torch.randn(p.shape, generator=g))
                if "norm" in name
                else 0.08 * torch.randn(p.shape, generator=g)
            )
    folder = tmp_path_factory.mktemp("lora_base")
    model.save_pretrained(folder)
    return str(folder)


def random_peft(hf_config: dict, targets, rank: int, seed: int) -> dict[str, torch.Tensor]:
    """Random PEFT tensors (A and B both non-zero, so every gradient is) for the given targets of an HF config."""
    from megatron_rlvr.models.lora import peft_names

    h, f = hf_config["hidden_size"], hf_config["intermediate_size"]
    d = hf_config.get("head_dim") or h // hf_config["num_attention_heads"]
    q, kv = hf_config["num_attention_heads"] * d, hf_config["num_key_value_heads"] * d
    shapes = {
        "qkv": {"self_attn.q_proj": (h, q), "self_attn.k_proj": (h, kv), "self_attn.v_proj": (h, kv)},
        "proj": {"self_attn.o_proj": (q, h)},
        "fc1": {"mlp.gate_proj": (h, f), "mlp.up_proj": (h, f)},
        "fc2": {"mlp.down_proj": (f, h)},
    }
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(hf_config["num_hidden_layers"]):
        for t in targets:
            for mod, (fan_in, fan_out) in shapes[t].items():
                a, b = peft_names(f"model.layers.{layer}.{mod}.weight")
                out[a] = 0.2 * torch.randn(rank, fan_in, generator=g)
                out[b] = 0.2 * torch.randn(fan_out, rank, generator=g)
    return out


def _rank_forward_backward(folder: str, peft: dict, ids: torch.Tensor, targets: list, sp: bool) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from megatron_rlvr.megatron.policy import wrap_ddp
    from megatron_rlvr.models.build import build_gpt_model, gather_vocab_parallel
    from megatron_rlvr.models.hf_config import megatron_model_args
    from megatron_rlvr.models.hf_loading import load_hf_weights
    from megatron_rlvr.models.lora import adapters_disabled, attach_lora, gather_peft_tensors, load_peft_tensors

    tp = ps.get_tensor_model_parallel_world_size()
    tp_group = ps.get_tensor_model_parallel_group()
    # one padded vocabulary at every TP: the padding's zero logits enter the loss's softmax
    args = megatron_model_args(folder, tp_size=tp, sequence_parallel=sp, padded_vocab_size=512)
    model = build_gpt_model(args)
    load_hf_weights(model, args, folder)
    lora = attach_lora(model, LoRAConfig(rank=RANK, alpha=2.0 * RANK, targets=targets), args, seed=0)
    load_peft_tensors(model, peft)
    pos = torch.arange(ids.shape[1]).unsqueeze(0).expand(ids.shape[0], -1)

    def logits_of(m):
        with torch.no_grad():
            return gather_vocab_parallel(m(ids, pos, None).float(), tp_group, VOCAB)

    # the trainer's path: megatron DDP (adapters only), backward, finalize_model_grads (DP average; with sequence
    # parallelism also the TP sum of the replicated adapters' partial gradients)
    ddp = wrap_ddp(model, distributed_optimizer=False)
    ddp.zero_grad_buffer()
    out = ddp(ids, pos, None)  # [b, s, V/tp]
    loss = vocab_parallel_cross_entropy(
        out.float().transpose(0, 1).contiguous(), ids.roll(-1, 1).t().contiguous()
    ).mean()
    loss.backward()
    finalize_model_grads([ddp])
    res = {"logits": gather_vocab_parallel(out.detach().float(), tp_group, VOCAB), "loss": loss.item()}
    res["grads"] = gather_peft_tensors(model, grads=True)
    res["base_grads"] = [
        n
        for n, p in model.named_parameters()
        if not lora.is_adapter_param(p) and (p.grad is not None or hasattr(p, "main_grad"))
    ]
    res["ddp_buffer_numel"] = sum(b.grad_data.numel() for b in ddp.buffers)
    res["trainable"] = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    with adapters_disabled(model):
        res["disabled"] = logits_of(model)
    base = build_gpt_model(args)
    load_hf_weights(base, args, folder)
    res["base"] = logits_of(base)
    with torch.no_grad():
        for p in lora.adapted_weights():
            p.copy_(lora.merged_weight(p))
    with adapters_disabled(model):
        res["merged"] = logits_of(model)
    return res


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("targets", [[t] for t in LORA_TARGETS] + [list(LORA_TARGETS)], ids=lambda t: "+".join(t))
def test_tp1_tp2_forward_and_gradients_agree(dist_pool, base_folder, targets):
    from megatron_rlvr.models.hf_config import load_hf_config

    peft = random_peft(load_hf_config(base_folder), targets, RANK, seed=7)
    ids = torch.randint(3, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    runs = {
        "tp1": dist_pool.run(_rank_forward_backward, tp=1, args=(base_folder, peft, ids, targets, False))[0],
        "tp2": dist_pool.run(_rank_forward_backward, tp=2, args=(base_folder, peft, ids, targets, False))[0],
    }
    if len(targets) == len(LORA_TARGETS):
        runs["tp2_sp"] = dist_pool.run(_rank_forward_backward, tp=2, args=(base_folder, peft, ids, targets, True))[0]
    ref = runs["tp1"]
    assert set(ref["grads"]) == set(peft)
    assert _rel(ref["logits"], ref["base"]) > 1e-2  # the adapter changes the model
    for name, r in runs.items():
        assert not r["base_grads"], f"{name}: frozen base weights got gradients: {r['base_grads'][:3]}"
        assert all(n.startswith("lora_adapters.") for n in r["trainable"]), r["trainable"]
        assert torch.equal(r["disabled"], r["base"]), f"{name}: adapters disabled != base model"
        assert _rel(r["merged"], r["logits"]) < 1e-5, name
        assert _rel(r["logits"], ref["logits"]) < 1e-5, name
        assert abs(r["loss"] - ref["loss"]) < 1e-5 * abs(ref["loss"])
        for k, g in ref["grads"].items():
            assert g.abs().sum() > 0, k
            assert _rel(r["grads"][k], g) < 1e-5, f"{name}: gradient of {k}"
        worst = max(_rel(r["grads"][k], g) for k, g in ref["grads"].items())
        print(f"\n{'+'.join(targets)} {name} vs tp1: logits {_rel(r['logits'], ref['logits']):.1e}, grads {worst:.1e}")


def _rank_step_and_export(folder: str, peft: dict | None, ids: torch.Tensor, out_root: str) -> dict:
    """One optimizer step of the policy (LoRA when ``peft`` is given, else full fine-tuning) through the trainer's
    builders, then the merged HF export and the PEFT export."""
    import os

    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from megatron_rlvr.config import OptimizerConfig, ParallelConfig, ScheduleConfig
    from megatron_rlvr.megatron.policy import _torch_optimizers, build_model, build_optimizer, wrap_ddp
    from megatron_rlvr.models.export import export_hf
    from megatron_rlvr.models.hf_config import load_hf_config, megatron_model_args
    from megatron_rlvr.models.lora import adapter_params, export_peft, load_peft_tensors
    from megatron_rlvr.models.source import ModelSource

    tp = ps.get_tensor_model_parallel_world_size()
    pg = ProcessGroupCollection.use_mpu_process_groups()
    args = megatron_model_args(folder, tp_size=tp, padded_vocab_size=512)
    source = ModelSource(load_hf_config(folder), folder, None, False)
    lora = LoRAConfig(rank=RANK, alpha=2.0 * RANK) if peft is not None else None
    model = build_model(args, source, 0, pg, lora=lora)
    if peft is not None:
        load_peft_tensors(model, peft)
    ddp = wrap_ddp(model, distributed_optimizer=False)
    optimizer, _ = build_optimizer(
        ddp,
        OptimizerConfig(lr=1e-2),
        ScheduleConfig(steps=2),
        ParallelConfig(tp=tp, distributed_optimizer=False),
        "float32",
    )
    frozen_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    pos = torch.arange(ids.shape[1]).unsqueeze(0).expand(ids.shape[0], -1)
    out = ddp(ids, pos, None)
    loss = vocab_parallel_cross_entropy(out.float().transpose(0, 1).contiguous(), ids.roll(-1, 1).t().contiguous())
    loss.mean().backward()
    finalize_model_grads([ddp])
    ok, _, _ = optimizer.step()
    opt_params = [p for o in _torch_optimizers(optimizer) for g in o.param_groups for p in g["params"]]
    state_bytes = sum(
        t.numel() * t.element_size()
        for o in _torch_optimizers(optimizer)
        for st in o.state.values()
        for t in st.values()
        if torch.is_tensor(t)
    )
    res = {
        "step_ok": ok,
        "optimizer_params": len(opt_params),
        "optimizer_numel": sum(p.numel() for p in opt_params),
        "optimizer_state_bytes": state_bytes,
        "ddp_grad_buffer_numel": sum(b.grad_data.numel() for b in ddp.buffers),
        "frozen_unchanged": all(
            torch.equal(p, frozen_before[n]) for n, p in model.named_parameters() if n in frozen_before
        ),
        "n_frozen": len(frozen_before),
    }
    if peft is not None:
        ids_opt = {id(p) for p in opt_params}
        res["optimizer_is_adapters"] = ids_opt == {id(p) for p in adapter_params(model)}
        tag = f"tp{tp}"
        res["merged_dir"] = export_hf(ddp, args, os.path.join(out_root, f"merged_{tag}"), source_dir=folder)
        res["peft_dir"] = export_peft(ddp, os.path.join(out_root, f"peft_{tag}"), base_model=folder)
    return res


def test_optimizer_holds_adapters_only_and_exports_merge(dist_pool, base_folder, tmp_path):
    """One step at TP=1 and TP=2: the optimizer, its state and DDP's gradient buffer cover the adapters only, the
    base weights do not move, the PEFT exports of both layouts agree, and the merged HF export equals
    W + (alpha/r) B A computed by hand from the base checkpoint and the PEFT export."""

    from megatron_rlvr.models.hf_config import load_hf_config
    from megatron_rlvr.models.lora import read_peft_folder

    hf_cfg = load_hf_config(base_folder)
    peft = random_peft(hf_cfg, LORA_TARGETS, RANK, seed=11)
    ids = torch.randint(3, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))
    full = dist_pool.run(_rank_step_and_export, tp=2, args=(base_folder, None, ids, str(tmp_path)))[0]
    runs = {
        tp: dist_pool.run(_rank_step_and_export, tp=tp, args=(base_folder, peft, ids, str(tmp_path)))[0]
        for tp in (1, 2)
    }
    lora = runs[2]
    n_adapter = sum(v.numel() for v in peft.values())
    print(
        f"\noptimizer state bytes per rank at TP=2: LoRA r={RANK} {lora['optimizer_state_bytes']} vs full "
        f"{full['optimizer_state_bytes']}; DDP grad buffer numel {lora['ddp_grad_buffer_numel']} vs "
        f"{full['ddp_grad_buffer_numel']}"
    )
    assert full["n_frozen"] == 0 and full["step_ok"]
    for tp, r in runs.items():
        assert r["step_ok"] and r["optimizer_is_adapters"], tp
        assert r["frozen_unchanged"] and r["n_frozen"] > 0, tp
        # Adam: exp_avg + exp_avg_sq (fp32) per adapter element, plus a step counter per tensor
        assert r["optimizer_state_bytes"] < 2 * 4 * r["optimizer_numel"] + 64 * r["optimizer_params"]
    assert runs[1]["optimizer_numel"] == n_adapter
    assert lora["optimizer_state_bytes"] * 10 < full["optimizer_state_bytes"]
    assert lora["ddp_grad_buffer_numel"] * 10 < full["ddp_grad_buffer_numel"]

    cfg1, t1 = read_peft_folder(runs[1]["peft_dir"])
    cfg2, t2 = read_peft_folder(runs[2]["peft_dir"])
    assert cfg1 == cfg2 and cfg1["r"] == RANK and cfg1["peft_type"] == "LORA"
    assert sorted(cfg1["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    assert set(t1) == set(peft)
    for k in t1:
        assert not torch.equal(t1[k], peft[k]), f"{k} did not train"
        # TP = 1 vs 2: the same math summed in other orders (on AMX CPUs oneDNN also picks kernels by shape): 2.4e-5
        # measured for a lora_B that starts at zero; a wrongly sliced or gathered shard differs by O(1)
        assert _rel(t2[k], t1[k]) < 1e-4, k
    for r in runs.values():
        assert_merged_export(base_folder, r["merged_dir"], r["peft_dir"], read_peft_folder(r["peft_dir"])[1])


def test_peft_loads_our_adapter_export_like_our_merged_export(dist_pool, base_folder, tmp_path):
    """Round trip through the ``peft`` package itself (an independent implementation of LoRA): the PEFT folder our
    TP=2 trainer exports, loaded by ``peft`` onto the base HF model, gives the logits of our merged HF export, and
    every adapter tensor lands in peft's model (no name silently dropped). Skipped only without ``peft`` (the dev
    extra installs it)."""
    pytest.importorskip("peft")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from megatron_rlvr.models.hf_config import load_hf_config

    peft_tensors = random_peft(load_hf_config(base_folder), LORA_TARGETS, RANK, seed=5)
    ids = torch.randint(3, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(4))
    r = dist_pool.run(_rank_step_and_export, tp=2, args=(base_folder, peft_tensors, ids, str(tmp_path)))[0]

    def logits(model):
        with torch.no_grad():
            return model.eval()(ids).logits.double()

    base = AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float64)
    base_logits = logits(base)
    with_peft = PeftModel.from_pretrained(base, r["peft_dir"])
    loaded = {
        k.replace(".default", ""): v for k, v in with_peft.state_dict().items() if ".lora_A." in k or ".lora_B." in k
    }
    from megatron_rlvr.models.lora import read_peft_folder

    ours = read_peft_folder(r["peft_dir"])[1]
    assert set(loaded) == set(ours)
    assert all(torch.equal(loaded[k].double(), ours[k].double()) for k in ours)
    theirs = logits(with_peft)
    merged = logits(AutoModelForCausalLM.from_pretrained(r["merged_dir"], dtype=torch.float64))
    print(f"\npeft vs our merged export: rel {_rel(theirs, merged):.1e}; vs the base {_rel(theirs, base_logits):.1e}")
    assert _rel(theirs, base_logits) > 1e-2, "the adapter must change the model"
    assert _rel(theirs, merged) < 1e-6


def _lora_policy(folder: str, tp: int, distributed_optimizer: bool):
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_rlvr.config import OptimizerConfig, ParallelConfig, ScheduleConfig
    from megatron_rlvr.megatron.policy import build_model, build_optimizer, wrap_ddp
    from megatron_rlvr.models.hf_config import load_hf_config, megatron_model_args
    from megatron_rlvr.models.source import ModelSource

    pg = ProcessGroupCollection.use_mpu_process_groups()
    args = megatron_model_args(folder, tp_size=tp, padded_vocab_size=512)
    source = ModelSource(load_hf_config(folder), folder, None, False)
    model = build_model(args, source, 0, pg, lora=LoRAConfig(rank=RANK, alpha=2.0 * RANK))
    par = ParallelConfig(tp=tp, distributed_optimizer=distributed_optimizer)
    ddp = wrap_ddp(model, par.distributed_optimizer)
    optimizer, scheduler = build_optimizer(ddp, OptimizerConfig(lr=1e-2), ScheduleConfig(steps=4), par, "float32")
    return args, model, ddp, optimizer, scheduler


def _train_step(ddp, optimizer, scheduler, ids):
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    pos = torch.arange(ids.shape[1]).unsqueeze(0).expand(ids.shape[0], -1)
    out = ddp(ids, pos, None)
    loss = vocab_parallel_cross_entropy(out.float().transpose(0, 1).contiguous(), ids.roll(-1, 1).t().contiguous())
    loss.mean().backward()
    finalize_model_grads([ddp])
    ok, _, _ = optimizer.step()
    scheduler.step(1)
    assert ok


def _rank_checkpoint(folder: str, peft: dict, ids: torch.Tensor, save_dir: str, resume: bool) -> dict:
    """save: load ``peft``, step on ids[:1], checkpoint, step on ids[1:]. resume: load the checkpoint into a fresh
    policy at this layout, step on ids[1:]. Returns the adapters after the last step and the checkpoint's files."""
    import os

    from megatron.core import parallel_state as ps

    from megatron_rlvr.models.checkpointing import CheckpointConfig, load_checkpoint, read_meta, save_checkpoint
    from megatron_rlvr.models.lora import gather_peft_tensors, load_peft_tensors

    tp = ps.get_tensor_model_parallel_world_size()
    args, model, ddp, optimizer, scheduler = _lora_policy(folder, tp, distributed_optimizer=True)
    out = {}
    if resume:
        load_checkpoint(save_dir, model=ddp, optimizer=optimizer, scheduler=scheduler, load_rng=False)
    else:
        load_peft_tensors(model, peft)
        _train_step(ddp, optimizer, scheduler, ids[:1])
        path = save_checkpoint(
            CheckpointConfig(save_dir), 1, model=ddp, optimizer=optimizer, scheduler=scheduler, model_args=args
        )
        out["meta"] = read_meta(path)
        out["saved_adapters"] = gather_peft_tensors(model)
        from torch.distributed.checkpoint import FileSystemReader

        out["keys"] = sorted(FileSystemReader(path).read_metadata().state_dict_metadata)
        out["bytes"] = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
    _train_step(ddp, optimizer, scheduler, ids[1:])
    out["adapters"] = gather_peft_tensors(model)
    out["lr"] = optimizer.param_groups[0]["lr"]
    return out


def test_checkpoint_holds_adapters_and_resumes_exactly_at_any_tp(dist_pool, base_folder, tmp_path):
    from megatron_rlvr.models.hf_config import load_hf_config

    peft = random_peft(load_hf_config(base_folder), LORA_TARGETS, RANK, seed=5)
    ids = torch.randint(3, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(4))
    save_dir = str(tmp_path / "ckpt")
    ref = dist_pool.run(_rank_checkpoint, tp=2, args=(base_folder, peft, ids, save_dir, False))[0]
    meta = ref["meta"]
    assert meta["lora"]["rank"] == RANK and meta["lora_base"] == base_folder
    tensors = [k for k in ref["keys"] if not k.startswith(("rng_state", "optimizer.distributed.param_state.step"))]
    assert tensors and all(k.startswith(("lora.", "optimizer.")) for k in tensors), tensors  # no base weight
    assert any(k.startswith("optimizer.") for k in tensors)
    print(f"\nLoRA checkpoint: {ref['bytes']} bytes, {len(tensors)} tensors")
    for tp in (2, 1):
        got = dist_pool.run(_rank_checkpoint, tp=tp, args=(base_folder, peft, ids, save_dir, True))[0]
        assert got["lr"] == ref["lr"]
        for k, v in ref["adapters"].items():
            if tp == 2:
                assert torch.equal(got["adapters"][k], v), f"tp2 resume: {k}"
            else:
                assert _rel(got["adapters"][k], v) < 1e-5, f"tp1 resume (resharded): {k}"

    # convert to-hf of the LoRA checkpoint: the merged model and the PEFT folder
    merged_dir, peft_dir = str(tmp_path / "merged"), str(tmp_path / "peft")
    dist_pool.run(_rank_convert, tp=2, args=(save_dir, merged_dir, peft_dir))
    assert_merged_export(base_folder, merged_dir, peft_dir, ref["saved_adapters"])


def _rank_convert(ckpt: str, out: str, adapter_out: str) -> None:
    from megatron_rlvr.models.convert import to_hf_on_rank

    to_hf_on_rank(ckpt, out, adapter_out=adapter_out)


def assert_merged_export(base_folder: str, merged_dir: str, peft_dir: str, adapters: dict) -> None:
    """The merged HF folder equals W + (alpha/r) B A computed by hand from the base checkpoint and the PEFT folder,
    whose tensors are ``adapters``."""
    from safetensors.torch import load_file

    from megatron_rlvr.models.lora import read_peft_folder

    cfg, t = read_peft_folder(peft_dir)
    assert set(t) == set(adapters) and all(torch.equal(t[k], adapters[k]) for k in t)
    base = load_file(f"{base_folder}/model.safetensors")
    merged = load_file(f"{merged_dir}/model.safetensors")
    assert set(merged) == set(base)
    scale = cfg["lora_alpha"] / cfg["r"]
    for name, w in base.items():
        stem = "base_model.model." + name.removesuffix(".weight")
        a = t.get(f"{stem}.lora_A.weight")
        want = w + scale * t[f"{stem}.lora_B.weight"] @ a if a is not None else w
        assert (merged[name] - want).abs().max() < 1e-6, name


def _rank_merged_sync(folder: str, peft: dict, ids: torch.Tensor) -> dict:
    """The trainer's weight sync of a LoRA policy (TP=2) into the transformers engine: the engine holds the merged
    weights and its logits equal megatron's adapter forward."""
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_rlvr.models.build import forward_logits
    from megatron_rlvr.models.hf_config import hf_config_object, load_hf_config
    from megatron_rlvr.models.lora import load_peft_tensors
    from megatron_rlvr.rollout.hf_engine import HFRolloutEngine
    from megatron_rlvr.trainer.weights import sync_weights

    tp = ps.get_tensor_model_parallel_world_size()
    args, model, ddp, _, _ = _lora_policy(folder, tp, distributed_optimizer=False)
    load_peft_tensors(model, peft)
    engine = HFRolloutEngine.from_config(hf_config_object(load_hf_config(folder)), None, dtype=torch.float32)
    sync_weights(engine, ddp, args, ProcessGroupCollection.use_mpu_process_groups())
    ours = forward_logits(ddp, ids, vocab_size=VOCAB)[0]
    with torch.no_grad():
        theirs = engine.model(ids).logits.float()
    return {"rel": _rel(theirs, ours), "state": {k: v.clone() for k, v in engine.model.state_dict().items()}}


def test_merged_sync_into_the_transformers_engine(dist_pool, base_folder):
    from safetensors.torch import load_file

    from megatron_rlvr.models.hf_config import load_hf_config

    peft = random_peft(load_hf_config(base_folder), LORA_TARGETS, RANK, seed=9)
    ids = torch.randint(3, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(6))
    res = dist_pool.run(_rank_merged_sync, tp=2, args=(base_folder, peft, ids))
    base = load_file(f"{base_folder}/model.safetensors")
    for r in res:
        print(f"\nmerged sync: engine logits vs megatron LoRA forward, relative {r['rel']:.2e}")
        assert r["rel"] < 1e-5
        for name, w in base.items():
            stem = "base_model.model." + name.removesuffix(".weight")
            a = peft.get(f"{stem}.lora_A.weight")
            want = w + 2.0 * peft[f"{stem}.lora_B.weight"] @ a if a is not None else w
            assert (r["state"][name] - want).abs().max() < 1e-6, name


def _rank_merged_stream_memory(folder: str, peft: dict, bucket_bytes: int) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_rlvr.models.lora import load_peft_tensors
    from megatron_rlvr.rollout.weight_stream import StreamStats, WeightStreamConfig, megatron_weight_stream

    args, model, _, _, _ = _lora_policy(folder, ps.get_tensor_model_parallel_world_size(), distributed_optimizer=False)
    load_peft_tensors(model, peft)
    stats = StreamStats()
    cfg = WeightStreamConfig(bucket_bytes=bucket_bytes)
    pg = ProcessGroupCollection.use_mpu_process_groups()
    n = 0
    for bucket in megatron_weight_stream(model, args, pg_collection=pg, config=cfg, stats=stats):
        n += len(bucket)
        del bucket
    return {"peak": stats.meter.peak_bytes, "largest": stats.largest_tensor_bytes, "buckets": stats.buckets, "n": n}


def test_merged_stream_keeps_its_memory_bound(dist_pool, base_folder):
    """Merged weights are new tensors (not views of the parameters): the stream counts them, so its buffered bytes
    stay within bucket_bytes + the largest tensor at TP=1 and TP=2."""
    from megatron_rlvr.models.hf_config import load_hf_config

    peft = random_peft(load_hf_config(base_folder), LORA_TARGETS, RANK, seed=3)
    bucket = 80_000
    for tp in (1, 2):
        for r in dist_pool.run(_rank_merged_stream_memory, tp=tp, args=(base_folder, peft, bucket)):
            assert r["buckets"] > 2 and r["peak"] <= bucket + r["largest"], (tp, r)


MEGATRON_TARGETS = {
    "qkv": "self_attention.linear_qkv",
    "proj": "self_attention.linear_proj",
    "fc1": "mlp.linear_fc1",
    "fc2": "mlp.linear_fc2",
}
"""Target -> megatron linear, written out here independently of ``models.lora.TARGET_MODULES``."""


def _rank_ownership_and_stream_modes(folder: str, peft: dict, targets: list) -> dict:
    """A LoRA policy at this rank's (TP, PP) layout: its ownership table checked against the module tree (by
    parameter names), then one weight stream per ``WeightStreamConfig.adapters`` mode."""
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_rlvr.megatron.policy import ModelSource, build_model, wrap_ddp
    from megatron_rlvr.models.build import unwrap
    from megatron_rlvr.models.hf_config import load_hf_config, megatron_model_args
    from megatron_rlvr.models.lora import LoRAAdapter, adapter_params, load_peft_tensors, lora_container
    from megatron_rlvr.models.mapping import layer_offset
    from megatron_rlvr.rollout.weight_stream import WeightStreamConfig, megatron_weight_stream

    pg = ProcessGroupCollection.use_mpu_process_groups()
    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    args = megatron_model_args(folder, tp_size=tp, pp_size=pp, padded_vocab_size=512)
    source = ModelSource(load_hf_config(folder), folder, None, False)
    lora_cfg = LoRAConfig(rank=RANK, alpha=2.0 * RANK, targets=targets)
    model = build_model(args, source, 0, pg, lora=lora_cfg)
    ddp = wrap_ddp(model, distributed_optimizer=False)
    load_peft_tensors(model, peft)
    gpt = unwrap(model)
    table = lora_container(ddp)
    assert table is gpt.lora_adapters
    named = dict(gpt.named_parameters())
    n_layers = len(gpt.decoder.layers)
    want_weights = {f"decoder.layers.{i}.{MEGATRON_TARGETS[t]}.weight" for i in range(n_layers) for t in targets}
    want_params = {f"lora_adapters.layers.{i}.{t}.lora_{ab}" for i in range(n_layers) for t in targets for ab in "AB"}
    res = {"n_layers": n_layers, "offset": layer_offset(args.config, pg.pp.rank())}
    res["names_found"] = want_weights <= set(named) and want_params <= set(named)
    by_id = {id(p): n for n, p in named.items()}
    res["adapted"] = sorted(by_id[id(w)] for w in table.adapted_weights())
    res["want_adapted"] = sorted(want_weights)
    res["adapter_params"] = sorted(by_id[id(p)] for p in adapter_params(ddp))
    res["want_adapter_params"] = sorted(want_params)

    # every lookup over the whole module tree, with the tensors' elementwise == made to fail: identity only
    def no_eq(self, other):
        raise AssertionError("the ownership table compared tensors by value")

    eq = torch.Tensor.__eq__
    torch.Tensor.__eq__ = no_eq
    try:
        owner = {n: table.adapter_of(p) for n, p in named.items()}
        is_adapter = {n: table.is_adapter_param(p) for n, p in named.items()}
        res["clone_misses"] = all(
            table.adapter_of(p.detach().clone()) is None and not table.is_adapter_param(p.detach().clone())
            for p in named.values()
        )
    finally:
        torch.Tensor.__eq__ = eq
    res["owner_is_its_adapter"] = all(
        (owner[n] is None) == (n not in want_weights)
        and (
            owner[n] is None or owner[n] is gpt.get_submodule(f"lora_adapters.layers.{n.split('.')[2]}.{_target_of(n)}")
        )
        for n in named
    )
    res["owner_types"] = all(isinstance(a, LoRAAdapter) for a in owner.values() if a is not None)
    res["is_adapter_matches_names"] = all(is_adapter[n] == (n in want_params) for n in named)

    for mode in ("base", "merged"):
        cfg = WeightStreamConfig(bucket_bytes=80_000, adapters=mode)
        res[mode] = {
            n: t.clone() for b in megatron_weight_stream(ddp, args, pg_collection=pg, config=cfg) for n, t in b
        }
    return res


def _target_of(megatron_name: str) -> str:
    return next(t for t, m in MEGATRON_TARGETS.items() if f".{m}." in megatron_name)


@pytest.mark.parametrize("tp,pp,targets", [(1, 1, ["qkv", "fc2"]), (2, 2, list(LORA_TARGETS))], ids=["tp1", "tp2pp2"])
def test_ownership_table_and_base_or_merged_stream(dist_pool, base_folder, tp, pp, targets):
    """The adapters' ownership table names exactly the adapted base weights (the target linears' weights of every
    local layer) and exactly the adapters' A and B, compared by parameter name against the module tree; every
    lookup goes by identity (a clone of a parameter is not in the table, tensor ``__eq__`` is never called). The
    weight stream with ``adapters="base"`` gives exactly the
    base checkpoint's tensors; with ``"merged"`` it gives W + (alpha/r) B A computed in fp64 from the base
    checkpoint and the PEFT tensors (fp32, 1e-6), and neither sends an adapter tensor."""
    from safetensors.torch import load_file

    from megatron_rlvr.models.hf_config import load_hf_config

    peft = random_peft(load_hf_config(base_folder), targets, RANK, seed=13)
    res = dist_pool.run(_rank_ownership_and_stream_modes, tp=tp, pp=pp, args=(base_folder, peft, targets))
    base = load_file(f"{base_folder}/model.safetensors")
    scale = 2.0  # alpha / r
    merged_want = {}
    for name, w in base.items():
        stem = "base_model.model." + name.removesuffix(".weight")
        a = peft.get(f"{stem}.lora_A.weight")
        if a is None:
            merged_want[name] = w.double()
        else:
            merged_want[name] = w.double() + scale * peft[f"{stem}.lora_B.weight"].double() @ a.double()
    for r in res:
        assert r["n_layers"] == 2 // pp and r["names_found"]
        assert r["adapted"] == r["want_adapted"] and len(r["adapted"]) == len(targets) * r["n_layers"]
        assert r["adapter_params"] == r["want_adapter_params"]
        assert r["owner_is_its_adapter"] and r["owner_types"] and r["is_adapter_matches_names"]
        assert r["clone_misses"]
        assert set(r["base"]) == set(base) and set(r["merged"]) == set(base)
        for name, w in base.items():
            assert torch.equal(r["base"][name], w), f"base stream: {name}"
            err = (r["merged"][name].double() - merged_want[name]).abs().max().item()
            assert err < 1e-6, f"merged stream: {name} off by {err}"
        changed = [n for n in base if not torch.equal(r["merged"][n], base[n])]
        assert changed and sorted(changed) == sorted(n for n in base if _peft_a(n) in peft)


def _peft_a(hf_name: str) -> str:
    return "base_model.model." + hf_name.removesuffix(".weight") + ".lora_A.weight"


def test_weight_stream_adapters_mode_is_validated():
    from megatron_rlvr.rollout.weight_stream import WeightStreamConfig

    with pytest.raises(ValueError, match="WeightStreamConfig.adapters must be 'merged' or 'base'"):
        WeightStreamConfig(adapters="adapter")


def test_expert_adapters_on_moe_models_are_refused():
    from types import SimpleNamespace

    from megatron_rlvr.models.lora import attach_lora

    args = SimpleNamespace(config=SimpleNamespace(num_moe_experts=8))
    with pytest.raises(ValueError, match=r"MoE experts are not supported.*targets \[qkv, proj\]"):
        attach_lora(None, LoRAConfig(targets=["qkv", "fc1"]), args)


def test_lora_config_validation():
    for bad in (dict(rank=0), dict(alpha=0), dict(dropout=1.0), dict(targets=["q_proj"]), dict(targets=[])):
        with pytest.raises(ValueError, match="model.lora"):
            LoRAConfig(**bad)
    with pytest.raises(ValueError, match="model.lora.sync"):
        LoRAConfig(sync="both")
    assert LoRAConfig(rank=8, alpha=16).scale == 2.0


def _rank_export_on_a_full_disk(out: str) -> str | None:
    """export_peft with the adapter file's write failing as on a full disk (after part of it was written)."""
    import errno

    import safetensors.torch

    from megatron_rlvr.models import lora

    def full_disk(tensors, path, metadata=None):
        with open(path, "wb") as f:
            f.write(b"\0" * 64)
        raise OSError(errno.ENOSPC, "No space left on device")

    real = lora.gather_peft_tensors, lora.peft_config_dict, safetensors.torch.save_file
    lora.gather_peft_tensors = lambda model, pg_collection=None: {"a.lora_A.weight": torch.ones(2, 2)}
    lora.peft_config_dict = lambda model, base_model: {"r": 2}
    safetensors.torch.save_file = full_disk
    try:
        lora.export_peft(None, out)
        return None
    except ValueError as e:
        return str(e)
    finally:  # the pool's ranks live on into the next tests
        lora.gather_peft_tensors, lora.peft_config_dict, safetensors.torch.save_file = real


def test_an_adapter_export_on_a_full_disk_leaves_no_empty_folder(dist_pool, tmp_path):
    """A LoRA adapter export that cannot be written (rank 0 writes; here ENOSPC after a partial file) left an empty
    or half-written output folder and the other ranks waiting in a barrier; now every rank raises one line naming
    the folder and the cause, and nothing is left there (``test_full_disk.py`` checks a previous export is kept)."""
    out = str(tmp_path / "adapter")
    errs = dist_pool.run(_rank_export_on_a_full_disk, args=(out,), timeout=120)
    assert all(e is not None and e == errs[0] for e in errs), errs
    assert f"cannot write the LoRA adapters to {out}" in errs[0] and "No space left on device" in errs[0]
    assert "\n" not in errs[0] and not list(tmp_path.iterdir())

"""LoRA on the attention of the MoE families (models/lora.py), checked against PEFT on transformers' model: a tiny
random DeepSeek-V3 (multi-latent attention with a q LoRA: adapters on q_a_proj and kv_a_proj_with_mqa, whole on
every TP rank, on the column-parallel q_b_proj and kv_b_proj, and on the row-parallel o_proj), GLM-4.5 (q/k/v
biases, qk-norm, partial rotary) and GPT-OSS (biases, sinks, sliding window) with random non-zero A and B (fp32).
At TP=1 and at TP=2 (MLA: with sequence parallelism) megatron's logits equal ``PeftModel.from_pretrained`` on the
HF model, as do its weights with the adapters merged in (the merged weight stream's tensors); its adapter gradients
equal PEFT's, the adapters it exports load into PEFT to the same logits, and the planner counts the adapter
parameters one GPU holds.
Controls, each of which must miss megatron's logits by 100 x the tolerance or more: the export with one module's
adapter under a wrong name (PEFT then leaves it at zero), with the column-parallel B's two halves swapped (the
concatenation of TP=2 shards in the wrong order), and with the row-parallel A's halves swapped."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from test_models_deepseek import _make_model as make_dsv3_model
from test_models_glm4_moe import make_glm_model
from test_models_gpt_oss import _config as gpt_oss_config
from test_models_gpt_oss import _make_model as make_gpt_oss_model

VOCAB = 160
SEQ = 16  # > GPT-OSS's sliding window (8); even (sequence parallelism at TP=2)
RANK = 4
ALPHA = 8.0
LOGIT_TOL = 1e-4  # max-abs; logits are O(1..10)
GRAD_TOL = 1e-4  # relative, per tensor
CONTROL_MIN = 100 * LOGIT_TOL

FAMILIES = {
    # family: (megatron targets, HF attention modules adapted, (column-parallel module, row-parallel module),
    #          (module renamed in the wrong-name control, its wrong name))
    "dsv3": (
        ["q_a", "q_b", "kv_a", "kv_b", "proj"],
        ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],
        ("kv_b_proj", "o_proj"),
        ("kv_a_proj_with_mqa", "kv_a_proj"),
    ),
    "glm4": (["qkv", "proj"], ["q_proj", "k_proj", "v_proj", "o_proj"], ("k_proj", "o_proj"), ("v_proj", "w_proj")),
    "gpt_oss": (["qkv", "proj"], ["q_proj", "k_proj", "v_proj", "o_proj"], ("q_proj", "o_proj"), ("o_proj", "out")),
}


def _hf_model(family: str):
    from transformers import DeepseekV3Config, Glm4MoeConfig

    from megatron_rlvr.families.tiny import TINY_DSV3_MODEL, TINY_GLM4_MOE_MODEL

    ids = dict(vocab_size=VOCAB, pad_token_id=None, bos_token_id=1, eos_token_id=2)
    if family == "dsv3":
        return make_dsv3_model(DeepseekV3Config(**(TINY_DSV3_MODEL | ids)), seed=51)
    if family == "glm4":
        return make_glm_model(Glm4MoeConfig(**(TINY_GLM4_MOE_MODEL | ids)), seed=52)
    return make_gpt_oss_model(gpt_oss_config(), seed=53)


def _peft_folder(tensors: dict, modules: list[str], folder: str) -> str:
    """A PEFT adapter folder written here from the tensors (independently of models.lora's export)."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(folder, "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": ALPHA, "target_modules": modules}
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)
    return folder


def _peft_run(base, folder: str, ids: torch.Tensor, grads: bool = False):
    """Logits of ``PeftModel.from_pretrained(base, folder)`` (and its adapter gradients of the mean next-token
    cross-entropy, keyed by the PEFT file's names)."""
    from peft import PeftModel

    model = PeftModel.from_pretrained(copy.deepcopy(base), folder, is_trainable=grads)
    logits = model(ids).logits.float()
    if not grads:
        return logits.detach(), None
    _loss(logits, ids).backward()
    g = {n.replace(".default", ""): p.grad.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    return logits.detach(), g


def _loss(logits_BSV, ids):
    return torch.nn.functional.cross_entropy(logits_BSV[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(family, HF folder, base HF model, random PEFT tensors, ids, PEFT's logits and gradients)."""
    name = request.param
    _, modules, _, _ = FAMILIES[name]
    base = _hf_model(name)
    folder = str(tmp_path_factory.mktemp(name))
    base.save_pretrained(folder)
    g = torch.Generator().manual_seed(9)
    peft = {}
    for layer in range(base.config.num_hidden_layers):
        for m in modules:
            out_f, in_f = base.get_submodule(f"model.layers.{layer}.self_attn.{m}").weight.shape
            stem = f"base_model.model.model.layers.{layer}.self_attn.{m}"
            peft[f"{stem}.lora_A.weight"] = 0.2 * torch.randn(RANK, in_f, generator=g)
            peft[f"{stem}.lora_B.weight"] = 0.2 * torch.randn(out_f, RANK, generator=g)
    ids = torch.randint(3, VOCAB, (2, SEQ), generator=g)
    ref_logits, ref_grads = _peft_run(base, _peft_folder(peft, modules, folder + "_peft"), ids, grads=True)
    base_logits = base(ids).logits.float().detach()
    assert (ref_logits - base_logits).abs().max() > CONTROL_MIN  # the adapters change the model
    return name, folder, base, peft, ids, ref_logits, ref_grads


def _rank_lora(name: str, folder: str, peft: dict, ids: torch.Tensor, export_dir: str) -> dict:
    """Megatron with the adapters loaded from the PEFT tensors: logits, one backward through DDP (adapter gradients
    as PEFT tensors), and the PEFT export."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megatron_rlvr.config.lora_config import LoRAConfig
    from megatron_rlvr.megatron.policy import wrap_ddp
    from megatron_rlvr.models.build import build_gpt_model
    from megatron_rlvr.models.hf_config import megatron_model_args
    from megatron_rlvr.models.hf_loading import load_hf_weights
    from megatron_rlvr.models.lora import (
        adapter_params,
        adapters_disabled,
        attach_lora,
        export_peft,
        gather_peft_tensors,
        load_peft_tensors,
    )
    from megatron_rlvr.models.mapping import ExpertLayout

    pg = ProcessGroupCollection.use_mpu_process_groups()
    experts = ExpertLayout.of(pg)
    args = megatron_model_args(folder, tp_size=pg.tp.size(), ep_size=experts.ep_size, etp_size=experts.etp_size)
    model = build_gpt_model(args, pg_collection=pg)
    load_hf_weights(model, args, folder, pg_collection=pg)
    targets = FAMILIES[name][0]
    lora = attach_lora(model, LoRAConfig(rank=RANK, alpha=ALPHA, targets=targets), args, pg_collection=pg)
    load_peft_tensors(model, peft)
    ddp = wrap_ddp(model, distributed_optimizer=False)
    ddp.zero_grad_buffer()
    pos = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)
    logits = gather_from_tensor_model_parallel_region(ddp(ids, pos, None))[..., :VOCAB]
    _loss(logits.float(), ids).backward()
    finalize_model_grads([ddp])  # DP average of equal batches; the TP sum of sequence-parallel partial gradients
    grads = gather_peft_tensors(model, pg_collection=pg, grads=True)
    export_peft(model, export_dir, base_model=folder, pg_collection=pg)
    numel = sum(p.numel() for p in adapter_params(model))
    with torch.no_grad():  # W + (alpha/r) B A of each shard, what the merged weight stream sends
        for p in lora.adapted_weights():
            p.copy_(lora.merged_weight(p))
        with adapters_disabled(model):
            merged = gather_from_tensor_model_parallel_region(model(ids, pos, None))[..., :VOCAB]
    sp = bool(args.config.sequence_parallel)
    return {"logits": logits.detach().float(), "grads": grads, "sp": sp, "numel": numel, "merged": merged.float()}


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _halves_swapped(t: torch.Tensor, dim: int) -> torch.Tensor:
    a, b = t.chunk(2, dim=dim)
    return torch.cat([b, a], dim=dim)


@pytest.mark.parametrize("tp", [1, 2])
def test_attention_lora_matches_peft(dist_pool, family, tp, tmp_path):
    from megatron_rlvr.config import ParallelConfig
    from megatron_rlvr.config.lora_config import LoRAConfig
    from megatron_rlvr.families.table import model_spec_from_hf_config
    from megatron_rlvr.models.lora import read_peft_folder
    from megatron_rlvr.planner.memory import lora_stage_params

    name, folder, base, peft, ids, ref_logits, ref_grads = family
    _, modules, (column, row), (renamed, wrong) = FAMILIES[name]
    export_dir = str(tmp_path / "adapter")
    r = dist_pool.run(_rank_lora, tp=tp, etp=1, args=(name, folder, peft, ids, export_dir), timeout=300)[0]
    if name == "dsv3":
        assert r["sp"] == (tp > 1)  # MLA at TP > 1 runs with sequence parallelism (the replicated adapters' case)
    # the planner's count of adapter parameters per GPU is what the model holds
    lora = LoRAConfig(rank=RANK, alpha=ALPHA, targets=FAMILIES[name][0])
    assert lora_stage_params(model_spec_from_hf_config(folder), ParallelConfig(tp=tp), lora) == [r["numel"]]
    err = (r["logits"] - ref_logits).abs().max().item()
    assert err < LOGIT_TOL, f"{name} tp{tp}: logits vs PEFT max-abs {err:.2e}"
    assert (r["merged"] - ref_logits).abs().max().item() < LOGIT_TOL, f"{name} tp{tp}: adapters merged into W"
    assert set(r["grads"]) == set(peft) == set(ref_grads)
    for k, g in ref_grads.items():
        assert g.abs().sum() > 0, k
        assert _rel(r["grads"][k], g) < GRAD_TOL, f"{name} tp{tp}: gradient of {k}: {_rel(r['grads'][k], g):.2e}"
    cfg, exported = read_peft_folder(export_dir)
    assert sorted(cfg["target_modules"]) == sorted(modules)
    logits, _ = _peft_run(base, export_dir, ids)
    assert (logits - ref_logits).abs().max().item() < LOGIT_TOL, f"{name} tp{tp}: exported adapters in PEFT"
    controls = {}
    bad = {k.replace(f".{renamed}.", f".{wrong}."): v for k, v in exported.items()}
    controls["wrong name"] = bad
    controls["column B halves swapped"] = {
        k: _halves_swapped(v, 0) if f".{column}.lora_B" in k else v for k, v in exported.items()
    }
    controls["row A halves swapped"] = {
        k: _halves_swapped(v, 1) if f".{row}.lora_A" in k else v for k, v in exported.items()
    }
    errs = {}
    for c, tensors in controls.items():
        logits, _ = _peft_run(base, _peft_folder(tensors, modules, str(tmp_path / c.replace(" ", "_"))), ids)
        errs[c] = (logits - r["logits"]).abs().max().item()
    print(f"\n{name} tp{tp}: logits vs PEFT {err:.1e}; controls {', '.join(f'{c} {e:.1e}' for c, e in errs.items())}")
    assert all(e > CONTROL_MIN for e in errs.values()), errs

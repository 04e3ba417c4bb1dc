"""Megatron kernel fusions (megatron_rlvr/models/fusions.py): the decision table from a detected stack, all off on
CPU (config and run header), and on a GPU (@pytest.mark.gpu, run by tools/gpu_check.sh) one fused training step
agrees with the unfused one: logits, loss and every gradient."""

import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_rlvr.models.fusions import FUSION_FLAGS, FusionSupport, detect, fusion_flags


def test_decision_table():
    """Each fusion is on exactly when its kernel exists: torch-only fusions need CUDA, RoPE fusion needs TE,
    gradient-accumulation fusion TE or Apex, masked softmax the softmax extension modules; persistent LayerNorm
    never (RMSNorm models); nothing without CUDA even when the packages import."""
    none = FusionSupport(cuda=True, transformer_engine=None, apex=False)
    assert none.flags() == {
        "bias_activation_fusion": True,
        "bias_dropout_fusion": True,
        "masked_softmax_fusion": False,
        "apply_rope_fusion": False,
        "gradient_accumulation_fusion": False,
        "persist_layer_norm": False,
    }
    te = FusionSupport(cuda=True, transformer_engine="2.8.0", apex=False)
    assert te.flags()["apply_rope_fusion"] and te.flags()["gradient_accumulation_fusion"]
    assert not te.flags()["masked_softmax_fusion"]
    apex = FusionSupport(cuda=True, transformer_engine=None, apex=True, softmax_kernels=True)
    assert apex.flags()["gradient_accumulation_fusion"] and apex.flags()["masked_softmax_fusion"]
    assert not apex.flags()["apply_rope_fusion"] and not apex.flags()["persist_layer_norm"]
    cpu = FusionSupport(cuda=False, transformer_engine="2.8.0", apex=True, softmax_kernels=True)
    assert not any(cpu.flags().values())
    assert set(none.flags()) == set(FUSION_FLAGS)
    assert "TE 2.8.0" in te.describe() and "apply_rope" in te.describe()
    assert cpu.describe() == "fusions: off (CPU)"


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU behaviour")
def test_all_fusions_off_on_cpu():
    """On CPU the built TransformerConfig has every fusion off, whatever ``fusions`` asks."""
    from megatron_rlvr.families.tiny import tiny_hf_config
    from megatron_rlvr.models.hf_config import megatron_model_args

    assert detect() == FusionSupport(cuda=False, transformer_engine=None, apex=False)
    assert fusion_flags() == {k: False for k in FUSION_FLAGS}
    for fusions in (None, True, False):
        cfg = megatron_model_args(tiny_hf_config(), fusions=fusions).config
        assert {k: getattr(cfg, k) for k in FUSION_FLAGS} == {k: False for k in FUSION_FLAGS}


def _gpu_child() -> dict:
    """One training step of the tiny model twice, fusions off then on (same start weights, same batch)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    from megatron_rlvr.families.tiny import tiny_hf_config
    from megatron_rlvr.megatron.parallel import init_distributed
    from megatron_rlvr.megatron.policy import build_model, wrap_ddp
    from megatron_rlvr.models.build import unwrap
    from megatron_rlvr.models.source import ModelSource
    from megatron_rlvr.ops import vocab_parallel_token_stats

    d = init_distributed(1, 1, 0)
    cfg = tiny_hf_config()
    source = ModelSource(cfg, None, None, True)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, cfg["vocab_size"], (4, 16), generator=g).cuda()
    pos = torch.arange(16).expand(4, 16).contiguous().cuda()
    out = {"support": detect().describe()}
    results = {}
    from megatron_rlvr.models.hf_config import megatron_model_args

    for name, fusions in (("unfused", False), ("fused", None)):
        args = megatron_model_args(cfg, fusions=fusions)
        model = wrap_ddp(build_model(args, source, 1234, d.pg), False)
        flags = {k: getattr(unwrap(model).config, k) for k in FUSION_FLAGS}
        model.zero_grad_buffer()
        logits = model(tokens, pos, None)
        b, s, v = logits.shape
        st = vocab_parallel_token_stats(
            logits.reshape(b * s, v),
            tp_group=None,
            token_ids_T=torch.roll(tokens, -1, 1).reshape(-1),
            vocab_size=cfg["vocab_size"],
            want=("logprob", "entropy"),
        )
        loss = -(st["logprob"].mean()) - 0.01 * st["entropy"].mean()
        loss.backward()
        grads = {
            n: (p.main_grad if getattr(p, "main_grad", None) is not None else p.grad).detach().float().cpu()
            for n, p in model.named_parameters()
        }
        results[name] = (logits.detach().float().cpu(), float(loss), grads, flags)
    lu, loss_u, gu, flags_u = results["unfused"]
    lf, loss_f, gf, flags_f = results["fused"]
    out["flags_unfused"], out["flags_fused"] = flags_u, flags_f
    out["logits_max_abs_diff"] = float((lu - lf).abs().max())
    out["loss"] = [loss_u, loss_f]
    out["grad_rel_diff"] = max(float((gu[n] - gf[n]).norm() / (gu[n].norm() + 1e-12)) for n in gu)
    return out


@pytest.mark.gpu
def test_fused_and_unfused_step_agree_on_gpu():
    """GPU only (tools/gpu_check.sh; never run on the CPU CI): with the detected fusions on, the tiny model's logits,
    loss and gradients of one step match the all-off step to fp32 kernel noise, and at least the torch-only
    fusions were really on."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    env = dict(os.environ, NVIDIA_TF32_OVERRIDE="0")
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--gpu-child"], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    print(res)
    assert not any(res["flags_unfused"].values())
    assert res["flags_fused"]["bias_activation_fusion"] and res["flags_fused"]["bias_dropout_fusion"]
    assert res["logits_max_abs_diff"] < 1e-3
    assert res["loss"][1] == pytest.approx(res["loss"][0], rel=1e-4)
    assert res["grad_rel_diff"] < 1e-3


if __name__ == "__main__" and "--gpu-child" in sys.argv:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    print(json.dumps(_gpu_child()))

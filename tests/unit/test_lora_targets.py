"""``model.lora.targets`` on the two attention kinds: which megatron linear each name adapts (written out here by hand
from megatron's MLASelfAttention / SelfAttention submodule names), and the one-line refusals of a name the model's
attention does not have (the standard ``qkv`` on multi-latent attention, ``q_a`` without a query down projection,
MLA names on a GQA model, an unknown name)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_rlvr.config.lora_config import LoRAConfig
from megatron_rlvr.models.lora import target_module

GQA = SimpleNamespace(mla=False, q_lora_rank=0)
MLA_Q_LORA = SimpleNamespace(mla=True, q_lora_rank=32)  # DeepSeek-V3
MLA_NO_Q_LORA = SimpleNamespace(mla=True, q_lora_rank=0)  # DeepSeek-V2-Lite


def test_targets_name_the_megatron_linears():
    """Each name maps to the linear holding the HF module PEFT adapts (q_b is q_proj without a q LoRA)."""
    sa = "self_attention."
    assert target_module("qkv", GQA) == sa + "linear_qkv"
    assert target_module("proj", GQA) == sa + "linear_proj"
    assert target_module("fc2", GQA) == "mlp.linear_fc2"
    assert target_module("q_a", MLA_Q_LORA) == sa + "linear_q_down_proj"
    assert target_module("q_b", MLA_Q_LORA) == sa + "linear_q_up_proj"
    assert target_module("q_b", MLA_NO_Q_LORA) == sa + "linear_q_proj"
    assert target_module("kv_a", MLA_NO_Q_LORA) == sa + "linear_kv_down_proj"
    assert target_module("kv_b", MLA_Q_LORA) == sa + "linear_kv_up_proj"
    assert target_module("proj", MLA_Q_LORA) == sa + "linear_proj"


@pytest.mark.parametrize(
    "target,dims,match",
    [
        ("qkv", MLA_Q_LORA, "'qkv' does not exist on multi-latent attention"),
        ("kv_b", GQA, "'kv_b' does not exist on this attention"),
        ("q_a", MLA_NO_Q_LORA, "q_lora_rank is null"),
    ],
)
def test_targets_the_attention_lacks_are_refused(target, dims, match):
    with pytest.raises(ValueError, match=match):
        target_module(target, dims)


def test_config_accepts_mla_names_and_refuses_unknown_ones():
    assert LoRAConfig(targets=["q_a", "q_b", "kv_a", "kv_b", "proj"]).targets[0] == "q_a"
    with pytest.raises(ValueError, match="model.lora.targets must be distinct names"):
        LoRAConfig(targets=["q_c"])

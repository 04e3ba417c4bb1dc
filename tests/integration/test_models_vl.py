"""Vision-language policies in megatron: tiny random Qwen2.5-VL (contiguous M-RoPE) and Qwen3-VL (interleaved M-RoPE,
DeepStack) give transformers' logits and gradients (language model and vision tower, fp32) at TP=1 and TP=2 on the
pooled gloo ranks, for a batch of two right-padded sequences with three images of different sizes; the export back to
HF is bit-identical to transformers' checkpoint; M-RoPE positions equal transformers' get_rope_index.
"""

from __future__ import annotations

import os

import pytest
import torch

KINDS = ("qwen2_5_vl", "qwen3_vl")


def _images():
    from PIL import Image, ImageDraw

    out = []
    for i, (w, h) in enumerate([(112, 112), (56, 84), (84, 56)]):
        im = Image.new("RGB", (w, h), "white")
        d = ImageDraw.Draw(im)
        for k in range(i + 1):
            d.ellipse((4 + 14 * k, 4 + 8 * k, 24 + 14 * k, 24 + 8 * k), fill=["red", "blue", "green"][k % 3])
        out.append(im)
    return out


def _samples(proc):
    """Two processed samples (batch 1 each): one image, then two images of other sizes."""
    ims = _images()
    contents = [
        ([{"type": "image"}, {"type": "text", "text": "How many circles?"}], ims[:1], "3"),
        (
            [
                {"type": "text", "text": "Sum: "},
                {"type": "image"},
                {"type": "text", "text": " and "},
                {"type": "image"},
            ],
            ims[1:],
            "12",
        ),
    ]
    out = []
    for content, images, answer in contents:
        text = proc.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True) + answer
        out.append(dict(proc(images=images, text=[text], return_tensors="pt")))
    return out


def _saved_name(kind: str, name: str) -> str:
    """transformers' in-memory parameter name -> the name save_pretrained writes."""
    if kind == "qwen2_5_vl":
        name = name.replace("model.language_model.", "model.").replace("model.visual.", "visual.")
    return name


def _seq_logprob(logits, ids, lengths):
    """Sum over the rows of the log-probs of each row's real next tokens."""
    lp = torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    keep = torch.arange(ids.shape[1] - 1)[None] < (torch.tensor(lengths)[:, None] - 1)
    return (lp * keep).sum()


def _batch(samples, pad_id: int, image_token_id: int, merge: int) -> dict:
    """The two samples right-padded into one megatron batch: ids [2, s], M-RoPE positions [3, 2, s], image mask, and
    the images' pixel values / grids in batch-major order."""
    from megatron_rlvr.models.mrope import rope_index

    lengths = [s["input_ids"].shape[1] for s in samples]
    s_max = max(lengths)
    ids = torch.full((len(samples), s_max), pad_id, dtype=torch.long)
    pos = torch.arange(s_max).expand(3, len(samples), s_max).clone()
    for r, smp in enumerate(samples):
        ids[r, : lengths[r]] = smp["input_ids"][0]
        pos[:, r, : lengths[r]] = rope_index(smp["input_ids"][0] == image_token_id, smp["image_grid_thw"], merge)
    return dict(
        ids=ids,
        lengths=lengths,
        position_ids=pos,
        image_mask=ids == image_token_id,
        pixel_values=torch.cat([s["pixel_values"] for s in samples]),
        image_grid_thw=torch.cat([s["image_grid_thw"] for s in samples]),
    )


@pytest.fixture(scope="module")
def vl_models(tmp_path_factory):
    """{kind: (folder, megatron batch, reference logits per sample, reference grads by saved HF name)}."""
    from transformers import AutoModelForImageTextToText

    from megatron_rlvr.families.tiny_vl import save_tiny_vl
    from megatron_rlvr.families.vl_processor import load_vl_processor

    out = {}
    for i, kind in enumerate(KINDS):
        folder = save_tiny_vl(tmp_path_factory.mktemp(kind), kind, seed=11 + i)
        proc = load_vl_processor(folder)
        hf = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
        samples = _samples(proc)
        hf.zero_grad()
        logits = []
        for smp in samples:
            lg = hf(**smp).logits
            _seq_logprob(lg, smp["input_ids"], [smp["input_ids"].shape[1]]).backward()
            logits.append(lg.detach()[0])
        grads = {_saved_name(kind, n): p.grad.detach().clone() for n, p in hf.named_parameters()}
        merge = hf.config.vision_config.spatial_merge_size
        batch = _batch(samples, proc.tokenizer.pad_token_id, hf.config.image_token_id, merge)
        out[kind] = (folder, batch, logits, grads)
    return out


def _rank_vl(models: dict, export_root: str | None) -> dict:
    """Build each model at the pool's TP, load the HF folder, forward + backward the padded batch through megatron's
    DDP; the reduced gradients gathered to HF names by the export path, the 1-D-position control, and optionally the
    export."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megatron_rlvr.megatron.policy import wrap_ddp
    from megatron_rlvr.models.build import build_gpt_model
    from megatron_rlvr.models.export import export_hf, iter_hf_tensors
    from megatron_rlvr.models.hf_config import megatron_model_args
    from megatron_rlvr.models.hf_loading import load_hf_weights

    pg = ProcessGroupCollection.use_mpu_process_groups()
    out = {}
    for kind, (folder, b, _, _) in models.items():
        args = megatron_model_args(folder, tp_size=pg.tp.size())
        model = build_gpt_model(args, pg_collection=pg)
        load_hf_weights(model, args, folder, pg_collection=pg)
        ddp = wrap_ddp(model, distributed_optimizer=False)
        ddp.zero_grad_buffer()
        vision = dict(pixel_values=b["pixel_values"], image_grid_thw=b["image_grid_thw"], image_mask=b["image_mask"])
        logits = gather_from_tensor_model_parallel_region(ddp(b["ids"], b["position_ids"], None, **vision))
        logits = logits[..., : args.dims.vocab_size]
        # data-parallel rank d weighs its loss by d + 1: the averaged gradient is (dp + 1) / 2 times the reference's
        # only if every parameter, the tower's included, is reduced over data parallel
        (_seq_logprob(logits, b["ids"], b["lengths"]) * (pg.dp.rank() + 1)).backward()
        finalize_model_grads([ddp])  # megatron's reductions: DP, and the q/k norms' partial sums over TP
        saved = {n: p.data for n, p in model.named_parameters()}
        for p in model.parameters():
            p.data = p.main_grad.to(p.dtype) / ((pg.dp.size() + 1) / 2)
        grads = {k: v.clone() for k, v in iter_hf_tensors(model, args, pg_collection=pg)}
        for n, p in model.named_parameters():
            p.data = saved[n]
        with torch.no_grad():
            flat = torch.arange(b["ids"].shape[1])[None].expand(b["ids"].shape[0], -1)
            control = gather_from_tensor_model_parallel_region(model(b["ids"], flat, None, **vision))
        if export_root is not None:
            export_hf(model, args, os.path.join(export_root, kind), source_dir=folder, pg_collection=pg)
        out[kind] = {
            "logits": logits.detach(),
            "control": control[..., : args.dims.vocab_size],
            "grads": grads,
            "tower_params": sum(1 for n, _ in model.named_parameters() if n.startswith("visual.")),
        }
    return out


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _saved_tensors(folder: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(folder, "model.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_vl_logits_and_grads_match_transformers(dist_pool, vl_models, tmp_path, tp):
    export_root = str(tmp_path) if tp == 2 else None
    r0 = dist_pool.run(_rank_vl, tp=tp, args=(vl_models, export_root), timeout=400)[0]
    for kind, (folder, b, ref_logits, ref_grads) in vl_models.items():
        got = r0[kind]
        errs = [_rel(got["logits"][r, :n], ref_logits[r]) for r, n in enumerate(b["lengths"])]
        control = max(_rel(got["control"][r, :n], ref_logits[r]) for r, n in enumerate(b["lengths"]))
        grads = got["grads"]
        assert sorted(grads) == sorted(ref_grads), kind
        worst = {
            part: max((_rel(grads[k], ref_grads[k]), k) for k in ref_grads if ("visual." in k) == (part == "tower"))
            for part in ("tower", "lm")
        }
        print(f"{kind} tp={tp}: logits {max(errs):.1e}, 1-D positions {control:.1e}, worst grads {worst}")
        assert max(errs) < 1e-5, (kind, errs)
        assert control > 1e-2, (kind, control)  # the positions matter: the test sees a wrong M-RoPE
        assert worst["tower"][0] < 1e-4 and worst["lm"][0] < 1e-4, (kind, worst)
        if export_root is not None:  # bit-identical to transformers' own checkpoint, processor files copied
            src, dst = _saved_tensors(folder), _saved_tensors(os.path.join(export_root, kind))
            assert sorted(src) == sorted(dst), kind
            assert [k for k in src if not torch.equal(src[k], dst[k])] == [], kind
            assert os.path.isfile(os.path.join(export_root, kind, "processor_config.json"))


def test_rope_index_matches_transformers(tmp_path):
    """The pure M-RoPE positions equal transformers' get_rope_index for both families, images of three sizes."""
    from transformers import AutoModelForImageTextToText

    from megatron_rlvr.families.tiny_vl import save_tiny_vl
    from megatron_rlvr.families.vl_processor import load_vl_processor
    from megatron_rlvr.models.mrope import rope_index

    for kind in KINDS:
        folder = save_tiny_vl(tmp_path / kind, kind)
        proc = load_vl_processor(folder)
        hf = AutoModelForImageTextToText.from_pretrained(folder)
        for smp in _samples(proc):
            want, _ = hf.model.get_rope_index(smp["input_ids"], smp["mm_token_type_ids"], smp["image_grid_thw"])
            got = rope_index(smp["input_ids"][0] == proc.image_token_id, smp["image_grid_thw"], 2)
            assert torch.equal(got, want[:, 0]), kind
        with pytest.raises(ValueError, match="image grids"):
            rope_index(smp["input_ids"][0] == proc.image_token_id, smp["image_grid_thw"][:1], 2)


def _rank_to_megatron(models: dict, root: str) -> None:
    from megatron_rlvr.models.convert import to_megatron_on_rank

    for kind, (folder, _, _, _) in models.items():
        to_megatron_on_rank(folder, os.path.join(root, kind, "ckpt"))


def _rank_to_hf(models: dict, root: str) -> None:
    from megatron_rlvr.models.convert import to_hf_on_rank

    for kind in models:
        to_hf_on_rank(os.path.join(root, kind, "ckpt"), os.path.join(root, kind, "hf"), max_shard_bytes=200_000)


@pytest.mark.slow
def test_vl_convert_reshards_and_round_trips_bit_identical(dist_pool, vl_models, tmp_path):
    """HF -> megatron checkpoint at TP=2 -> HF at TP=1 (sharded files): every tensor, the tower's included,
    bit-identical to transformers' checkpoint; the processor files follow."""
    from safetensors.torch import load_file

    dist_pool.run(_rank_to_megatron, tp=2, args=(vl_models, str(tmp_path)), timeout=300)
    dist_pool.run(_rank_to_hf, tp=1, args=(vl_models, str(tmp_path)), timeout=300)
    for kind, (folder, _, _, _) in vl_models.items():
        out = tmp_path / kind / "hf"
        dst = {}
        for f in sorted(os.listdir(out)):
            if f.endswith(".safetensors"):
                dst.update(load_file(os.path.join(out, f)))
        src = _saved_tensors(folder)
        assert sorted(src) == sorted(dst), kind
        assert [k for k in src if not torch.equal(src[k], dst[k])] == [], kind
        assert (out / "processor_config.json").is_file(), kind

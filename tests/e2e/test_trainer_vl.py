"""The trainer on a vision-language policy (``configs/tiny_vl.yaml``: a 2-layer Qwen2.5-VL with a 2-block vision tower,
the visual_count task) in-process on the shared 4-rank gloo pool: it learns to count the circles of an image with the
transformers engine at TP = 2; CPGD, MCPO and GRPO run two steps each on both VL families; micro-batches carry the
images, their image mask and M-RoPE positions, with and without row packing."""

import math
import os

import pytest
import torch
import trainer_helpers

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(REPO, "configs", "tiny_vl.yaml")


@pytest.mark.slow
def test_tiny_vl_learns_to_count(dist_pool, tmp_path):
    """TP = 2, DP = 2: answering one digit always is right half of the time; reading the image is needed for a mean
    reward >= 0.8 over the last 5 of 25 steps, and for both counts to be answered right most of the time."""
    overrides = [*trainer_helpers.QUIET, "launch.nproc=4", "schedule.steps=25"]
    codes = dist_pool.run(
        trainer_helpers.train_runs, tp=2, args=(CONFIG, str(tmp_path), {"learn": []}, overrides), timeout=900
    )[0]
    assert codes == {"learn": 0}
    rewards = [r["reward/mean"] for r in trainer_helpers.records(tmp_path / "learn")]
    print("tiny_vl rewards:", [round(r, 2) for r in rewards])
    assert sum(rewards[:5]) / 5 <= 0.3, rewards[:5]
    assert sum(rewards[-5:]) / 5 >= 0.8, rewards
    last = trainer_helpers.records(tmp_path / "learn")[-5:]
    for level in ("1", "2"):  # not one digit for every image
        assert sum(r[f"accuracy/level_{level}"] for r in last) / 5 >= 0.7, (level, last)


@pytest.mark.slow
def test_tiny_vl_with_the_vllm_engine_agrees_with_the_trainer(dist_pool, tmp_path):
    """rollout.engine=vllm on the tiny VL policy: after every step's weight sync (tower included) vLLM's log-probs
    of its samples equal the trainer's recomputed ones (megatron, with the images and M-RoPE positions). Skipped
    without vLLM unless MEGATRON_RLVR_REQUIRE_VLLM=1."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        if os.environ.get("MEGATRON_RLVR_REQUIRE_VLLM") == "1":
            pytest.fail("MEGATRON_RLVR_REQUIRE_VLLM=1 but vllm is not importable")
        pytest.skip("vllm is not installed")
    overrides = [*trainer_helpers.QUIET, "launch.nproc=4", "schedule.steps=4", "rollout.engine=vllm"]
    codes = dist_pool.run(
        trainer_helpers.train_runs, tp=2, args=(CONFIG, str(tmp_path), {"vllm": []}, overrides), timeout=600
    )[0]
    assert codes == {"vllm": 0}
    recs = trainer_helpers.records(tmp_path / "vllm")
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    worst = max(r["mismatch/abs_prob_diff_max"] for r in recs)
    print(f"tiny_vl with vLLM: max |p_vllm - p_trainer| over 4 steps {worst:.1e}")
    assert worst < 1e-4, [r["mismatch/abs_prob_diff_max"] for r in recs]
    assert recs[-1]["reward/mean"] > recs[0]["reward/mean"]


@pytest.mark.slow
def test_vl_presets_run_two_steps(dist_pool, tmp_path):
    """CPGD (policy drift), MCPO (mastered prompts, hinge KL) and GRPO on Qwen2.5-VL and Qwen3-VL (interleaved
    M-RoPE, DeepStack), packed rows for one of them: finite losses, a gradient, each algorithm's own metrics; the
    vision tower trains with the language model, and stays at its start weights with model.freeze_vision."""
    runs = {
        "cpgd": ["algorithm.preset=cpgd"],
        "mcpo": ["algorithm.preset=mcpo"],
        "grpo": ["algorithm.preset=grpo"],
        "grpo_qwen3_vl": ["algorithm.preset=grpo", "model.name=tiny_vl3", "train.pack_sequences=true"],
        "frozen": ["algorithm.preset=grpo", "model.freeze_vision=true"],
    }
    overrides = [
        *trainer_helpers.QUIET,
        "schedule.steps=2",
        "train.prompts_per_step=4",
        "train.mini_batch_prompts=2",
        "rollout.n=4",
        "launch.nproc=4",
    ]
    runs = {k: [*v, "checkpoint.export_hf=true"] if k in ("grpo", "frozen") else v for k, v in runs.items()}
    codes = dist_pool.run(trainer_helpers.train_runs, tp=2, args=(CONFIG, str(tmp_path), runs, overrides), timeout=600)[
        0
    ]
    assert codes == {n: 0 for n in runs}
    for name in runs:
        recs = trainer_helpers.records(tmp_path / name)
        assert [r["step"] for r in recs] == [1, 2], name
        trained = [r for r in recs if r.get("train/updates", 0) >= 1]
        assert trained, f"{name}: no update in two steps"
        for r in trained:
            assert math.isfinite(r["loss/total"]) and r["train/skipped_nonfinite"] == 0, name
            if r["adv/abs_mean"] > 0:
                assert r["optim/grad_norm"] > 0, name
    assert any("drift/kl" in r for r in trainer_helpers.records(tmp_path / "cpgd"))
    assert any("mcpo/hinge_kl" in r for r in trainer_helpers.records(tmp_path / "mcpo"))
    # the exported policies against the start weights: the tower trains, and stays put with model.freeze_vision
    from safetensors.torch import load_file

    from megatron_rlvr.families.tiny import tiny_hf_config
    from megatron_rlvr.megatron.policy import TINY_VISION_STD, random_hf_state_dict

    start = random_hf_state_dict(tiny_hf_config(name="tiny_vl"), 1234, vision_std=TINY_VISION_STD)
    moved = {}
    for name in ("grpo", "frozen"):
        end = load_file(str(tmp_path / name / "hf" / "model.safetensors"))
        assert sorted(end) == sorted(start), name
        moved[name] = {
            part: sum(not torch.equal(end[k], start[k]) for k in start if k.startswith("visual.") == (part == "tower"))
            for part in ("tower", "lm")
        }
    assert moved["grpo"]["tower"] > 0 and moved["grpo"]["lm"] > 0, moved
    assert moved["frozen"]["tower"] == 0 and moved["frozen"]["lm"] > 0, moved


def test_vl_config_refuses_pipeline_parallel_and_freeze_without_tower():
    from megatron_rlvr.config import load_run_config
    from megatron_rlvr.config.run import ConfigError, check_layout

    with pytest.raises(ConfigError, match="vision-language policies .* parallel.pp=1"):
        check_layout(load_run_config(CONFIG, ["parallel.pp=2", "parallel.tp=1"]), 2)
    with pytest.raises(ConfigError, match="model.freeze_vision=true needs a vision-language model"):
        check_layout(load_run_config(CONFIG, ["model.name=tiny", "model.freeze_vision=true"]), 2)
    check_layout(load_run_config(CONFIG, ["model.freeze_vision=true"]), 2)


def _vision(n_images, seed):
    from megatron_rlvr.trainer.microbatch import VisionInputs

    g = torch.Generator().manual_seed(seed)
    grid = torch.tensor([[1, 4, 4]] * n_images)
    P = 3 + 4 * n_images
    mask = torch.zeros(P, dtype=torch.bool)
    for k in range(n_images):
        mask[1 + 4 * k : 5 + 4 * k] = True
    return VisionInputs(torch.randn(16 * n_images, 6, generator=g), grid, mask, 2)


def test_microbatch_carries_images_packed_and_unpacked():
    """Unpacked and packed micro-batches of the same sequences: the same image tokens, pixel values in the order of
    their tokens in [b, s], and each sequence's M-RoPE positions (from 0 at its own start) wherever it is placed."""
    from megatron_rlvr.models.mrope import rope_index
    from megatron_rlvr.trainer.microbatch import Sequence, build_microbatch

    seqs = []
    for i, n in enumerate([1, 0, 2]):
        v = _vision(n, i) if n else None
        P = 3 + 4 * n
        seqs.append(Sequence(tokens=list(range(10, 10 + P + 2 + i)), prompt_len=P, vision=v))
    flat = build_microbatch(seqs, 3, 16, 0)
    assert flat.position_ids.shape == (3, 3, 16) and flat.image_mask.shape == (3, 16)
    assert torch.equal(flat.pixel_values, torch.cat([seqs[0].vision.pixel_values, seqs[2].vision.pixel_values]))
    packed = build_microbatch(seqs, 2, 16, 0, rows=[[2], [0, 1]])
    assert torch.equal(packed.pixel_values, torch.cat([seqs[2].vision.pixel_values, seqs[0].vision.pixel_values]))
    assert torch.equal(packed.image_grid_thw, torch.tensor([[1, 4, 4]] * 3))
    for j, q in enumerate(seqs):
        m = torch.zeros(q.length, dtype=torch.bool)
        if q.vision is not None:
            m[: q.prompt_len] = q.vision.prompt_image_mask
        want = rope_index(m, None if q.vision is None else q.vision.image_grid_thw, 2)
        assert torch.equal(flat.position_ids[:, j, : q.length], want)
        assert torch.equal(flat.image_mask[j, : q.length], m)
        where = packed.unpack[j, : q.length]  # flat positions in the packed [b * s] layout
        assert torch.equal(packed.position_ids.reshape(3, -1)[:, where], want)
        assert torch.equal(packed.image_mask.reshape(-1)[where], m)
    assert int(packed.image_mask.sum()) == int(flat.image_mask.sum()) == 12
    text_only = build_microbatch([seqs[1]], 1, 16, 0)
    assert text_only.position_ids.shape == (1, 16) and text_only.pixel_values is None

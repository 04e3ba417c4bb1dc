"""``megatron-rlvr train`` with LoRA, end to end on CPU: the tiny preset (2 ranks, TP = 2, MCPO, transformers
engine, merged sync) with adapters on every target of a frozen random base, then ``convert to-hf`` of its last
checkpoint into a merged HF folder and a PEFT folder.

The base is the tiny architecture drawn with transformers' init at initializer_range 0.2: at the preset's 0.02 the
frozen LM head's rows are so short that no adapter can give a logit margin above ~2 (reward stays near chance
whatever the adapters learn); full fine-tuning trains the head, LoRA cannot. The run is the recipe docs/lora.md shows
(lr 5e-3 with a cosine decay, a 0.01 entropy bonus, 150 steps: final reward >= 0.998 at seeds 1-5): the mean training
reward of the last 5 steps must reach 0.95 (a random policy is right ~6% of the time)."""

import json
import os
import subprocess
import sys

import torch
import trainer_helpers

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 150


def _cmd(*args):
    return [sys.executable, "-m", "megatron_rlvr.commands.cli", *args]


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def test_tiny_lora_run_learns_and_converts(tmp_path):
    from megatron_rlvr.families.tiny import save_tiny_tokenizer, tiny_hf_config

    base = tmp_path / "base"
    base.mkdir()
    cfg = tiny_hf_config()
    cfg["initializer_range"] = 0.2
    (base / "config.json").write_text(json.dumps(cfg))
    tok = save_tiny_tokenizer(base / "tokenizer")
    run = tmp_path / "run"
    proc = subprocess.run(
        _cmd(
            "train",
            f"logging.run_dir={run}",
            f"schedule.steps={STEPS}",
            "model.name=tiny-lora",
            f"model.hf_config={base}",
            f"model.tokenizer={tok}",
            "model.lora.rank=16",
            "model.lora.alpha=32",
            *trainer_helpers.DENSE_TINY,  # the task this run was sized for (the preset's exact_stop is sparser)
            "optimizer.lr=5e-3",
            "schedule.lr_decay=cosine",
            "algorithm.entropy.coef=0.01",
        ),
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward/mean"] for r in recs]
    assert len(rewards) == STEPS
    assert sum(rewards[-5:]) / 5 >= 0.95, rewards
    assert all(r["mismatch/abs_prob_diff_max"] < 1e-4 for r in recs)  # the engine runs the merged adapters
    ckpt = run / "checkpoints" / f"step_{STEPS:09d}"
    meta = json.loads((ckpt / "rlvr_meta.json").read_text())
    assert meta["lora"]["rank"] == 16 and meta["lora_base"] is None  # a random base, rebuilt from its seed

    out, peft = tmp_path / "merged", tmp_path / "peft"
    conv = subprocess.run(
        _cmd("convert", "to-hf", "--ckpt", str(ckpt), "--out", str(out), "--adapter-out", str(peft)),
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert conv.returncode == 0, conv.stdout[-3000:] + conv.stderr[-3000:]
    from safetensors.torch import load_file

    from megatron_rlvr.megatron.policy import random_hf_state_dict
    from megatron_rlvr.models.lora import read_peft_folder

    pcfg, t = read_peft_folder(str(peft))
    merged = load_file(str(out / "model.safetensors"))
    exported = load_file(str(run / "hf" / "model.safetensors"))  # the run's own end-of-training export
    scale = pcfg["lora_alpha"] / pcfg["r"]
    for name, w in random_hf_state_dict(meta["hf_config"], meta["lora_base_seed"]).items():
        stem = "base_model.model." + name.removesuffix(".weight")
        a = t.get(f"{stem}.lora_A.weight")
        want = w + scale * t[f"{stem}.lora_B.weight"] @ a if a is not None else w
        assert (merged[name] - want).abs().max() < 1e-6, name
        assert torch.equal(merged[name], exported[name]), name

"""``megatron-rlvr eval MODEL --files F [F ...]``: avg@k and pass@k (unbiased) of an HF model folder (or a run
directory's exported ``hf/``) on jsonl/parquet benchmarks, one table row per file. One process with the transformers
engine (CPU, or one GPU); rewards in worker processes with per-item timeouts, as in training."""

from __future__ import annotations

import json
import os
import sys


def resolve_model_dir(path: str) -> str:
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    hf = os.path.join(path, "hf")
    if os.path.isfile(os.path.join(hf, "config.json")):
        return hf
    raise ValueError(
        f"{path} is neither an HF model folder nor a run directory with an exported hf/ folder (train with "
        "checkpoint.export_hf=true, or export a checkpoint with `megatron-rlvr convert`)"
    )


def eval_main(ns) -> int:
    import torch

    from megatron_rlvr.data import DataConfig, load_dataset
    from megatron_rlvr.rewards import RewardConfig, RewardManager
    from megatron_rlvr.rollout.hf_engine import HFEngineConfig, HFRolloutEngine
    from megatron_rlvr.trainer.evaluation import bench_name, evaluate_examples, format_table, summarize

    try:
        model_dir = resolve_model_dir(ns.model)
        for f in ns.files:
            if not os.path.isfile(f):
                raise ValueError(f"--files: not found: {f}")
        if ns.k < 1:
            raise ValueError(f"--k must be >= 1, got {ns.k}")
        data_kwargs = {"template": ns.template}
        if ns.prompt_template:
            data_kwargs["prompt_template"] = ns.prompt_template
        data_cfg = DataConfig(**data_kwargs)
        reward_cfg = RewardConfig(fn=ns.reward, extraction=ns.extraction, num_workers=1)
    except ValueError as e:
        print(f"megatron-rlvr eval: error: {e}", file=sys.stderr)
        return 2

    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32 if device == "cpu" else torch.bfloat16)
    eos = None
    try:
        eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    except OSError:
        pass
    engine = HFRolloutEngine(
        model, tokenizer, config=HFEngineConfig(max_batch_rows=ns.batch_rows, device=device), eos_token_ids=eos
    )
    results = []
    with RewardManager(reward_cfg) as rm:
        for path in ns.files:
            ds = load_dataset([path], "auto", False)
            examples = list(ds.examples)[: ns.max_problems] if ns.max_problems else list(ds.examples)
            correct, lengths = evaluate_examples(
                engine,
                rm,
                tokenizer,
                data_cfg,
                examples,
                k=ns.k,
                temperature=ns.temperature,
                top_p=ns.top_p,
                max_tokens=ns.max_tokens,
                max_prompt_len=ns.max_prompt_len,
                seed=ns.seed,
            )
            results.append(summarize(bench_name(path), correct, lengths))
            print(f"  {results[-1].name}: {results[-1].problems} problems done", file=sys.stderr, flush=True)
    engine.close()
    print(f"model: {model_dir}  (k={ns.k}, temperature={ns.temperature}, top_p={ns.top_p})")
    print(format_table(results))
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump([r.__dict__ for r in results], f, indent=2)
    return 0

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


TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""One of these in a folder means it has a tokenizer (without one transformers can silently build an empty one)."""

EVAL_DEFAULTS = {"reward": "math", "extraction": "boxed", "template": "chat", "prompt_template": None}


def run_settings(model_path: str) -> dict:
    """The reward / extraction / template settings of the run MODEL belongs to (its config.yaml: MODEL itself or
    the folder above an exported hf/), or {} when it is not a run's export."""
    import yaml

    for d in (model_path, os.path.dirname(os.path.abspath(model_path))):
        path = os.path.join(d, "config.yaml")
        if os.path.isfile(path):
            try:
                with open(path) as f:
                    cfg = yaml.safe_load(f) or {}
            except (OSError, yaml.YAMLError):
                return {}
            reward, data = cfg.get("reward") or {}, cfg.get("data") or {}
            out = {
                "reward": reward.get("fn"),
                "extraction": reward.get("extraction"),
                "template": data.get("template"),
                "prompt_template": data.get("prompt_template"),
            }
            return {k: v for k, v in out.items() if v is not None}
    return {}


def resolve_settings(ns) -> tuple[dict, list[str]]:
    """Explicit flags, else the run's own settings, else the eval defaults; plus notes on what came from the run."""
    run = run_settings(ns.model)
    out, notes = {}, []
    for key, default in EVAL_DEFAULTS.items():
        given = getattr(ns, key, None)
        if given is not None:
            out[key] = given
        elif key in run:
            out[key] = run[key]
            notes.append(f"{key.replace('_', '-')}={run[key]!r}")
        else:
            out[key] = default
    return out, notes


def check_tokenizer(model_dir: str, tokenizer_dir: str | None) -> str:
    d = tokenizer_dir or model_dir
    if not any(os.path.isfile(os.path.join(d, n)) for n in TOKENIZER_MARKERS):
        flag = "--tokenizer" if tokenizer_dir else "MODEL"
        raise ValueError(
            f"{flag} {d} has no tokenizer files ({', '.join(TOKENIZER_MARKERS)}): copy the base model's tokenizer "
            "there, or pass --tokenizer DIR (a tiny-model export: re-export it with `megatron-rlvr convert to-hf`, "
            "which now writes the tokenizer)"
        )
    return d


def check_out_path(out: str) -> None:
    """``--out`` can be written: checked before the model is loaded, not after the whole evaluation."""
    parent = os.path.dirname(os.path.abspath(out))
    if os.path.isdir(out):
        raise ValueError(f"--out {out} is a directory; give a file name (e.g. {os.path.join(out, 'eval.json')})")
    if not os.path.isdir(parent):
        raise ValueError(f"--out {out}: the folder {parent} does not exist")
    if not os.access(out if os.path.exists(out) else parent, os.W_OK):
        raise ValueError(f"--out {out}: not writable")


def eval_main(ns) -> int:
    import torch

    from megatron_rlvr.data import DataConfig, load_dataset
    from megatron_rlvr.eval.benchmarks import bench_name, evaluate_examples, format_table, summarize
    from megatron_rlvr.rewards import RewardConfig, RewardManager
    from megatron_rlvr.rollout.hf_engine import HFEngineConfig, HFRolloutEngine

    try:
        model_dir = resolve_model_dir(ns.model)
        for f in ns.files:
            if not os.path.isfile(f):
                raise ValueError(f"--files: not found: {f}")
        if ns.k < 1:
            raise ValueError(f"--k must be >= 1, got {ns.k}")
        for flag, value in (("--max-tokens", ns.max_tokens), ("--max-prompt-len", ns.max_prompt_len)):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if getattr(ns, "batch_rows", 1) < 1:
            raise ValueError(f"--batch-rows must be >= 1, got {ns.batch_rows}")
        if not ns.temperature >= 0:
            raise ValueError(f"--temperature must be >= 0 (0: greedy), got {ns.temperature}")
        if not 0 < ns.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1], got {ns.top_p}")
        tok_dir = check_tokenizer(model_dir, getattr(ns, "tokenizer", None))
        settings, notes = resolve_settings(ns)
        data_kwargs = {"template": settings["template"]}
        if settings["prompt_template"]:
            data_kwargs["prompt_template"] = settings["prompt_template"]
        data_cfg = DataConfig(**data_kwargs)
        reward_cfg = RewardConfig(fn=settings["reward"], extraction=settings["extraction"], num_workers=1)
        # before the model is loaded and anything generated: the benchmark rows and the --out path
        benchmarks = [(path, load_dataset([path], "auto", False)) for path in ns.files]
        if ns.out:
            check_out_path(ns.out)
    except ValueError as e:
        print(f"megatron-rlvr eval: error: {e}", file=sys.stderr)
        return 2
    if notes:
        print(f"megatron-rlvr eval: using the run's settings: {', '.join(notes)}", file=sys.stderr, flush=True)

    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
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
        for path, ds in benchmarks:
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

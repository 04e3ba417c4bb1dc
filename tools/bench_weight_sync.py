#!/usr/bin/env python
"""Benchmark: stream a ~0.5B-parameter random model (Qwen2-0.5B shapes, bf16) from TP=2 megatron shards into the
transformers rollout engine on each of 2 gloo ranks, and in the same run time a plain copy of the same bytes.

- sync: ``engine.update_weights(stream_hf_weights(...))``: plan, TP all-gathers, inverse QKV / gate-up layouts and
  vocab un-padding from the mapping table, buckets, the engine's in-place copies. Bytes = the HF tensors each engine
  receives (the whole model).
- copy: the same number of bytes moved the plainest way over the same transport: each rank all-gathers its flat
  shard bytes in the same bucket-sized messages into a preallocated buffer and copies them once into the engine's
  storage (no mapping, layouts, metadata or per-tensor calls). ``sync_over_copy`` is the stream's efficiency
  against that floor (target >= 0.5). ``memcpy_gbps`` (a single in-memory copy) is printed for context.

Runs on a 2-core CPU machine in a few minutes (``--layers`` / ``--hidden`` shrink the model). On a GPU machine the
same code runs on CPU tensors too (it measures the stream, not the accelerator). Last line: ``key=value`` pairs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def qwen2_05b_like(layers: int, hidden: int) -> dict:
    """Qwen2-0.5B's shapes (hidden 896, 24 layers, 14 heads, 2 KV heads, FFN 4864, vocab 151936, tied)."""
    heads = 14 if hidden % 14 == 0 else 8
    return dict(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        vocab_size=151936,
        hidden_size=hidden,
        intermediate_size=int(hidden * 4864 / 896) // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        eos_token_id=151643,
        bos_token_id=151643,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )


def _rank(cfg_dict: dict, bucket_bytes: int, rounds: int) -> dict:
    import torch
    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection
    from transformers import AutoModelForCausalLM, Qwen2Config

    from megatron_rlvr.models.build import build_gpt_model
    from megatron_rlvr.models.hf_config import megatron_model_args
    from megatron_rlvr.models.mapping import WeightMapping
    from megatron_rlvr.rollout.hf_engine import HFRolloutEngine
    from megatron_rlvr.rollout.weight_stream import StreamStats, WeightStreamConfig, stream_hf_weights

    torch.set_num_threads(1)  # 2 ranks on 2 cores
    pg = ProcessGroupCollection.use_mpu_process_groups()
    cfg = Qwen2Config(**cfg_dict)
    args = megatron_model_args(cfg, tp_size=pg.tp.size(), pp_size=1, dtype=torch.bfloat16, perform_initialization=False)
    model = build_gpt_model(args)
    g = torch.Generator().manual_seed(dist.get_rank())
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).mul_(0.02).to(p.dtype))
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    hf.to_empty(device="cpu")  # weights arrive through the stream; no generation here
    hf.tie_weights()  # to_empty re-creates parameters: restore the tied LM head
    engine = HFRolloutEngine(hf)
    mapping = WeightMapping(args.dims)
    n_params = sum(p.numel() for p in hf.parameters())

    def sync_once() -> tuple[float, StreamStats]:
        st = StreamStats()
        dist.barrier()
        t0 = time.perf_counter()
        engine.update_weights(
            stream_hf_weights(
                model, mapping, tp_group=pg.tp, pp_group=pg.pp, config=WeightStreamConfig(bucket_bytes), stats=st
            )
        )
        dist.barrier()
        return time.perf_counter() - t0, st

    # plain copy: the same bytes, flat, same transport and message sizes, written once into a destination buffer
    shard = torch.cat([p.detach().reshape(-1).view(torch.uint8) for p in model.parameters()])
    tp = pg.tp.size()
    per_msg = max(1, bucket_bytes // tp)
    staging = torch.empty(min(per_msg, shard.numel()) * tp, dtype=torch.uint8)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # same call as the stream
    flat_dst = None

    def copy_once(total: int) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        written = 0
        for s in range(0, shard.numel(), per_msg):
            piece = shard[s : s + per_msg]
            out = staging[: piece.numel() * tp]
            gather(out, piece, group=pg.tp)
            n = min(out.numel(), total - written)
            flat_dst[written : written + n].copy_(out[:n])
            written += n
        dist.barrier()
        return time.perf_counter() - t0

    # interleaved rounds, so that load from other processes hits both measurements alike
    sync_times, copy_times, stats = [], [], None
    for _ in range(rounds):
        dt, stats = sync_once()
        sync_times.append(dt)
        if flat_dst is None:
            flat_dst = torch.empty(stats.bytes, dtype=torch.uint8)
        copy_times.append(copy_once(stats.bytes))
    total = stats.bytes

    # spot check: this rank's embedding rows arrived unchanged (bit for bit)
    local = dict(model.named_parameters())["module.embedding.word_embeddings.weight"]
    start = pg.tp.rank() * local.shape[0]
    rows = max(0, min(local.shape[0], args.dims.vocab_size - start))
    exact = bool(torch.equal(hf.get_input_embeddings().weight[start : start + rows], local[:rows]))
    src = torch.empty_like(flat_dst)
    t0 = time.perf_counter()
    flat_dst.copy_(src)
    memcpy_s = time.perf_counter() - t0
    return dict(
        params=n_params,
        bytes=total,
        sync_s=statistics.median(sync_times),
        copy_s=statistics.median(copy_times),
        memcpy_s=memcpy_s,
        peak=stats.meter.peak_bytes,
        largest=stats.largest_tensor_bytes,
        buckets=stats.buckets,
        tensors=stats.tensors,
        exact=exact,
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=896)
    ap.add_argument("--bucket-mb", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3, help="timed repetitions (median reported)")
    ap.add_argument("--timeout", type=float, default=900)
    a = ap.parse_args()

    from megatron_rlvr.testing.distributed import run_distributed

    cfg = qwen2_05b_like(a.layers, a.hidden)
    t0 = time.perf_counter()
    res = run_distributed(_rank, 2, tp=2, args=(cfg, a.bucket_mb << 20, a.rounds), timeout=a.timeout)
    wall = time.perf_counter() - t0
    r0 = res[0]
    sync_s = max(r["sync_s"] for r in res)
    copy_s = max(r["copy_s"] for r in res)
    gb = r0["bytes"] / 1e9
    out = dict(
        params_m=round(r0["params"] / 1e6, 1),
        bytes_gb=round(gb, 3),
        tensors=r0["tensors"],
        buckets=r0["buckets"],
        bucket_mb=a.bucket_mb,
        sync_s=round(sync_s, 3),
        copy_s=round(copy_s, 3),
        sync_gbps=round(gb / sync_s, 3),
        copy_gbps=round(gb / copy_s, 3),
        sync_over_copy=round(copy_s / sync_s, 3),
        memcpy_gbps=round(gb / max(r["memcpy_s"] for r in res), 3),
        peak_buffer_mb=round(max(r["peak"] for r in res) / 2**20, 1),
        bound_mb=round(((a.bucket_mb << 20) + r0["largest"]) / 2**20, 1),
        bit_exact=all(r["exact"] for r in res),
        wall_s=round(wall, 1),
    )
    print(" ".join(f"{k}={v}" for k, v in out.items()))
    return 0 if out["bit_exact"] and max(r["peak"] for r in res) <= (a.bucket_mb << 20) + r0["largest"] else 1


if __name__ == "__main__":
    sys.exit(main())

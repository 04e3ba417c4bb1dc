"""Memory and time of one training step with context parallelism: CP = 1 against CP = 2 (CP = 4 with ``--cp4``) at
growing sequence lengths, on gloo ranks of this machine.

The work: a dense GQA model of the tiny family's shape (hidden 64, 2 layers, 4 query / 2 KV heads of 16, SwiGLU FFN
128, the character vocabulary; ``max_position_embeddings`` set to the longest length), fp32, no recompute, one
sequence of L tokens (a 1/8 prompt, advantage 1) per data-parallel rank, and one step of the trainer's own update
(``trainer.update.policy_update``: DAPO's token-mean loss, the behaviour log-probs from the same forward, backward,
megatron's DDP gradient reduction over data x context parallel, Adam). Every layout runs on 2 ranks (4 with
``--cp4``): CP = 1 is DP = 2, each rank training its own copy of the L-token sequence (what one GPU of a CP = 1 run
holds); CP = 2 splits the one sequence over the two ranks (zig-zag chunks). Each (length, CP) runs in freshly forked
ranks, so the process-lifetime peak RSS is that step's.

What is measured, per rank (the largest over the ranks is reported):

    act_mem   bytes of the distinct tensors autograd saves for backward during the step (a saved-tensor hook sees
              each; parameters are left out): the activation memory CP divides. Exact and device independent.
    rss_peak  the rank's peak resident memory during the step (ru_maxrss) minus its resident memory just before:
              everything the step allocated at once on this CPU (activations, logits, gradients, Adam's state on
              the first step, allocator slack), an upper bound measured by the kernel.
    step_s    wall time of a second, identical step (the first pays one-time costs).

Without Transformer Engine (CPU) the CP attention all-gathers keys and values and megatron's local attention
materialises the [L/cp, L] softmax per head, which it saves for backward: act_mem grows as L^2 at large L, and CP
halves that term; the gathered keys and values are saved at the full length. On GPUs Transformer Engine's flash
attention saves no L^2 term (and rings keys and values instead of gathering them), so there act_mem is linear in L;
this tool does not run there.

The last lines, per length L:

    bench_context_parallel L=<L> cp1_act_mib=.. cp2_act_mib=.. act_mem_cp2_over_cp1=.. rss_cp2_over_cp1=..
        step_s_cp1=.. step_s_cp2=.. [act_mem_cp4_over_cp1=..] growth_cp1=.. growth_cp2=..

growth_cpN is act_mem at L over act_mem at the previous (half) length: 2 for linear, 4 for quadratic growth.

    PYTHONPATH=$PWD .venv/bin/python tools/bench_context_parallel.py --max-len 4096     # 1k, 2k, 4k: a few minutes
    PYTHONPATH=$PWD .venv/bin/python tools/bench_context_parallel.py --cp4              # 1k..16k, CP 1, 2, 4
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LENGTHS = (1024, 2048, 4096, 8192, 16384)
MIB = 1024**2


def _model_config(max_len: int) -> dict:
    from megatron_rlvr.families.tiny import tiny_hf_config

    return {
        **tiny_hf_config(),
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": max_len,
    }


def _step_rank(length: int, max_len: int) -> dict:
    """On every rank of the current layout: two identical training steps on one L-token sequence per data-parallel
    rank; the first measured for memory, the second for time."""
    import psutil
    import torch
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_rlvr.algorithms import preset
    from megatron_rlvr.config import OptimizerConfig, ParallelConfig, ScheduleConfig
    from megatron_rlvr.megatron.policy import build_model, build_optimizer, wrap_ddp
    from megatron_rlvr.models.hf_config import megatron_model_args
    from megatron_rlvr.models.source import ModelSource
    from megatron_rlvr.rollout.mismatch import MismatchCorrectionConfig
    from megatron_rlvr.trainer.batch import TrainBatch
    from megatron_rlvr.trainer.microbatch import Sequence
    from megatron_rlvr.trainer.token_loss import StatsSpec
    from megatron_rlvr.trainer.update import UpdateSettings, policy_update

    pg = ProcessGroupCollection.use_mpu_process_groups()
    cp, dp = pg.cp.size(), pg.dp.size()
    hf = _model_config(max_len)
    args = megatron_model_args(hf, tp_size=1, pp_size=1, cp_size=cp)
    model = wrap_ddp(build_model(args, ModelSource(hf, None, None, True), seed=5, pg=pg), distributed_optimizer=False)
    par = ParallelConfig(cp=cp, distributed_optimizer=False)
    optimizer, _ = build_optimizer(model, OptimizerConfig(lr=1e-4), ScheduleConfig(steps=10), par, "float32")
    ctx = UpdateSettings(
        algo=preset("dapo"),
        spec=StatsSpec(
            tp_group=None,
            vocab_size=args.dims.vocab_size,
            temperature=1.0,
            chunk_size=1024,
            cp_group=pg.cp if cp > 1 else None,
        ),  # fmt: skip
        pg=pg,
        device=torch.device("cpu"),
        pad_id=0,
        micro_batch_tokens=length,
        seq_multiple=2 * cp if cp > 1 else 1,
        n_per_group=dp,
        num_mini_batches=1,
        ppo_epochs=1,
        correction=MismatchCorrectionConfig(tis_cap=None),
        skip_nonfinite=False,
    )
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(3, args.dims.vocab_size, (length,), generator=g).tolist()
    seqs = tuple(
        Sequence(tokens=tokens, prompt_len=length // 8, adv=1.0 if i % 2 == 0 else -1.0, rollout_logprobs=[])
        for i in range(dp)
    )
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            saved[s.data_ptr()] = max(saved.get(s.data_ptr(), 0), s.nbytes())
        return t

    me = psutil.Process()

    def step():
        return policy_update(ctx, model, optimizer, TrainBatch(sequences=seqs, old_from_first_forward=True))

    rss0 = me.memory_info().rss
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    assert out.metrics["train/updates"] == 1.0, out.metrics
    t0 = time.perf_counter()
    step()
    return {
        "act_mem": sum(saved.values()),
        "rss_peak": max(0, peak - rss0),
        "step_s": time.perf_counter() - t0,
        "loss": out.metrics.get("loss/total", float("nan")),
    }


def run(lengths: list[int], cps: list[int], world: int, timeout: float) -> dict:
    """{(L, cp): {act_mem, rss_peak, step_s}}, the largest over ranks, each in freshly forked ranks."""
    from megatron_rlvr.testing.distributed import DistributedPool

    results = {}
    max_len = max(lengths)
    for L in lengths:
        for cp in cps:
            with DistributedPool(world) as pool:
                per_rank = pool.run(_step_rank, cp=cp, args=(L, max_len), timeout=timeout)
            r = {k: max(x[k] for x in per_rank) for k in ("act_mem", "rss_peak", "step_s")}
            results[L, cp] = r
            print(
                f"L={L} cp={cp}: act_mem {r['act_mem'] / MIB:.1f} MiB, rss_peak {r['rss_peak'] / MIB:.1f} MiB, "
                f"step {r['step_s']:.2f} s",
                flush=True,
            )
    return results


def summary(results: dict, lengths: list[int], cps: list[int]) -> list[str]:
    lines = []
    for j, L in enumerate(lengths):
        a1, a2 = results[L, 1]["act_mem"], results[L, 2]["act_mem"]
        r1, r2 = results[L, 1]["rss_peak"], results[L, 2]["rss_peak"]
        line = (
            f"bench_context_parallel L={L} cp1_act_mib={a1 / MIB:.1f} cp2_act_mib={a2 / MIB:.1f} "
            f"act_mem_cp2_over_cp1={a2 / a1:.3f} rss_cp2_over_cp1={r2 / max(r1, 1):.3f} "
            f"step_s_cp1={results[L, 1]['step_s']:.2f} step_s_cp2={results[L, 2]['step_s']:.2f}"
        )
        if 4 in cps:
            line += f" act_mem_cp4_over_cp1={results[L, 4]['act_mem'] / a1:.3f}"
        if j > 0:
            prev = lengths[j - 1]
            line += " " + " ".join(
                f"growth_cp{c}={results[L, c]['act_mem'] / results[prev, c]['act_mem']:.2f}" for c in cps
            )
        lines.append(line)
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-len", type=int, default=LENGTHS[-1], help="longest sequence length (of 1k, 2k, .., 16k)")
    ap.add_argument("--lengths", type=str, default=None, help="comma-separated lengths instead (multiples of 8)")
    ap.add_argument("--cp4", action="store_true", help="also CP = 4 (4 ranks for every layout)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per (length, CP) run")
    a = ap.parse_args(argv)
    lengths = [int(x) for x in a.lengths.split(",")] if a.lengths else [L for L in LENGTHS if L <= a.max_len]
    if not lengths or any(L <= 0 or L % 8 for L in lengths):
        print(f"error: --lengths / --max-len: positive multiples of 8 needed, got {lengths}", file=sys.stderr)
        return 2
    cps = [1, 2, 4] if a.cp4 else [1, 2]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("PYTHONWARNINGS", "ignore")  # the ranks' Apex / deprecation notices, once per process
    if REPO not in sys.path:
        sys.path.append(REPO)
    results = run(lengths, cps, 4 if a.cp4 else 2, a.timeout)
    for line in summary(results, lengths, cps):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())

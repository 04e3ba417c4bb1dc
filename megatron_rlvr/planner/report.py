"""The planner's output (the per-GPU memory table, the layout search) and ``megatron-rlvr plan``'s command line."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
from collections.abc import Sequence

from megatron_rlvr.families.table import MEGATRON_VOCAB_DIVISIBLE_BY
from megatron_rlvr.planner.inputs import load_plan_config, run_dir_config
from megatron_rlvr.planner.memory import (
    GIB,
    LOGITS_CHUNK_FACTOR,
    MemoryPlan,
    PlanConfig,
    cp_comm_bytes_per_layer,
    estimate_memory,
)

# ----------------------------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------------------------


def _g(x: float) -> str:
    return f"{x / GIB:8.2f}"


_DTYPE_SHORT = {"bfloat16": "bf16", "float32": "fp32"}


def format_plan(plan: MemoryPlan) -> str:
    """Human-readable table (GiB per GPU) with the verdict and reasons."""
    lines = _header_lines(plan)
    if plan.errors:
        lines.append("INVALID LAYOUT:")
        lines += [f"  - {e}" for e in plan.errors]
        return "\n".join(lines)
    cfg = plan.config
    m, par, tr = cfg.model, cfg.parallel, cfg.train
    lines.append(
        f"sizes   micro-batch {cfg.micro_batch_tokens} tokens (max seq {cfg.max_model_len}), vocab {m.vocab} -> "
        f"padded {m.padded_vocab(par.tp)} (multiple of {MEGATRON_VOCAB_DIVISIBLE_BY} x TP), recompute={tr.recompute}"
    )
    lines.append("")
    lines.append(f"{'GiB per GPU':<58}{'':>8}")
    phase = f"training ranks: {plan.train_ranks} GPUs" if plan.disaggregated else "training phase"
    lines.append(f"-- {phase} (pipeline stage {plan.worst_stage} of {par.pp}, the largest) " + "-" * 12)
    lines += [f"  {label:<56}{_g(v)}" for label, v in _training_rows(plan)]
    lines.append(
        f"  {'= training peak' + (' per training rank' if plan.disaggregated else ''):<56}{_g(plan.train_peak)}"
    )
    lines += _rollout_lines(plan)
    lines += _cp_comm_lines(plan)
    lines.append("")
    lines += _verdict_lines(plan)
    return "\n".join(lines)


def _header_lines(plan: MemoryPlan) -> list[str]:
    """The model, cluster and layout lines (with the MoE, vision-tower and disaggregation details) and warnings."""
    cfg = plan.config
    m, par, ro, cl = cfg.model, cfg.parallel, cfg.rollout, cfg.cluster
    engine = "vLLM" if cfg.engine == "vllm" else "transformers"
    lines = [
        f"model   {m.name} ({cfg.dtype}): {m.param_count() / 1e9:.2f} B params, L={m.layers} h={m.hidden} f={m.ffn} "
        f"heads={m.heads} kv_heads={m.kv_heads} d={m.head_dim} V={m.vocab}",
        f"cluster {cl.nodes} node(s) x {cl.gpus_per_node} GPUs x {cl.gpu_mem_gb:g} GiB = world {plan.world_size}",
        f"layout  TP={par.tp}{f' CP={par.cp}' if par.cp > 1 else ''} PP={par.pp} DP={plan.dp} "
        f"SP={'on' if cfg.sequence_parallel else 'off'} | rollout "
        f"TP={par.rollout_tp} ({plan.engines} {engine} engines"
        f"{', rollout.engine=auto' if ro.engine == 'auto' else ''})",
    ]
    if plan.disaggregated:
        lines[2] += (
            f"\n        disaggregated: {plan.train_ranks} training ranks (TP x PP x DP) + {par.rollout_ranks} rollout "
            f"ranks ({plan.engines} engines), rollout.max_staleness={ro.max_staleness}"
        )
    if m.is_moe:
        lines[0] += (
            f"\n        MoE: {m.n_moe_layers} of {m.layers} layers, {m.experts} experts (f_e={m.expert_ffn}), "
            f"top-{m.top_k}"
            f"{f', shared expert f={m.shared_expert_ffn}' if m.shared_expert_ffn else ''}: "
            f"{m.active_param_count() / 1e9:.2f} B params active per token"
        )
        lines[2] += f"\n        experts: EP={par.ep} ETP={par.expert_tp} expert-DP={plan.edp} ({par.moe_dispatcher})"
    if m.vision is not None:
        v = m.vision
        lines[0] += (
            f"\n        vision tower {v.kind}: {v.param_count() / 1e6:.0f} M params (depth={v.depth} h={v.hidden} "
            f"f={v.ffn}), {'trained' if cfg.trains_vision else 'frozen'}, whole on each GPU of pipeline stage 0; "
            f"{cfg.image_patches_per_micro_batch} patches per micro-batch"
        )
    if cfg.teacher is not None:
        t = cfg.teacher
        # forward ~2 FLOPs per parameter per token, against ~6 for the policy's forward + backward
        share = 2 * t.active_param_count() / (6 * m.active_param_count())
        when = "in every update forward (full-vocabulary KL)" if cfg.teacher_logits else "once per step"
        lines.append(
            f"distill teacher {t.name}: {t.param_count() / 1e9:.2f} B params, frozen at the policy's layout; its "
            f"forward costs ~{share:.2f}x the policy's training compute per token, {when}"
        )
    lines += [f"warning: {w}" for w in plan.warnings]
    return lines


def _training_rows(plan: MemoryPlan) -> list[tuple[str, float]]:
    """(label, bytes) of each term of the training peak on the worst pipeline stage."""
    cfg = plan.config
    m, par, ro, tr = cfg.model, cfg.parallel, cfg.rollout, cfg.train
    c = plan.components
    dt = _DTYPE_SHORT[cfg.dtype]
    T = -(-cfg.micro_batch_tokens // par.cp)  # context parallelism: this GPU's share of the micro-batch's tokens
    vp = m.padded_vocab(par.tp)
    p = plan.stage_param_counts[plan.worst_stage]
    dp_div = plan.dp * par.cp if par.distributed_optimizer else 1  # megatron shards over data x context parallel
    opt = "Adam m,v (8 B/param" if cfg.dtype == "float32" else "fp32 master + Adam m,v (12 B/param"
    dp_name = "DPxCP" if par.cp > 1 else "DP"
    rows = [
        (f"weights {dt} ({p / 1e9:.3f} B params on this GPU)", c["weights"]),
        ("main grads fp32 (4 B/param)", c["grads"]),
        (f"{opt} / {dp_name}={dp_div})", c["optimizer"]),
    ]
    if m.is_moe:
        e = plan.stage_expert_param_counts[plan.worst_stage]
        edp_div = plan.edp if par.distributed_optimizer else 1
        rows[0] = (f"weights bf16 ({p / 1e9:.3f} B params, {e / 1e9:.3f} B in experts)", c["weights"])
        rows[2] = (f"fp32 master + Adam m,v (12 B/param / {dp_name}={dp_div}, experts / {edp_div})", c["optimizer"])
    if cfg.keeps_ref_model:
        rows.append((f"reference model {dt}", c["ref_model"]))
    if cfg.teacher is not None:
        rows.append((f"distillation teacher {cfg.teacher.name} {dt} (frozen)", c["teacher"]))
    mark_n = " <-" if tr.recompute == "none" else ""
    mark_f = " <-" if tr.recompute == "full" else ""
    rows += [
        (f"activations, no recompute{mark_n}", c["act_none"]),
        (f"activations, full recompute{mark_f}", c["act_full"]),
        (f"logits [{T} x {vp // par.tp}] {dt} + grad", c["logits"]),
        (
            f"logits chunk work [{min(tr.logits_chunk, T)} x {vp // par.tp}] fp32 x{LOGITS_CHUNK_FACTOR}",
            c["logits_chunk"],
        ),
    ]
    if cfg.teacher_logits:
        rows.append((f"teacher logits [{T} x {vp // par.tp}] {dt} (full-vocabulary KL)", c["teacher_logits"]))
    rows += [
        ("framework (CUDA context, NCCL, fragmentation)", c["train_overhead"]),
    ]
    if m.vision is not None and plan.worst_stage == 0:
        vision_total = c["vision_weights"] + c["vision_state"] + c["vision_activations"]
        rows.append(("  of which the vision tower (weights, grads + Adam, act.)", vision_total))
    if not plan.disaggregated:  # a disaggregated training rank holds no engine
        if cfg.engine == "vllm":
            rows.append((f"vLLM asleep (level {ro.sleep_level}, residual)", c["engine_in_training"]))
        else:
            rows.append((f"transformers engine weights {dt} (resident)", c["engine_in_training"]))
    return rows


_CP_EXCHANGE = {
    "p2p": "ring p2p: K, V passed on cp - 1 times; backward K, V and dK, dV",
    "all_gather": "K, V all-gathered; backward dK, dV reduce-scattered",
    "a2a": "all-to-all of Q, K, V and the output; backward the same on gradients",
}


def _cp_comm_lines(plan: MemoryPlan) -> list[str]:
    """With cp > 1: what one GPU sends per layer per micro-batch for the context-parallel attention
    (``cp_comm_bytes_per_layer``), and per micro-batch over its pipeline stage's layers."""
    cfg = plan.config
    par = cfg.parallel
    if par.cp == 1:
        return []
    v = cp_comm_bytes_per_layer(cfg)
    mib = 1024**2
    n_local = cfg.model.layers // par.pp
    rec = f" + recompute {v.recompute / mib:.1f}" if v.recompute else ""
    return [
        f"-- context parallelism CP={par.cp}, cp_comm_type={par.cp_comm_type} ({_CP_EXCHANGE[par.cp_comm_type]}) "
        + "-" * 4,
        f"  sent per GPU per layer per micro-batch: forward {v.forward / mib:.1f} + backward {v.backward / mib:.1f}"
        f"{rec} = {v.total / mib:.1f} MiB; x {n_local} layers = {n_local * v.total / GIB:.2f} GiB per micro-batch",
    ]


def _rollout_lines(plan: MemoryPlan) -> list[str]:
    """The rollout section: its heading, each term of the rollout peak, and the peak."""
    cfg = plan.config
    par, ro = cfg.parallel, cfg.rollout
    c = plan.components
    dt = _DTYPE_SHORT[cfg.dtype]
    vllm = cfg.engine == "vllm"
    if not vllm:
        head = f"transformers engine, max_batch_rows={ro.max_batch_rows}"
    elif ro.kv_cache_gb is not None:
        head = f"vLLM TP={par.rollout_tp}, kv_cache_gb={ro.kv_cache_gb:g}"
    else:
        head = f"vLLM TP={par.rollout_tp}, gpu_memory_utilization={ro.gpu_memory_utilization:g}"
    where = f"rollout ranks: {par.rollout_ranks} GPUs, never asleep" if plan.disaggregated else "rollout phase"
    lines = [f"-- {where} ({head}) " + "-" * 8]
    kv_seqs = plan.kv_tokens / cfg.max_model_len
    off = " (offloaded)" if cfg.cluster.offload_during_rollout else ""
    rows = [] if plan.disaggregated else [(f"training state kept on GPU{off}", c["train_state_in_rollout"])]
    if vllm:
        whole = "util x GPU" if ro.kv_cache_gb is None else "weights + overhead + kv_cache_gb"
        rows += [
            (f"vLLM engine = {whole}, of which:", c["engine"]),
            (f"    weights {dt} (KV heads replicated if rtp > kv_heads)", c["engine_weights"]),
            ("    activations, CUDA graphs, sampler (assumed)", c["engine_overhead"]),
        ]
    else:
        rows += [
            ("transformers engine, of which:", c["engine"]),
            (f"    weights {dt} (whole model on every rank)", c["engine_weights"]),
        ]
    rows += [
        (f"    KV cache {dt}: {plan.kv_tokens} tokens = {kv_seqs:.1f} seqs of {cfg.max_model_len}", c["kv_cache"]),
        ("framework (CUDA context, NCCL, fragmentation)", c["train_overhead"]),
    ]
    lines += [f"  {label:<56}{_g(v)}" for label, v in rows]
    lines.append(
        f"  {'= rollout peak' + (' per rollout rank' if plan.disaggregated else ''):<56}{_g(plan.rollout_peak)}"
    )
    return lines


def _verdict_lines(plan: MemoryPlan) -> list[str]:
    """Host RAM for vLLM's sleep, the peak against the usable memory, FITS / DOES NOT FIT and the reasons."""
    cfg = plan.config
    ro, cl = cfg.rollout, cfg.cluster
    lines = []
    if cfg.engine == "vllm" and ro.sleep_level == 1 and not plan.disaggregated:
        ram = plan.components["host_ram_per_node"] / GIB
        lines.append(f"host RAM per node for vLLM sleep level 1 weight backup: {ram:.1f} GiB")
    verdict = "FITS" if plan.fits else "DOES NOT FIT"
    if plan.disaggregated:
        lines.append(
            f"per role: training ranks {plan.train_peak / GIB:.1f} GiB, rollout ranks {plan.rollout_peak / GIB:.1f} "
            "GiB per GPU"
        )
    lines.append(
        f"peak {plan.peak / GIB:.1f} GiB per GPU of {plan.limit / GIB:.1f} usable "
        f"({cl.gpu_mem_gb:g} GiB x {cl.usable_fraction:g}): {verdict}"
    )
    lines += [f"  - {r}" for r in plan.reasons]
    return lines


def _with_nodes(cfg: PlanConfig, nodes: int) -> PlanConfig:
    return dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, nodes=nodes))


def smallest_fitting_nodes(cfg: PlanConfig, max_nodes: int = 128) -> MemoryPlan | None:
    """Plan at the smallest node count (1..max_nodes) where the layout is valid and fits; None if none does."""
    for n in range(1, max_nodes + 1):
        plan = estimate_memory(_with_nodes(cfg, n))
        if plan.fits:
            return plan
    return None


SEARCH_CP = (1, 2, 4, 8)
"""Context-parallel sizes ``search_layouts`` tries for dense text models (the others are planned at cp=1)."""


def search_layouts(cfg: PlanConfig) -> list[MemoryPlan]:
    """Every valid (tp, cp, pp, rollout_tp) with tp, rollout_tp <= GPUs per node and cp in ``SEARCH_CP`` (dense text
    models; others keep cp=1), sorted: fitting first, then no context parallelism before any (CP exchanges keys and
    values in every layer, so it is chosen only when no cp=1 layout fits: a sequence too long for the memory
    otherwise), then the smaller model-parallel size tp x cp x pp (less communication, more DP), then less CP, then
    less PP (smaller pipeline bubble), then smaller rollout TP (more independent engines)."""
    gpn = cfg.cluster.gpus_per_node
    sizes = [t for t in (1, 2, 4, 8, 16) if t <= gpn]
    m = cfg.model
    dense_text = not m.is_moe and m.vision is None and m.mla is None
    cps = SEARCH_CP if dense_text else (1,)
    # MoE: every expert-parallel size that divides the experts (expert TP as configured); dense: ep as configured
    eps = [e for e in (1, 2, 4, 8, 16, 32, 64) if m.experts % e == 0] if m.is_moe else [cfg.parallel.ep]
    plans = []
    # GPT-OSS: megatron builds biased experts only at expert TP 1, so its layouts set parallel.etp=1 at every TP
    etp = 1 if m.is_moe and m.linear_bias else cfg.parallel.etp
    for tp, cp, pp, rtp, ep in itertools.product(sizes, cps, (1, 2, 4, 8), sizes, eps):
        try:
            par = dataclasses.replace(
                cfg.parallel, tp=tp, cp=cp, pp=pp, rollout_tp=rtp, ep=ep, etp=etp, sequence_parallel=None
            )
        except ValueError:
            continue
        plan = estimate_memory(dataclasses.replace(cfg, parallel=par))
        if not plan.errors:
            plans.append(plan)

    def rank(p: MemoryPlan):
        par = p.config.parallel
        return (not p.fits, par.cp > 1, par.tp * par.cp * par.pp, par.cp, par.pp, par.rollout_tp, -par.ep, p.peak)

    plans.sort(key=rank)
    return plans


def format_search(plans: list[MemoryPlan]) -> str:
    """The search table, best first; the first fitting row is marked as the layout the planner would choose. When
    disaggregated, ``train`` / ``rollout`` are a training rank's and a rollout rank's GPU (the rollout ranks' count
    is the config's: memory does not decide the balance of generation and training time). The ``cp`` column is
    shown when the search tried context parallelism (a dense text model)."""
    moe = bool(plans) and plans[0].config.model.is_moe
    m0 = plans[0].config.model if plans else None
    cp_col = m0 is not None and not m0.is_moe and m0.vision is None and m0.mla is None
    disagg = bool(plans) and plans[0].disaggregated
    ep_head = f" {'ep':>3}" if moe else ""
    eng_head = f" {'engines':>7}" if disagg else ""
    cp_head = f" {'cp':>3}" if cp_col else ""
    head = (
        f"{'tp':>3}{cp_head} {'pp':>3} {'rtp':>4} {'dp':>4}{ep_head}{eng_head} {'train':>7} {'rollout':>8} {'peak':>7}"
    )
    head += f" {'kv seqs':>8}  verdict"
    lines = [head + "   (GiB per GPU" + (": a training rank, a rollout rank, the larger)" if disagg else ")")]
    chosen = next((p for p in plans if p.fits), None)
    for p in plans:
        par = p.config.parallel
        seqs = p.kv_tokens / p.config.max_model_len
        why = "fits" if p.fits else "no: " + p.reasons[0].split(";")[0]
        ep = f" {par.ep:>3}" if moe else ""
        eng = f" {p.engines:>7}" if disagg else ""
        cp = f" {par.cp:>3}" if cp_col else ""
        lines.append(
            f"{par.tp:>3}{cp} {par.pp:>3} {par.rollout_tp:>4} {p.dp:>4}{ep}{eng} {p.train_peak / GIB:7.1f} "
            f"{p.rollout_peak / GIB:8.1f} {p.peak / GIB:7.1f} {seqs:8.1f}  {why}{'   <- chosen' if p is chosen else ''}"
        )
    if chosen is not None:
        par = chosen.config.parallel
        lines.append(
            f"chosen: tp={par.tp}{f' cp={par.cp}' if par.cp > 1 else ''} pp={par.pp} rollout_tp={par.rollout_tp}"
            + (f" ep={par.ep}" if moe else "")
            + (f" etp={par.etp}" if moe and m0.linear_bias else "")  # GPT-OSS: set it, etp unset means tp
            + " (fits"
            + (" with no context parallelism unless no cp=1 layout fits, then" if cp_col else "")
            + (" with the smallest tp x cp x pp, then the least cp" if cp_col else " with the smallest tp x pp")
            + ", then the least pp, then the smallest rollout TP: the most engines)"
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="megatron-rlvr plan",
        description="Validate a parallel layout and estimate per-GPU memory (training + colocated vLLM, or with "
        "parallel.rollout_ranks > 0 each role of the disaggregated layout).",
    )
    ap.add_argument("config", help="run-config YAML, HF config.json / folder, or a built-in model name")
    ap.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. parallel.tp=8")
    ap.add_argument(
        "--gpus-per-node", type=int, default=None, help="GPUs per node (default: cluster.gpus_per_node or 8)"
    )
    ap.add_argument("--gpu-mem-gb", type=float, default=None, help="GiB per GPU (default: cluster.gpu_mem_gb or 80)")
    ap.add_argument(
        "--nodes", type=int, default=None, help="node count (default: cluster.nodes, else the smallest that fits)"
    )
    ap.add_argument("--usable-fraction", type=float, default=None, help="share of GPU memory a plan may fill (0.92)")
    ap.add_argument(
        "--search",
        action="store_true",
        help="list every valid (tp, cp, pp, rollout_tp) for this allocation (cp: dense text models)",
    )
    return ap


def plan_main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``megatron-rlvr plan``; returns the exit status (0 fits, 1 refused, 2 bad input)."""
    args = _parser().parse_intermixed_args(list(sys.argv[1:] if argv is None else argv))
    cli = {
        k: v
        for k, v in (
            ("cluster.nodes", args.nodes),
            ("cluster.gpus_per_node", args.gpus_per_node),
            ("cluster.gpu_mem_gb", args.gpu_mem_gb),
            ("cluster.usable_fraction", args.usable_fraction),
        )
        if v is not None
    }
    try:
        cfg = load_plan_config(run_dir_config(args.config), list(args.overrides) + [f"{k}={v}" for k, v in cli.items()])
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if cfg.cluster.nodes is None:
        plan = smallest_fitting_nodes(cfg)
        if plan is None:
            print(format_plan(estimate_memory(_with_nodes(cfg, 1))))
            print("no node count up to 128 fits this layout", file=sys.stderr)
            return 1
        print(f"(--nodes not given: the smallest node count that fits is {plan.config.cluster.nodes})")
    else:
        plan = estimate_memory(cfg)
    if args.search:
        print(format_search(search_layouts(plan.config)))
        print()
    print(format_plan(plan))
    return 0 if plan.fits else 1

"""Benchmark the vocab-parallel token statistics against the naive path and megatron-core, on gloo CPU ranks.

    python tools/bench_vocab_parallel.py            # T=2048, V=151936 (Qwen2.5), TP=2, fp32 and bf16 (~5 min)
    python tools/bench_vocab_parallel.py --quick    # tiny shapes: a smoke run
    python tools/bench_vocab_parallel.py --impl eager   # only the eager implementation (the pre-compile benchmark)

Spawns TP gloo ranks (megatron parallel state initialised, CPU shims applied, 1 intra-op thread per rank: 2 ranks
on 2 cores) and measures, for each input dtype, forward + backward w.r.t. the logits shard of:

  (a) fused_logprob  vocab_parallel_token_stats(want=("logprob",))
  (b) fused_all4     vocab_parallel_token_stats(want=("logprob", "entropy", "margin", "kl")) vs reference logits
  (c) naive_all4     all-gather the full logits (and reference logits), then plain torch ops on [T, V]
  (d) megatron_ce    megatron.core.tensor_parallel.vocab_parallel_cross_entropy (= -logprob)
  (a') compiled_logprob, (b') compiled_all4: (a), (b) with impl="compiled" (torch.compile'd local math,
       megatron_rlvr/ops/compiled.py); --impl selects eager, compiled or both (default).

Compilation is timed separately: before the timed repeats every compiled method runs once at T and once at a
second length (T/2 + 1: shapes are dynamic, so this must not compile again); ``compile_s`` is the slowest rank's
time for that warm-up (it depends on the inductor cache in /tmp: first run cold, later runs warm),
``compiled_graphs`` the graphs compiled, and ``recompiles_after_warmup`` the graphs compiled during the timed and
memory runs and the memory scan at other lengths (must be 0).

Loss: a random per-token weight times each statistic (margin enters as a detached weight, as in MCPO).

Time: every repeat starts after a barrier; a repeat's time is the slowest rank's forward+backward time; the
reported time is the best of the repeats (timeit's convention: the least disturbed run on a shared machine). Wall
time, and each rank's user and system CPU time (``getrusage``; 1 intra-op thread per rank, gloo's threads
included), are reported. The headline ratios use USER CPU time. System time here is almost all the kernel's first
touch of freshly mmap'd tensors (every [T, V/tp] gradient is a new allocation: PyTorch's CPU allocator does not
cache), which a GPU's caching allocator never pays, and it is the noisiest number on this VM: the same 622 MiB
``torch.exp2(x)`` measured 0.14-0.21 s user but 0.08-1.16 s system across runs, while into an existing tensor it
took 0 s system. User time is what the op computes. In the table, "wall s", "user s" and "cpu s" (user +
sys) are the best repeat's, "median" the median repeat's wall time, and "sys s" the median repeat's system time
(how much faulting a typical repeat had). On a shared 2-core machine wall time also includes waiting
for a core. The user+sys ratios (``_cpu``) and the wall-time ratios (``_wall``) are printed alongside.
megatron's op overwrites its fp32 input in place, so it is handed a fresh copy made outside the timed region (in
training it consumes the output layer's logits; the copy is not its cost).

Peak extra memory: exact tensor bytes from PyTorch's own allocator accounting. A separate, untimed run per method
is recorded with ``torch.profiler.profile(profile_memory=True)``, which logs every CPU tensor allocation and free
(including temporaries inside ops and autograd buffers) with its byte count and timestamp; the running sum of those
events from the start of the call is the memory the call added on top of what existed before it (the inputs), and
its maximum is the peak extra memory. This counts exactly what the op holds, unlike process RSS, which the C
allocator rounds, caches and returns lazily. Reported per rank (max over ranks), in MiB; it includes the returned
gradient w.r.t. the logits shard ("grad"). "workspace" = peak extra - grad: what the op needs beyond its output,
which for the fused op stays flat in T (shown at two sequence lengths) while the naive path grows with T x V.

Allocator: on Linux a tensor larger than 32 MiB is a fresh mmap, and first-touching it costs page faults (measured
here: 0.35 s for one 622 MiB tensor with 4 KiB pages) - an artefact that GPU runs (caching allocator) do not have.
By default the ranks run with PyTorch's documented CPU setting ``THP_MEM_ALLOC_ENABLE=1`` (large allocations
2 MiB-aligned and backed by transparent huge pages: the same first touch costs ~0.05 s), applied identically to
every method; ``--system-malloc`` measures with 4 KiB pages instead. Memory numbers do not depend on this. (A glibc
"never return memory" heap was tried and rejected: it fragments under the naive path's multi-GiB tensors.)

Floors: in the same run, after the methods' repeats (in repeats of their own), three compiled primitives that each
make one pass over the shard, timed like the methods: ``floor_expsum`` (read x, one exponential per element, a
two-level sum: the least a log-sum-exp does), ``floor_expwrite`` (read x, one exponential per element, write a new
[T, V/tp] tensor: the least a gradient does) and ``floor_read`` (read the reference logits once). Log-prob cannot do
less than expsum + expwrite (its forward's normaliser and its backward's gradient); all four statistics cannot do
less than that plus an exponential pass over the reference logits (the KL needs their log-sum-exp) plus their second
read (the KL gradient needs log q): 2 x expsum + expwrite + read, without counting the margin's max or any sum beyond
the normaliser. Their ratio, ``all4_vs_logprob_floor``, is the least ``all4_vs_logprob`` an exact implementation
made of passes as fast as these can show on this machine once its log-prob runs at its floor; ``logprob_vs_floor``
and ``all4_vs_floor`` say how far each op is from its own.

The LAST line printed is ``key=value`` pairs: ``logprob_vs_megatron`` (time (a)/(d), lower is better),
``all4_vs_logprob`` (time (b)/(a)), ``all4_vs_megatron`` (time (b)/(d): all four statistics against megatron's
log-prob alone; no target, context for the ratio above), ``naive_mem_over_fused`` (peak extra memory (c)/(b),
higher is better), each for fp32 and bf16 (the un-suffixed keys are the worse of the two), and the fused call's
(b) peak extra memory and workspace at two sequence lengths. With the compiled implementation measured, the
un-suffixed time ratios are those of (a') and (b') (``all4_vs_logprob = b'/a'``, ``logprob_vs_megatron = a'/d``)
and the eager ones carry an ``_eager`` suffix; ``all4_compiled_vs_eager_logprob`` = b'/a.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:  # runnable as `python tools/bench_vocab_parallel.py` from a checkout
    sys.path.insert(0, _ROOT)

METHODS = ("fused_logprob", "fused_all4", "naive_all4", "megatron_ce")
COMPILED_METHODS = ("compiled_logprob", "compiled_all4")
ALL4 = ("logprob", "entropy", "margin", "kl")
MiB = 2.0**20


# ------------------------------------------------------------------------------------------- per-rank measurements
def _inputs(T, v_local, dtype, seed):
    import torch

    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, v_local, generator=g) * 2.0).to(dtype)
    ref = (x.float() + 0.3 * torch.randn(T, v_local, generator=g)).to(dtype)
    return x, ref


def _step(method, x, ref, ids, wts, group, vocab_size, chunk_size):
    """One forward + backward; returns the gradient w.r.t. this rank's logits shard."""
    import torch
    import torch.distributed as dist

    from megatron_rlvr.ops import vocab_parallel_token_stats

    impl = "compiled" if method.startswith("compiled_") else "eager"
    if method in ("fused_logprob", "compiled_logprob"):
        xl = x.detach().requires_grad_(True)
        out = vocab_parallel_token_stats(
            xl, tp_group=group, token_ids_T=ids, vocab_size=vocab_size, chunk_size=chunk_size, impl=impl
        )
        loss = (out["logprob"] * wts[0]).sum()
        return torch.autograd.grad(loss, xl)[0]
    if method in ("fused_all4", "compiled_all4"):
        xl = x.detach().requires_grad_(True)
        out = vocab_parallel_token_stats(
            xl,
            tp_group=group,
            token_ids_T=ids,
            other_logits_TV=ref,
            vocab_size=vocab_size,
            want=ALL4,
            chunk_size=chunk_size,
            impl=impl,
        )
        loss = ((wts[0] + out["margin"]) * out["logprob"] + wts[1] * out["entropy"] + wts[2] * out["kl"]).sum()
        return torch.autograd.grad(loss, xl)[0]
    if method == "naive_all4":
        tp, rank = dist.get_world_size(group), dist.get_rank(group)

        def gather(t):
            parts = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(parts, t.contiguous(), group=group)
            return torch.cat(parts, dim=-1)

        full = gather(x.detach()).requires_grad_(True)  # [T, V]
        logp = torch.log_softmax(full.float(), dim=-1)
        p = logp.exp()
        lp = logp.gather(1, ids[:, None]).squeeze(1)
        ent = -(p * logp).sum(-1)
        top = p.detach().topk(2, dim=-1).values
        margin = top[:, 0] - top[:, 1]
        logq = torch.log_softmax(gather(ref).float(), dim=-1)
        kl = (p * (logp - logq)).sum(-1)
        loss = ((wts[0] + margin) * lp + wts[1] * ent + wts[2] * kl).sum()
        v = x.shape[1]
        return torch.autograd.grad(loss, full)[0][:, rank * v : (rank + 1) * v].contiguous()
    if method.startswith("floor_"):
        return _floor_kernels()[method](x, ref)
    if method == "megatron_ce":
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        loss = vocab_parallel_cross_entropy(x, ids)  # x: a fresh copy requiring grad, see _prepare
        return torch.autograd.grad((loss * wts[0]).sum(), x)[0]
    raise ValueError(f"unknown method {method!r}")


_FLOORS = ("floor_expsum", "floor_expwrite", "floor_read")


def _floor_kernels():
    """The one-pass primitives of the floor (module docstring), compiled once per process (static shapes)."""
    if not hasattr(_floor_kernels, "fns"):
        import torch

        s2 = 1.4426950408889634  # log2(e): exponentials as exp2, as the ops compute them
        blk = 256

        def expsum(x, _ref):
            c, n = x.shape
            q = n // blk
            main = torch.exp2(x[:, : q * blk].reshape(c, q, blk).float() * s2).sum(-1).sum(-1)
            return main + torch.exp2(x[:, q * blk :].float() * s2).sum(-1)

        def expwrite(x, _ref):
            return (torch.exp2(x.float() * s2) * 0.5).to(x.dtype)

        def read(_x, ref):
            return ref.float().sum(-1)

        fns = {"floor_expsum": expsum, "floor_expwrite": expwrite, "floor_read": read}
        _floor_kernels.fns = {k: torch.compile(f, dynamic=False) for k, f in fns.items()}
    return _floor_kernels.fns


def _prepare(method, x):
    """megatron overwrites its (fp32) input: give it a private copy, made outside the measured region."""
    if method == "megatron_ce":
        return x.detach().clone().requires_grad_(True)
    return x


def _peak_extra_bytes(fn):
    """Peak of (bytes allocated - bytes freed) by CPU tensors while fn runs, from the profiler's allocator events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        keep = fn()
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns()
    )
    cur = peak = 0
    for e in events:
        cur += e.nbytes()
        peak = max(peak, cur)
    del keep
    return peak


def _user_sys() -> tuple[float, float]:
    """This process's user and system CPU seconds so far (all its threads: the compute thread and gloo's)."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime


def _bench_rank(cfg):
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    rank, tp = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    v_local = cfg["vocab"] // tp
    vocab_size = cfg["vocab"]
    T, T_naive = cfg["tokens"], cfg["naive_tokens"]
    res = {"time": {}, "user": {}, "sys": {}, "mem": {}, "grad_mib": {}, "scan": {}, "phase_s": {}, "floor_user": {}}
    clock = time.perf_counter()

    def phase(name):
        nonlocal clock
        now = time.perf_counter()
        res["phase_s"][name] = now - clock
        clock = now

    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, vocab_size, (max(T, *cfg["scan_tokens"]),), generator=g)
    wts_all = [torch.randn(ids.shape[0], generator=g) for _ in range(3)]

    def run(method, x, ref, t):
        return _step(method, x, ref, ids[:t], [w[:t] for w in wts_all], group, vocab_size, cfg["chunk_size"])

    def mib(t):
        return t.numel() * t.element_size() / MiB

    from megatron_rlvr.ops import compiled as ops_compiled

    compiled_methods = [m for m in cfg["methods"] if m.startswith("compiled_")]
    if compiled_methods:  # compile warm-up: at T and at a second length (dynamic shapes: no second graph)
        t0 = time.perf_counter()
        for dname in cfg["dtypes"]:
            x, ref = _inputs(T, v_local, getattr(torch, dname), seed=100 + rank)
            for t in (T, T // 2 + 1):
                for method in compiled_methods:
                    dist.barrier(group=group)
                    run(method, x[:t], ref[:t], t)
            del x, ref
        res["compile_s"] = time.perf_counter() - t0
        res["graphs_after_warmup"] = ops_compiled.compile_stats()["total_graphs"]
        res["compile_disabled"] = ops_compiled.disabled_reason()
        phase("compile warm-up")

    for dname in cfg["dtypes"]:
        dtype = getattr(torch, dname)
        x, ref = _inputs(T, v_local, dtype, seed=100 + rank)
        timed = list(cfg["methods"]) + list(cfg["floors"])
        tokens = {m: (T_naive if m == "naive_all4" else T) for m in timed}
        times = {m: [] for m in timed}
        users = {m: [] for m in timed}
        syss = {m: [] for m in timed}

        # Round-robin: each repeat runs every method once, so that a change in machine load hits all alike. Then the
        # floors, in repeats of their own: their fresh [T, V/tp] outputs between the methods would change the
        # methods' memory state. They are compiled first, outside the timing; without a working compiler, no floors.
        for stage in (cfg["methods"], cfg["floors"]):
            if stage is cfg["floors"] and stage:
                try:
                    for m in stage:
                        run(m, x, ref, T)
                except Exception as e:
                    res["floor_error"] = f"{type(e).__name__}: {str(e).strip()[:200]}"
                    break
            for i in range(cfg["warmup"] + cfg["repeats"]):
                for method in stage:
                    if method == "naive_all4":
                        continue  # the slow reference is timed by its one memory-profiled run below (no time target)
                    t = tokens[method]
                    xm = _prepare(method, x[:t])
                    dist.barrier(group=group)
                    t0, (u0, s0) = time.perf_counter(), _user_sys()
                    grad = run(method, xm, ref[:t], t)
                    dt, (u1, s1) = time.perf_counter() - t0, _user_sys()
                    del grad, xm
                    if i >= cfg["warmup"]:
                        times[method].append(dt)
                        users[method].append(u1 - u0)
                        syss[method].append(s1 - s0)
        phase(f"timed runs {dname}")
        for method in cfg["floors"]:
            if users[method]:
                res["floor_user"][f"{method}/{dname}"] = users[method]
        for method in cfg["methods"]:
            key = f"{method}/{dname}"
            t = tokens[method]
            res["time"][key] = times[method]
            res["user"][key] = users[method]
            res["sys"][key] = syss[method]
            xm = _prepare(method, x[:t])
            dist.barrier(group=group)
            t0, (u0, s0) = time.perf_counter(), _user_sys()
            res["mem"][key] = _peak_extra_bytes(lambda m=method, xm=xm, t=t, ref=ref: run(m, xm, ref[:t], t))
            if method == "naive_all4":
                u1, s1 = _user_sys()
                res["time"][key] = [time.perf_counter() - t0]
                res["user"][key], res["sys"][key] = [u1 - u0], [s1 - s0]
            res["grad_mib"][key] = mib(x[:t])
            del xm
        if T_naive != T:  # the fused op at the naive path's length, for a like-for-like memory ratio
            dist.barrier(group=group)
            ref_m = "fused_all4" if "fused_all4" in cfg["methods"] else "compiled_all4"
            res["mem"][f"{ref_m}@naive_T/{dname}"] = _peak_extra_bytes(
                lambda x=x, ref=ref, m=ref_m: run(m, x[:T_naive], ref[:T_naive], T_naive)
            )
        phase(f"memory runs {dname}")
        del x, ref
    # The full fused call's memory at two sequence lengths (bf16 keeps the long-T inputs within a small machine's
    # memory; only fused_all4, the superset, at the second length: the profiler's ~0.15 ms per op makes each
    # profiled long run cost tens of seconds on 2 cores).
    for Ts in cfg["scan_tokens"]:
        if Ts == T and cfg["scan_dtype"] in cfg["dtypes"]:  # measured above
            for method in [m for m in ("fused_all4", "compiled_all4") if m in cfg["methods"]]:
                key = f"{method}/{cfg['scan_dtype']}"
                res["scan"][f"{method}/T{Ts}"] = (res["mem"][key] / MiB, res["grad_mib"][key])
            continue
        x, ref = _inputs(Ts, v_local, getattr(torch, cfg["scan_dtype"]), seed=200 + rank)
        for method in [m for m in ("fused_all4", "compiled_all4") if m in cfg["methods"]]:
            dist.barrier(group=group)
            peak = _peak_extra_bytes(lambda m=method, x=x, ref=ref, Ts=Ts: run(m, x, ref, Ts))
            res["scan"][f"{method}/T{Ts}"] = (peak / MiB, mib(x))
        del x, ref
        phase(f"memory scan T={Ts}")
    if compiled_methods:
        res["recompiles"] = ops_compiled.compile_stats()["total_graphs"] - res["graphs_after_warmup"]
    return res


# ------------------------------------------------------------------------------------------------------ reporting
def _aggregate(per_rank, cfg):
    """Slowest rank per repeat, best repeat; largest rank memory."""
    out = {}
    for key in per_rank[0]["time"]:
        n_rep = len(per_rank[0]["time"][key])
        per_repeat = [max(r["time"][key][i] for r in per_rank) for i in range(n_rep)]
        user_repeat = [max(r["user"][key][i] for r in per_rank) for i in range(n_rep)]
        cpu_repeat = [max(r["user"][key][i] + r["sys"][key][i] for r in per_rank) for i in range(n_rep)]
        sys_repeat = [max(r["sys"][key][i] for r in per_rank) for i in range(n_rep)]
        out[key] = dict(
            best_s=min(per_repeat),
            median_s=statistics.median(per_repeat),
            user_s=min(user_repeat),
            cpu_s=min(cpu_repeat),
            sys_s=statistics.median(sys_repeat),
            peak_mib=max(r["mem"][key] for r in per_rank) / MiB,
            grad_mib=per_rank[0]["grad_mib"][key],
        )
    for key in per_rank[0]["floor_user"]:  # slowest rank per repeat, best repeat (as the methods' user time)
        n_rep = len(per_rank[0]["floor_user"][key])
        out.setdefault("_floors", {})[key] = min(max(r["floor_user"][key][i] for r in per_rank) for i in range(n_rep))
    for key in per_rank[0]["mem"]:
        if "@naive_T" in key:
            out[key] = dict(peak_mib=max(r["mem"][key] for r in per_rank) / MiB)
    out["_phases"] = {k: max(r["phase_s"][k] for r in per_rank) for k in per_rank[0]["phase_s"]}
    out["_floor_error"] = next((r["floor_error"] for r in per_rank if "floor_error" in r), None)
    if "compile_s" in per_rank[0]:
        out["_compile"] = dict(
            compile_s=max(r["compile_s"] for r in per_rank),
            compiled_graphs=max(r["graphs_after_warmup"] for r in per_rank),
            recompiles_after_warmup=max(r["recompiles"] for r in per_rank),
            disabled=next((r["compile_disabled"] for r in per_rank if r["compile_disabled"]), None),
        )
    scan = {k: max(r["scan"][k][0] for r in per_rank) for k in per_rank[0]["scan"]}
    scan_grad = {k: per_rank[0]["scan"][k][1] for k in per_rank[0]["scan"]}
    return out, scan, scan_grad


def _report(agg, scan, scan_grad, cfg, wall):
    hdr = f"{'method':<18}{'dtype':<10}{'wall s':>8}{'median':>8}{'user s':>8}{'sys s':>8}{'cpu s':>8}"
    hdr += f"{'peak extra MiB':>16}{'grad MiB':>10}"
    hdr += f"{'workspace MiB':>15}"
    print(
        f"\nvocab-parallel token stats: T={cfg['tokens']} V={cfg['vocab']} TP={cfg['tp']} "
        f"(V/tp={cfg['vocab'] // cfg['tp']}), forward+backward, best of {cfg['repeats']} round-robin repeats, "
        f"pages={'4 KiB (system)' if cfg['system_malloc'] else 'THP'}, chunk_size={cfg['chunk_size'] or 'auto'}"
    )
    if cfg["naive_tokens"] != cfg["tokens"]:
        print(
            f"naive_all4 runs at T={cfg['naive_tokens']} (its [T, V] fp32 tensors at T={cfg['tokens']} would not fit "
            f"this machine's memory for {cfg['tp']} ranks); its memory ratio is taken against fused_all4 at that T"
        )
    print(hdr)
    print("-" * len(hdr))
    for key, r in agg.items():
        if key.startswith("_"):
            continue
        method, dname = key.split("/")
        if "best_s" not in r:
            continue
        ws = r["peak_mib"] - r["grad_mib"]
        if method == "naive_all4":
            method = f"naive@T{cfg['naive_tokens']}*"
        print(
            f"{method:<18}{dname:<10}{r['best_s']:>8.3f}{r['median_s']:>8.3f}{r['user_s']:>8.3f}{r['sys_s']:>8.3f}"
            f"{r['cpu_s']:>8.3f}{r['peak_mib']:>16.1f}"
            f"{r['grad_mib']:>10.1f}{ws:>15.1f}"
        )
    print("* naive: one run, timed under the memory profiler (it has no time target)")
    print(f"\nfused_all4 peak extra memory vs sequence length ({cfg['scan_dtype']}; workspace = peak - grad):")
    for key, peak in scan.items():
        grad = scan_grad[key]
        print(f"  {key:<22} peak {peak:>9.1f} MiB   grad {grad:>9.1f} MiB   workspace {peak - grad:>7.1f} MiB")
    kv = {}
    # the headline time ratios are the compiled implementation's when it was measured, else the eager one's
    has_compiled = "compiled_all4" in cfg["methods"]
    has_eager = "fused_all4" in cfg["methods"]
    impls = ([("compiled_", "")] if has_compiled else []) + (
        [("fused_", "_eager" if has_compiled else "")] if has_eager else []
    )
    for dname in cfg["dtypes"]:

        def t(m, dname=dname, what="user_s"):
            return max(agg[f"{m}/{dname}"][what], 1e-6)  # clock ticks: a tiny (--quick) op may read 0 s

        for prefix, sfx in impls:
            lp, a4 = f"{prefix}logprob", f"{prefix}all4"
            kv[f"logprob_vs_megatron{sfx}_{dname}"] = t(lp) / t("megatron_ce")
            kv[f"all4_vs_logprob{sfx}_{dname}"] = t(a4) / t(lp)
            kv[f"all4_vs_megatron{sfx}_{dname}"] = t(a4) / t("megatron_ce")  # all four vs megatron's log-prob only
            for clock, what in (("_cpu", "cpu_s"), ("_wall", "best_s")):
                kv[f"logprob_vs_megatron{clock}{sfx}_{dname}"] = t(lp, what=what) / t("megatron_ce", what=what)
                kv[f"all4_vs_logprob{clock}{sfx}_{dname}"] = t(a4, what=what) / t(lp, what=what)
        if has_compiled and has_eager:
            kv[f"all4_compiled_vs_eager_logprob_{dname}"] = t("compiled_all4") / t("fused_logprob")
        floors = agg.get("_floors", {})
        if f"floor_expsum/{dname}" in floors:
            f_es, f_ew, f_rd = (max(floors[f"floor_{k}/{dname}"], 1e-6) for k in ("expsum", "expwrite", "read"))
            lp_floor, a4_floor = f_es + f_ew, 2 * f_es + f_ew + f_rd
            print(
                f"\nfloors ({dname}, user s): expsum {f_es:.3f}, expwrite {f_ew:.3f}, read {f_rd:.3f}; log-prob >= "
                f"{lp_floor:.3f}, all four >= {a4_floor:.3f}: all4_vs_logprob >= {a4_floor / lp_floor:.3f} for an "
                "exact implementation whose log-prob runs at its floor (passes as fast as these)"
            )
            kv[f"all4_vs_logprob_floor_{dname}"] = a4_floor / lp_floor
            lp_m, a4_m = impls[0][0] + "logprob", impls[0][0] + "all4"
            kv[f"logprob_vs_floor_{dname}"] = t(lp_m) / lp_floor
            kv[f"all4_vs_floor_{dname}"] = t(a4_m) / a4_floor
        mem_ref = "fused_all4" if has_eager else "compiled_all4"
        fused_key = f"{mem_ref}@naive_T/{dname}" if cfg["naive_tokens"] != cfg["tokens"] else f"{mem_ref}/{dname}"
        kv[f"naive_mem_over_fused_{dname}"] = agg[f"naive_all4/{dname}"]["peak_mib"] / agg[fused_key]["peak_mib"]
    for _, sfx in impls:
        for base in [f"{r}{c}" for c in ("", "_cpu", "_wall") for r in ("logprob_vs_megatron", "all4_vs_logprob")]:
            kv[f"{base}{sfx}"] = max(kv[f"{base}{sfx}_{d}"] for d in cfg["dtypes"])
        kv[f"all4_vs_megatron{sfx}"] = max(kv[f"all4_vs_megatron{sfx}_{d}"] for d in cfg["dtypes"])
    kv["naive_mem_over_fused"] = min(kv[f"naive_mem_over_fused_{d}"] for d in cfg["dtypes"])
    if all(f"all4_vs_logprob_floor_{d}" in kv for d in cfg["dtypes"]):
        for base in ("all4_vs_logprob_floor", "logprob_vs_floor", "all4_vs_floor"):
            kv[base] = max(kv[f"{base}_{d}"] for d in cfg["dtypes"])
    if "_compile" in agg:
        c = agg["_compile"]
        print(
            f"\ncompiled path: compile warm-up {c['compile_s']:.1f} s (slowest rank; 2 lengths x {len(cfg['dtypes'])}"
            f" dtypes), {c['compiled_graphs']} graphs, {c['recompiles_after_warmup']} recompiles after warm-up"
            + (f"; DISABLED (eager fallback): {c['disabled']}" if c["disabled"] else "")
        )
        kv["compile_s"] = c["compile_s"]
        kv["compiled_graphs"] = c["compiled_graphs"]
        kv["recompiles_after_warmup"] = c["recompiles_after_warmup"]
    if agg.get("_floor_error"):
        print(f"\nfloors not measured (their compilation failed: {agg['_floor_error']})")
    for key in scan:
        method, tlen = key.split("/")
        kv[f"{method}_workspace_mib_{tlen}"] = scan[key] - scan_grad[key]
        kv[f"{method}_peak_mib_{tlen}"] = scan[key]
    phases = ", ".join(f"{k} {v:.0f}s" for k, v in agg.get("_phases", {}).items())
    print(f"\nper-rank phases: {phases}")
    kv["naive_tokens"] = cfg["naive_tokens"]
    kv["wall_s"] = wall
    for key in ("logprob_vs_megatron", "all4_vs_logprob"):  # the headline ratios last
        kv[key] = kv.pop(key)
    print("\n" + " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in kv.items()))
    return kv


def _naive_tokens_that_fit(tokens: int, vocab: int, tp: int) -> int:
    """The naive path keeps ~8 fp32 [T, V] tensors alive per rank (measured: 4.6 MiB per token at V=151936):
    use the requested T if all ranks fit in 45% of the available memory, else the largest power of 2 that does."""
    per_token = 8 * vocab * 4 * tp * 1.2
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return tokens
    t = tokens
    while t > 16 and t * per_token > 0.45 * avail:
        t //= 2
    return t


def _methods(impl: str) -> tuple[str, ...]:
    eager = () if impl == "compiled" else ("fused_logprob", "fused_all4")
    comp = COMPILED_METHODS if impl in ("compiled", "both") else ()
    return eager + comp + ("naive_all4", "megatron_ce")


def build_config(argv=None) -> dict:
    """Parse the command line into the per-rank configuration (no side effects)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2048, help="sequence length T of the timed runs")
    ap.add_argument("--vocab", type=int, default=151936, help="vocabulary size V (split over --tp)")
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks (gloo processes)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--chunk-size", type=int, default=None, help="fused op chunk size (default: the op's auto)")
    ap.add_argument("--scan-tokens", type=int, nargs=2, default=(2048, 8192), help="lengths of the memory scan")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--system-malloc", action="store_true", help="no THP_MEM_ALLOC_ENABLE (4 KiB pages)")
    ap.add_argument(
        "--naive-tokens",
        type=int,
        default=None,
        help="T for the naive path (default: --tokens if it fits in available memory, else the largest power of 2)",
    )
    ap.add_argument(
        "--impl",
        choices=("eager", "compiled", "both"),
        default="both",
        help="implementation(s) of the fused op to measure (the headline ratios use compiled when measured)",
    )
    ap.add_argument("--quick", action="store_true", help="tiny shapes (smoke run)")
    ap.add_argument("--no-floors", action="store_true", help="skip the one-pass floor primitives")
    args = ap.parse_args(argv)
    if args.quick:
        args.tokens, args.vocab, args.repeats, args.warmup, args.scan_tokens = 64, 4096, 1, 0, (32, 128)
    if args.vocab % args.tp:
        raise SystemExit(f"--vocab {args.vocab} must be divisible by --tp {args.tp}")
    naive_tokens = args.naive_tokens or _naive_tokens_that_fit(args.tokens, args.vocab, args.tp)
    return dict(
        naive_tokens=min(naive_tokens, args.tokens),
        tokens=args.tokens,
        vocab=args.vocab,
        tp=args.tp,
        repeats=args.repeats,
        warmup=args.warmup,
        chunk_size=args.chunk_size,
        scan_tokens=tuple(args.scan_tokens),
        scan_dtype="bfloat16",
        dtypes=list(args.dtypes),
        methods=_methods(args.impl),
        floors=() if args.no_floors else _FLOORS,
        system_malloc=args.system_malloc,
    )


def main(argv=None):
    cfg = build_config(argv)
    if not cfg["system_malloc"]:
        # Read by PyTorch's CPU allocator in each rank (the harness's forkserver starts after this).
        os.environ["THP_MEM_ALLOC_ENABLE"] = "1"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from megatron_rlvr.testing.distributed import run_distributed

    t0 = time.perf_counter()
    per_rank = run_distributed(_bench_rank, world_size=cfg["tp"], tp=cfg["tp"], args=(cfg,), timeout=900)
    wall = time.perf_counter() - t0
    agg, scan, scan_grad = _aggregate(per_rank, cfg)
    return _report(agg, scan, scan_grad, cfg, wall)


if __name__ == "__main__":
    main()

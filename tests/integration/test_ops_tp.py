"""Multi-rank (gloo) checks of the vocab-parallel token statistics at TP = 2 and 4.

Every rank builds the same full-vocabulary logits, keeps its TP shard, runs the op, and compares results and its
gradient shard with the float64 full-vocabulary reference of test_ops_math (and, for log-probs, with
megatron-core's own vocab_parallel_cross_entropy). All checks of one TP size run in ONE call on the shared 4-rank
pool (at TP=2 the two data-parallel replicas simply repeat the checks). Ranks return per-check errors; the test
asserts them here so a failure names the check. Both implementations run: eager and "compiled" (torch.compile'd
local math; the collectives stay eager between the compiled kernels; shards of <= 256 columns take the eager path
by design, so at TP=4 some checks mix compiled and eager ranks)."""

from __future__ import annotations

import pytest
import torch
from test_ops_math import ALL, grads_of, make_case, reference_stats

from megatron_rlvr.ops import vocab_parallel_token_stats


def _shard(t, rank, tp):
    v = t.shape[-1] // tp
    return t[..., rank * v : (rank + 1) * v]


def _padded(V, tp):
    """megatron's padding: a multiple of 128 * tp."""
    m = 128 * tp
    return (V + m - 1) // m * m


def _grad_err(g, ref):
    """Max abs error; for a bf16 gradient, the error beyond bf16's rounding of the exact value (2^-8 relative)."""
    err = (g.double() - ref).abs()
    if g.dtype == torch.bfloat16:
        err = err - 2.0**-8 * ref.abs()
    return err.max().item()


def _check_against_reference(name, group, rank, tp, T, V, dtype, temperature, chunk, errs, impl, tie_rows=False):
    Vp = _padded(V, tp)
    x, w, ids, wt = make_case(T, V, dtype, seed=T + V, padded_to=Vp)
    x[:, V:] = 50.0  # padding holds large garbage: must not leak
    if tie_rows:
        x[0, :] = x[0, :].clamp_max(1.0)
        x[0, 3] = x[0, Vp // tp + 5] = 8.0  # top-2 tie across two shards
        x[1, :] = x[1, :].clamp_max(1.0)
        x[1, V - 2] = x[1, V - 3] = 8.0  # tie inside the last valid shard
    mask = (torch.arange(T) % 3 != 1).double()  # every third token masked out
    wt = {k: v * mask for k, v in wt.items()}
    xs, ws = _shard(x, rank, tp).clone(), _shard(w, rank, tp).clone()
    xs0, ws0 = xs.clone(), ws.clone()
    xs.requires_grad_(True)
    ws.requires_grad_(True)
    out = vocab_parallel_token_stats(
        xs,
        tp_group=group,
        token_ids_T=ids,
        other_logits_TV=ws,
        temperature=temperature,
        vocab_size=V,
        want=ALL,
        chunk_size=chunk,
        impl=impl,
    )
    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    ref = reference_stats(xr, wr, ids, temperature, V)
    for k in ALL:
        errs[f"{name}/{k}"] = (out[k].double() - ref[k].detach()).abs().max().item()
    gx, gw = grads_of(out, wt, (xs, ws))
    rx, rw = grads_of(ref, wt, (xr, wr))
    errs[f"{name}/grad_logits"] = _grad_err(gx, _shard(rx, rank, tp))
    errs[f"{name}/grad_other"] = _grad_err(gw, _shard(rw, rank, tp))
    masked = mask == 0
    errs[f"{name}/grad_on_masked_rows"] = max(gx[masked].abs().max().item(), gw[masked].abs().max().item())
    pad_from = max(0, min(Vp // tp, V - rank * (Vp // tp)))  # this shard's first padding column
    errs[f"{name}/grad_on_padding"] = float(gx[:, pad_from:].abs().sum() + gw[:, pad_from:].abs().sum())
    errs[f"{name}/input_changed"] = float(not (torch.equal(xs.detach(), xs0) and torch.equal(ws.detach(), ws0)))
    if tie_rows:
        errs[f"{name}/tie_margin"] = max(abs(out["margin"][0].item()), abs(out["margin"][1].item()))
    return out, (gx, gw)


def _megatron_reference(group, rank, tp, dtype, errs, impl):
    """megatron-core's vocab_parallel_cross_entropy (reads megatron's TP group: the harness initialised it) gives
    -logprob and, for loss weights g, the gradient of sum(g * -logprob)."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    T, V = 12, 256 * tp
    x, _, ids, wt = make_case(T, V, dtype, seed=99)
    xs = _shard(x, rank, tp).clone()
    xm = xs.clone().requires_grad_(True)  # megatron may modify its input in place: give it its own copy
    loss = vocab_parallel_cross_entropy(xm, ids)
    (loss * wt["logprob"].to(loss.dtype)).sum().backward()
    xo = xs.clone().requires_grad_(True)
    lp = vocab_parallel_token_stats(xo, tp_group=group, token_ids_T=ids, want=("logprob",), impl=impl)["logprob"]
    (-lp * wt["logprob"].float()).sum().backward()
    errs[f"megatron_{dtype}/logprob"] = (lp.double() + loss.double()).abs().max().item()
    errs[f"megatron_{dtype}/grad"] = _grad_err(xo.grad, xm.grad.double())


def _logprob_alone(group, rank, tp, errs, impl):
    """Log-prob alone (the compiled path's unshifted first try, `_fwd_lse0`, on shards of 320 > 256 columns) equals
    the fp64 reference when the ranks take different shifts for the same rows: row 3 is +95 on shard 0 only (exp
    overflows there, so rank 0 redoes rows 2-3 shifted by their max while the other ranks keep shift 0) and row 6 is
    -120 on every shard (all ranks redo it shifted). Chunks of 2 rows, temperature 0.8."""
    from megatron_rlvr.ops import compiled

    T, V = 10, 320 * tp
    x, _, ids, wt = make_case(T, V, torch.float32, seed=31)
    x[3, :320] += 95.0
    x[6] -= 120.0
    before = compiled.compile_stats()["calls_by_kernel"].get("_fwd_lse0", 0)
    xs = _shard(x, rank, tp).clone().requires_grad_(True)
    out = vocab_parallel_token_stats(
        xs, tp_group=group, token_ids_T=ids, want=("logprob",), temperature=0.8, chunk_size=2, impl=impl
    )
    xr = x.double().requires_grad_(True)
    ref = reference_stats(xr, None, ids, 0.8, V)
    errs["fp32_lp_alone/logprob"] = (out["logprob"].double() - ref["logprob"].detach()).abs().max().item()
    (gx,) = grads_of(out, wt, (xs,))
    (rx,) = grads_of({"logprob": ref["logprob"]}, wt, (xr,))
    errs["fp32_lp_alone/grad_logits"] = _grad_err(gx, _shard(rx, rank, tp))
    used = compiled.compile_stats()["calls_by_kernel"].get("_fwd_lse0", 0) > before
    errs["lp_alone_lse0_unused"] = float(impl == "compiled" and not used)


def _tp_checks(impl="eager"):
    from megatron_rlvr.ops import compiled

    calls = compiled.compile_stats()["calls"]
    errs = _tp_checks_body(impl)
    if impl == "compiled":
        errs["compiled_disabled"] = float(compiled.disabled_reason() is not None)
        errs["compiled_unused"] = float(compiled.compile_stats()["calls"] == calls)
    return errs


def _tp_checks_body(impl):
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    rank, tp = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    errs: dict[str, float] = {}
    # fp32 + temperature + padded vocab (V=1000 -> 1024) + ties + masking, several chunks
    _check_against_reference(
        "fp32_t0.7_pad", group, rank, tp, 11, 1000, torch.float32, 0.7, 4, errs, impl, tie_rows=True
    )
    # bf16 inputs, fp32 accumulation
    _check_against_reference("bf16_t1.0", group, rank, tp, 9, 512 * tp, torch.bfloat16, 1.0, None, errs, impl)
    # fp64: exactness of the merge itself; V=300 at tp=4 pads to 512, so the last shard is ALL padding
    out_c, g_c = _check_against_reference("fp64_t1.3_pad", group, rank, tp, 10, 300, torch.float64, 1.3, 3, errs, impl)
    out_u, g_u = _check_against_reference(
        "fp64_t1.3_pad_1chunk", group, rank, tp, 10, 300, torch.float64, 1.3, 10, errs, impl
    )
    errs["chunked_vs_unchunked"] = max(
        max((out_c[k] - out_u[k]).abs().max().item() for k in ALL),
        max((a - b).abs().max().item() for a, b in zip(g_c, g_u)),
    )
    # all TP ranks return identical statistics
    lp = out_c["logprob"].contiguous()
    gathered = [torch.empty_like(lp) for _ in range(tp)]
    torch.distributed.all_gather(gathered, lp, group=group)
    errs["ranks_agree"] = max((g - lp).abs().max().item() for g in gathered)
    _megatron_reference(group, rank, tp, torch.float32, errs, impl)
    _megatron_reference(group, rank, tp, torch.bfloat16, errs, impl)
    _logprob_alone(group, rank, tp, errs, impl)
    return errs


TOLS = {"fp32": 3e-5, "bf16": 3e-5, "fp64": 1e-10, "megatron": 1e-5}
EXACT = (
    "grad_on_masked_rows",
    "grad_on_padding",
    "input_changed",
    "tie_margin",
    "ranks_agree",
    "compiled_disabled",
    "compiled_unused",
    "lse0_unused",
)


def _tol(key: str) -> float:
    if key.endswith(EXACT):
        return 0.0
    if key == "chunked_vs_unchunked":
        return 1e-12
    return TOLS[key.split("_")[0]]


@pytest.mark.parametrize("impl", ["eager", "compiled"])
@pytest.mark.parametrize("tp", [2, 4])
def test_vocab_parallel_stats_match_full_vocab_reference(dist_pool, tp, impl):
    """At TP=tp: logprob/entropy/margin/kl/kl_rev and gradients w.r.t. both sharded logits equal the fp64
    full-vocabulary reference (fp32, bf16, fp64 inputs; temperature != 1; padded vocab incl. an all-padding shard;
    cross-shard and in-shard top-2 ties give margin exactly 0; masked tokens get zero gradient; inputs unchanged;
    chunked == unchunked; all TP ranks agree) and log-probs and their gradient equal megatron-core's
    vocab_parallel_cross_entropy; log-prob alone is exact when the ranks shift the same rows differently. With
    impl="compiled" the compiled kernels must really have run."""
    results = dist_pool.run(_tp_checks, tp=tp, args=(impl,), timeout=600)
    failures = []
    for rank, errs in enumerate(results):
        for key, err in errs.items():
            if not err <= _tol(key):
                failures.append(f"rank {rank}: {key} error {err:.3g} > tol {_tol(key):.1g}")
    assert not failures, "\n".join(failures)


def _load_bench():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "tools" / "bench_vocab_parallel.py"
    spec = importlib.util.spec_from_file_location("bench_vocab_parallel", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _bench_smoke(cfg):
    return _load_bench()._bench_rank(cfg)


def test_benchmark_smoke(dist_pool, capsys):
    """tools/bench_vocab_parallel.py --quick runs its four methods on the TP=2 ranks and prints a table whose last
    line carries the agreed key=value ratios (finite); the naive path needs more memory than the fused op."""
    bench = _load_bench()
    cfg = bench.build_config(["--quick"])
    per_rank = dist_pool.run(_bench_smoke, tp=2, args=(cfg,), timeout=120)
    agg, scan, scan_grad = bench._aggregate(per_rank, cfg)
    kv = bench._report(agg, scan, scan_grad, cfg, wall=0.0)
    last = capsys.readouterr().out.strip().splitlines()[-1]
    parsed = dict(item.split("=") for item in last.split())
    for key in ("logprob_vs_megatron", "all4_vs_logprob", "all4_vs_megatron", "naive_mem_over_fused"):
        assert key in parsed and float(parsed[key]) > 0 and float(parsed[key]) == pytest.approx(kv[key], abs=1e-3)
    assert kv["naive_mem_over_fused"] > 1.0
    # the one-pass floors were timed in the same run and their ratios reported
    for key in ("all4_vs_logprob_floor", "logprob_vs_floor", "all4_vs_floor"):
        assert key in parsed and float(parsed[key]) > 0 and float(parsed[key]) == pytest.approx(kv[key], abs=1e-3)

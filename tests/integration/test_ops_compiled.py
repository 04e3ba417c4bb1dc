"""The compiled implementation of the vocab-parallel token statistics as a mechanism: one graph per kernel variant
serves every sequence length (no recompiles per micro-batch), the per-call selection (no process-wide default), and the
fallback to eager when compilation is impossible. Its numerics are checked against the fp64 references by every
test of test_ops_math.py and test_ops_tp.py (they run through both implementations)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from test_ops_math import compiled_usable

import megatron_rlvr.ops as ops
import megatron_rlvr.ops.vocab_parallel as vocab_parallel
from megatron_rlvr.ops import compiled, vocab_parallel_token_stats

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("want", [("logprob", "entropy", "margin", "kl"), ("logprob",)])
def test_lengths_vary_without_recompiling(want):
    """After the first call of a variant, other sequence lengths and vocabulary widths (micro-batches of varying T,
    another model's shard) and another temperature compile nothing; results match the eager path. Log-prob alone
    takes its own kernels (`_fwd_lse0`, `_bwd_gz_x`)."""
    if compiled_usable() is not None:
        pytest.skip(f"torch.compile unusable here: {compiled_usable()}")

    def call(T, V, temperature, impl):
        g = torch.Generator().manual_seed(T * V)
        x = (torch.randn(T, V, generator=g) * 3).requires_grad_(True)
        w = torch.randn(T, V, generator=g) + x.detach()
        ids = torch.randint(0, V, (T,), generator=g)
        out = vocab_parallel_token_stats(
            x, token_ids_T=ids, other_logits_TV=w, temperature=temperature, want=want, impl=impl
        )
        sum(out[k] if k != "kl" else -out[k] for k in want if k != "margin").sum().backward()
        return out, x.grad

    call(5, 700, 1.0, "compiled")  # warm-up: compiles this variant's forward and backward graphs (if new)
    before = compiled.compile_stats()["total_graphs"]
    # (a shard whose tail block is exactly 1 column, e.g. V/tp = 513, compiles one more graph: torch specialises
    # size 1; real shards are multiples of 64)
    for T, V, temperature in [(2, 700, 1.0), (37, 700, 0.7), (300, 1000, 1.0), (64, 517, 1.3)]:
        out_c, g_c = call(T, V, temperature, "compiled")
        out_e, g_e = call(T, V, temperature, "eager")
        for k in want:
            torch.testing.assert_close(out_c[k], out_e[k], atol=2e-5, rtol=2e-5, msg=k)
        torch.testing.assert_close(g_c, g_e, atol=2e-6, rtol=1e-4)
    assert compiled.compile_stats()["total_graphs"] == before, compiled.compile_stats()


def test_the_implementation_is_chosen_per_call_only():
    """``impl`` defaults to "eager" in the signature and nothing else: no process-wide setter or mode exists; a bad
    name is rejected naming the choices."""
    import inspect

    assert inspect.signature(vocab_parallel_token_stats).parameters["impl"].default == "eager"
    for mod in (ops, vocab_parallel):
        assert not [n for n in vars(mod) if "set_fused" in n or "get_fused" in n or "DEFAULT_MODE" in n]
    with pytest.raises(ValueError, match="eager"):
        vocab_parallel_token_stats(torch.zeros(2, 8), token_ids_T=torch.tensor([0, 1]), impl="triton")


_FALLBACK_SCRIPT = textwrap.dedent(
    """
    import json, warnings
    import torch
    from megatron_rlvr.ops import compiled, vocab_parallel_token_stats
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 400, generator=g, requires_grad=True)
    ids = torch.randint(0, 400, (6,), generator=g)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = {}
        for impl in ("compiled", "compiled", "eager"):
            out = vocab_parallel_token_stats(x, token_ids_T=ids, want=("logprob", "entropy"), impl=impl)
            (grad,) = torch.autograd.grad((out["logprob"] + out["entropy"]).sum(), x)
            res.setdefault(impl, []).append((out["logprob"], out["entropy"], grad))
    same = all(
        torch.equal(a, b) for run in res["compiled"] for a, b in zip(run, res["eager"][0])
    )
    msgs = [str(w.message) for w in caught if "fused statistics" in str(w.message)]
    print(json.dumps(dict(msgs=msgs, disabled=compiled.disabled_reason(), same=same)))
    """
)


def test_no_compiler_falls_back_to_eager_with_one_warning(tmp_path):
    """Without a working C++ compiler (CXX points nowhere, empty inductor cache) the compiled path warns ONCE
    (one line naming the failure) and gives exactly the eager results, for that call and later ones."""
    env = dict(os.environ, CXX=str(tmp_path / "no-such-g++"), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", _FALLBACK_SCRIPT], env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["disabled"] is not None and "failed to compile" in res["disabled"]
    assert len(res["msgs"]) == 1 and "using the eager path" in res["msgs"][0] and "\n" not in res["msgs"][0]
    assert res["same"]


def _kernel_calls(fn):
    """Compiled calls per kernel made while fn runs."""
    before = dict(compiled.compile_stats()["calls_by_kernel"])
    fn()
    after = compiled.compile_stats()["calls_by_kernel"]
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def test_forward_variant_dispatch():
    """Which forward kernels a call takes: log-prob alone sums unshifted exponentials (`_fwd_lse0`, no max pass) and
    hands a chunk with an overflowing row (logits ~ +95) to the max-shifted `_fwd_lse`; the margin needs the max, so
    log-prob + margin goes straight to `_fwd_lse`, and all four statistics to `_fwd_kl`. Results equal the eager
    path's in every case."""
    if compiled_usable() is not None:
        pytest.skip(f"torch.compile unusable here: {compiled_usable()}")
    g = torch.Generator().manual_seed(3)
    T, V = 12, 600
    x = torch.randn(T, V, generator=g) * 3
    w = x + torch.randn(T, V, generator=g)
    ids = torch.randint(0, V, (T,), generator=g)

    def check(x, want, chunk_size=None):
        outs = {}
        for impl in ("eager", "compiled"):
            outs[impl] = vocab_parallel_token_stats(
                x, token_ids_T=ids, other_logits_TV=w, want=want, impl=impl, chunk_size=chunk_size
            )
        for k in want:
            torch.testing.assert_close(outs["compiled"][k], outs["eager"][k], atol=2e-5, rtol=2e-5, msg=k)

    calls = _kernel_calls(lambda: check(x, ("logprob",)))
    assert calls == {"_fwd_lse0": 1}, calls
    hot = x.clone()
    hot[7] += 95.0  # exp overflows fp32 in this row: its chunk (rows 6-11 at chunk_size 6) is redone shifted
    calls = _kernel_calls(lambda: check(hot, ("logprob",), chunk_size=6))
    assert calls == {"_fwd_lse0": 2, "_fwd_lse": 1}, calls
    calls = _kernel_calls(lambda: check(x, ("logprob", "margin")))
    assert calls == {"_fwd_lse": 1}, calls
    calls = _kernel_calls(lambda: check(x, ("logprob", "entropy", "margin", "kl")))
    assert calls == {"_fwd_kl": 1}, calls

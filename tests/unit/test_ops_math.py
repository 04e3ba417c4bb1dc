"""Single-process checks of megatron_rlvr.ops against float64 full-vocabulary torch references.

The op runs unsharded here (tp_group=None); the multi-rank TP=2/4 checks are in test_ops_tp.py and share the
reference in `reference_stats`. Each test names the behaviour it checks. Every check of the token statistics runs
through both implementations (the `impl` fixture): the eager reference here, and the torch.compile'd kernels of
megatron_rlvr.ops.compiled in tests/integration/test_ops_math_compiled.py, which runs these same tests; shapes are
dynamic there, so that module compiles each kernel variant once per dtype (and once more for shards of <= 256
columns), ~10-60 s each on a 2-core CPU: too slow for the unit tier."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rlvr.ops import (
    compiled,
    kl_estimator,
    vocab_parallel_entropy,
    vocab_parallel_kl,
    vocab_parallel_logprobs,
    vocab_parallel_token_stats,
    vocab_parallel_top2_margin,
)

ALL = ("logprob", "entropy", "margin", "kl", "kl_rev")
DIFFERENTIABLE = ("logprob", "entropy", "kl", "kl_rev")


def compiled_usable() -> str | None:
    """None if the compiled path works in this process (one tiny compiled call, cached), else why not."""
    if not hasattr(compiled_usable, "reason"):
        x = torch.randn(2, 300)
        vocab_parallel_token_stats(x, token_ids_T=torch.tensor([0, 1]), impl="compiled")
        compiled_usable.reason = compiled.disabled_reason()
    return compiled_usable.reason


def impl_fixture(*impls: str):
    """The ``impl`` fixture over ``impls`` (here "eager"; test_ops_math_compiled.py: "compiled")."""

    @pytest.fixture(params=impls)
    def impl(request):
        """The implementation the test passes to every call (``impl=impl``); for "compiled", also check that the
        compiled kernels really ran (no silent fallback to eager)."""
        if request.param == "compiled" and compiled_usable() is not None:
            pytest.skip(f"torch.compile unusable here: {compiled_usable()}")
        calls = compiled.compile_stats()["calls"]
        yield request.param
        if request.param == "compiled":
            assert compiled.disabled_reason() is None
            assert compiled.compile_stats()["calls"] > calls, "the compiled path was not used"

    return impl


impl = impl_fixture("eager")


def reference_stats(x, w, ids, temperature, vocab_size):
    """float64 full-vocabulary reference, straight from the definitions (autograd gives reference gradients).
    x, w: full padded logits [T, Vp]; only columns < vocab_size are the distribution."""
    z = x.double()[:, :vocab_size] / temperature
    lp = torch.log_softmax(z, -1)
    p = lp.exp()
    out = {"entropy": -(p * lp).sum(-1)}
    top = p.topk(min(2, vocab_size), -1).values
    out["margin"] = (top[:, 0] - top[:, 1]) if vocab_size > 1 else top[:, 0]
    if ids is not None:
        out["logprob"] = lp.gather(1, ids[:, None]).squeeze(1)
    if w is not None:
        lq = torch.log_softmax(w.double()[:, :vocab_size] / temperature, -1)
        q = lq.exp()
        out["kl"] = (p * (lp - lq)).sum(-1)
        out["kl_rev"] = (q * (lq - lp)).sum(-1)
    return out


def make_case(T, V, dtype, seed=0, scale=3.0, padded_to=None):
    g = torch.Generator().manual_seed(seed)
    Vp = padded_to or V
    x = (torch.randn(T, Vp, generator=g, dtype=torch.float64) * scale).to(dtype)
    w = (x.double() + torch.randn(T, Vp, generator=g, dtype=torch.float64)).to(dtype)
    ids = torch.randint(0, V, (T,), generator=g)
    weights = {k: torch.randn(T, generator=g, dtype=torch.float64) for k in ALL}
    return x, w, ids, weights


def grads_of(outs, weights, inputs):
    loss = sum((outs[k].double() * weights[k]).sum() for k in outs if k in DIFFERENTIABLE)
    return torch.autograd.grad(loss, inputs, allow_unused=True)


# Tolerances: fp32 compute vs fp64 reference. bf16 inputs are upcast exactly, so the reference is computed from
# the same bf16 values and only fp32 accumulation error remains.
TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 2e-5}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_all_stats_forward_backward_match_fp64_reference(dtype, temperature, impl):
    """Every statistic and the gradients w.r.t. BOTH logits inputs equal the fp64 full-vocab reference, with a
    chunk size that does not divide T (several chunks plus a ragged last one)."""
    T, V = 23, 517
    x, w, ids, wt = make_case(T, V, dtype)
    x.requires_grad_(True)
    w.requires_grad_(True)
    out = vocab_parallel_token_stats(
        x, token_ids_T=ids, other_logits_TV=w, temperature=temperature, want=ALL, chunk_size=5, impl=impl
    )
    ref = reference_stats(x.detach(), w.detach(), ids, temperature, V)
    xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref_g = reference_stats(xr, wr, ids, temperature, V)
    tol = TOL[dtype]
    for k in ALL:
        assert out[k].dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        torch.testing.assert_close(out[k].double(), ref[k], atol=tol, rtol=tol, msg=k)
    gx, gw = grads_of(out, wt, (x, w))
    rx, rw = grads_of(ref_g, wt, (xr, wr))
    assert gx.dtype == dtype and gw.dtype == dtype
    # a bf16 gradient is the exact one rounded to bf16: within 2^-8 relative (plus fp32 accumulation error)
    gtol = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 2e-5}[dtype]
    grel = 2.0**-8 if dtype == torch.bfloat16 else gtol
    torch.testing.assert_close(gx.double(), rx, atol=gtol, rtol=grel)
    torch.testing.assert_close(gw.double(), rw, atol=gtol, rtol=grel)


@pytest.mark.parametrize("key", DIFFERENTIABLE)
def test_each_stat_alone_has_exact_gradient(key, impl):
    """A single requested statistic (not only the fused set) back-propagates its own exact gradient; the second
    logits input gets a gradient exactly when the statistic depends on it."""
    T, V = 9, 300
    x, w, ids, wt = make_case(T, V, torch.float64, seed=3)
    x.requires_grad_(True)
    w.requires_grad_(True)
    out = vocab_parallel_token_stats(x, token_ids_T=ids, other_logits_TV=w, temperature=1.3, want=(key,), impl=impl)
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = reference_stats(xr, wr, ids, 1.3, V)
    gx, gw = grads_of(out, wt, (x, w))
    rx, rw = grads_of({key: ref[key]}, wt, (xr, wr))
    torch.testing.assert_close(gx, rx, atol=1e-11, rtol=1e-10)
    if key in ("kl", "kl_rev"):
        torch.testing.assert_close(gw, rw, atol=1e-11, rtol=1e-10)
    else:
        assert gw is None and rw is None


def test_gradcheck_fp64(impl):
    """Numerical differentiation (torch.autograd.gradcheck) agrees with the analytic backward for the fused call,
    with padding and temperature."""
    g = torch.Generator().manual_seed(5)
    # 260 columns, 258 real: wider than one 256-column block (the compiled kernels' narrowest shard)
    x = torch.randn(3, 260, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(3, 260, dtype=torch.float64, generator=g, requires_grad=True)
    ids = torch.tensor([0, 257, 5])

    def f(a, b):
        o = vocab_parallel_token_stats(
            a, token_ids_T=ids, other_logits_TV=b, temperature=0.8, vocab_size=258, want=ALL, chunk_size=2, impl=impl
        )
        return tuple(o[k] for k in DIFFERENTIABLE)

    assert torch.autograd.gradcheck(f, (x, w), eps=1e-6, atol=1e-7)


def test_padded_vocab_does_not_leak(impl):
    """Columns with global id >= vocab_size (megatron's padding) change no result and get zero gradient, even
    when they hold huge values."""
    T, V, Vp = 6, 1000, 1024
    x, w, ids, wt = make_case(T, V, torch.float32, padded_to=Vp)
    x[:, V:] = 1e4  # would dominate every statistic if it leaked
    w[:, V:] = -1e4
    x.requires_grad_(True)
    w.requires_grad_(True)
    out = vocab_parallel_token_stats(
        x, token_ids_T=ids, other_logits_TV=w, vocab_size=V, want=ALL, chunk_size=4, impl=impl
    )
    ref = reference_stats(x.detach(), w.detach(), ids, 1.0, V)
    for k in ALL:
        torch.testing.assert_close(out[k].double(), ref[k], atol=2e-5, rtol=2e-5, msg=k)
    gx, gw = grads_of(out, wt, (x, w))
    assert torch.all(gx[:, V:] == 0) and torch.all(gw[:, V:] == 0)


def test_exact_top2_ties_give_zero_margin(impl):
    """Two equal largest logits (in one row, possibly far apart in the vocab) give a margin of exactly 0; a
    unique max gives p1 - p2 > 0 equal to the reference; bf16 ties as well."""
    T, V = 4, 2000
    # below the ties everywhere (an unseeded randn * 2 passed 9 in about one run in 40: no tie at the top)
    x = (torch.randn(T, V, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 2).clamp(-8, 8)
    x[0, 5] = x[0, 1900] = 9.0  # tie across distant blocks
    x[1, 300] = x[1, 301] = 9.0  # tie inside one block
    x[2, :] = 0.0  # uniform row: everything ties
    x[3, 7] = 9.0  # unique max
    for dtype in (torch.float32, torch.bfloat16):
        m = vocab_parallel_top2_margin(x.to(dtype), temperature=0.6, impl=impl)
        assert m[0].item() == 0.0 and m[1].item() == 0.0 and m[2].item() == 0.0
        ref = reference_stats(x.to(dtype), None, None, 0.6, V)["margin"]
        assert m[3].item() > 0
        torch.testing.assert_close(m.double(), ref, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("want", [("logprob",), ("logprob", "entropy", "kl")])
def test_bf16_gradient_of_confident_token_is_rounded_once(want, impl):
    """For a confident target token (p_y ~ 0.999) the log-prob gradient at y is g (1 - p_y), a small difference of
    O(g) terms: the bf16 gradient must be that exact value rounded once (2^-8 relative), not a sum of rounded
    parts."""
    T, V = 4, 300
    x, w, _, wt = make_case(T, V, torch.float64, seed=4)
    ids = torch.tensor([3, 10, 200, 299])
    x[torch.arange(T), ids] = 15.0  # p_y ~ 0.999
    xb = x.to(torch.bfloat16).requires_grad_(True)
    wb = w.to(torch.bfloat16)
    out = vocab_parallel_token_stats(xb, token_ids_T=ids, other_logits_TV=wb, want=want, chunk_size=2, impl=impl)
    (gx,) = grads_of(out, wt, (xb,))
    xr = xb.detach().double().requires_grad_(True)
    ref = reference_stats(xr, wb.double(), ids, 1.0, V)
    (rx,) = grads_of({k: ref[k] for k in want}, wt, (xr,))
    at_y, ref_y = gx[torch.arange(T), ids].double(), rx[torch.arange(T), ids]
    if want == ("logprob",):
        assert (ref_y.abs() < 0.01 * wt["logprob"].abs()).all()  # really a cancellation case
    torch.testing.assert_close(at_y, ref_y, rtol=2.0**-8, atol=1e-7)
    torch.testing.assert_close(gx.double(), rx, rtol=2.0**-8, atol=1e-6)


def test_margin_is_detached(impl):
    """The margin is a stop-gradient weight: it does not require grad even when the logits do."""
    x = torch.randn(3, 300, requires_grad=True)
    out = vocab_parallel_token_stats(x, want=("margin", "entropy"), impl=impl)
    assert not out["margin"].requires_grad and out["entropy"].requires_grad


def test_masked_tokens_get_zero_gradient_and_inputs_are_unchanged(impl):
    """A loss mask multiplying the outputs zeroes the gradient on masked rows exactly; neither logits input is
    modified (checked bitwise, fp32 and bf16)."""
    T, V = 10, 400
    for dtype in (torch.float32, torch.bfloat16):
        x, w, ids, _ = make_case(T, V, dtype, seed=7)
        x0, w0 = x.clone(), w.clone()
        x.requires_grad_(True)
        w.requires_grad_(True)
        mask = torch.tensor([1, 0, 1, 1, 0, 0, 1, 0, 1, 1], dtype=torch.float32)
        out = vocab_parallel_token_stats(x, token_ids_T=ids, other_logits_TV=w, want=ALL, chunk_size=3, impl=impl)
        loss = sum((out[k] * mask).sum() for k in DIFFERENTIABLE)
        loss.backward()
        masked = mask == 0
        assert torch.all(x.grad[masked] == 0) and torch.all(w.grad[masked] == 0)
        assert torch.all(x.grad[~masked].abs().sum(-1) > 0)
        assert torch.equal(x.detach(), x0) and torch.equal(w.detach(), w0)


@pytest.mark.parametrize("chunk", [1, 3, 64, None])
def test_chunked_equals_unchunked(chunk, impl):
    """Results and gradients do not depend on the chunk size (1 token per chunk up to one chunk for all)."""
    T, V = 17, 700
    x, w, ids, wt = make_case(T, V, torch.float32, seed=11)

    def run(cs):
        a, b = x.clone().requires_grad_(), w.clone().requires_grad_()
        o = vocab_parallel_token_stats(a, token_ids_T=ids, other_logits_TV=b, want=ALL, chunk_size=cs, impl=impl)
        return o, grads_of(o, wt, (a, b))

    o1, g1 = run(chunk)
    o2, g2 = run(T)
    for k in ALL:
        torch.testing.assert_close(o1[k], o2[k], atol=1e-6, rtol=1e-6)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("want", [("logprob",), ("logprob", "entropy", "kl"), ALL])
def test_shift_fallbacks_for_extreme_rows_are_exact(want, impl):
    """The fast paths (unshifted exp for log-prob, w shifted by z's max, exp(z) * exp(-lse) in the backward) must
    hand over to the max-shifted path where they would overflow or underflow: rows with logits ~ +95 (exp
    overflows fp32), ~ -120 (sum underflows), and reference logits 300 above / below the policy's. Chunks of 2 mix
    normal and extreme rows. Results and gradients w.r.t. both inputs equal the fp64 reference."""
    T, V = 10, 257
    x, w, ids, wt = make_case(T, V, torch.float32, seed=21)
    x[2:4] += 95.0
    x[5] -= 120.0
    w[6] += 300.0
    w[7] -= 300.0
    w[8] = x[8] + 95.0
    x.requires_grad_(True)
    w.requires_grad_(True)
    out = vocab_parallel_token_stats(x, token_ids_T=ids, other_logits_TV=w, want=want, chunk_size=2, impl=impl)
    xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = reference_stats(xr, wr, ids, 1.0, V)
    for k in want:
        torch.testing.assert_close(out[k].double(), ref[k].detach(), atol=5e-5, rtol=1e-5, msg=k)
    gx, gw = grads_of(out, wt, (x, w))
    rx, rw = grads_of({k: ref[k] for k in want}, wt, (xr, wr))
    torch.testing.assert_close(gx.double(), rx, atol=2e-5, rtol=1e-4)
    if gw is not None or rw is not None:
        torch.testing.assert_close(gw.double(), rw, atol=2e-5, rtol=1e-4)
    # and with the other logits frozen (the usual RL case: only the policy's logits need a gradient)
    x2 = x.detach().clone().requires_grad_(True)
    out2 = vocab_parallel_token_stats(
        x2, token_ids_T=ids, other_logits_TV=w.detach(), want=want, chunk_size=2, impl=impl
    )
    (g2,) = grads_of(out2, wt, (x2,))
    torch.testing.assert_close(g2.double(), rx, atol=2e-5, rtol=1e-4)


def test_wrappers_and_leading_dims(impl):
    """The convenience wrappers equal the fused call, and [S, B, V] inputs keep their leading shape."""
    S, B, V = 3, 4, 300
    x = torch.randn(S, B, V)
    w = torch.randn(S, B, V)
    ids = torch.randint(0, V, (S, B))
    out = vocab_parallel_token_stats(x, token_ids_T=ids, other_logits_TV=w, want=ALL, impl=impl)
    assert all(v.shape == (S, B) for v in out.values())
    torch.testing.assert_close(vocab_parallel_logprobs(x, ids, impl=impl), out["logprob"])
    torch.testing.assert_close(vocab_parallel_entropy(x, impl=impl), out["entropy"])
    torch.testing.assert_close(vocab_parallel_top2_margin(x, impl=impl), out["margin"])
    torch.testing.assert_close(vocab_parallel_kl(x, w, impl=impl), out["kl"])
    torch.testing.assert_close(vocab_parallel_kl(x, w, reverse=True, impl=impl), out["kl_rev"])


def test_extreme_logits_stay_finite_and_exact(impl):
    """Large-magnitude logits (max-shift needed), a one-hot-like row and T=0 are handled."""
    x = torch.full((3, 300), -1e4)  # the 296 further columns carry (almost) no mass
    x[:, :4] = torch.tensor([[1000.0, 999.0, -1000.0, 0.0], [-500.0, -501.0, -502.0, -503.0], [0.0, 0.0, 0.0, 0.0]])
    ids = torch.tensor([0, 3, 2])
    out = vocab_parallel_token_stats(x, token_ids_T=ids, want=("logprob", "entropy", "margin"), impl=impl)
    ref = reference_stats(x, None, ids, 1.0, 300)
    for k in out:
        torch.testing.assert_close(out[k].double(), ref[k], atol=1e-5, rtol=1e-5)
    empty = vocab_parallel_token_stats(
        torch.zeros(0, 8, requires_grad=True), token_ids_T=torch.zeros(0).long(), impl=impl
    )
    assert empty["logprob"].shape == (0,)


def test_bad_arguments_raise_clear_errors(impl):
    """Bad input gets a ValueError naming the argument."""
    x = torch.randn(4, 300)
    ids = torch.tensor([0, 1, 2, 3])
    cases = [
        (dict(want=("logprob",)), "token_ids_T"),
        (dict(want=("kl",)), "other_logits_TV"),
        (dict(want=("bogus",)), "unknown"),
        (dict(want=()), "want"),
        (dict(want="entropy"), "want"),
        (dict(want=("entropy",), temperature=0.0), "temperature"),
        (dict(want=("entropy",), vocab_size=301), "vocab_size"),
        (dict(want=("entropy",), chunk_size=0), "chunk_size"),
        (dict(want=("logprob",), token_ids_T=torch.tensor([0, 1, 2, 300])), "token_ids_T"),
        (dict(want=("logprob",), token_ids_T=ids, vocab_size=3), "vocab_size=3"),
        (dict(want=("logprob",), token_ids_T=ids.float()), "integer"),
        (dict(want=("kl",), other_logits_TV=torch.randn(4, 299)), "shape"),
    ]
    for kwargs, needle in cases:
        with pytest.raises(ValueError, match=needle):
            vocab_parallel_token_stats(x, **kwargs, impl=impl)
    bad = x.clone()
    bad[2, 3] = float("nan")
    with pytest.raises(ValueError, match="non-finite at token 2"):
        vocab_parallel_entropy(bad, impl=impl)
    with pytest.raises(ValueError, match="logits_TV"):
        vocab_parallel_entropy(torch.arange(10), impl=impl)
    with pytest.raises(ValueError, match="impl"):
        vocab_parallel_entropy(x, impl="triton")


# ----------------------------------------------------------------------------------------------- KL estimators
def test_kl_estimators_match_formulas_and_are_unbiased():
    """k1/k2/k3 equal their closed forms; sampled from pi, k1 and k3 average to the exact KL(pi || ref)
    (Schulman 2020), k3 and k2 are >= 0."""
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(50, generator=g, dtype=torch.float64) - 3
    logq = torch.randn(50, generator=g, dtype=torch.float64) - 3
    d = logp - logq
    torch.testing.assert_close(kl_estimator(logp, logq, "k1", clamp=None), d)
    torch.testing.assert_close(kl_estimator(logp, logq, "k2", clamp=None), 0.5 * d**2)
    torch.testing.assert_close(kl_estimator(logp, logq, "k3", clamp=None), torch.exp(-d) + d - 1)
    assert (kl_estimator(logp, logq, "k3") >= 0).all()
    # unbiasedness on a small categorical distribution, exact expectation over its support
    zp, zq = torch.randn(7, generator=g, dtype=torch.float64), torch.randn(7, generator=g, dtype=torch.float64)
    lp, lq = zp.log_softmax(0), zq.log_softmax(0)
    exact = (lp.exp() * (lp - lq)).sum()
    for kind in ("k1", "k3"):
        est = (lp.exp() * kl_estimator(lp, lq, kind, clamp=None)).sum()
        torch.testing.assert_close(est, exact)


def test_kl_estimator_clamp_and_errors():
    """clamp bounds log r before exp (k3 stays finite for a huge ratio); bad kind/shape/clamp raise."""
    logp = torch.tensor([-200.0, -1.0])
    logq = torch.tensor([-1.0, -1.0])
    k3 = kl_estimator(logp, logq, "k3", clamp=20.0)
    assert torch.isfinite(k3).all()
    assert math.isclose(k3[0].item(), math.expm1(20.0) - 20.0, rel_tol=1e-6)
    assert torch.isinf(kl_estimator(logp, logq, "k3", clamp=None)[0])
    lp = torch.tensor([-1.0, -2.0], requires_grad=True)
    kl_estimator(lp, torch.tensor([-1.5, -1.0]), "k3").sum().backward()
    torch.testing.assert_close(lp.grad, 1 - torch.exp(torch.tensor([-0.5, 1.0])))  # d/dlogp [e^{-d} + d - 1]
    with pytest.raises(ValueError, match="kind"):
        kl_estimator(logp, logq, "k4")
    with pytest.raises(ValueError, match="shape"):
        kl_estimator(logp, logq[:1], "k1")
    with pytest.raises(ValueError, match="clamp"):
        kl_estimator(logp, logq, "k1", clamp=0)

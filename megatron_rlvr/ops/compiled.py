"""Compiled local math of the vocab-parallel token statistics (torch.compile / inductor).

The same per-shard math as the eager path of `megatron_rlvr.ops.vocab_parallel`, written as plain tensor code that
inductor fuses into few loops (fused C++ on CPU, Triton on GPU): a forward kernel that reads each logits shard once
and returns per-token partial sums, and backward kernels that write the gradient in one pass. Collectives are NOT
here: `vocab_parallel._TokenStats` calls these kernels for the local parts and keeps its eager, exact merge (one
all-reduce MAX, one all-reduce SUM, one top-2 all-gather) between them, so nothing compiled ever communicates.

Forward (per row chunk, see `_chunk_rows`): the vocabulary shard is viewed as blocks of `BLOCK` columns (plus a
ragged tail block). Per block, relative to the block's own max m_b (exact, so no exponential can overflow), in
base-2 units ``d = (x - m_b) log2(e) / T``::

    s = sum 2^d      a_zz = sum 2^d d      (w shifted by x's block max: dw = (w - m_b) log2(e) / T)
    s_w = sum 2^dw   a_zw = sum 2^d dw     a_ww = sum 2^dw dw     a_wz = sum 2^dw d

The block max and the sums over a block are one loop nest over a cache-resident block, so every logit is read
from memory once (this needs the full blocks' and the tail's partials merged without a ``torch.cat``: see
`_row_partials`; inductor's generated loops can be read with ``TORCH_LOGS=output_code``). The blocks are then
merged exactly to the row max M (the log-sum-exp merge, as across TP ranks: ``s = sum_b s_b 2^(delta_b)``,
``a = sum_b (a_b + delta_b s_b) 2^(delta_b)`` with ``delta_b = (m_b - M) log2(e)/T``), which also makes the long
sums two-level (blocks of 256, then <= V/256 blocks): accurate without a cascade sum.
Rows where w overflows or underflows against x's shift (w far from x) are redone by the eager path, which retries
with w's own max. The top-2 margin uses the block maxima: top-2 among them plus the runner-up inside the winning
block (`vocab_parallel._row_top2`). Log-prob alone needs no max: on the CPU, `_fwd_lse0` sums ``2^(x log2(e) / T)``
unshifted in one streaming pass, and only a chunk with a row that over- or underflows takes the shifted kernel (as
the eager path does).

Backward: ``grad = p (alpha + beta log p + gamma log q) - klr q`` with ``log p = (x - T lse) / T`` (and ``grad_w``
likewise) evaluated per element in one pass and rounded once into the logits' dtype; `patch_gradient` then adds the
one-hot term ``lp onehot(y)`` at the T target elements (recomputed in the compute dtype, so a bf16 gradient is still
rounded once) and zeroes the padding columns.

Shapes are dynamic (``torch.compile(dynamic=True)``): one graph per kernel variant and input dtype serves every
sequence length and vocabulary shard size; the temperature enters as a 0-dim tensor, so it does not recompile
either. A one-row chunk runs on the eager path (torch specialises sizes 0 and 1).

If torch.compile is unavailable or a compilation fails (no C++ compiler, unsupported platform), `run` warns once and
returns None; the caller then uses the eager path for the rest of the process.
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from collections import Counter

import torch
import torch.fx.experimental._config

__all__ = ["BLOCK", "compile_stats", "disabled_reason", "reset_compile_stats"]

log = logging.getLogger(__name__)

BLOCK = 256
"""Columns per block of the forward kernel (= `vocab_parallel._TOP2_BLOCK`, so the block maxima serve the top-2)."""
MIN_COLUMNS = BLOCK + 1
"""Narrowest shard (valid columns) the compiled kernels take; narrower ones (toy vocabularies: nothing to gain, and
one graph fewer per variant to compile) run on the eager path."""
_LN2 = math.log(2.0)
# Rows per forward call: bounds the [chunk, V/tp / BLOCK] block partials (~10 KiB per row at V/tp = 76k), so the
# memory stays flat in T; large enough that the per-call overhead (~0.3 ms on CPU: guards, wrapper, the eager
# per-chunk epilogue) is noise against the ~15 ms of math per 220 rows at V/tp = 76k.
_CHUNK_ELEMENTS = 1 << 24
_MIN_CHUNK_ROWS = 8


# ------------------------------------------------------------------------------------------------------- kernels
def _block_stats(xb: torch.Tensor, wb: torch.Tensor | None, s2: torch.Tensor, ent: bool, rev: bool):
    """Per-block partials of ``xb [c, k, b]`` (and ``wb``) relative to each block's max; sums over the last dim."""
    cd = s2.dtype
    xf = xb.to(cd)
    m = xf.amax(-1, keepdim=True)
    d = (xf - m) * s2  # exact difference first, then the scale: full relative precision near the max
    e = torch.exp2(d)
    out = {"m": m.squeeze(-1), "s": e.sum(-1)}
    if ent:
        out["a_zz"] = (e * d).sum(-1)
    if wb is not None:
        dw = (wb.to(cd) - m) * s2
        ew = torch.exp2(dw)
        out["s_w"] = ew.sum(-1)
        out["a_zw"] = (e * dw).sum(-1)
        if rev:
            out["a_ww"] = (ew * dw).sum(-1)
            out["a_wz"] = (ew * d).sum(-1)
    return out


def _row_partials(x: torch.Tensor, w: torch.Tensor | None, s2: torch.Tensor, ent: bool, rev: bool):
    """Block partials of ``x [c, n]`` merged to the row max; returns [c] sums (base-2 units), the row max, the
    maxima of the full blocks ``block_max [c, q]`` and of the tail block ``tail_max [c]`` (logits units, exact
    elements of x)."""
    c, n = x.shape
    # q full blocks and a tail of 1..BLOCK columns (never empty: one graph whether or not BLOCK divides n; the
    # same block layout as `vocab_parallel._row_top2`'s)
    q = (n - 1) // BLOCK  # >= 1: narrower shards take the eager path (`MIN_COLUMNS`)
    main = _block_stats(
        x[:, : q * BLOCK].reshape(c, q, BLOCK),
        None if w is None else w[:, : q * BLOCK].reshape(c, q, BLOCK),
        s2,
        ent,
        rev,
    )
    tail_w = None if w is None else w[:, q * BLOCK :].unsqueeze(1)
    tail = {k: v.squeeze(1) for k, v in _block_stats(x[:, q * BLOCK :].unsqueeze(1), tail_w, s2, ent, rev).items()}
    # The full blocks and the tail are merged without concatenating their partials: a torch.cat copies the block
    # maxima into a new buffer in a loop vectorised along the blocks, and that extra loop stops inductor from fusing
    # the block max and the block sums into one loop nest (it then makes two passes over the logits: measured 0.21
    # vs 0.15 s for the log-sum-exp of a [2048, 75968] fp32 shard, 1 thread).
    M = torch.maximum(main["m"].amax(-1), tail["m"])
    dm, dt = (main["m"] - M[:, None]) * s2, (tail["m"] - M) * s2  # <= 0
    rm, rt = torch.exp2(dm), torch.exp2(dt)

    def merged(key: str, weight: str | None = None) -> torch.Tensor:
        """sum_b (a_b [+ delta_b s_b]) 2^delta_b over the full blocks and the tail."""
        a_m, a_t = main[key], tail[key]
        if weight is not None:
            a_m, a_t = a_m + dm * main[weight], a_t + dt * tail[weight]
        return (a_m * rm).sum(-1) + a_t * rt

    out = {"M": M, "block_max": main["m"], "tail_max": tail["m"], "s_z": merged("s")}
    if ent:
        out["a_zz"] = merged("a_zz", "s")
    if w is not None:
        out["s_w"] = merged("s_w")
        out["a_zw"] = merged("a_zw", "s")
        if rev:
            out["a_ww"] = merged("a_ww", "s_w")
            out["a_wz"] = merged("a_wz", "s_w")
    return out


# One top-level function per variant: dynamo keeps its compiled graphs per code object (recompile limit 8 each), so
# separate functions keep every variant x dtype within the limit without touching global dynamo settings.
def _fwd_lse0(x, s2):
    """log-prob only, first try: ``s = sum 2^(x log2(e) / T)`` with no shift at all. The shifted kernels below
    wait on each block's max before its exponentials (a max loop, a horizontal reduction, then the exponential
    loop, block after block); with no max this is one streaming pass of exponentials, summed two-level (blocks of
    `BLOCK`, then the blocks and the tail) for accuracy: 0.034-0.041 s against 0.067-0.080 s for `_fwd_lse` on a
    [2048, 75968] fp32 shard, 1 thread, AVX-512. Chunks with a row whose sum over- or underflows (logits beyond ~88,
    or all below ~-69) are redone by the caller with the shifted `_fwd_lse`, as the eager path does (`_sum_ok`).
    Each term's relative error is ~eps |x| log2(e), the precision fp32 logits of that size carry anyway."""
    c, n = x.shape
    q = (n - 1) // BLOCK
    cd = s2.dtype
    main = torch.exp2(x[:, : q * BLOCK].reshape(c, q, BLOCK).to(cd) * s2).sum(-1).sum(-1)
    return {"s_z": main + torch.exp2(x[:, q * BLOCK :].to(cd) * s2).sum(-1)}


def _fwd_lse(x, s2):
    """log-prob only, shifted: the log-sum-exp partials relative to the row max (chunks `_fwd_lse0` cannot take);
    also the margin's block maxima when the margin is wanted without entropy or KL."""
    return _row_partials(x, None, s2, ent=False, rev=False)


def _fwd_ent(x, s2):
    """+ sum p (z - m): entropy (and anything else needing E_p[z]) without a second distribution."""
    return _row_partials(x, None, s2, ent=True, rev=False)


def _fwd_kl(x, w, s2):
    """+ the second distribution's log-sum-exp and sum p (w - m): KL(pi || q)."""
    return _row_partials(x, w, s2, ent=True, rev=False)


def _fwd_kl_rev(x, w, s2):
    """+ sum q (w - m), sum q (z - m): KL(q || pi)."""
    return _row_partials(x, w, s2, ent=True, rev=True)


def _log2p(x, lse_x, s2):
    """log2 p = (x - T lse) log2(e) / T, [T, V] (difference first: precision near the max)."""
    return (x.to(s2.dtype) - lse_x[:, None]) * s2


# Gradient math per element (compute dtype). The kernels below only round it into the logits' dtype: the one-hot
# term (+lp at the target column) and the zero on padding columns are patched afterwards on the few elements they
# touch (`patch_gradient`), because per-element index masks (an int64 arange compared twice per element) cost more
# than the gradient math: 0.32 vs 0.23 s for a [2048, 75968] fp32 shard (1 thread).
def _gz_x(x, lse_x, s2, alpha, beta2):
    """grad_z = p (alpha + beta log p)  (log-prob, entropy)."""
    lp2 = _log2p(x, lse_x, s2)
    return torch.exp2(lp2) * (alpha[:, None] + beta2[:, None] * lp2)


def _gz_xw(x, w, lse_x, lse_w, s2, alpha, beta2, gamma2):
    """grad_z = p (alpha + beta log p + gamma log q)  (+ KL(pi || q))."""
    lp2 = _log2p(x, lse_x, s2)
    lq2 = _log2p(w, lse_w, s2)
    return torch.exp2(lp2) * (alpha[:, None] + beta2[:, None] * lp2 + gamma2[:, None] * lq2)


def _gz_xwq(x, w, lse_x, lse_w, s2, alpha, beta2, gamma2, klr):
    """grad_z = p (alpha + beta log p + gamma log q) - klr q  (+ KL(q || pi))."""
    lp2 = _log2p(x, lse_x, s2)
    lq2 = _log2p(w, lse_w, s2)
    f = alpha[:, None] + beta2[:, None] * lp2 + gamma2[:, None] * lq2
    return torch.exp2(lp2) * f - klr[:, None] * torch.exp2(lq2)


def _g_both(x, w, lse_x, lse_w, s2, alpha, beta2, gamma2, klr, alpha_w, klr2, kl):
    """grad_z as in `_gz_xwq`, grad_w = q (alpha_w + klr (log q - log p)) - kl p."""
    lp2 = _log2p(x, lse_x, s2)
    lq2 = _log2p(w, lse_w, s2)
    p, q = torch.exp2(lp2), torch.exp2(lq2)
    gz = p * (alpha[:, None] + beta2[:, None] * lp2 + gamma2[:, None] * lq2) - klr[:, None] * q
    gw = q * (alpha_w[:, None] + klr2[:, None] * (lq2 - lp2)) - kl[:, None] * p
    return gz, gw


def _bwd_gz_x(x, *args):
    return _gz_x(x, *args).to(x.dtype)


def _bwd_gz_xw(x, w, *args):
    return _gz_xw(x, w, *args).to(x.dtype)


def _bwd_gz_xwq(x, w, *args):
    return _gz_xwq(x, w, *args).to(x.dtype)


def _bwd_both(x, w, *args):
    """Both gradients in one pass (the second logits need a gradient too)."""
    gz, gw = _g_both(x, w, *args)
    return gz.to(x.dtype), gw.to(w.dtype)


_GRAD_MATH = {"_bwd_gz_x": _gz_x, "_bwd_gz_xw": _gz_xw, "_bwd_gz_xwq": _gz_xwq, "_bwd_both": _g_both}


def patch_gradient(name, grads, inputs, args, n_valid, rows=None, cols=None, lp=None):
    """Finish the gradients a backward kernel returned, in place: zero on padding columns ``>= n_valid`` (of each of
    ``grads``), and at the target elements ``(rows, cols)`` of ``grads[0]`` the kernel's value plus ``lp[rows]``,
    recomputed from the same per-element math (`_GRAD_MATH`) in the compute dtype and rounded once, as the
    gradient's other elements are. ``inputs``/``args``: the kernel's logits tensors and its other arguments (the
    1-D ones are per-row coefficients [T] and are indexed by ``rows``; the 0-dim scale is passed as is)."""
    for g in grads:
        if n_valid < g.shape[1]:
            g[:, n_valid:] = 0
    if rows is None or rows.numel() == 0:
        return
    picked = [t[rows, cols].unsqueeze(1) for t in inputs]
    sel = [a[rows] if torch.is_tensor(a) and a.dim() == 1 else a for a in args]
    val = _GRAD_MATH[name](*picked, *sel)
    val = val[0] if isinstance(val, tuple) else val
    grads[0][rows, cols] = (val.squeeze(1) + lp[rows]).to(grads[0].dtype)


_KERNELS = {
    f.__name__: f
    for f in (_fwd_lse0, _fwd_lse, _fwd_ent, _fwd_kl, _fwd_kl_rev, _bwd_gz_x, _bwd_gz_xw, _bwd_gz_xwq, _bwd_both)
}


# ---------------------------------------------------------------------------------------- compilation bookkeeping
class _State:
    compiled: dict = {}
    disabled: str | None = None  # reason, once a compilation failed or torch.compile is unavailable
    checked: bool = False  # torch.compile's availability was checked
    graphs: Counter = Counter()  # graphs compiled per kernel (the first per variant + every recompile)
    compile_s: float = 0.0
    calls: int = 0
    calls_by_kernel: Counter = Counter()  # compiled calls made per kernel (which variants a call actually took)


def _counting_backend(name):
    from torch._dynamo import lookup_backend

    inductor = lookup_backend("inductor")

    def backend(gm, example_inputs):
        _State.graphs[name] += 1
        return inductor(gm, example_inputs)

    return backend


def _get(name: str):
    fn = _State.compiled.get(name)
    if fn is None:
        fn = _State.compiled[name] = torch.compile(_KERNELS[name], dynamic=True, backend=_counting_backend(name))
    return fn


def disabled_reason() -> str | None:
    """Why the compiled path is off in this process (None while it is usable)."""
    if _State.disabled is None and not _State.checked:
        _State.checked = True
        try:
            import torch._dynamo  # noqa: F401

            if not torch._dynamo.is_dynamo_supported():
                _disable("torch.compile is not supported on this Python/platform")
        except Exception as e:  # an import failure of dynamo itself
            _disable(f"torch.compile unavailable ({type(e).__name__}: {e})")
    return _State.disabled


def _disable(reason: str) -> None:
    _State.disabled = reason
    msg = f"megatron_rlvr.ops: compiled fused statistics off, using the eager path: {reason}"
    log.warning(msg)
    warnings.warn(msg, RuntimeWarning, stacklevel=3)


def run(name: str, *args):
    """Call compiled kernel `name`; None (and the eager path from then on) if compilation is impossible or fails."""
    if _State.disabled is not None or (not _State.checked and disabled_reason() is not None):
        return None
    before = sum(_State.graphs.values())
    t0 = time.perf_counter()
    try:
        # no duck sizing: equal sizes (T == V/tp, a chunk == its base) must not become one symbol (a guard that
        # recompiles when they differ)
        with torch.fx.experimental._config.patch(use_duck_shape=False):
            # detached inputs: plain tensors, not views, so the graph does not guard on a view's base (another
            # graph for every base layout: 3-D logits, a chunk of a larger tensor, ...)
            out = _get(name)(*(a.detach() if torch.is_tensor(a) else a for a in args))
    except Exception as e:  # the compiler chain (dynamo, inductor, the C++/Triton toolchain); the math is pure
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        _disable(f"{name} failed to compile or run ({type(e).__name__}: {first})")
        return None
    if sum(_State.graphs.values()) != before:
        _State.compile_s += time.perf_counter() - t0
    _State.calls += 1
    _State.calls_by_kernel[name] += 1
    return out


def compile_stats() -> dict:
    """Graphs compiled per kernel, their total (first compilations + recompiles), seconds spent in calls that
    compiled, compiled calls made (in all and per kernel), and the reason the path is off (None if on)."""
    return {
        "graphs": dict(_State.graphs),
        "total_graphs": sum(_State.graphs.values()),
        "compile_s": _State.compile_s,
        "calls": _State.calls,
        "calls_by_kernel": dict(_State.calls_by_kernel),
        "disabled": _State.disabled,
    }


def reset_compile_stats() -> None:
    """Zero the counters (compiled graphs are kept)."""
    _State.graphs = Counter()
    _State.compile_s = 0.0
    _State.calls = 0
    _State.calls_by_kernel = Counter()


def _chunk_bounds(T: int, n: int, chunk_rows: int | None):
    """Row ranges for the forward; no range of one row unless T == 1 (a size-1 dim would specialise the graph)."""
    c = chunk_rows or max(_MIN_CHUNK_ROWS, _CHUNK_ELEMENTS // max(1, n))
    c = max(2, c) if T > 1 else 1
    bounds = list(range(0, T, c)) + [T]
    if len(bounds) > 2 and bounds[-1] - bounds[-2] == 1:
        del bounds[-2]  # fold a trailing one-row chunk into the previous one
    return list(zip(bounds[:-1], bounds[1:]))


def fwd_name(want: set[str]) -> str:
    """The forward kernel variant for a set of wanted statistics."""
    if "kl_rev" in want:
        return "_fwd_kl_rev"
    if "kl" in want:
        return "_fwd_kl"
    if want - {"logprob", "margin"}:
        return "_fwd_ent"
    return "_fwd_lse"


def scale2(plan, dtype, device) -> torch.Tensor:
    return torch.tensor(1.0 / (_LN2 * plan.temperature), dtype=dtype, device=device)

"""Exact per-token statistics of a policy whose output layer is split over tensor-parallel (TP) ranks.

Each TP rank holds a shard ``logits [T, V/tp]`` of the (padded) vocabulary: rank r owns global token ids
``[r * V/tp, (r + 1) * V/tp)``. Megatron pads the vocabulary to a multiple of ``tp x 128``; ids ``>= vocab_size``
are padding and are excluded from every result and get zero gradient. Per token t, with ``z = logits / temperature``
over the TRUE vocabulary ``j < vocab_size``:

    lse       = log sum_j exp(z_j)                  p_j = exp(z_j - lse)
    logprob   = z_y - lse                                               (y: the given token id)
    entropy   = -sum_j p_j log p_j  = lse - E_p[z]
    margin    = p_(1) - p_(2)                                           (top-2 probabilities; 0 on a tie)
    kl        = KL(pi || q) = sum_j p_j (log p_j - log q_j)             (q: softmax of other_logits / temperature)
    kl_rev    = KL(q || pi) = sum_j q_j (log q_j - log p_j)

Nothing of size V is ever communicated. A forward pass over the shard's tokens in chunks produces per-token
partial statistics relative to a per-shard shift m_r (the shard's row max, or 0 for log-prob alone where that
cannot overflow): s_r = sum exp(z - m_r), a_r = sum exp(z - m_r) (z - m_r), the target logit, the shard's top-2
logits. Then, per call, ONE all-reduce(MAX) of the shifts, ONE all-reduce(SUM) of the rescaled partials
(``x * exp(m_r - M)``: the log-sum-exp merge) and, for the margin, ONE all-gather of each shard's top-2 values
``[T, 2]``. These are exact merges, not approximations.

Gradients (derived analytically; ``d/dlogits = d/dz / temperature``), with log p_j = z_j - lse, log q_j = w_j - lse_w:

    d logprob / d z_j = 1[j = y] - p_j
    d entropy / d z_j = -p_j (log p_j + entropy)
    d kl      / d z_j = p_j (log p_j - log q_j - kl)        d kl     / d w_j = q_j - p_j
    d kl_rev  / d z_j = p_j - q_j                           d kl_rev / d w_j = q_j (log q_j - log p_j - kl_rev)

Each involves only the local element and per-token GLOBAL statistics (lse, entropy, kl) saved from the forward,
so the backward needs no communication: every TP rank computes the gradient of its own shard. This assumes, as
megatron's own ``vocab_parallel_cross_entropy`` does, that the per-token upstream gradient is identical on all
TP ranks (each TP rank evaluates the same loss on the same replicated per-token statistics).

Memory: the autograd Function saves only the input logits (no copy) and O(T) statistics; the backward recomputes
p (and q) chunk by chunk, so extra memory is a few ``chunk x V/tp`` fp32 buffers, independent of T (besides the
gradient itself; measured: 7-8 MiB at T=2048 and at T=8192 for V/tp=75968, tools/bench_vocab_parallel.py). All
arithmetic is in fp32 for bf16/fp16 inputs (fp64 inputs stay fp64). Inputs are never modified: all in-place
arithmetic is on this module's own temporaries.

Precision (fp32 compute): exponentials are evaluated as exp2 of (x - m) * log2(e) / T (half the cost of exp on
CPU); where |m| > 64, or a fast path would overflow, the exact max-shifted two-pass form is used instead. Results
and gradients carry rounding of order 1e-7 x max|logit| (the precision of fp32 logits of that size); the tests
compare against float64 full-vocabulary references at tolerance 2e-5 (3e-5 across TP ranks). A bf16 gradient is
the fp32 value rounded once.

The margin is returned detached (stop-gradient). MCPO's margin credit uses p_(1) - p_(2) as a confidence weight on
a token's credit, which multiplies the policy-gradient term like an advantage and must not itself be optimised
(otherwise the policy could raise its loss weight by flattening or sharpening its top-2); it is also not
differentiable where the top-2 tie or swap order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

import megatron_rlvr.ops.compiled as _compiled

__all__ = [
    "FUSED_STATISTICS_MODES",
    "STAT_NAMES",
    "vocab_parallel_token_stats",
    "vocab_parallel_logprobs",
    "vocab_parallel_entropy",
    "vocab_parallel_top2_margin",
    "vocab_parallel_kl",
]

STAT_NAMES = ("logprob", "entropy", "margin", "kl", "kl_rev")
"""Statistics `vocab_parallel_token_stats` can return (keys of its ``want`` argument and of its result)."""

FUSED_STATISTICS_MODES = ("eager", "compiled")
"""Implementations of the per-shard math: "eager" (chunked torch ops, the reference) or "compiled" (torch.compile /
inductor kernels of `megatron_rlvr.ops.compiled`; falls back to eager with one warning if compilation fails). Chosen
per call (``impl``); there is no process-wide default."""


# Default chunk budget in elements of one fp32 temporary ([chunk, V/tp]). On CPU small chunks keep the several
# passes over a chunk inside the last-level cache; on GPU larger chunks amortise kernel launches.
_CPU_CHUNK_ELEMENTS = 1 << 19
_GPU_CHUNK_ELEMENTS = 1 << 26
# Row-max search for the margin works on blocks of this many logits (see `_row_top2`).
_TOP2_BLOCK = 256
# Elementwise exponentials are computed as exp(z - m) = 2^((x - m) * log2(e) / T): torch's exp2 costs less than
# half of exp on CPU (Sleef), and the scaling folds into the pass that forms x - m (or converts bf16 to fp32)
# anyway. Per-row scalars (shifts, log-sum-exp, target logit, top-2) stay in nats, differences formed before any
# scaling. exp(z) without a max shift is used only where it cannot overflow (z < 80 < 88.7) and where the
# normaliser exp(-lse) is a normal fp32 number (|lse| < 80); sums below 1e-30 are treated as underflowed.
_LN2 = math.log(2.0)
_LOG2E = 1.0 / _LN2
_UNSHIFTED_MAX = 80.0
_MIN_UNSHIFTED_SUM = 1e-30
# (x - m) * scale is formed in one pass (scale * x - scale * m) while |m| <= this, else exactly in two passes.
_ONE_PASS_SHIFT_MAX = 64.0


@dataclass(frozen=True)
class _Plan:
    """Everything the autograd Function needs besides tensors (validated by `vocab_parallel_token_stats`)."""

    want: tuple[str, ...]
    temperature: float
    tp_group: object
    tp_rank: int
    tp_size: int
    vocab_start: int
    """Global id of this shard's first column."""
    n_valid: int
    """Columns of this shard that hold real (non-padding) tokens: a prefix of the shard."""
    chunk_rows: int
    compute_dtype: torch.dtype
    impl: str = "eager"
    """"eager" or "compiled" (`FUSED_STATISTICS_MODES`)."""
    user_chunk_rows: int | None = None
    """The caller's chunk_size (None: each implementation's own default)."""

    @property
    def need_kl(self) -> bool:
        return "kl" in self.want or "kl_rev" in self.want

    @property
    def scale2(self) -> float:
        """Logits -> base-2 exponent units: exp(x / T) = 2^(x * scale2)."""
        return _LOG2E / self.temperature


# ---------------------------------------------------------------------------------------------------- collectives
def _all_reduce_(t: torch.Tensor, op, plan: _Plan) -> torch.Tensor:
    if plan.tp_size > 1 and t.numel():  # every TP rank has the same T, so all skip together
        # gloo collectives on non-contiguous tensors are silently wrong: always contiguous.
        t = t.contiguous()
        dist.all_reduce(t, op=op, group=plan.tp_group)
    return t


def _all_gather_rows(t: torch.Tensor, plan: _Plan) -> torch.Tensor:
    """[T, k] on every rank -> [T, tp * k] (rank-major)."""
    if plan.tp_size == 1 or t.numel() == 0:
        return t
    t = t.contiguous()
    parts = [torch.empty_like(t) for _ in range(plan.tp_size)]
    dist.all_gather(parts, t, group=plan.tp_group)
    return torch.cat(parts, dim=-1)


# ------------------------------------------------------------------------------------------------ per-chunk pieces
def _row_top2(x: torch.Tensor, block_max: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Largest and second-largest value of every row of ``x [c, n]`` (duplicates count: a tie gives top1 == top2).

    ``torch.topk``/``argmax`` over 76k columns cost ~5x a plain max on CPU, so: one ``amax`` over blocks of
    `_TOP2_BLOCK` columns, top-2 among block maxima (small), then top-2 inside the winning block only. The second
    largest is either the runner-up block's max or the runner-up inside the winning block. ``block_max [c, nb]``
    (blocks of `_TOP2_BLOCK` columns, a ragged tail last; any dtype holding x's values exactly) may be given when
    already computed (the compiled forward does). Returns exact elements of ``x`` (-inf where the row has fewer than
    2 entries), as ``block_max``'s dtype when given."""
    c, n = x.shape
    ninf = torch.tensor(float("-inf"), dtype=x.dtype, device=x.device)
    if n <= _TOP2_BLOCK:
        vals = torch.topk(x, min(2, n), dim=-1).values
        top2 = vals[:, 1] if n >= 2 else ninf.expand(c)
        return vals[:, 0], top2
    q, rem = divmod(n, _TOP2_BLOCK)
    if block_max is None:
        block_max = x[:, : q * _TOP2_BLOCK].unflatten(1, (q, _TOP2_BLOCK)).amax(-1)  # [c, q]
        if rem:
            block_max = torch.cat([block_max, x[:, q * _TOP2_BLOCK :].amax(-1, keepdim=True)], dim=1)
    bvals, bidx = torch.topk(block_max, 2, dim=-1)  # q + (rem > 0) >= 2 blocks here
    cols = bidx[:, :1] * _TOP2_BLOCK + torch.arange(_TOP2_BLOCK, device=x.device)  # [c, B] columns of winning block
    inside = x.gather(1, cols.clamp_max(n - 1))
    inside = inside.masked_fill(cols >= n, ninf)  # the clamped tail duplicates must not fake a tie
    in_vals = torch.topk(inside, 2, dim=-1).values.to(bvals.dtype)
    return bvals[:, 0], torch.maximum(bvals[:, 1], in_vals[:, 1])


def _to_base2(x: torch.Tensor, shift_x: torch.Tensor | None, plan: _Plan, out: torch.Tensor) -> torch.Tensor:
    """``out = (x - shift_x) * log2(e) / temperature`` in the compute dtype, so that ``exp2(out) = exp(z - m)``;
    ``shift_x`` ([c], compute dtype, logits units) is subtracted BEFORE scaling so the result keeps full relative
    precision near the row max. A bf16 ``x``
    promotes exactly through the dimensioned fp32 operand (a python-scalar operand would make torch compute in
    bf16)."""
    if shift_x is None:
        return torch.mul(x, _scale_tensor(plan, out), out=out)
    if bool(shift_x.abs().max() <= _ONE_PASS_SHIFT_MAX):
        # one pass: scale * x - scale * shift; rounding error <= ulp(scale * |x|), i.e. ~1e-7 x |logit| relative
        # in exp(z - m): the precision the fp32 logits carry anyway for logits of this size
        return torch.add((shift_x * -plan.scale2).unsqueeze(-1), x, alpha=plan.scale2, out=out)
    return torch.sub(x, shift_x.unsqueeze(-1), out=out).mul_(plan.scale2)


def _scale_tensor(plan: _Plan, like: torch.Tensor) -> torch.Tensor:
    """log2(e) / T as a [1, 1] tensor of the compute dtype (dimensioned, so a bf16 operand promotes exactly)."""
    return torch.full((1, 1), plan.scale2, dtype=like.dtype, device=like.device)


# (Per-row coefficients are applied with mul/add: torch.addcmul with a broadcast [c, 1] factor measured 4-5x slower
# than mul + add on CPU.)
def _rowdot(a: torch.Tensor, b: torch.Tensor, tmp: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = sum_j a[:, j] * b[:, j] via a reusable temporary (no allocation of a [c, n] product; torch's cascade
    sum is ~40x more accurate than a BLAS dot over 10^5 fp32 terms, measured, and as fast here)."""
    return torch.sum(torch.mul(a, b, out=tmp), -1, out=out)


def _sum_ok(s: torch.Tensor) -> torch.Tensor:
    """Rows whose unshifted sum of exp(z) is usable: finite (no term overflowed, i.e. every z < 88.7) and not so
    small that denormal terms matter."""
    return torch.isfinite(s) & (s >= _MIN_UNSHIFTED_SUM)


class _Buffers:
    """Reusable [chunk, n_valid] temporaries of the compute dtype, allocated on first use."""

    def __init__(self, rows: int, cols: int, dtype: torch.dtype, device: torch.device):
        self.rows, self.cols, self.dtype, self.device = rows, cols, dtype, device
        self._bufs: dict[str, torch.Tensor] = {}

    def get(self, name: str, c: int) -> torch.Tensor:
        buf = self._bufs.get(name)
        if buf is None:
            buf = self._bufs[name] = torch.empty(self.rows, self.cols, dtype=self.dtype, device=self.device)
        return buf[:c]


# -------------------------------------------------------------------------------------------------------- forward
def _local_partials(logits: torch.Tensor, other: torch.Tensor | None, ids: torch.Tensor | None, plan: _Plan):
    """One chunked pass over this shard: per-token partial statistics relative to a per-row shift m (z units):
    s = sum exp(z - m), a = sum exp(z - m) (z - m), ...

    With entropy/KL/margin the shift is the shard's row max (the margin needs the max anyway, and entropy and KL
    are differences of O(max logit) terms: measured from the max they keep fp32 error ~1e-7 instead of
    ~1e-7 x |max logit|). For log-prob alone no max pass is needed: 2^y is summed unshifted (shift 0), which is as
    accurate for the log-sum-exp, and a chunk is redone with the max shift only if a row's sum overflowed or
    underflowed (`_sum_ok`). Returns a dict of [T] tensors (compute dtype). Inside a chunk the differences are kept
    in base-2 units (see `_to_base2`); the dot products are converted to nats at the end."""
    T = logits.shape[0]
    n = plan.n_valid
    dt = plan.compute_dtype
    dev = logits.device
    want = set(plan.want)
    need_max = bool(want - {"logprob"})
    need_ey = "entropy" in want or "kl" in want  # sum_j e_j (z_j - m)
    inv_t = 1.0 / plan.temperature
    out: dict[str, torch.Tensor] = {}

    def new(name: str, fill: float = 0.0) -> torch.Tensor:
        out[name] = torch.full((T,), fill, dtype=dt, device=dev)
        return out[name]

    m_z, s_z = new("m_z", float("-inf")), new("s_z")
    # exp(z) cannot overflow on this shard's rows where this is True (used by the backward's unshifted path)
    no_overflow = out["no_overflow"] = torch.zeros(T, dtype=torch.bool, device=dev)
    a_zz = new("a_zz") if need_ey else None
    z_y = new("z_y") if "logprob" in want else None
    top1, top2 = (new("top1", float("-inf")), new("top2", float("-inf"))) if "margin" in want else (None, None)
    if plan.need_kl:
        new("m_w", float("-inf")), new("s_w")
        if "kl" in want:
            new("a_zw")
        if "kl_rev" in want:
            new("a_ww"), new("a_wz")
    if n == 0 or T == 0:  # this shard is all padding: contributes nothing (shift -inf, sums 0)
        no_overflow.fill_(True)
        return out
    if z_y is not None:
        z_y.copy_(_target_logit(logits, ids, plan))

    bufs = _Buffers(min(plan.chunk_rows, T), n, dt, dev)
    scale_t = _scale_tensor(plan, s_z)
    for a in range(0, T, plan.chunk_rows):
        b = min(a + plan.chunk_rows, T)
        c = b - a
        x = logits[a:b, :n]  # a view; padded columns are simply not part of it
        if not need_max:
            e_z = torch.mul(x, scale_t, out=bufs.get("e_z", c)).exp2_()
            s = torch.sum(e_z, -1, out=s_z[a:b])
            if bool(_sum_ok(s).all()):
                m_z[a:b] = 0.0
                continue
        # Row max (and the runner-up for the margin) in logits units: exact elements of x.
        if top2 is not None:
            mx, second = _row_top2(x)
            top1[a:b] = mx.to(dt) * inv_t
            top2[a:b] = second.to(dt) * inv_t
        else:
            mx = x.amax(-1)
        mx = mx.to(dt)
        torch.mul(mx, inv_t, out=m_z[a:b])
        d_z = _to_base2(x, mx, plan, bufs.get("d_z", c))  # (z - m) log2(e) (<= 0)
        if need_ey or "kl_rev" in want:
            e_z = torch.exp2(d_z, out=bufs.get("e_z", c))
        else:
            e_z = d_z.exp2_()  # d_z no longer needed: exponentiate our own buffer in place
        torch.sum(e_z, -1, out=s_z[a:b])
        tmp = bufs.get("tmp", c) if (need_ey or plan.need_kl) else None
        if a_zz is not None:
            _rowdot(e_z, d_z, tmp, out=a_zz[a:b])
        if plan.need_kl:
            _other_partials(other[a:b, :n], mx, e_z, d_z, tmp, out, a, b, plan, bufs)
    for k in ("a_zz", "a_zw", "a_ww", "a_wz"):  # base-2 differences -> nats
        if k in out:
            out[k].mul_(_LN2)
    # exp(z) cannot overflow where the shift (0 for unshifted rows, whose finite sum proved it) is < 80
    torch.lt(m_z, _UNSHIFTED_MAX, out=no_overflow)
    return out


def _target_logit(logits: torch.Tensor, ids: torch.Tensor, plan: _Plan) -> torch.Tensor:
    """[T]: the target token's logit / temperature on the rank that owns it, 0 elsewhere (one gather for all
    tokens; the all-reduce of the merge then gives every rank the value)."""
    n, dt = plan.n_valid, plan.compute_dtype
    loc = ids - plan.vocab_start
    mine = (loc >= 0) & (loc < n)
    picked = logits[:, :n].gather(1, loc.clamp(0, n - 1).unsqueeze(-1)).squeeze(-1).to(dt) * (1.0 / plan.temperature)
    return torch.where(mine, picked, torch.zeros((), dtype=dt, device=logits.device))


def _other_partials(xw, mx, e_z, d_z, tmp, out: dict[str, torch.Tensor], a: int, b: int, plan: _Plan, bufs) -> None:
    """The second distribution's partials of rows a:b into ``out`` (its shift m_w and sum s_w, and the dot products
    a_zw for KL, a_ww / a_wz for the reverse KL), given the chunk's logits ``xw`` [c, n], z's row max ``mx`` and
    z's base-2 differences ``d_z`` and exponentials ``e_z``."""
    c = b - a
    a_zw, a_ww, a_wz = out.get("a_zw"), out.get("a_ww"), out.get("a_wz")
    # Shift w by z's max: the two distributions are usually close, so this saves a max pass over w; if some row's
    # sum over- or underflows, redo the chunk with w's own max.
    for attempt in range(2):
        mxw = mx if attempt == 0 else xw.amax(-1).to(plan.compute_dtype)
        d_w = _to_base2(xw, mxw, plan, bufs.get("d_w", c))
        if a_zw is not None:
            _rowdot(e_z, d_w, tmp, out=a_zw[a:b])
        e_w = torch.exp2(d_w, out=bufs.get("e_w", c)) if a_ww is not None else d_w.exp2_()
        sw = torch.sum(e_w, -1, out=out["s_w"][a:b])
        if attempt == 1 or bool(_sum_ok(sw).all()):
            break
    torch.mul(mxw, 1.0 / plan.temperature, out=out["m_w"][a:b])
    if a_ww is not None:
        _rowdot(e_w, d_w, tmp, out=a_ww[a:b])
        _rowdot(e_w, d_z, tmp, out=a_wz[a:b])


def _merge(part: dict[str, torch.Tensor], plan: _Plan) -> dict[str, torch.Tensor]:
    """Exact merge of the shards' partials: all-reduce(MAX) of shifts, rescale, all-reduce(SUM), top-2 all-gather.

    Returns global per-token values: the requested statistics, plus for the backward lse_z (and lse_w) and the rows
    where it may skip the shift."""
    want = set(plan.want)
    maxes = [part["m_z"]] + ([part["m_w"]] if plan.need_kl else [])
    glob_max = _all_reduce_(torch.stack(maxes, dim=-1), dist.ReduceOp.MAX, plan)
    M_z = glob_max[:, 0]
    # Log-sum-exp merge: a partial taken relative to the shard's shift m_r is rescaled by exp(m_r - M) to the
    # global shift M. A shard with no valid columns has m_r = -inf and zero partials: force its terms to 0
    # explicitly (0 * (-inf) would be NaN).
    has = part["s_z"] > 0
    r_z = torch.exp(part["m_z"] - M_z)
    dm_z = torch.where(has, part["m_z"] - M_z, torch.zeros_like(M_z))  # m_r - M (<= 0)
    names, cols = ["s_z"], [part["s_z"] * r_z]
    if "a_zz" in part:  # sum e (z - M) = sum e (z - m_r) + (m_r - M) sum e
        names.append("a_zz")
        cols.append((part["a_zz"] + dm_z * part["s_z"]) * r_z)
    if "z_y" in part:
        names.append("z_y")
        cols.append(part["z_y"])  # only the owning shard is non-zero
    if plan.need_kl:
        M_w = glob_max[:, 1]
        r_w = torch.exp(part["m_w"] - M_w)
        dm_w = torch.where(has, part["m_w"] - M_w, torch.zeros_like(M_w))
        names.append("s_w")
        cols.append(part["s_w"] * r_w)
        if "a_zw" in part:  # sum e_z (w - M_w)
            names.append("a_zw")
            cols.append((part["a_zw"] + dm_w * part["s_z"]) * r_z)
        if "a_ww" in part:  # sum e_w (w - M_w), sum e_w (z - M_z)
            names += ["a_ww", "a_wz"]
            cols.append((part["a_ww"] + dm_w * part["s_w"]) * r_w)
            cols.append((part["a_wz"] + dm_z * part["s_w"]) * r_w)
    summed = _all_reduce_(torch.stack(cols, dim=-1), dist.ReduceOp.SUM, plan)
    g = {name: summed[:, i] for i, name in enumerate(names)}

    res: dict[str, torch.Tensor] = {}
    log_s_z = torch.log(g["s_z"])
    res["lse_z"] = M_z + log_s_z
    # Rows where the backward may use p = exp(z) * exp(-lse) (one pass fewer than exp(z - lse)).
    res["bwd_unshifted"] = part["no_overflow"] & (res["lse_z"].abs() < _UNSHIFTED_MAX)
    if "logprob" in want:
        res["logprob"] = (g["z_y"] - M_z) - log_s_z
    mean_dz = g["a_zz"] / g["s_z"] if "a_zz" in g else None  # E_p[z] - M_z
    if "entropy" in want:
        res["entropy"] = log_s_z - mean_dz  # lse - E_p[z], both relative to M_z
    if plan.need_kl:
        log_s_w = torch.log(g["s_w"])
        res["lse_w"] = M_w + log_s_w
        if "kl" in want:  # E_p[log p] - E_p[log q]
            res["kl"] = (mean_dz - log_s_z) - (g["a_zw"] / g["s_z"] - log_s_w)
        if "kl_rev" in want:  # E_q[log q] - E_q[log p]
            res["kl_rev"] = (g["a_ww"] / g["s_w"] - log_s_w) - (g["a_wz"] / g["s_w"] - log_s_z)
    if "margin" in want:
        # Global top-2 from every shard's local top-2: exact, ties give exactly 0.
        cand = _all_gather_rows(torch.stack([part["top1"], part["top2"]], dim=-1), plan)
        top = torch.topk(cand, 2, dim=-1).values
        res["margin"] = torch.exp(top[:, 0] - res["lse_z"]) - torch.exp(top[:, 1] - res["lse_z"])
    return res


# ------------------------------------------------------------------------------------------------------- backward
def _grad_coefficients(plan: _Plan, grads: dict[str, torch.Tensor], saved: dict[str, torch.Tensor]):
    """Per-token coefficients ([T], already divided by temperature; None = term absent) of

        grad_z = p * (alpha + beta * log p + gamma * log q) - klr * q + lp * onehot(y)
        grad_w = q * (alpha_w + klr * (log q - log p)) - kl * p

    obtained by collecting the per-statistic formulas of the module docstring weighted by their upstream grads
    (log p, log q in nats)."""
    inv_t = 1.0 / plan.temperature
    g = {k: v.to(plan.compute_dtype) * inv_t for k, v in grads.items()}
    lp, ent, kl, klr = g.get("logprob"), g.get("entropy"), g.get("kl"), g.get("kl_rev")

    def total(*terms):
        terms = [t for t in terms if t is not None]
        return sum(terms[1:], terms[0]) if terms else None

    return dict(
        lp=lp,
        kl=kl,
        klr=klr,
        alpha=total(
            -lp if lp is not None else None,
            -ent * saved["entropy"] if ent is not None else None,
            -kl * saved["kl"] if kl is not None else None,
            klr,
        ),
        beta=total(kl, -ent if ent is not None else None),
        gamma=-kl if kl is not None else None,
        alpha_w=total(kl, -klr * saved["kl_rev"] if klr is not None else None),
    )


def _backward(plan: _Plan, logits, other, ids, saved, grads, need_gz: bool, need_gw: bool):
    """Chunked recompute of p (and q) and the gradient formulas of `_grad_coefficients`; no communication."""
    T = logits.shape[0]
    n = plan.n_valid
    dt = plan.compute_dtype
    co = _grad_coefficients(plan, grads, saved)
    grad_z = torch.empty_like(logits, memory_format=torch.contiguous_format) if need_gz else None
    grad_w = torch.empty_like(other, memory_format=torch.contiguous_format) if need_gw else None
    for gt in (grad_z, grad_w):
        if gt is not None and n < gt.shape[1]:
            gt[:, n:] = 0  # padded vocabulary entries get zero gradient
    if n == 0 or T == 0:
        return grad_z, grad_w
    lse_z = saved["lse_z"]
    lse_w = saved.get("lse_w")
    # Fast path, where exp(z) cannot overflow (rows flagged by the forward): p = exp(z) * c with c = exp(-lse), and
    #     p * (alpha + beta log p + gamma log q) = exp(z) * (A + B x + G w),
    #     A = c (alpha - beta lse_z - gamma lse_w),  B = c beta / T,  G = c gamma / T
    # (log p = x / T - lse_z, log q = w / T - lse_w): exp, the factor and the product in 6 cheap passes instead of
    # 9. The price is rounding at the scale of the logits (~1e-7 x |logit| relative to the gradient), as in the fp32
    # logits themselves. kl_rev (needs q) and gradients w.r.t. other_logits take the general path below.
    fast_ok = need_gz and not need_gw and co["klr"] is None
    if fast_ok:
        fast_chunks, fast_A, fast_B, fast_G = _fast_factors(plan, co, saved, T)
    if co["lp"] is not None:  # the target tokens this shard owns, and where each chunk's start in that list
        t_rows, t_cols = _owned_targets(ids, plan)
        t_start = torch.searchsorted(
            t_rows, torch.arange(0, T + plan.chunk_rows, plan.chunk_rows, device=t_rows.device)
        ).tolist()
    # general path: log2 p / log2 q buffers (coefficients take the ln2); q when kl_rev flows to z or for grad_w
    beta2 = co["beta"] * _LN2 if co["beta"] is not None else None
    gamma2 = co["gamma"] * _LN2 if co["gamma"] is not None else None
    klr2 = co["klr"] * _LN2 if co["klr"] is not None else None
    need_logq = (need_gz and gamma2 is not None) or need_gw
    need_q = (need_gz and klr2 is not None) or need_gw
    need_logp_kept = (need_gz and beta2 is not None) or need_gw
    same_dtype = grad_z is not None and grad_z.dtype == dt
    bufs = _Buffers(min(plan.chunk_rows, T), n, dt, logits.device)
    scale_t = _scale_tensor(plan, lse_z)
    for i, a in enumerate(range(0, T, plan.chunk_rows)):
        b = min(a + plan.chunk_rows, T)
        c = b - a
        x = logits[a:b, :n]
        gz_view = grad_z[a:b, :n] if need_gz else None
        if co["lp"] is not None:
            rows, cols = t_rows[t_start[i] : t_start[i + 1]] - a, t_cols[t_start[i] : t_start[i + 1]]
        if fast_ok and fast_chunks[i]:
            f_B, f_G = (fast_B[a:b] if fast_B is not None else None), (fast_G[a:b] if fast_G is not None else None)
            w = other[a:b, :n] if f_G is not None else None
            e, f = _fast_chunk(x, w, scale_t, fast_A[a:b], f_B, f_G, bufs, gz_view)
            if co["lp"] is not None:
                # + lp at the target token: write the exact e * f + lp, rounded once (adding lp to an already
                # rounded bf16 value would lose everything for a confident token, where e * f ~ -lp)
                val = e[rows, cols] * f.expand(c, n)[rows, cols] + co["lp"][a:b][rows]
                gz_view[rows, cols] = val.to(gz_view.dtype)
            continue
        target = (gz_view if same_dtype else bufs.get("gz", c)) if need_gz else None
        logp = _to_base2(x, lse_z[a:b] * plan.temperature, plan, bufs.get("logp", c))  # log2 p
        p = torch.exp2(logp, out=bufs.get("p", c)) if need_logp_kept else logp.exp2_()
        logq = q = None
        if need_logq or need_q:
            logq = _to_base2(other[a:b, :n], lse_w[a:b] * plan.temperature, plan, bufs.get("logq", c))
            if need_q:
                q = torch.exp2(logq, out=bufs.get("q", c))
        if need_gw:
            coefs = (_chunk_col(co["alpha_w"], a, b), _chunk_col(klr2, a, b), _chunk_col(co["kl"], a, b))
            grad_w[a:b, :n] = _grad_w_chunk(p, logp, q, logq, *coefs, bufs)
        if need_gz:
            coefs = (_chunk_col(co["alpha"], a, b), _chunk_col(beta2, a, b), _chunk_col(gamma2, a, b))
            _grad_z_chunk(p, logp, q, logq, *coefs, _chunk_col(co["klr"], a, b), target)
            if co["lp"] is not None:
                target[rows, cols] += co["lp"][a:b][rows]
            if not same_dtype:
                gz_view.copy_(target)
    return grad_z, grad_w


def _chunk_col(v_T: torch.Tensor | None, a: int, b: int) -> torch.Tensor | None:
    """Rows a:b of a per-token coefficient as a ``[c, 1]`` column (None stays None: the term is absent)."""
    return v_T[a:b, None] if v_T is not None else None


def _grad_z_chunk(p, logp, q, logq, alpha, beta, gamma, klr, target) -> None:
    """One chunk of the general path's gradient w.r.t. the logits into ``target``:
    ``p * (alpha + beta log p + gamma log q) - klr * q`` (``[c, n]``; log p, log q in base 2 and ``beta``, ``gamma``
    with their ln 2; None: that term is absent). Overwrites the log p and log q buffers (the caller's scratch)."""
    if beta is not None:
        # factor = alpha + beta log p (+ gamma log q), built in the log p buffer (ours)
        factor = logp.mul_(beta)
        if alpha is not None:
            factor.add_(alpha)
        if gamma is not None:
            factor.add_(logq.mul_(gamma))  # logq (ours) is not needed after this
        torch.mul(p, factor, out=target)
    elif alpha is not None:
        torch.mul(p, alpha, out=target)
    else:
        target.zero_()
    if klr is not None:
        target.sub_(q.mul_(klr))


def _grad_w_chunk(p, logp, q, logq, alpha_w, klr, kl, bufs: _Buffers) -> torch.Tensor:
    """One chunk of the gradient w.r.t. the other logits, ``q * (alpha_w + klr * (log q - log p)) - kl * p``
    (``[c, n]``; log p, log q in base 2 and ``klr`` with its ln 2; ``klr`` / ``kl`` None: that term is absent)."""
    t = bufs.get("tw", p.shape[0])
    if klr is not None:
        torch.sub(logq, logp, out=t).mul_(klr).add_(alpha_w)
        gw = t.mul_(q)
    else:
        gw = torch.mul(q, alpha_w, out=t)
    if kl is not None:
        gw.sub_(torch.mul(p, kl, out=bufs.get("tmp", p.shape[0])))
    return gw


def _fast_factors(plan: _Plan, co: dict, saved: dict, T: int):
    """The backward's fast path (see `_backward`): whether each chunk may take it (all its rows unshifted; one host
    sync for all chunks) and the row factors A, B, G ``[T, 1]`` (B, G None when beta, gamma are)."""
    lse_z, lse_w = saved["lse_z"], saved.get("lse_w")
    inv_t = 1.0 / plan.temperature
    flags = saved["bwd_unshifted"]
    pad = (-T) % plan.chunk_rows
    if pad:
        flags = torch.cat([flags, flags.new_ones(pad)])
    fast_chunks = flags.view(-1, plan.chunk_rows).all(-1).tolist()
    c_row = torch.exp(-lse_z)
    alpha = co["alpha"] if co["alpha"] is not None else torch.zeros_like(c_row)
    fast_B = fast_G = None
    if co["beta"] is not None:
        alpha = alpha - co["beta"] * lse_z
        fast_B = (c_row * co["beta"] * inv_t)[:, None]
    if co["gamma"] is not None:
        alpha = alpha - co["gamma"] * lse_w
        fast_G = (c_row * co["gamma"] * inv_t)[:, None]
    return fast_chunks, (c_row * alpha)[:, None], fast_B, fast_G


def _fast_chunk(x, w, scale_t, A, B, G, bufs: _Buffers, gz_view):
    """One chunk of the fast path: ``gz_view = exp(z) * (A + B x + G w)`` (``[c, n]``); returns exp(z) and the
    factor (``[c, n]``, or A ``[c, 1]``) for the target tokens' fix-up."""
    c = x.shape[0]
    e = torch.mul(x, scale_t, out=bufs.get("p", c)).exp2_()
    if B is None:
        f = A
    else:
        f = torch.mul(x, B, out=bufs.get("factor", c)).add_(A)
        if G is not None:
            f.add_(torch.mul(w, G, out=bufs.get("tmp", c)))
    # computed in the compute dtype and rounded once into the gradient's dtype (bf16 needs no fp32 copy)
    torch.mul(e, f, out=gz_view)
    return e, f


def _owned_targets(ids: torch.Tensor, plan: _Plan) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, local columns) of the target tokens that this shard owns."""
    loc = ids - plan.vocab_start
    rows = torch.nonzero((loc >= 0) & (loc < plan.n_valid)).squeeze(-1)
    return rows, loc[rows]


# ---------------------------------------------------------------------------------------- compiled local math
def _partial_keys(plan: _Plan) -> list[str]:
    """The keys `_local_partials` returns for this plan (both implementations return exactly these, so all TP
    ranks all-reduce the same columns whichever path each chunk took)."""
    want = set(plan.want)
    keys = ["m_z", "s_z", "no_overflow"]
    if "entropy" in want or "kl" in want:
        keys.append("a_zz")
    if "logprob" in want:
        keys.append("z_y")
    if "margin" in want:
        keys += ["top1", "top2"]
    if plan.need_kl:
        keys += ["m_w", "s_w"]
        if "kl" in want:
            keys.append("a_zw")
        if "kl_rev" in want:
            keys += ["a_ww", "a_wz"]
    return keys


def _local_partials_compiled(logits, other, ids, plan: _Plan):
    """`_local_partials` through the compiled forward kernel (`megatron_rlvr.ops.compiled`), row chunk by row
    chunk; chunks where the second distribution over/underflows against the first one's shift take the eager path
    (which retries with its own max). On the CPU, log-prob alone tries the unshifted `_fwd_lse0` first (m_z = 0,
    as on the eager path). None if the compiled path is unavailable (the caller runs eager)."""
    T, n = logits.shape[0], plan.n_valid
    if T < 2 or n < _compiled.MIN_COLUMNS:
        return None
    dt, dev = plan.compute_dtype, logits.device
    inv_t = 1.0 / plan.temperature
    name = _compiled.fwd_name(set(plan.want))
    s2 = _compiled.scale2(plan, dt, dev)
    keys = _partial_keys(plan)
    pieces: dict[str, list[torch.Tensor]] = {k: [] for k in keys}
    # Log-prob alone needs no max (the margin does): on the CPU, unshifted sums first, as on the eager path (there the
    # shifted kernel's wait on each block's max costs more than the per-chunk check). A GPU keeps the one-pass
    # shifted kernel: its block max costs no extra read there, and the check would sync the host once per chunk.
    unshifted_first = set(plan.want) == {"logprob"} and dev.type == "cpu"
    for a, b in _compiled._chunk_bounds(T, n, plan.user_chunk_rows):
        x = logits[a:b, :n]
        if unshifted_first:
            out = _compiled.run("_fwd_lse0", x, s2)
            if out is None:
                return None
            if bool(_sum_ok(out["s_z"]).all()):
                c = b - a
                pieces["m_z"].append(torch.zeros(c, dtype=dt, device=dev))
                pieces["s_z"].append(out["s_z"])
                pieces["no_overflow"].append(torch.ones(c, dtype=torch.bool, device=dev))
                continue
        out = _compiled.run(name, x, s2) if other is None else _compiled.run(name, x, other[a:b, :n], s2)
        if out is None:
            return None
        if plan.need_kl and not bool(_sum_ok(out["s_w"]).all()):
            part = _local_partials(logits[a:b], other[a:b], None if ids is None else ids[a:b], plan)
        else:
            m_z = out["M"] * inv_t
            part = {"m_z": m_z, "s_z": out["s_z"], "no_overflow": m_z < _UNSHIFTED_MAX}
            for k in ("a_zz", "a_zw", "a_ww", "a_wz"):
                if k in keys:
                    part[k] = out[k] * _LN2  # base-2 differences -> nats
            if plan.need_kl:
                part["m_w"], part["s_w"] = m_z, out["s_w"]
            if "margin" in plan.want:
                block_max = torch.cat([out["block_max"], out["tail_max"].unsqueeze(1)], dim=1)  # [c, nb]: small
                top1, top2 = _row_top2(x, block_max)
                part["top1"], part["top2"] = top1.to(dt) * inv_t, top2.to(dt) * inv_t
        for k in keys:
            if k != "z_y":
                pieces[k].append(part[k])
    res = {k: torch.cat(v) for k, v in pieces.items() if k != "z_y"}
    if "z_y" in keys:  # the target's logit, on the rank that owns it (one gather for all tokens)
        loc = ids - plan.vocab_start
        mine = (loc >= 0) & (loc < n)
        picked = logits[:, :n].gather(1, loc.clamp(0, n - 1).unsqueeze(-1)).squeeze(-1).to(dt) * inv_t
        res["z_y"] = torch.where(mine, picked, torch.zeros((), dtype=dt, device=dev))
    return res


def _backward_compiled(plan: _Plan, logits, other, ids, saved, grads, need_gz: bool, need_gw: bool):
    """`_backward` through the compiled one-pass gradient kernels; None if the compiled path is unavailable."""
    T, n = logits.shape[0], plan.n_valid
    if T < 2 or n < _compiled.MIN_COLUMNS:
        return None
    dt, dev = plan.compute_dtype, logits.device
    co = _grad_coefficients(plan, grads, saved)
    zeros = torch.zeros(T, dtype=dt, device=dev)

    def z(t):
        return zeros if t is None else t

    s2 = _compiled.scale2(plan, dt, dev)
    lse_x = saved["lse_z"] * plan.temperature  # logits units, so log2 p = (x - lse_x) * s2 (difference first)
    lse_w = saved["lse_w"] * plan.temperature if "lse_w" in saved else None
    rows = cols = None
    if co["lp"] is not None and need_gz:
        rows, cols = _owned_targets(ids, plan)
    alpha, beta2, gamma2 = z(co["alpha"]), z(co["beta"]) * _LN2, z(co["gamma"]) * _LN2
    if need_gw:  # both in one pass (grad_z is dropped if not needed: that case is rare)
        name, inputs = "_bwd_both", (logits, other)
        args = (lse_x, lse_w, s2, alpha, beta2, gamma2, z(co["klr"]), co["alpha_w"], z(co["klr"]) * _LN2, z(co["kl"]))
    elif co["klr"] is not None:
        name, inputs, args = "_bwd_gz_xwq", (logits, other), (lse_x, lse_w, s2, alpha, beta2, gamma2, co["klr"])
    elif co["gamma"] is not None:
        name, inputs, args = "_bwd_gz_xw", (logits, other), (lse_x, lse_w, s2, alpha, beta2, gamma2)
    else:
        name, inputs, args = "_bwd_gz_x", (logits,), (lse_x, s2, alpha, beta2)
    res = _compiled.run(name, *inputs, *args)
    if res is None:
        return None
    grads_out = list(res) if isinstance(res, tuple) else [res]
    _compiled.patch_gradient(name, grads_out, inputs, args, n, rows, cols, co["lp"])
    if need_gw:
        return (grads_out[0] if need_gz else None), grads_out[1]
    return grads_out[0], None


class _TokenStats(torch.autograd.Function):
    """Chunked fused forward, recompute-in-backward. Outputs are in ``plan.want`` order."""

    @staticmethod
    def forward(ctx, logits, other, ids, plan: _Plan):
        part = _local_partials_compiled(logits, other, ids, plan) if plan.impl == "compiled" else None
        if part is None:
            part = _local_partials(logits, other, ids, plan)
        res = _merge(part, plan)
        saved_names = ["lse_z", "bwd_unshifted"] + [k for k in ("lse_w", "entropy", "kl", "kl_rev") if k in res]
        ctx.plan = plan
        ctx.saved_names = saved_names
        ctx.save_for_backward(logits, other, ids, *[res[k] for k in saved_names])
        ctx.set_materialize_grads(False)
        outs = tuple(res[k].clone() for k in plan.want)  # clones: callers may modify outputs in place
        if "margin" in plan.want:
            ctx.mark_non_differentiable(outs[plan.want.index("margin")])
        return outs

    @staticmethod
    @once_differentiable
    def backward(ctx, *grad_outs):
        plan: _Plan = ctx.plan
        logits, other, ids, *stats = ctx.saved_tensors
        saved = dict(zip(ctx.saved_names, stats))
        grads = {k: g for k, g in zip(plan.want, grad_outs) if k != "margin" and g is not None}
        need_gz, need_gw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not grads:
            return None, None, None, None
        need_gw = need_gw and ("kl" in grads or "kl_rev" in grads)
        res = None
        if plan.impl == "compiled":
            res = _backward_compiled(plan, logits, other, ids, saved, grads, need_gz, need_gw)
        grad_z, grad_w = res if res is not None else _backward(plan, logits, other, ids, saved, grads, need_gz, need_gw)
        return grad_z, grad_w, None, None


# ------------------------------------------------------------------------------------------------------ public API
def _group_rank_size(tp_group) -> tuple[int, int]:
    if tp_group is None:
        return 0, 1
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("tp_group was given but torch.distributed is not initialised")
    return dist.get_rank(group=tp_group), dist.get_world_size(group=tp_group)


def vocab_parallel_token_stats(
    logits_TV: torch.Tensor,
    *,
    tp_group=None,
    token_ids_T: torch.Tensor | None = None,
    other_logits_TV: torch.Tensor | None = None,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    want: Sequence[str] = ("logprob",),
    chunk_size: int | None = None,
    impl: str = "eager",
) -> dict[str, torch.Tensor]:
    """Per-token statistics over the FULL vocabulary from this rank's logits shard, in one fused pass.

    Args:
        logits_TV: this rank's shard ``[T, V/tp]`` (leading dims ``[..., V/tp]`` are flattened and restored),
            bf16/fp16/fp32/fp64. Rank r of ``tp_group`` owns global ids ``[r * V/tp, (r+1) * V/tp)``. Never modified.
        tp_group: the tensor-parallel process group, or None for one unsharded shard (no communication; None never
            means the default WORLD group).
        token_ids_T: global token ids ``[T]`` (integer), needed for "logprob"; must lie in ``[0, vocab_size)``.
        other_logits_TV: second distribution's shard (same shape, e.g. reference or old-policy logits), needed for
            "kl" and "kl_rev"; scaled by the same temperature. Gradients flow to it if it requires grad.
        temperature: logits are divided by it (> 0).
        vocab_size: true vocabulary size; global ids ``>= vocab_size`` are padding, excluded from every result and
            given zero gradient. Default: all ``tp x V/tp`` columns are real.
        want: any subset of `STAT_NAMES`: "logprob", "entropy", "margin" (p1 - p2, detached), "kl" (KL(pi||other)),
            "kl_rev" (KL(other||pi)).
        chunk_size: tokens per chunk; extra memory is a few ``chunk_size x V/tp`` compute-dtype buffers. Default
            (None): about 512k elements (2 MiB fp32) per buffer on CPU (cache-sized), 64M on GPU. The compiled
            path holds no [chunk, V/tp] buffers; it uses the chunk only to bound its per-block partials.
        impl: "eager" (the default) or "compiled" (`FUSED_STATISTICS_MODES`); the trainer passes
            ``train.fused_statistics``. Both give the same results to rounding; "compiled" falls back to eager, with
            one warning, where torch.compile is unavailable or fails.

    Returns:
        dict name -> ``[T]`` (or the leading shape) tensor, fp32 (fp64 for fp64 inputs), identical on all TP ranks.
        "logprob", "entropy", "kl", "kl_rev" are differentiable w.r.t. the logits; "margin" is not (see module doc).

    Raises:
        ValueError: on a bad argument, naming it; or if a result is NaN/inf (non-finite logits).
    """
    if not torch.is_tensor(logits_TV) or logits_TV.dim() < 1 or not logits_TV.is_floating_point():
        raise ValueError(f"logits_TV must be a floating-point tensor [..., V/tp], got {_describe(logits_TV)}")
    want_t = _checked_want(want)
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    lead, v_local = tuple(logits_TV.shape[:-1]), logits_TV.shape[-1]
    if v_local < 1:
        raise ValueError("logits_TV has an empty vocabulary dimension")
    tp_rank, tp_size = _group_rank_size(tp_group)
    padded = v_local * tp_size
    vocab_size = padded if vocab_size is None else vocab_size
    if not isinstance(vocab_size, int) or not 1 <= vocab_size <= padded:
        raise ValueError(f"vocab_size must be an int in [1, tp * V/tp = {padded}], got {vocab_size!r}")
    logits = _as_rows(logits_TV)
    other = _other_rows(other_logits_TV, logits_TV) if "kl" in want_t or "kl_rev" in want_t else None
    ids = _token_ids(token_ids_T, lead, vocab_size, logits.device) if "logprob" in want_t else None
    if impl not in FUSED_STATISTICS_MODES:
        raise ValueError(f"impl must be one of {FUSED_STATISTICS_MODES}, got {impl!r}")
    compute_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    n_valid = max(0, min(v_local, vocab_size - tp_rank * v_local))
    chunk_rows = _chunk_rows(chunk_size, n_valid, logits.is_cuda)
    plan = _Plan(
        want=want_t,
        temperature=float(temperature),
        tp_group=tp_group,
        tp_rank=tp_rank,
        tp_size=tp_size,
        vocab_start=tp_rank * v_local,
        n_valid=n_valid,
        chunk_rows=chunk_rows,
        compute_dtype=compute_dtype,
        impl=impl,
        user_chunk_rows=chunk_size,
    )
    outs = _TokenStats.apply(logits, other, ids, plan)
    for name, t in zip(want_t, outs):
        _check_finite(name, t, other is not None)
    return {name: t.reshape(lead) for name, t in zip(want_t, outs)}


def _as_rows(t_TV: torch.Tensor) -> torch.Tensor:
    """``[..., V/tp]`` as ``[T, V/tp]`` rows with unit stride along the vocabulary (a view when it already is)."""
    rows = t_TV.reshape(-1, t_TV.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _check_finite(name: str, t_T: torch.Tensor, with_other: bool) -> None:
    """A non-finite statistic means NaN/inf logits: name the statistic and the first such token."""
    if t_T.numel() and not bool(torch.isfinite(t_T).all()):
        bad = int((~torch.isfinite(t_T)).nonzero()[0, 0])
        raise ValueError(
            f"vocab_parallel_token_stats: {name} is non-finite at token {bad}; logits_TV"
            + (" or other_logits_TV" if with_other else "")
            + " contain NaN/inf"
        )


def _checked_want(want: Sequence[str]) -> tuple[str, ...]:
    """``want`` ordered and de-duplicated; a string, an empty sequence or an unknown name is a ValueError."""
    want_t = tuple(dict.fromkeys(want))
    if isinstance(want, str) or not want_t:
        raise ValueError(f"want must be a non-empty sequence of names from {STAT_NAMES}, got {want!r}")
    unknown = [w for w in want_t if w not in STAT_NAMES]
    if unknown:
        raise ValueError(f"want has unknown statistic(s) {unknown}; available: {STAT_NAMES}")
    return want_t


def _other_rows(other_logits_TV: torch.Tensor | None, logits_TV: torch.Tensor) -> torch.Tensor:
    """The second distribution's shard as contiguous rows ``[T, V/tp]``, checked against ``logits_TV``."""
    if other_logits_TV is None:
        raise ValueError('"kl"/"kl_rev" need other_logits_TV (the second distribution\'s logits shard)')
    if not torch.is_tensor(other_logits_TV) or not other_logits_TV.is_floating_point():
        raise ValueError(f"other_logits_TV must be a floating-point tensor, got {_describe(other_logits_TV)}")
    if other_logits_TV.shape != logits_TV.shape:
        raise ValueError(
            f"other_logits_TV shape {tuple(other_logits_TV.shape)} != logits_TV shape {tuple(logits_TV.shape)}"
        )
    if other_logits_TV.device != logits_TV.device:
        raise ValueError(f"other_logits_TV is on {other_logits_TV.device}, logits_TV on {logits_TV.device}")
    return _as_rows(other_logits_TV)


def _token_ids(token_ids_T: torch.Tensor | None, lead: tuple[int, ...], vocab_size: int, device) -> torch.Tensor:
    """The target ids flattened to ``[T]`` int64 on ``device``, checked: shape ``lead``, values in the vocabulary."""
    if token_ids_T is None:
        raise ValueError('"logprob" needs token_ids_T (global token ids, shape logits_TV.shape[:-1])')
    if not torch.is_tensor(token_ids_T) or token_ids_T.is_floating_point() or token_ids_T.is_complex():
        raise ValueError(f"token_ids_T must be an integer tensor, got {_describe(token_ids_T)}")
    if tuple(token_ids_T.shape) != lead:
        raise ValueError(f"token_ids_T shape {tuple(token_ids_T.shape)} != logits_TV.shape[:-1] {lead}")
    ids = token_ids_T.reshape(-1).to(device=device, dtype=torch.long)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(
            f"token_ids_T must lie in [0, vocab_size={vocab_size}); got range [{int(ids.min())}, {int(ids.max())}]"
        )
    return ids


def _chunk_rows(chunk_size: int | None, n_valid: int, is_cuda: bool) -> int:
    """Tokens per chunk: ``chunk_size``, or (None) as many as fit the device's per-buffer element budget."""
    if chunk_size is None:
        budget = _GPU_CHUNK_ELEMENTS if is_cuda else _CPU_CHUNK_ELEMENTS
        return max(1, budget // max(1, n_valid))
    if isinstance(chunk_size, int) and chunk_size >= 1:
        return chunk_size
    raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")


def _describe(t) -> str:
    if torch.is_tensor(t):
        return f"tensor(shape={tuple(t.shape)}, dtype={t.dtype})"
    return type(t).__name__


def vocab_parallel_logprobs(
    logits_TV, token_ids_T, tp_group=None, temperature=1.0, vocab_size=None, chunk_size=None, impl="eager"
) -> torch.Tensor:
    """log pi(token) over the full vocabulary: ``[T]`` fp32, differentiable. See `vocab_parallel_token_stats`."""
    return vocab_parallel_token_stats(
        logits_TV,
        tp_group=tp_group,
        token_ids_T=token_ids_T,
        temperature=temperature,
        vocab_size=vocab_size,
        want=("logprob",),
        chunk_size=chunk_size,
        impl=impl,
    )["logprob"]


def vocab_parallel_entropy(logits_TV, tp_group=None, temperature=1.0, vocab_size=None, chunk_size=None, impl="eager"):
    """Entropy of pi over the full vocabulary: ``[T]`` fp32, differentiable."""
    return vocab_parallel_token_stats(
        logits_TV,
        tp_group=tp_group,
        temperature=temperature,
        vocab_size=vocab_size,
        want=("entropy",),
        chunk_size=chunk_size,
        impl=impl,
    )["entropy"]


def vocab_parallel_top2_margin(
    logits_TV, tp_group=None, temperature=1.0, vocab_size=None, chunk_size=None, impl="eager"
):
    """p_(1) - p_(2) of pi over the full vocabulary: ``[T]`` fp32, detached (a stop-gradient credit weight)."""
    return vocab_parallel_token_stats(
        logits_TV,
        tp_group=tp_group,
        temperature=temperature,
        vocab_size=vocab_size,
        want=("margin",),
        chunk_size=chunk_size,
        impl=impl,
    )["margin"]


def vocab_parallel_kl(
    logits_TV,
    other_logits_TV,
    tp_group=None,
    temperature=1.0,
    vocab_size=None,
    reverse=False,
    chunk_size=None,
    impl="eager",
):
    """Exact KL(pi || other) (or KL(other || pi) with ``reverse=True``) per token: ``[T]`` fp32, differentiable
    w.r.t. both logits."""
    key = "kl_rev" if reverse else "kl"
    return vocab_parallel_token_stats(
        logits_TV,
        tp_group=tp_group,
        other_logits_TV=other_logits_TV,
        temperature=temperature,
        vocab_size=vocab_size,
        want=(key,),
        chunk_size=chunk_size,
        impl=impl,
    )[key]

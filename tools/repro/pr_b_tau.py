"""F-GRPO (arXiv 2602.06717) Pr(B_tau) vs group size N: closed form vs Monte Carlo with our sampler.

B_tau: a group of N rollouts has MIXED rewards (so GRPO learns from it) but misses a rare correct solution of mass
tau. With mu the total correct mass (the rare solution included), the three outcomes per rollout are: rare correct
(tau), other correct (mu - tau), wrong (1 - mu), and

    Pr(B_tau) = (1 - tau)^N - (mu - tau)^N - (1 - mu)^N

(no rare sample, minus the two disjoint zero-variance cases). The paper's point: it is not monotone in N, largest
at moderate N, so moderate groups sharpen onto the common solutions and forget the rare ones.

Monte Carlo: each rollout is drawn with the sampling rule of our HF rollout engine (``HFRolloutEngine``: temperature,
``filter_logits`` top-k / top-p, then the exponential race argmax(p / q), q ~ Exp(1)), vectorised over trials; a
second check draws N = 8 with the engine's per-sample generators seeded by ``sample_seed`` exactly as
``HFRolloutEngine._generate_rows`` does.

    python tools/repro/pr_b_tau.py --out /tmp/pr_b_tau        # ~20 s; --quick for a seconds-long smoke run
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron_rlvr.rollout.engine import sample_seed  # noqa: E402
from megatron_rlvr.rollout.hf_engine import filter_logits  # noqa: E402
from tools.repro.common import pyplot, write_json  # noqa: E402


def closed_form(N: int, mu: float, tau: float) -> float:
    return (1 - tau) ** N - (mu - tau) ** N - (1 - mu) ** N


def outcome_logits(mu: float, tau: float) -> torch.Tensor:
    """log-probabilities of (rare correct, other correct, wrong)."""
    return torch.tensor([tau, mu - tau, 1 - mu], dtype=torch.float64).log()


def race_sample(logits_V: torch.Tensor, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """The HF engine's rule (temperature 1, no top-k/p): argmax(softmax(filter_logits(l)) / Exp(1)), batched."""
    probs = torch.softmax(filter_logits(logits_V[None], 0, 1.0), dim=-1)[0]
    q = torch.empty(*shape, probs.numel(), dtype=torch.float64).exponential_(generator=gen)
    return torch.argmax(probs / q, dim=-1)


def monte_carlo(N: int, mu: float, tau: float, trials: int, seed: int) -> tuple[float, float]:
    """(estimate, standard error) of Pr(B_tau) from ``trials`` groups of N."""
    gen = torch.Generator().manual_seed(seed)
    logits = outcome_logits(mu, tau)
    hits, done = 0, 0
    chunk = max(1, 2_000_000 // N)
    while done < trials:
        b = min(chunk, trials - done)
        a = race_sample(logits, (b, N), gen)
        no_rare = ~(a == 0).any(dim=1)
        correct = a <= 1
        mixed = correct.any(dim=1) & ~correct.all(dim=1)
        hits += int((no_rare & mixed).sum())
        done += b
    p = hits / trials
    return p, math.sqrt(max(p * (1 - p), 1e-12) / trials)


def engine_seeded(N: int, mu: float, tau: float, trials: int, seed: int) -> float:
    """Pr(B_tau) with one torch.Generator per sample seeded by sample_seed(seed, group, i), as the engine does."""
    probs = torch.softmax(filter_logits(outcome_logits(mu, tau).float()[None], 0, 1.0), dim=-1)[0]
    hits = 0
    for g in range(trials):
        a = []
        for i in range(N):
            gen = torch.Generator().manual_seed(sample_seed(seed, g, i))
            a.append(int(torch.argmax(probs / torch.empty_like(probs).exponential_(generator=gen))))
        correct = [x <= 1 for x in a]
        hits += (0 not in a) and any(correct) and not all(correct)
    return hits / trials


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/repro/pr_b_tau")
    ap.add_argument("--trials", type=int, default=20000)
    ap.add_argument("--plot", default=None, help="PNG path (default <out>/pr_b_tau.png)")
    ap.add_argument("--quick", action="store_true", help="seconds-long smoke mode")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    Ns = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512] if not args.quick else [2, 8, 32]
    trials = args.trials if not args.quick else 2000
    settings = [(0.5, 0.05), (0.3, 0.02), (0.8, 0.01)]
    rows = []
    for mu, tau in settings:
        for N in Ns:
            cf = closed_form(N, mu, tau)
            mc, se = monte_carlo(N, mu, tau, trials, seed=N)
            rows.append({"mu": mu, "tau": tau, "N": N, "closed_form": cf, "monte_carlo": mc, "se": se})
    check_trials = 3000 if not args.quick else 200
    seeded = {
        "N": 8,
        "mu": 0.5,
        "tau": 0.05,
        "trials": check_trials,
        "engine_seeded": engine_seeded(8, 0.5, 0.05, check_trials, seed=7),
        "closed_form": closed_form(8, 0.5, 0.05),
    }
    worst = {}
    for mu, tau in settings:
        best = max(range(1, 4097), key=lambda n: closed_form(n, mu, tau))
        worst[f"mu={mu},tau={tau}"] = {"argmax_N": best, "max": closed_form(best, mu, tau)}
    max_z = max(abs(r["monte_carlo"] - r["closed_form"]) / max(r["se"], 1e-4) for r in rows)
    res = {
        "rows": rows,
        "engine_seeded_check": seeded,
        "worst_N": worst,
        "max_abs_z": max_z,
        "seconds": time.perf_counter() - t0,
    }
    write_json(os.path.join(args.out, "pr_b_tau.json"), res)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    for mu, tau in settings:
        rs = [r for r in rows if r["mu"] == mu and r["tau"] == tau]
        dense = [2**k for k in range(0, 13)]
        ax.plot(dense, [closed_form(n, mu, tau) for n in dense], "-", label=f"closed form mu={mu} tau={tau}")
        ax.errorbar([r["N"] for r in rs], [r["monte_carlo"] for r in rs], [1.96 * r["se"] for r in rs], fmt="o", ms=3)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("group size N")
    ax.set_ylabel("Pr(B_tau)")
    ax.set_title("Pr(mixed group, rare solution missed): lines closed form, dots MC", fontsize=8)
    ax.legend(fontsize=6)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    plot = args.plot or os.path.join(args.out, "pr_b_tau.png")
    os.makedirs(os.path.dirname(os.path.abspath(plot)), exist_ok=True)
    fig.savefig(plot, dpi=90)
    for r in rows:
        print(
            f"mu={r['mu']} tau={r['tau']} N={r['N']:4d}: closed {r['closed_form']:.4f}  MC {r['monte_carlo']:.4f} "
            f"± {1.96 * r['se']:.4f}"
        )
    print(f"engine-seeded check N=8: {seeded['engine_seeded']:.4f} vs closed form {seeded['closed_form']:.4f}")
    print(f"worst N: {worst}; max |z| = {max_z:.2f}; {res['seconds']:.1f} s; wrote {args.out} and {plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""F-GRPO (arXiv 2602.06717) categorical-policy simulation, driven by OUR advantage estimators and policy loss.

A single prompt, a categorical policy softmax(z) over K actions of which C are correct (paper: K = 128,000,
C = 10,000; the default here is the paper's size). Each step samples a group of N actions, scores them (1 correct,
0 wrong), computes the group advantages with ``megatron_rlvr.algorithms.compute_advantages`` for the chosen
algorithm config, and takes one SGD step on the logits z of ``compute_policy_loss`` (one-token "sequences", the
config's own policy loss and aggregation; on-policy, so the PPO clip is inactive and the gradient is the policy
gradient). Logged per step:

- Q_pos: the probability mass on correct actions;
- M_ret: the fraction of the initially correct actions whose probability is >= its initial value ("retained").

Claim checked: M_ret stays ~1 at very large N (131,072), falls to 0.2-0.4 at N = 8, and the focal weight
(gamma = 1) raises it markedly at N = 8. Because focal scaling also shrinks the step, M_ret is compared both at
the same step and at the same Q_pos (the first step with Q_pos >= ``--q-target``).

    python tools/repro/categorical_sim.py --out /tmp/catsim            # minutes; --quick for a smoke run
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron_rlvr.algorithms import (  # noqa: E402
    AlgorithmConfig,
    LossNormalizers,
    PolicyLossInputs,
    compute_advantages,
    compute_policy_loss,
    local_normalizer_counts,
    preset,
)
from tools.repro.common import fmt_ci, mean_ci, pyplot, write_json  # noqa: E402


def algorithms() -> dict[str, AlgorithmConfig]:
    """The group estimators compared (no reference KL: there is no reference policy in the simulation)."""
    base = {"ref_kl": {"coef": 0.0}}
    out = {
        "grpo": preset("grpo", **base),
        "f_grpo_g0.5": preset("f_grpo"),
        "f_grpo_g1": AlgorithmConfig.from_dict({"advantage": {"focal_gamma": 1.0}}, base=preset("f_grpo")),
        "dr_grpo": preset("dr_grpo"),
        "rloo": preset("rloo"),
        "mcpo_qw": preset("mcpo", hinge_kl={"enabled": False}),
    }
    return out


def run_one(
    algo: AlgorithmConfig,
    K: int,
    C: int,
    N: int,
    steps: int,
    lr: float,
    init_std: float,
    seed: int,
    q_target: float,
    lr_per_sample: bool = False,
) -> dict:
    """One simulated run; ``lr_per_sample`` scales the step by N (the loss summed, not averaged, over the group)."""
    gen = torch.Generator().manual_seed(seed)
    z = (torch.randn(K, generator=gen, dtype=torch.float64) * init_std).requires_grad_(True)
    correct_K = torch.zeros(K, dtype=torch.bool)
    correct_K[torch.randperm(K, generator=gen)[:C]] = True
    with torch.no_grad():
        p0 = torch.softmax(z, 0).clone()
    q_curve, m_curve = [], []
    m_at_target, step_at_target = None, None
    for step in range(steps):
        with torch.no_grad():
            p = torch.softmax(z, 0)
            q = float(p[correct_K].sum())
            m = float((p[correct_K] >= p0[correct_K] * (1 - 1e-12)).double().mean())
        q_curve.append(q)
        m_curve.append(m)
        if m_at_target is None and q >= q_target:
            m_at_target, step_at_target = m, step
        a_N = torch.multinomial(p, N, replacement=True, generator=gen)
        r = correct_K[a_N].double()[None]
        adv, _ = compute_advantages(algo, r, correct_G_n=r.bool())
        logp = torch.log_softmax(z, 0)[a_N][:, None]  # [B = N one-token sequences, T = 1]
        mask = torch.ones(N, 1, dtype=torch.bool)
        mastered = torch.zeros(N, dtype=torch.bool)
        norms = LossNormalizers.from_counts(local_normalizer_counts(mask, mastered))
        inputs = PolicyLossInputs(
            logp_BT=logp, old_logp_BT=logp.detach(), mask_BT=mask, adv_B=adv.reshape(-1), mastered_B=mastered
        )
        loss, _ = compute_policy_loss(algo, inputs, norms)
        (g,) = torch.autograd.grad(loss, z)
        with torch.no_grad():
            z -= (lr * N if lr_per_sample else lr) * g
    with torch.no_grad():
        p = torch.softmax(z, 0)
        q_curve.append(float(p[correct_K].sum()))
        m_curve.append(float((p[correct_K] >= p0[correct_K] * (1 - 1e-12)).double().mean()))
    return {"Q_pos": q_curve, "M_ret": m_curve, "M_ret_at_target": m_at_target, "step_at_target": step_at_target}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/repro/categorical_sim")
    ap.add_argument("--K", type=int, default=128_000)
    ap.add_argument("--C", type=int, default=10_000)
    ap.add_argument(
        "--lrs",
        default="2:8,8:4,32:4,13107:30",
        help="N:lr pairs (SGD on the logits, loss averaged over the group as in GRPO): the gradient of a logit "
        "scales like 1/N for small groups and like pi_a for large ones, so one lr cannot serve every N",
    )
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--init-std", type=float, default=0.0, help="std of the i.i.d. normal initial logits")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--algos", default="grpo,f_grpo_g0.5,f_grpo_g1,dr_grpo,rloo,mcpo_qw")
    ap.add_argument("--q-target", type=float, default=0.5)
    ap.add_argument("--plot", default=None)
    ap.add_argument("--quick", action="store_true", help="seconds-long smoke mode (K=2000, C=150, 20 steps)")
    args = ap.parse_args(argv)
    if args.quick:
        args.K, args.C, args.steps, args.seeds, args.lrs = 2000, 150, 20, 2, "2:8,8:4,2048:30"
        args.algos = "grpo,f_grpo_g1"
    torch.set_num_threads(1)
    algos = algorithms()
    names = args.algos.split(",")
    lr_of = {int(a): float(b) for a, b in (x.split(":") for x in args.lrs.split(","))}
    Ns = list(lr_of)
    t0 = time.perf_counter()
    results = []
    for N in Ns:
        lr = lr_of[N]
        if True:
            for name in names:
                runs = [
                    run_one(
                        algos[name],
                        args.K,
                        args.C,
                        N,
                        args.steps,
                        lr,
                        args.init_std,
                        1000 + s,
                        args.q_target,
                    )
                    for s in range(args.seeds)
                ]
                row = {
                    "lr": lr,
                    "N": N,
                    "algo": name,
                    "Q_pos_final": [r["Q_pos"][-1] for r in runs],
                    "M_ret_final": [r["M_ret"][-1] for r in runs],
                    "M_ret_at_target": [r["M_ret_at_target"] for r in runs],
                    "step_at_target": [r["step_at_target"] for r in runs],
                    "Q_pos_curve_mean": [sum(c) / len(c) for c in zip(*[r["Q_pos"] for r in runs])],
                    "M_ret_curve_mean": [sum(c) / len(c) for c in zip(*[r["M_ret"] for r in runs])],
                }
                results.append(row)
                tgt = [x for x in row["M_ret_at_target"] if x is not None]
                at = fmt_ci(tgt) if len(tgt) == len(runs) else f"{len(tgt)}/{len(runs)} reached"
                print(
                    f"lr={lr} N={N:6d} {name:12s} Q_pos {fmt_ci(row['Q_pos_final'])}  "
                    f"M_ret {fmt_ci(row['M_ret_final'])}  M_ret@Q>={args.q_target}: {at}",
                    flush=True,
                )
    meta = {k: v for k, v in vars(args).items()}
    meta["seconds"] = time.perf_counter() - t0
    write_json(os.path.join(args.out, "categorical_sim.json"), {"settings": meta, "results": results})
    plt = pyplot()
    fig, axes = plt.subplots(2, len(Ns), figsize=(3.0 * len(Ns), 4.6), squeeze=False)
    for j, N in enumerate(Ns):
        lr0 = lr_of[N]
        for name in names:
            row = next(r for r in results if r["N"] == N and r["algo"] == name)
            axes[0][j].plot(row["Q_pos_curve_mean"], label=name)
            axes[1][j].plot(row["M_ret_curve_mean"], label=name)
        axes[0][j].set_title(f"N={N} (lr {lr0})", fontsize=8)
        axes[1][j].set_xlabel("step", fontsize=8)
        for ax in (axes[0][j], axes[1][j]):
            ax.grid(alpha=0.3)
            ax.tick_params(labelsize=7)
    axes[0][0].set_ylabel("Q_pos")
    axes[1][0].set_ylabel("M_ret")
    axes[0][0].legend(fontsize=6)
    fig.suptitle(
        f"categorical policy K={args.K}, C={args.C}, init std {args.init_std}, mean of {args.seeds} seeds", fontsize=9
    )
    fig.tight_layout()
    plot = args.plot or os.path.join(args.out, "categorical_sim.png")
    os.makedirs(os.path.dirname(os.path.abspath(plot)), exist_ok=True)
    fig.savefig(plot, dpi=80)
    print(f"{meta['seconds']:.0f} s; wrote {args.out} and {plot}")
    _ = mean_ci
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

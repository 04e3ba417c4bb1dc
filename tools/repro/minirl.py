"""Small-scale algorithm comparisons in minutes on a CPU: OUR algorithm library in a minimal pure-torch RL loop.

What is ours and what is not. Everything algorithmic is the library the trainer runs: ``compute_advantages``
(estimators, F-GRPO focal weights, MCPO query weights), ``mastered_rollouts``, ``local_normalizer_counts`` /
``LossNormalizers`` (global normalisers per mini-batch), ``compute_policy_loss`` (PPO/DAPO clip, PG, CPGD with drift,
MCPO hinge-KL, margin credit from the top-2 margin of the current policy) and the trainer's diagnostics
(``ratio_quantile_metrics``, ``forgetting_metrics``). What is NOT the trainer: the model (a 2-layer causal
transformer of width 64 in plain torch), generation (plain sampling at temperature 1), the optimizer (torch Adam)
and the loop below. That is what makes 3 seeds x several algorithms fit in minutes on 2 shared cores; the same
comparisons at scale run through ``megatron-rlvr train`` from ``configs/repro/*.yaml``.

Task: procedural addition with fixed-width operands, "07+05=" -> "12<eos>", three difficulty levels mixed in the
prompt pool (1: one-digit + one-digit, 2: two-digit + one-digit, 3: two-digit + two-digit), so that prompts are
spread over difficulties and can be mastered and forgotten. The policy is first warm-started by a short supervised
phase (the same checkpoint per seed for every algorithm), then trained by RL (reward 1 for the exact answer followed
by <eos>, else 0). Held-out problems (a disjoint set) give pass@k (unbiased estimator, k up to ``--eval-k``).

    python tools/repro/minirl.py --comparison mcpo_vs_dapo --seeds 3 --out runs/repro/mcpo_vs_dapo
    python tools/repro/minirl.py --list                       # the comparisons and their settings
    python tools/repro/minirl.py --comparison all --quick     # seconds-long smoke run of every comparison
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron_rlvr.algorithms import (  # noqa: E402
    AlgorithmConfig,
    LossNormalizers,
    PolicyLossInputs,
    compute_advantages,
    compute_policy_loss,
    dynamic_sampling_keep,
    local_normalizer_counts,
    mastered_rollouts,
    preset,
)
from megatron_rlvr.eval.benchmarks import pass_at_k  # noqa: E402
from megatron_rlvr.trainer.diagnostics import forgetting_metrics, ratio_quantile_metrics  # noqa: E402
from tools.repro.common import fmt_ci, mean_ci, pyplot, write_json  # noqa: E402

VOCAB = list("0123456789+=") + ["<eos>"]
EOS = 12
V = len(VOCAB)
PROMPT_LEN = 6  # "dd+dd="
RESP_LEN = 4  # up to 3 answer digits + <eos>


# ------------------------------------------------------------------------------------------------------------------
# Task and model
# ------------------------------------------------------------------------------------------------------------------


def make_problems(n: int, seed: int, level_weights=(1.0, 1.0, 1.0)) -> list[tuple[list[int], str, int]]:
    """(prompt ids, answer string, level) for ``n`` distinct problems."""
    rng = random.Random(seed)
    seen, out = set(), []
    while len(out) < n:
        level = rng.choices((1, 2, 3), weights=level_weights)[0]
        a = rng.randint(0, 9) if level == 1 else rng.randint(10, 99)
        b = rng.randint(0, 9) if level < 3 else rng.randint(10, 99)
        if (a, b) in seen:
            continue
        seen.add((a, b))
        prompt = f"{a:02d}+{b:02d}="
        out.append(([VOCAB.index(c) for c in prompt], str(a + b), level))
    return out


class TinyLM(nn.Module):
    """2-layer pre-norm causal transformer, width 64, learned positions."""

    def __init__(self, d: int = 64, layers: int = 2, heads: int = 4):
        super().__init__()
        self.emb = nn.Embedding(V, d)
        self.pos = nn.Embedding(PROMPT_LEN + RESP_LEN, d)
        layer = nn.TransformerEncoderLayer(d, heads, 2 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, V)

    def forward(self, tokens_BL: torch.Tensor) -> torch.Tensor:
        L = tokens_BL.shape[1]
        causal = torch.triu(torch.full((L, L), float("-inf")), diagonal=1)
        h = self.emb(tokens_BL) + self.pos(torch.arange(L))[None]
        return self.head(self.norm(self.body(h, mask=causal, is_causal=True)))


def response_logits(model: TinyLM, seq_BL: torch.Tensor) -> torch.Tensor:
    """Logits [B, RESP_LEN, V] predicting the response tokens of full sequences [B, PROMPT_LEN + RESP_LEN]."""
    return model(seq_BL[:, :-1])[:, PROMPT_LEN - 1 :]


def response_mask(resp_BT: torch.Tensor) -> torch.Tensor:
    """Tokens up to and including the first <eos> (all of them when there is none: truncated)."""
    is_eos = resp_BT == EOS
    before = torch.cumsum(is_eos.int(), dim=1) - is_eos.int()
    return before == 0


@torch.no_grad()
def sample(model: TinyLM, prompts_BP: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Full sequences [B, PROMPT_LEN + RESP_LEN] sampled at temperature 1."""
    seq = prompts_BP
    for _ in range(RESP_LEN):
        probs = torch.softmax(model(seq)[:, -1], dim=-1)
        seq = torch.cat([seq, torch.multinomial(probs, 1, generator=gen)], dim=1)
    return seq


def score(resp_BT: torch.Tensor, answers: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """(reward [B] float64 in {0, 1}, response length [B]) - exact answer followed by <eos>."""
    rewards, lengths = [], []
    for row, ans in zip(resp_BT.tolist(), answers):
        if EOS in row:
            k = row.index(EOS)
            rewards.append(float("".join(VOCAB[t] for t in row[:k]) == ans))
            lengths.append(k + 1)
        else:
            rewards.append(0.0)
            lengths.append(RESP_LEN)
    return torch.tensor(rewards, dtype=torch.float64), torch.tensor(lengths)


def supervised_warm_start(problems, steps: int, seed: int, lr: float = 3e-3, batch: int = 64) -> TinyLM:
    torch.manual_seed(seed)
    model = TinyLM()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    rng = random.Random(seed)
    for _ in range(steps):
        rows = rng.sample(problems, min(batch, len(problems)))
        seqs = []
        for p, ans, _lvl in rows:
            resp = [VOCAB.index(c) for c in ans] + [EOS]
            resp = resp + [EOS] * (RESP_LEN - len(resp))
            seqs.append(p + resp)
        seq = torch.tensor(seqs)
        logits = response_logits(model, seq)
        mask = response_mask(seq[:, PROMPT_LEN:])
        ce = nn.functional.cross_entropy(logits.reshape(-1, V), seq[:, PROMPT_LEN:].reshape(-1), reduction="none")
        loss = (ce * mask.reshape(-1)).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


# ------------------------------------------------------------------------------------------------------------------
# RL
# ------------------------------------------------------------------------------------------------------------------


@dataclass
class RLSettings:
    steps: int = 150
    prompts_per_step: int = 32
    n: int = 8
    lr: float = 1e-3
    num_mini_batches: int = 2
    ppo_epochs: int = 1
    clip_grad: float = 1.0
    probe_prompts: int = 16
    probe_rollouts: int = 4
    dynamic_sampling: bool = False
    """Refill the batch with informative groups (the algorithm's dapo.dynamic_sampling is ignored here)."""


@dataclass
class Arm:
    name: str
    algo: AlgorithmConfig
    overrides: dict = field(default_factory=dict)
    """RLSettings overrides for this arm."""


def token_tensors(model: TinyLM, seq: torch.Tensor, want_margin: bool):
    logits = response_logits(model, seq)
    logp_full = torch.log_softmax(logits.float(), dim=-1)
    logp = logp_full.gather(-1, seq[:, PROMPT_LEN:, None])[..., 0]
    probs = logp_full.exp()
    entropy = -(probs * logp_full).sum(-1)
    margin = None
    if want_margin:
        top2 = probs.topk(2, dim=-1).values
        margin = (top2[..., 0] - top2[..., 1]).detach()
    return logp, entropy, margin


def rl_step(model, opt, algo: AlgorithmConfig, s: RLSettings, pool, rng: random.Random, gen) -> dict[str, float]:
    G, n = s.prompts_per_step, s.n
    chosen, seqs, rewards, lengths = [], [], [], []
    for _round in range(4 if s.dynamic_sampling else 1):
        batch = rng.sample(range(len(pool)), G)
        prompts = torch.tensor([pool[i][0] for i in batch]).repeat_interleave(n, dim=0)
        seq = sample(model, prompts, gen)
        r, ln = score(seq[:, PROMPT_LEN:], [pool[i][1] for i in batch for _ in range(n)])
        r_G = r.view(G, n)
        keep = dynamic_sampling_keep(r_G) if s.dynamic_sampling else torch.ones(G, dtype=torch.bool)
        for g in range(G):
            if keep[g]:
                chosen.append(batch[g])
                seqs.append(seq[g * n : (g + 1) * n])
                rewards.append(r_G[g])
                lengths.append(ln[g * n : (g + 1) * n])
        if len(chosen) >= G:
            break
    m: dict[str, float] = {}
    if not chosen:
        return {"skipped": 1.0}
    chosen, seq = chosen[:G], torch.cat(seqs[:G])
    r_G, len_B = torch.stack(rewards[:G]), torch.cat(lengths[:G])
    Gk = len(chosen)
    correct = r_G.bool()
    adv_G, am = compute_advantages(algo, r_G, correct_G_n=correct)
    mastered_B = mastered_rollouts(algo, r_G, correct_G_n=correct).reshape(-1)
    mask = response_mask(seq[:, PROMPT_LEN:])
    with torch.no_grad():
        old_logp, _, _ = token_tensors(model, seq, False)
    m.update({k: float(v) for k, v in am.items() if k.startswith(("groups/", "reward/mean"))})
    m["response/length_mean"] = float(len_B.double().mean())
    acc: dict[str, list[float]] = {}
    for _epoch in range(s.ppo_epochs):
        for mb in range(s.num_mini_batches):
            g0, g1 = mb * Gk // s.num_mini_batches, (mb + 1) * Gk // s.num_mini_batches
            if g1 <= g0:
                continue
            sl = slice(g0 * n, g1 * n)
            logp, ent, margin = token_tensors(model, seq[sl], algo.margin_credit.enabled)
            norms = LossNormalizers.from_counts(local_normalizer_counts(mask[sl], mastered_B[sl]))
            inputs = PolicyLossInputs(
                logp_BT=logp,
                old_logp_BT=old_logp[sl],
                mask_BT=mask[sl],
                adv_B=adv_G.reshape(-1)[sl].float(),
                entropy_BT=ent,
                margin_BT=margin,
                mastered_B=mastered_B[sl],
            )
            loss, lm = compute_policy_loss(algo, inputs, norms)
            opt.zero_grad()
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), s.clip_grad)
            opt.step()
            info = {k: float(v) for k, v in lm.items()}
            info.update(ratio_quantile_metrics(logp, old_logp[sl], mask[sl]))
            info["optim/grad_norm"] = float(gn)
            for k, v in info.items():
                acc.setdefault(k, []).append(v)
    for k, vs in acc.items():
        m[k] = max(vs) if k.endswith("_max") else sum(vs) / len(vs)
    # forgetting probe: this step's mastered prompts re-sampled with the updated policy
    mastered_G = mastered_B.view(Gk, n).any(dim=1)
    probe = [chosen[g] for g in range(Gk) if mastered_G[g]][: s.probe_prompts]
    if probe:
        prompts = torch.tensor([pool[i][0] for i in probe]).repeat_interleave(s.probe_rollouts, dim=0)
        pseq = sample(model, prompts, gen)
        pr, _ = score(pseq[:, PROMPT_LEN:], [pool[i][1] for i in probe for _ in range(s.probe_rollouts)])
        m.update(forgetting_metrics(pr.view(len(probe), s.probe_rollouts).bool()))
    return m


@torch.no_grad()
def evaluate(model, problems, k: int, gen, chunk: int = 8192) -> dict[str, float]:
    """pass@j for j = 1, 2, 4, ... k (k samples per problem), accuracy by level, mean response length."""
    prompts = torch.tensor([p for p, _, _ in problems]).repeat_interleave(k, dim=0)
    answers = [a for _, a, _ in problems for _ in range(k)]
    rs, ls = [], []
    for i in range(0, prompts.shape[0], chunk):
        seq = sample(model, prompts[i : i + chunk], gen)
        r, ln = score(seq[:, PROMPT_LEN:], answers[i : i + chunk])
        rs.append(r)
        ls.append(ln)
    r = torch.cat(rs).view(len(problems), k)
    out = {"eval/length_mean": float(torch.cat(ls).double().mean())}
    j = 1
    while j <= k:
        out[f"eval/pass@{j}"] = sum(pass_at_k(k, int(c), j) for c in r.sum(1).tolist()) / len(problems)
        j *= 2
    for lvl in (1, 2, 3):
        rows = [i for i, (_, _, lv) in enumerate(problems) if lv == lvl]
        if rows:
            out[f"eval/acc_level{lvl}"] = float(r[rows].mean())
    return out


# ------------------------------------------------------------------------------------------------------------------
# The comparisons
# ------------------------------------------------------------------------------------------------------------------


def _algo(name: str, **overrides) -> AlgorithmConfig:
    return preset(name, **overrides)


def _with(base: AlgorithmConfig, label: str, d: dict) -> AlgorithmConfig:
    out = AlgorithmConfig.from_dict(d, base=base)
    return dataclasses.replace(out, name=label)


def comparisons() -> dict[str, dict]:
    """name -> {"arms": [...], "settings": RLSettings, "what": description}."""
    no_kl = {"ref_kl": {"coef": 0.0}}
    # DAPO without dynamic sampling: dynamic sampling drops every mastered group from the batch, which makes a
    # hinge-KL on mastered prompts inert (see docs/results.md); all four arms keep the same batches.
    dapo = _with(_algo("dapo"), "dapo", {"dapo": {"dynamic_sampling": False, "overlong_shaping": False}})
    hinge = {"hinge_kl": {"enabled": True, "beta": 1.0, "delta": 0.01}}
    qw = {"advantage": {"mcpo_query_weight": True}}
    grpo = _with(_algo("grpo"), "grpo", no_kl)
    out = {
        "mcpo_vs_dapo": {
            "what": "MCPO (hinge-KL + query-weight rebalancing) vs DAPO (clip-higher, token-mean, no dynamic sampling) "
            "and the two MCPO ablations; 4 mini-batch updates per step so that mastered prompts drift",
            "settings": RLSettings(steps=80, lr=3e-4, num_mini_batches=4),
            "arms": [
                Arm("dapo", dapo),
                Arm("mcpo", _with(dapo, "mcpo", {**hinge, **qw})),
                Arm("hinge_only", _with(dapo, "hinge_only", hinge)),
                Arm("rebalance_only", _with(dapo, "rebalance_only", qw)),
            ],
        },
        "cpgd_stability": {
            "what": "CPGD vs GRPO vs GRPO without clip vs PG, off-policy: 4 epochs x 4 mini-batches per step (16 "
            "optimizer steps on each batch) at 3x the learning rate of the other comparisons",
            "settings": RLSettings(steps=40, lr=1e-3, num_mini_batches=4, ppo_epochs=4),
            "arms": [
                Arm("grpo", grpo),
                Arm("grpo_noclip", _with(grpo, "grpo_noclip", {"policy_loss": {"eps_low": 0.999, "eps_high": 1e6}})),
                Arm("pg", _with(grpo, "pg", {"policy_loss": {"name": "pg"}})),
                Arm("cpgd", _algo("cpgd")),
            ],
        },
        "margin_credit": {
            "what": "GRPO vs GRPO + MCPO margin credit (tau_lo 0.3, tau_hi 0.9, floor 0.5)",
            "settings": RLSettings(steps=80, lr=3e-4, num_mini_batches=2),
            "arms": [
                Arm("grpo", grpo),
                Arm("grpo_margin", _with(grpo, "grpo_margin", {"margin_credit": {"enabled": True}})),
            ],
        },
        "fgrpo_passk": {
            "what": "GRPO vs F-GRPO (gamma 0.5 and 1.0), held-out pass@k up to k = 256",
            "settings": RLSettings(steps=80, lr=3e-4, num_mini_batches=2),
            "eval_k": 256,
            "eval_problems": 100,
            "arms": [
                Arm("grpo", grpo),
                Arm("f_grpo_g0.5", _algo("f_grpo")),
                Arm("f_grpo_g1", _with(_algo("f_grpo"), "f_grpo_g1", {"advantage": {"focal_gamma": 1.0}})),
            ],
        },
    }
    return out


SUMMARY_KEYS = [
    ("eval/pass@1", "final", "held-out pass@1"),
    ("eval/pass@8", "final", "held-out pass@8"),
    ("eval/pass@256", "final", "held-out pass@256"),
    ("eval/acc_level3", "final", "held-out acc, hardest level"),
    ("eval/length_mean", "final", "held-out response length"),
    ("reward/mean", "last20", "train reward (last 20 steps)"),
    ("groups/mastered_frac", "last20", "mastered frac (last 20)"),
    ("groups/all_wrong_frac", "last20", "all-wrong frac (last 20)"),
    ("forget/probe_accuracy", "mean", "forgetting probe acc (all steps)"),
    ("forget/still_mastered_frac", "mean", "still mastered (all steps)"),
    ("mcpo/mastered_abs_d", "mean", "mean |d| on mastered tokens"),
    ("loss/entropy", "max", "entropy, max over steps"),
    ("loss/entropy", "last20", "entropy (last 20)"),
    ("loss/ratio_max", "max", "max token ratio, any step"),
    ("ratio/q99", "mean", "ratio q99 (mean over steps)"),
    ("ratio/out_of_band_frac", "mean", "|r-1|>0.2 token frac"),
    ("loss/clip_frac_high", "mean", "clip frac high"),
    ("response/length_mean", "last20", "train length (last 20)"),
]


def summarize_run(hist: list[dict], final_eval: dict) -> dict[str, float]:
    out = {}
    for key, how, _label in SUMMARY_KEYS:
        if how == "final":
            if key in final_eval:
                out[f"{key}|{how}"] = final_eval[key]
            continue
        vals = [h[key] for h in hist if key in h and math.isfinite(h[key])]
        if not vals:
            continue
        if how == "last20":
            vals = vals[-20:]
            out[f"{key}|{how}"] = sum(vals) / len(vals)
        elif how == "mean":
            out[f"{key}|{how}"] = sum(vals) / len(vals)
        elif how == "max":
            out[f"{key}|{how}"] = max(vals)
    return out


def run_comparison(name: str, spec: dict, seeds: int, out_dir: str, quick: bool, eval_k: int, sft_steps: int):
    t_start = time.perf_counter()
    settings: RLSettings = spec["settings"]
    if quick:
        settings = dataclasses.replace(
            settings, steps=3, prompts_per_step=8, n=4, ppo_epochs=min(settings.ppo_epochs, 2)
        )
        eval_k, sft_steps = 4, 20
    if not quick:
        eval_k = spec.get("eval_k", eval_k)
    n_eval = spec.get("eval_problems", 200)
    pool = make_problems(600 if not quick else 60, seed=0)
    held_out_all = make_problems(600 + n_eval, seed=0)[600:] if not quick else make_problems(80, seed=0)[60:]
    results: dict[str, list[dict]] = {}
    curves: dict[str, list[list[dict]]] = {}
    init_evals = []
    for seed in range(seeds):
        sft = supervised_warm_start(pool, sft_steps, seed=seed)
        init_evals.append(evaluate(sft, held_out_all, min(eval_k, 16), torch.Generator().manual_seed(99 + seed)))
        for arm in spec["arms"]:
            s = dataclasses.replace(settings, **arm.overrides)
            model = copy.deepcopy(sft)
            opt = torch.optim.Adam(model.parameters(), lr=s.lr)
            rng = random.Random(1000 + seed)
            gen = torch.Generator().manual_seed(2000 + seed)
            hist = []
            t0 = time.perf_counter()
            for _step in range(s.steps):
                hist.append(rl_step(model, opt, arm.algo, s, pool, rng, gen))
            ev = evaluate(model, held_out_all, eval_k, torch.Generator().manual_seed(3000 + seed))
            summ = summarize_run(hist, ev)
            summ["seconds"] = time.perf_counter() - t0
            results.setdefault(arm.name, []).append(summ)
            curves.setdefault(arm.name, []).append(hist)
            print(
                f"[{name}] seed {seed} {arm.name:14s} pass@1 {ev['eval/pass@1']:.3f} "
                f"train reward {summ.get('reward/mean|last20', float('nan')):.3f} ({summ['seconds']:.0f} s)",
                flush=True,
            )
    table = render_table(name, spec, results, init_evals, seeds, settings, eval_k, sft_steps)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write(table)
    write_json(
        os.path.join(out_dir, f"{name}.json"),
        {
            "results": results,
            "init_evals": init_evals,
            "settings": dataclasses.asdict(settings),
            "seconds": time.perf_counter() - t_start,
        },
    )
    plot_curves(name, curves, os.path.join(out_dir, f"{name}.png"))
    print(table)
    print(f"[{name}] {time.perf_counter() - t_start:.0f} s; wrote {out_dir}/{name}.{{md,json,png}}", flush=True)
    return results


def render_table(name, spec, results, init_evals, seeds, settings, eval_k, sft_steps) -> str:
    arms = list(results)
    lines = [
        f"### {name}: {spec['what']}",
        "",
        f"{seeds} seeds, mean ± 95% t-interval over seeds. RL: {settings.steps} steps x {settings.prompts_per_step} "
        f"prompts x {settings.n} rollouts, Adam lr {settings.lr}, {settings.num_mini_batches} mini-batches x "
        f"{settings.ppo_epochs} epochs; warm start: {sft_steps} supervised steps (held-out pass@1 before RL: "
        f"{fmt_ci([e['eval/pass@1'] for e in init_evals])}); eval: {eval_k} samples per held-out problem.",
        "",
        "| metric | " + " | ".join(arms) + " |",
        "| --- | " + " | ".join("---" for _ in arms) + " |",
    ]
    for key, how, label in SUMMARY_KEYS:
        cells = []
        any_val = False
        for a in arms:
            xs = [r[f"{key}|{how}"] for r in results[a] if f"{key}|{how}" in r]
            if xs:
                any_val = True
                cells.append(fmt_ci(xs))
            else:
                cells.append("n/a")
        if any_val:
            lines.append(f"| {label.replace('|', chr(92) + '|')} | " + " | ".join(cells) + " |")
    secs = [sum(r["seconds"] for r in results[a]) for a in arms]
    lines.append("| seconds (all seeds) | " + " | ".join(f"{s:.0f}" for s in secs) + " |")
    return "\n".join(lines) + "\n"


def plot_curves(name: str, curves: dict, path: str) -> None:
    plt = pyplot()
    keys = [
        ("reward/mean", "train reward"),
        ("groups/mastered_frac", "mastered frac"),
        ("groups/all_wrong_frac", "all-wrong frac"),
        ("forget/probe_accuracy", "forgetting probe acc"),
        ("loss/entropy", "entropy"),
        ("loss/ratio_max", "max ratio"),
        ("response/length_mean", "length"),
        ("mcpo/mastered_abs_d", "mean |d| mastered"),
    ]
    keys = [(k, lab) for k, lab in keys if any(k in h for runs in curves.values() for run in runs for h in run)]
    cols = 4
    rows = (len(keys) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(12, 2.6 * rows), squeeze=False)
    for ax, (k, lab) in zip(axes.flat, keys):
        for arm, runs in curves.items():
            T = min(len(r) for r in runs)
            ys = []
            for t in range(T):
                vals = [r[t][k] for r in runs if k in r[t]]
                ys.append(sum(vals) / len(vals) if vals else float("nan"))
            w = 5
            sm = [
                sum(v for v in ys[max(0, i - w + 1) : i + 1] if v == v)
                / max(1, sum(1 for v in ys[max(0, i - w + 1) : i + 1] if v == v))
                for i in range(T)
            ]
            ax.plot(sm, label=arm)
        ax.set_title(lab, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if k == "loss/ratio_max":
            ax.set_yscale("log")
    for ax in list(axes.flat)[len(keys) :]:
        ax.axis("off")
    axes[0][0].legend(fontsize=6)
    fig.suptitle(f"{name}: mean over seeds, moving average 5 steps", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=70)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--comparison", default="mcpo_vs_dapo", help="a name from --list, or 'all'")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--out", default="runs/repro/minirl")
    ap.add_argument("--eval-k", type=int, default=16, help="samples per held-out problem (a comparison may set more)")
    ap.add_argument("--sft-steps", type=int, default=300)
    ap.add_argument("--steps", type=int, default=None, help="override the comparison's RL steps")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--quick", action="store_true", help="seconds-long smoke mode")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    specs = comparisons()
    if args.list:
        for k, v in specs.items():
            print(f"{k}: {v['what']}\n    {v['settings']}\n    arms: {[a.name for a in v['arms']]}")
        return 0
    names = list(specs) if args.comparison == "all" else args.comparison.split(",")
    for nm in names:
        if nm not in specs:
            raise SystemExit(f"--comparison {nm!r}: not one of {sorted(specs)} or 'all'")
    for nm in names:
        spec = specs[nm]
        if args.steps:
            spec = {**spec, "settings": dataclasses.replace(spec["settings"], steps=args.steps)}
        run_comparison(nm, spec, args.seeds if not args.quick else 1, args.out, args.quick, args.eval_k, args.sft_steps)
    _ = mean_ci
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

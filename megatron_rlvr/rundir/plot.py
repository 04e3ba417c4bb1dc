"""``megatron-rlvr plot RUN_DIR [RUN_DIR ...]``: PNG curves from metrics.jsonl; several runs are overlaid (one
colour per run) to compare algorithms. Needs matplotlib."""

from __future__ import annotations

import os

from megatron_rlvr.rundir.metrics_log import read_metrics

PANELS: list[tuple[str, list[tuple[str, str]]]] = [
    ("training reward", [("reward/mean", "reward"), ("reward/accuracy", "accuracy")]),
    (
        "reward by difficulty (group accuracy p)",
        [("reward/easy", "easy p>0.8"), ("reward/medium", "medium"), ("reward/hard", "hard p<0.2")],
    ),
    ("group fractions", [("groups/mastered_frac", "mastered"), ("groups/all_wrong_frac", "all wrong")]),
    ("policy entropy", [("loss/entropy", "entropy")]),
    (
        "drift on mastered prompts",
        [("mcpo/mastered_abs_d", "mean |logp - logp_old|"), ("mcpo/hinge_active_frac", "hinge active")],
    ),
    ("response length", [("response/length_mean", "mean"), ("response/truncated_frac", "truncated frac")]),
    # multi-turn rollouts (agent.environment set); single-turn runs log none of these keys
    (
        "agent: turns, tool calls and observation share (per trajectory)",
        [
            ("agent/turns_mean", "turns"),
            ("agent/tool_calls_per_trajectory", "tool calls"),
            ("agent/observation_token_frac", "observation token frac"),
        ],
    ),
    (
        "agent: failed tool calls (per step)",
        [("agent/tool_errors", "errors"), ("agent/malformed_calls", "malformed"), ("agent/tool_timeouts", "timeouts")],
    ),
    ("clip fractions", [("loss/clip_frac_low", "low"), ("loss/clip_frac_high", "high")]),
    (
        "forgetting probe (mastered at step s, re-sampled after its update)",
        [
            ("forget/probe_accuracy", "accuracy"),
            ("forget/control_accuracy", "control accuracy (before the update)"),
            ("forget/still_mastered_frac", "still mastered"),
        ],
    ),
    (
        "token ratio r = pi / pi_old",
        [("ratio/q1", "q1%"), ("ratio/q99", "q99%"), ("ratio/q99.9", "q99.9%"), ("loss/ratio_max", "max")],
    ),
    (
        "train / inference mismatch",
        [("mismatch/abs_prob_diff_mean", "mean |p_train - p_rollout|"), ("mismatch/kl_k3", "k3 KL(rollout || train)")],
    ),
    # the disaggregated schedule (parallel.rollout_ranks > 0); colocated runs log none of these keys
    (
        "staleness of trained samples (updates behind the trained policy)",
        [("async/staleness_mean", "mean"), ("async/staleness_max", "max"), ("async/token_staleness_mean", "per token")],
    ),
    ("staleness breakdown (fraction of trained samples per age)", [("async/staleness_frac_*", "age ")]),
    (
        "samples dropped / generations spanning a weight update",
        [
            ("async/dropped_samples", "dropped (older than k)"),
            ("async/partial_samples", "spanning an update"),
            ("async/in_flight_updates", "updates loaded mid-rollout"),
        ],
    ),
    (
        "idle time per step (s)",
        [
            ("async/trainer_wait_s", "trainer waits for samples"),
            ("async/rollout_wait_s", "rollout waits for weights"),
            ("async/rollout_s", "rollout generating"),
        ],
    ),
    (
        "weight version",
        [
            ("async/policy_version", "trained policy"),
            ("async/rollout_version", "rollout engines (at rollout start)"),
            ("async/sample_version_min", "oldest trained sample"),
        ],
    ),
    ("weight sync time (s)", [("sync/time_s", "publish (trainer)"), ("sync/apply_s", "apply (rollout)")]),
    ("weight sync volume", [("sync/gbytes", "GB sent"), ("sync/gbps", "GB/s")]),
]
"""(title, [(metric key, label), ...]) of each panel; missing metrics are left out, and a panel without any of its
metrics too. A key ending in ``*`` stands for every logged key with that prefix (in numeric order of the rest,
labelled ``label + rest``)."""

_STYLES = ["-", "--", ":", "-."]


def read_run(run_dir: str) -> tuple[str, list[dict]]:
    """(label, records by step) of a run directory (``read_metrics``: records of a step merged, later keys win)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise ValueError(f"{run_dir}: no metrics.jsonl (is it a megatron-rlvr run directory?)")
    records = read_metrics(path)
    if not records and os.path.getsize(path) > 0:
        raise ValueError(f"{path}: no step records (not a metrics.jsonl written by megatron-rlvr: binary or garbled?)")
    label = os.path.basename(os.path.normpath(run_dir))
    cfg_path = os.path.join(run_dir, "config.yaml")
    if os.path.isfile(cfg_path):
        import yaml

        try:
            with open(cfg_path) as f:
                cfg = yaml.safe_load(f)
        except (UnicodeDecodeError, yaml.YAMLError) as e:
            raise ValueError(f"{cfg_path}: not a readable config ({type(e).__name__}: {str(e)[:200]})") from None
        algo = ((cfg if isinstance(cfg, dict) else {}).get("algorithm") or {}).get("name")
        if algo:
            label = f"{label} ({algo})"
    return label, records


def _smooth(ys: list[float], w: int) -> list[float]:
    out, acc, q = [], 0.0, []
    for y in ys:
        q.append(y)
        acc += y
        if len(q) > w:
            acc -= q.pop(0)
        out.append(acc / len(q))
    return out


def _suffix_order(suffix: str):
    return (0, int(suffix), "") if suffix.isdigit() else (1, 0, suffix)


def panels_of(runs: list[tuple[str, list[dict]]]) -> list[tuple[str, list[tuple[str, str]]]]:
    """The panels of PANELS that have a metric in ``runs`` ((label, records) pairs), with the keys present."""
    logged = {k for _, recs in runs for r in recs for k in r}
    out = []
    for title, keys in PANELS:
        present = []
        for key, label in keys:
            if key.endswith("*"):
                rests = sorted((k[len(key) - 1 :] for k in logged if k.startswith(key[:-1])), key=_suffix_order)
                present += [(key[:-1] + rest, label + rest) for rest in rests]
            elif key in logged:
                present.append((key, label))
        if present:
            out.append((title, present))
    return out


def plot_runs(run_dirs: list[str], out: str | None = None, smooth: int = 5) -> str:
    """Write the curves PNG; returns its path (default <first run dir>/curves.png, or compare.png for several)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not run_dirs:
        raise ValueError("plot: give at least one run directory")
    runs = [read_run(d) for d in run_dirs]
    panels = panels_of(runs)
    if not panels:
        raise ValueError("plot: the runs have no metrics to plot yet")
    cols = 2
    rows = (len(panels) + cols - 1) // cols
    # constrained layout places the figure title above the panels' titles (tight_layout ignores it: they overlapped)
    fig, axes = plt.subplots(rows, cols, figsize=(12, 3.2 * rows), squeeze=False, layout="constrained")
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (title, keys) in zip(axes.flat, panels):
        for ri, (label, recs) in enumerate(runs):
            for ki, (key, klabel) in enumerate(keys):
                pts = [(r["step"], r[key]) for r in recs if r.get(key) is not None]
                if not pts:
                    continue
                xs, ys = zip(*pts)
                name = klabel if len(runs) == 1 else f"{label}: {klabel}"
                ax.plot(
                    xs,
                    _smooth(list(ys), smooth),
                    _STYLES[ki % len(_STYLES)],
                    color=colours[ri % len(colours)],
                    label=name,
                )
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    names = ", ".join(label for label, _ in runs)
    fig.suptitle(f"megatron-rlvr: {names} (moving average over {smooth} steps)", fontsize=11)
    if out is None:
        out = os.path.join(run_dirs[0], "curves.png" if len(runs) == 1 else "compare.png")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out

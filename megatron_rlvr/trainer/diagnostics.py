"""Diagnostics that make the headline algorithms' claims measurable during a run, cheap enough to leave on.

- **Forgetting probe** (MCPO, arXiv 2604.16972: "prompts mastered at step t fall from 100% to ~95% accuracy at step
  t + 1 under DAPO, ~98% with the hinge-KL"). Every ``diagnostics.forgetting_every`` steps, after the update and the
  weight sync, the prompts that were MASTERED in this step's rollouts (all rollouts correct, the hinge-KL's
  definition) are re-sampled ``forgetting_rollouts`` times with the UPDATED policy and scored:
  ``forget/probe_accuracy`` is their accuracy, ``forget/still_mastered_frac`` the fraction still all-correct.
  Prompts selected for being all-correct are partly lucky draws, so their accuracy falls on re-sampling even with no
  update (regression to the mean). The same-policy control measures that part: right after the rollout, before the
  update and the weight sync, the same prompts are re-sampled with the same seeds by the policy that generated the
  step (``forget/control_accuracy``, ``forget/control_still_mastered_frac``); ``forget/drop`` = control accuracy -
  probe accuracy is the forgetting the update caused (0 when the update changed nothing: the samples are then
  identical). Cost: ``2 x forgetting_prompts x forgetting_rollouts`` extra samples per probed step. Off by default.
- **Ratio statistics** (CPGD, arXiv 2505.12504: ratio-based losses show unstable ratio dynamics): per micro-batch,
  quantiles of r = exp(logp - logp_old) over response tokens, the fraction of tokens outside the PPO band
  |r - 1| > 0.2 and the largest |log r|. Always on (a sort of the micro-batch's token ratios, small next to the
  forward/backward). The trainer's loss metrics average the quantiles over micro-batches weighted by tokens (so they
  are a token-weighted mean of micro-batch quantiles, not a quantile of the step), and take the max of ``*_max``.
  With one mini-batch and one epoch the behaviour policy equals the current one and r = 1: ratios only move with
  ``train.num_mini_batches > 1`` or ``train.ppo_epochs > 1`` (or rollout-side old log-probs).

The math is in plain tensor functions (tested against hand-computed cases); :func:`forgetting_probe` is the trainer
glue.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_rlvr.algorithms import mastered_rollouts
from megatron_rlvr.megatron.parallel import all_gather_objects
from megatron_rlvr.rollout.groups import Generator, Round, generate_groups, sampling_params

RATIO_QUANTILES = (0.001, 0.01, 0.5, 0.99, 0.999)
"""Quantiles of the token ratio reported as ``ratio/q{100 q}`` (e.g. ``ratio/q99``, ``ratio/q99.9``)."""
RATIO_BAND = 0.2
"""|r - 1| beyond this counts as out of band (the PPO clip range of the GRPO / CPGD presets)."""
PROBE_ROUND = 1_000_003
"""Generation round index of probe samples: their seeds never coincide with a training rollout's."""


def _qname(q: float) -> str:
    s = f"{100 * q:.6g}"
    return f"ratio/q{s}"


def ratio_quantile_metrics(
    logp_BT: Tensor, old_logp_BT: Tensor, mask_BT: Tensor, quantiles=RATIO_QUANTILES, band: float = RATIO_BAND
) -> dict[str, float]:
    """Token-ratio statistics over the response tokens of one micro-batch (python floats).

    r = exp(clamp(logp - logp_old, -20, 20)). Keys: ``ratio/q<100 q>`` (torch.quantile, linear interpolation),
    ``ratio/out_of_band_frac`` (|r - 1| > band), ``ratio/abs_log_ratio_max`` (max |log r|). An empty mask gives
    r = 1 statistics."""
    m = mask_BT.bool()
    lr = (logp_BT.detach() - old_logp_BT.detach()).double().clamp(-20.0, 20.0)[m]
    if lr.numel() == 0 or not bool(torch.isfinite(lr).all()):
        lr = torch.zeros(1, dtype=torch.float64, device=lr.device)
    r = lr.exp()
    qs = torch.quantile(r, torch.tensor(quantiles, dtype=torch.float64, device=r.device))  # q on the input's device
    out = {_qname(q): float(v) for q, v in zip(quantiles, qs)}
    out["ratio/out_of_band_frac"] = float(((r - 1.0).abs() > band).double().mean())
    out["ratio/abs_log_ratio_max"] = float(lr.abs().max())
    return out


def forgetting_metrics(correct_P_m: Tensor, control_P_m: Tensor | None = None) -> dict[str, float]:
    """Accuracy of re-sampled previously mastered prompts: bool [P prompts, m samples] -> metrics.

    ``forget/probe_accuracy`` mean correctness, ``forget/still_mastered_frac`` prompts with every sample correct,
    ``forget/probe_prompts`` P. P = 0 gives only the count (no accuracy to report). ``control_P_m``: the same prompts
    re-sampled by the pre-update policy -> ``forget/control_accuracy``, ``forget/control_still_mastered_frac`` and
    ``forget/drop`` (control accuracy - probe accuracy)."""
    c = correct_P_m.bool()
    if c.dim() != 2:
        raise ValueError(f"forgetting_metrics expects [P, m] correctness, got shape {tuple(c.shape)}")
    out = {"forget/probe_prompts": float(c.shape[0])}
    if c.numel() == 0:
        return out
    out["forget/probe_accuracy"] = float(c.double().mean())
    out["forget/still_mastered_frac"] = float(c.all(dim=1).double().mean())
    if control_P_m is not None:
        k = control_P_m.bool()
        if k.shape != c.shape:
            raise ValueError(f"control shape {tuple(k.shape)} differs from the probe's {tuple(c.shape)}")
        out["forget/control_accuracy"] = float(k.double().mean())
        out["forget/control_still_mastered_frac"] = float(k.all(dim=1).double().mean())
        out["forget/drop"] = out["forget/control_accuracy"] - out["forget/probe_accuracy"]
    return out


def probe_selection(mastered_G: Tensor, max_prompts: int) -> list[int]:
    """Indices of the first ``max_prompts`` mastered groups (batch order: deterministic on every rank)."""
    idx = [int(i) for i in torch.nonzero(mastered_G.bool().reshape(-1)).reshape(-1)]
    return idx[:max_prompts]


@dataclass
class ProbeControl:
    """The forgetting probe's same-policy control: its prompts re-sampled before the update."""

    correct_P_m: Tensor
    seconds: float


def probe_prompts(side, rolled, step: int) -> list[int] | None:
    """Indices into ``rolled.groups`` of the prompts probed at ``step`` (its mastered groups, at most
    ``forgetting_prompts``); None when the probe is not due. ``side``: the rank's rollout side."""
    cfg = side.cfg.diagnostics
    if not cfg.probe_due(step) or not rolled.groups:
        return None
    r = rolled.rewards
    mastered_G = mastered_rollouts(side.cfg.algorithm, r.shaped_G_n, correct_G_n=r.correct_G_n).any(1)
    return probe_selection(mastered_G, cfg.forgetting_prompts)


def _resample(side, rolled, chosen: list[int], step: int, gather) -> Tensor:
    """bool [P, m]: the chosen prompts sampled ``forgetting_rollouts`` times by the engine's current weights, with
    the probe's seeds (the same for the control and the probe), and scored."""
    cfg = side.cfg
    params = dataclasses.replace(sampling_params(cfg.rollout), n=cfg.diagnostics.forgetting_rollouts)
    groups = rolled.groups
    gen = Generator(side.engine, side.reward_manager, side.tokenizer, side.engine_info, gather)
    rnd = Round(
        [groups[i].example for i in chosen],
        [list(groups[i].prompt_ids) for i in chosen],
        params,
        seed=cfg.train.seed,
        step=step,
        round_idx=PROBE_ROUND,
    )
    probed, _ = generate_groups(gen, rnd)
    thr = cfg.algorithm.advantage.correct_threshold
    return torch.tensor([[r >= thr for r in g.rewards] for g in probed], dtype=torch.bool)


def forgetting_control(side, rolled, step: int, gather=all_gather_objects) -> ProbeControl | None:
    """Trainer glue, after the rollout and before the update and the weight sync: the probe's prompts re-sampled by
    the policy that generated them (every rank calls it with the same batch). None when the probe is not due."""
    t0 = time.perf_counter()
    chosen = probe_prompts(side, rolled, step)
    if not chosen:
        return None
    return ProbeControl(_resample(side, rolled, chosen, step, gather), time.perf_counter() - t0)


def forgetting_probe(side, rolled, step: int, control: ProbeControl | None = None, gather=all_gather_objects):
    """Trainer glue: re-sample this step's mastered prompts (of ``rolled``, the step's RolloutBatch) with the updated
    engine weights (every rank calls it with the same batch; generation is split over the engines like the
    rollout); ``control`` (from :func:`forgetting_control`) adds the same-policy control's metrics. Returns {} when
    not due."""
    t0 = time.perf_counter()
    chosen = probe_prompts(side, rolled, step)
    if chosen is None:
        return {}
    if not chosen:
        return {"forget/probe_prompts": 0.0}
    c = _resample(side, rolled, chosen, step, gather)
    out = forgetting_metrics(c, control.correct_P_m if control is not None else None)
    out["time/forget_probe_s"] = time.perf_counter() - t0 + (control.seconds if control is not None else 0.0)
    return {k: (v if math.isfinite(v) else 0.0) for k, v in out.items()}

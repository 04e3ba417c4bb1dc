"""Train/inference mismatch: how far the rollout engine's token probabilities are from the trainer's, and optional
corrections (off by default).

The rollout engine (vLLM, bf16 kernels, different reductions) and the trainer (Megatron) compute slightly different
probabilities for the same tokens under the same weights, so the rollouts are mildly off-policy for the trainer
("Your Efficient RL Framework Secretly Brings You Off-Policy RL Training", F. Yao et al., 2025). With
``logp_train`` the trainer's log-prob of a rollout token (same weights, same temperature) and ``logp_rollout`` the
engine's, the per-token importance ratio is ``rho = p_train / p_rollout = exp(logp_train - logp_rollout)``.

Metrics (``mismatch_metrics``), over the response tokens of the mask:
  mean / max |p_train - p_rollout|; KL(rollout || train) estimated from the rollout tokens with Schulman's k1
  (``logp_rollout - logp_train``, unbiased) and k3 (``rho - 1 - log rho``, unbiased and >= 0); ratio statistics.
Corrections (``mismatch_correction``), each off unless configured:
  - truncated importance sampling (TIS; Yao et al. 2025, eq. for the truncated ratio): multiply each token's
    policy-gradient term by ``min(rho, C)``;
  - masked importance sampling: drop tokens whose ratio leaves ``[low, high]`` from the loss mask.
Pure tensor functions; no Megatron imports.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_rlvr.ops.kl import kl_estimator


@dataclass
class MismatchCorrectionConfig:
    """Optional off-policy corrections for the rollout/trainer probability mismatch (all off by default)."""

    tis_cap: float | None = None
    """Truncated importance sampling cap C: token weight min(p_train / p_rollout, C). None: no reweighting."""
    mask_low: float | None = None
    """Mask tokens whose ratio p_train / p_rollout is below this. None: no lower bound."""
    mask_high: float | None = None
    """Mask tokens whose ratio p_train / p_rollout is above this. None: no upper bound."""

    def __post_init__(self):
        if self.tis_cap is not None and not (self.tis_cap > 0 and self.tis_cap < float("inf")):
            raise ValueError(
                f"MismatchCorrectionConfig.tis_cap must be a finite number > 0 or None, got {self.tis_cap!r}"
            )
        if self.mask_low is not None and not self.mask_low >= 0:
            raise ValueError(f"MismatchCorrectionConfig.mask_low must be >= 0 or None, got {self.mask_low!r}")
        if self.mask_high is not None and not self.mask_high > 0:
            raise ValueError(f"MismatchCorrectionConfig.mask_high must be > 0 or None, got {self.mask_high!r}")
        if self.mask_low is not None and self.mask_high is not None and not self.mask_low < self.mask_high:
            raise ValueError(f"MismatchCorrectionConfig: mask_low={self.mask_low} must be < mask_high={self.mask_high}")

    @property
    def enabled(self) -> bool:
        return self.tis_cap is not None or self.mask_low is not None or self.mask_high is not None


POSITIVE_LOGP_TOL = 1e-4
"""Largest positive log-prob taken as rounding (fp32 log-softmax of a near-certain token); beyond: an error."""


def _check(logp_train: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if logp_train.shape != logp_rollout.shape or logp_train.shape != mask.shape:
        raise ValueError(
            f"mismatch: shapes differ: logp_train {tuple(logp_train.shape)}, logp_rollout "
            f"{tuple(logp_rollout.shape)}, mask {tuple(mask.shape)}"
        )
    m = mask.bool()
    for name, t in (("logp_train", logp_train), ("logp_rollout", logp_rollout)):
        bad = m & ~torch.isfinite(t)
        if bool(bad.any()):
            raise ValueError(f"mismatch: {name} is NaN/inf at {int(bad.sum())} unmasked tokens")
        # fp32 log-softmax of a near-certain token rounds to small positives (x - lse with |x| ~ 30 errs by ~1e-6;
        # a real SmolLM2 run stopped on +1e-6 at step 3); a swapped argument or a missing normaliser is far larger
        if bool((m & (t > POSITIVE_LOGP_TOL)).any()):
            raise ValueError(
                f"mismatch: {name} has positive values up to {float(t[m].max()):.3g} (log-probs must be <= 0; "
                f"rounding up to {POSITIVE_LOGP_TOL:g} is tolerated)"
            )
    return m


def _masked_mean(x: torch.Tensor, m: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    return torch.where(m, x, torch.zeros_like(x)).sum() / n.clamp(min=1)


@torch.no_grad()
def mismatch_metrics(
    logp_train_BT: torch.Tensor, logp_rollout_BT: torch.Tensor, mask_BT: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Per-step mismatch metrics over the masked (response) tokens; all zeros when no token is masked in.

    Inputs: log-probs [B, T] (any matching shape) of the sampled tokens; mask [B, T] (1 = response token)."""
    m = _check(logp_train_BT, logp_rollout_BT, mask_BT)
    lt, lr = logp_train_BT.double(), logp_rollout_BT.double()
    n = m.sum()
    diff = (lt.exp() - lr.exp()).abs()
    log_ratio = lt - lr
    ratio = log_ratio.exp()
    zero = torch.zeros((), dtype=torch.float64)
    some = bool(n > 0)
    out = {
        "mismatch/tokens": n.double(),
        "mismatch/abs_prob_diff_mean": _masked_mean(diff, m, n),
        "mismatch/abs_prob_diff_max": diff[m].max() if some else zero,
        # KL(rollout || train) from rollout samples: pi = rollout, ref = train
        "mismatch/kl_k1": _masked_mean(kl_estimator(lr, lt, "k1", clamp=None), m, n),
        "mismatch/kl_k3": _masked_mean(kl_estimator(lr, lt, "k3", clamp=20.0), m, n),
        "mismatch/log_ratio_abs_mean": _masked_mean(log_ratio.abs(), m, n),
        "mismatch/ratio_mean": _masked_mean(ratio, m, n),
        "mismatch/ratio_max": ratio[m].max() if some else zero,
        "mismatch/ratio_min": ratio[m].min() if some else zero,
    }
    return {k: v.float() for k, v in out.items()}


@torch.no_grad()
def correction_weights(
    logp_train_BT: torch.Tensor,
    logp_rollout_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    config: MismatchCorrectionConfig,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The corrections' math without input checks (the trainer's log-probs may be non-finite in a step that is then
    skipped): (token weights [B, T], new mask [B, T], metrics). Weights are detached: multiply them into the per-token
    policy-gradient loss. Disabled corrections leave weights at 1 and the mask unchanged."""
    m = mask_BT.bool()
    n = m.sum()
    ratio = (logp_train_BT.double() - logp_rollout_BT.double()).exp()
    weights = torch.ones_like(ratio)
    clipped = torch.zeros_like(m)
    if config.tis_cap is not None:
        clipped = m & (ratio > config.tis_cap)
        weights = torch.where(m, ratio.clamp(max=config.tis_cap), weights)
    keep = m.clone()
    if config.mask_low is not None:
        keep &= ratio >= config.mask_low
    if config.mask_high is not None:
        keep &= ratio <= config.mask_high
    weights = torch.where(keep, weights, torch.zeros_like(weights))
    metrics = {
        "mismatch/tis_clip_frac": (clipped.sum() / n.clamp(min=1)).float(),
        "mismatch/masked_frac": ((m & ~keep).sum() / n.clamp(min=1)).float(),
        "mismatch/weight_mean": _masked_mean(weights, keep, keep.sum()).float(),
    }
    return weights.to(logp_train_BT.dtype), keep.to(mask_BT.dtype), metrics


@torch.no_grad()
def mismatch_correction(
    logp_train_BT: torch.Tensor,
    logp_rollout_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    config: MismatchCorrectionConfig,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`correction_weights` after checking the inputs (finite, log-probs <= 0 on the mask): (token weights
    [B, T], new mask [B, T], metrics)."""
    _check(logp_train_BT, logp_rollout_BT, mask_BT)
    return correction_weights(logp_train_BT, logp_rollout_BT, mask_BT, config)

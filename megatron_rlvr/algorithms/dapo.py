"""DAPO data-side pieces (Yu et al., "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
arXiv 2503.14476), as pure functions the trainer calls between reward scoring and the advantage computation.

- Overlong reward shaping (Sec. 3.4, eq. 13), L = response length, L_max = max response length, L_buf = buffer:
      R_len = 0                                   L <= L_max - L_buf
              ((L_max - L_buf) - L) / L_buf        L_max - L_buf < L <= L_max
              -1                                   L > L_max
  times ``overlong_penalty_factor``, added to the task reward.
- Overlong filtering: responses cut at the length limit get their loss mask zeroed (Sec. 3.4).
- Dynamic sampling (Sec. 3.2): drop groups whose rewards are all equal (zero advantage, zero gradient); the trainer
  over-samples and refills the batch with the kept groups.

The clip-higher and token-mean parts of DAPO are :class:`PolicyLossConfig` (eps_high = 0.28) and
:class:`AggregationConfig` (``token-mean``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .algorithm_config import DapoConfig


def overlong_penalty(cfg: DapoConfig, lengths: Tensor) -> Tensor:
    """R_len * factor, same shape as ``lengths`` (response lengths in tokens), float64."""
    if bool((lengths < 0).any()):
        raise ValueError("overlong_penalty: response lengths must be >= 0")
    L = lengths.to(torch.float64)
    start = float(cfg.max_response_len - cfg.overlong_buffer_len)
    ramp = (start - L) / float(cfg.overlong_buffer_len)
    pen = torch.where(
        L <= start, torch.zeros_like(L), torch.where(L <= cfg.max_response_len, ramp, -torch.ones_like(L))
    )
    return pen * cfg.overlong_penalty_factor


def shape_rewards(cfg: DapoConfig, rewards: Tensor, lengths: Tensor) -> Tensor:
    """rewards + overlong penalty when ``cfg.overlong_shaping``, else rewards unchanged (dtype kept)."""
    if rewards.shape != lengths.shape:
        raise ValueError(f"shape_rewards: rewards {tuple(rewards.shape)} and lengths {tuple(lengths.shape)} differ")
    if not cfg.overlong_shaping:
        return rewards
    return (rewards.to(torch.float64) + overlong_penalty(cfg, lengths)).to(
        rewards.dtype if rewards.is_floating_point() else torch.float32
    )


def mask_truncated(mask_BT: Tensor, truncated_B: Tensor) -> Tensor:
    """Loss mask with every row of a truncated response zeroed (overlong filtering)."""
    if truncated_B.shape != mask_BT.shape[:1]:
        raise ValueError(f"mask_truncated: truncated_B must be [B]={mask_BT.shape[0]}, got {tuple(truncated_B.shape)}")
    return mask_BT.bool() & ~truncated_B.bool()[:, None]


def dynamic_sampling_keep(rewards_G_n: Tensor, valid_G_n: Tensor | None = None) -> Tensor:
    """bool [G]: groups to keep, i.e. whose valid rewards are not all equal (at least two distinct values)."""
    if rewards_G_n.dim() != 2:
        raise ValueError(f"dynamic_sampling_keep: rewards_G_n must be [G, n], got {tuple(rewards_G_n.shape)}")
    valid = torch.ones_like(rewards_G_n, dtype=torch.bool) if valid_G_n is None else valid_G_n.bool()
    r = rewards_G_n.to(torch.float64)
    rmax = torch.where(valid, r, torch.full_like(r, -math.inf)).amax(dim=1)
    rmin = torch.where(valid, r, torch.full_like(r, math.inf)).amin(dim=1)
    return (valid.sum(dim=1) >= 2) & (rmax > rmin)

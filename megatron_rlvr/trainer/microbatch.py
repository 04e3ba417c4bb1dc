"""Training sequences and their packing into micro-batches by token budget (pure torch, no Megatron).

A sequence is ``prompt + response`` token ids. Megatron's logits at input position t predict token t + 1, so the
response tokens (token indices [P, L)) are scored at positions [P - 1, L - 1): ``labels[t] = tokens[t + 1]`` and the
loss mask is true exactly there. Per-sequence response-aligned values (old / reference / rollout log-probs, length
R = L - P) are scattered to those positions.

Packing: a micro-batch is ``b`` sequences right-padded to a common length ``s`` with ``b * s <= micro_batch_tokens``
(padding is masked out of every loss term and statistic; causal attention keeps real positions unaffected by the
padding after them). With pipeline parallelism every micro-batch of a call has the same [b, s] (megatron's p2p
communication needs one tensor shape), so ``uniform=True`` pads all of them to the longest sequence and fills the
last micro-batch with fully masked dummy rows. Without it, sequences are sorted by length so micro-batches waste
little padding. Either way the loss is unchanged: the loss normalisers are global (megatron_rlvr.algorithms).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Sequence:
    """One training sequence (a prompt and one sampled response) with its per-sequence training inputs."""

    tokens: list[int]
    """prompt + response token ids."""
    prompt_len: int
    """P: number of prompt tokens."""
    adv: float = 0.0
    """Advantage of the sequence."""
    mastered: bool = False
    """Its prompt is mastered (MCPO hinge-KL)."""
    train: bool = True
    """False: the sequence is in the batch but contributes no loss (e.g. a truncated response under DAPO's
    overlong filtering); its mask is all False."""
    rollout_logprobs: list[float] = field(default_factory=list)
    """Engine log-probs of the response tokens (length R)."""

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def response_len(self) -> int:
        return len(self.tokens) - self.prompt_len


def pack(lengths: list[int], budget: int | None, uniform: bool, multiple: int = 1) -> list[tuple[list[int], int, int]]:
    """Group sequence indices into micro-batches: list of (indices, micro_batch_size b, padded length s).

    ``budget`` None: one sequence per micro-batch. ``multiple``: s is rounded up to a multiple of it (sequence
    parallelism splits s over TP ranks). ``uniform``: every micro-batch has the same (b, s); the last may hold fewer
    indices than b (the caller pads it with dummy rows).
    """
    if not lengths:
        return []

    def rounded(n: int) -> int:
        return -(-n // multiple) * multiple

    if uniform:
        s = rounded(max(lengths))
        b = 1 if budget is None else max(1, budget // s)
        idx = list(range(len(lengths)))
        return [(idx[i : i + b], b, s) for i in range(0, len(idx), b)]
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    out: list[tuple[list[int], int, int]] = []
    cur: list[int] = []
    cur_s = 0
    for i in order:
        s = rounded(lengths[i])
        new_s = max(cur_s, s)
        if cur and (budget is None or (len(cur) + 1) * new_s > budget):
            out.append((cur, len(cur), cur_s))
            cur, new_s = [], s
        cur.append(i)
        cur_s = new_s
    if cur:
        out.append((cur, len(cur), cur_s))
    return out


def _response_row(values, start: int, s: int, what: str) -> list[float]:
    """A [s] row of zeros with ``values`` (a list or a 1-D tensor, response-aligned) from position ``start``."""
    if values is None or len(values) == 0:
        return [0.0] * s
    vals = values.tolist() if isinstance(values, torch.Tensor) else list(values)
    if start + len(vals) > s:
        raise ValueError(f"{what}: {len(vals)} values from position {start} do not fit the micro-batch length {s}")
    return [0.0] * start + vals + [0.0] * (s - start - len(vals))


def build_microbatch(
    seqs: list[Sequence],
    b: int,
    s: int,
    pad_id: int,
    *,
    old_logp: list[torch.Tensor | None] | None = None,
    ref_logp: list[torch.Tensor | None] | None = None,
    ids: list[int] | None = None,
    tis_cap: float | None = None,
) -> dict[str, torch.Tensor]:
    """Tensors of one micro-batch: tokens/position_ids/labels [b, s] long, mask [b, s] bool, adv [b], mastered [b],
    rollout_logp / old_logp / ref_logp [b, s] float32 (0 where unknown), seq_ids [b] (-1 for dummy rows), and
    tis_weight [b, s] when ``tis_cap`` is set and old log-probs are given.

    Rows are assembled as Python lists and converted once per field: a step builds hundreds of sequences, and
    per-sequence tensor writes cost more than the lists (on CPU each torch call also passes the CPU shims)."""
    if len(seqs) > b:
        raise ValueError(f"build_microbatch: {len(seqs)} sequences do not fit micro-batch size {b}")
    tokens, labels, mask, rollout, old, ref = [], [], [], [], [], []
    for r, q in enumerate(seqs):
        L, P = q.length, q.prompt_len
        if L > s:
            raise ValueError(f"sequence of length {L} does not fit the micro-batch length {s}")
        tokens.append(list(q.tokens) + [pad_id] * (s - L))
        labels.append(list(q.tokens[1:]) + [pad_id] * (s - L + 1))
        n = L - P if (q.train and L > P) else 0
        mask.append([False] * (P - 1) + [True] * n + [False] * (s - P + 1 - n) if n else [False] * s)
        rollout.append(_response_row(q.rollout_logprobs, P - 1, s, "rollout log-probs"))
        old.append(_response_row(None if old_logp is None else old_logp[r], P - 1, s, "old log-probs"))
        ref.append(_response_row(None if ref_logp is None else ref_logp[r], P - 1, s, "reference log-probs"))
    dummy = b - len(seqs)
    zeros = [0.0] * s
    out = {
        "tokens": torch.tensor(tokens + [[pad_id] * s] * dummy, dtype=torch.long).reshape(b, s),
        "position_ids": torch.arange(s, dtype=torch.long).unsqueeze(0).expand(b, s).contiguous(),
        "labels": torch.tensor(labels + [[pad_id] * s] * dummy, dtype=torch.long).reshape(b, s),
        "mask": torch.tensor(mask + [[False] * s] * dummy, dtype=torch.bool).reshape(b, s),
        "adv": torch.tensor([float(q.adv) for q in seqs] + [0.0] * dummy, dtype=torch.float32),
        "mastered": torch.tensor([bool(q.mastered) for q in seqs] + [False] * dummy, dtype=torch.bool),
        "rollout_logp": torch.tensor(rollout + [zeros] * dummy, dtype=torch.float32).reshape(b, s),
        "old_logp": torch.tensor(old + [zeros] * dummy, dtype=torch.float32).reshape(b, s),
        "ref_logp": torch.tensor(ref + [zeros] * dummy, dtype=torch.float32).reshape(b, s),
        "seq_ids": torch.tensor(
            ([-1] * len(seqs) if ids is None else [int(i) for i in ids[: len(seqs)]]) + [-1] * dummy, dtype=torch.long
        ),
    }
    if tis_cap is not None and old_logp is not None:
        out["tis_weight"] = tis_weights(out["old_logp"], out["rollout_logp"], out["mask"], tis_cap)
    return out


def tis_weights(old_bs: torch.Tensor, rollout_bs: torch.Tensor, mask_bs: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance sampling (Yao et al., "Your efficient RL framework secretly brings you off-policy RL
    training", 2025): w = min(pi_train_old / pi_rollout, C) per token (1 off the mask), folded into the advantage
    (every policy loss here is positively homogeneous in A, so w * loss(A) == loss(w * A))."""
    w = torch.exp((old_bs - rollout_bs).clamp(max=20.0)).clamp(max=cap)
    return torch.where(mask_bs, w, torch.ones_like(w))


def response_values(values_bs: torch.Tensor, seqs: list[Sequence]) -> list[torch.Tensor]:
    """Inverse of the scatter: per sequence its response-aligned values (length R) from a [b, s] tensor."""
    values = values_bs.detach().float().cpu()
    return [values[r, q.prompt_len - 1 : q.length - 1].clone() for r, q in enumerate(seqs)]

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

Row packing (``pack_rows``, ``train.pack_sequences``): several sequences share one row of the model's [b, s] input
(first-fit decreasing into rows of up to twice the longest sequence), with a block-diagonal causal attention mask so a
token attends only to earlier tokens of its own sequence. Rotary attention depends only on the distance between two
positions, so a sequence placed at offset o of a row gets the same logits as alone in its row (up to float rounding;
tests/test_trainer_packing.py checks it against unpacked rows). The model's work follows the real tokens, not rows x
the longest. Everything the loss reads stays in the one-sequence-per-row layout [n_seq, s]: the micro-batch carries
``unpack`` [n_seq, s], the flat packed position of every (sequence, position), and the token statistics are gathered
through it right after the vocab-parallel ops.
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


def pack_rows(lengths: list[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing: sequence indices grouped into rows of at most ``capacity`` tokens (every length must be
    <= capacity). Rows come out longest-first; within a row, sequences in the order they were placed."""
    if any(n > capacity for n in lengths):
        raise ValueError(f"pack_rows: a sequence of length {max(lengths)} exceeds the row capacity {capacity}")
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for r, room in enumerate(free):
            if lengths[i] <= room:
                rows[r].append(i)
                free[r] -= lengths[i]
                break
        else:
            rows.append([i])
            free.append(capacity - lengths[i])
    return rows


def pack_packed(
    lengths: list[int], budget: int, uniform: bool, multiple: int = 1
) -> list[tuple[list[list[int]], int, int]]:
    """Micro-batches of packed rows: list of (rows, b, s), each row a list of sequence indices.

    Row length s: twice the longest sequence, capped by ``budget`` (never below the longest), rounded up to
    ``multiple``. Twice, so any two sequences fit a row and first-fit decreasing leaves little of a row empty even
    when every sequence is longer than half the longest; not more, because the local attention's score tensor of a
    micro-batch grows with s (b x heads x s^2 = budget x heads x s). A micro-batch holds b = budget // s rows (at
    least 1); ``uniform`` keeps b for the last one too (the caller pads it with empty rows)."""
    if not lengths:
        return []
    longest = max(lengths)
    s = -(-max(longest, min(budget, 2 * longest)) // multiple) * multiple
    b = max(1, budget // s)
    rows = pack_rows(lengths, s)
    return [(rows[i : i + b], b if uniform else len(rows[i : i + b]), s) for i in range(0, len(rows), b)]


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
    rows: list[list[int]] | None = None,
) -> dict[str, torch.Tensor]:
    """Tensors of one micro-batch: tokens/position_ids/labels [b, s] long, mask [b, s] bool, adv [b], mastered [b],
    rollout_logp / old_logp / ref_logp [b, s] float32 (0 where unknown), seq_ids [b] (-1 for dummy rows), and
    tis_weight [b, s] when ``tis_cap`` is set and old log-probs are given.

    Rows are assembled as Python lists and converted once per field: a step builds hundreds of sequences, and
    per-sequence tensor writes cost more than the lists (on CPU each torch call also passes the CPU shims).

    ``rows`` (row packing, see the module docstring): indices into ``seqs``, the sequences of each of the b model
    rows. The model inputs tokens / position_ids / labels [b, s] and ``attention_mask`` [b, 1, s, s] (True = not
    attended) are then packed, and everything else is in the one-sequence-per-row layout [len(seqs), s], with
    ``unpack`` [len(seqs), s] the packed flat position of each entry (0 past a sequence's end: masked there)."""
    if rows is not None:
        return _packed_microbatch(
            seqs, rows, b, s, pad_id, old_logp=old_logp, ref_logp=ref_logp, ids=ids, tis_cap=tis_cap
        )
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


def _packed_microbatch(seqs, rows, b, s, pad_id, *, old_logp, ref_logp, ids, tis_cap) -> dict[str, torch.Tensor]:
    if len(rows) > b:
        raise ValueError(f"build_microbatch: {len(rows)} packed rows do not fit micro-batch size {b}")
    placed = sorted(j for row in rows for j in row)
    if placed != list(range(len(seqs))):
        raise ValueError("build_microbatch: rows must place every sequence exactly once")
    out = build_microbatch(seqs, len(seqs), s, pad_id, old_logp=old_logp, ref_logp=ref_logp, ids=ids, tis_cap=tis_cap)
    tokens = [[pad_id] * s for _ in range(b)]
    labels = [[pad_id] * s for _ in range(b)]
    positions = [list(range(s)) for _ in range(b)]
    segment = [[-1] * s for _ in range(b)]  # padding is its own segment: its (unread) queries attend to padding only
    unpack = [[0] * s for _ in seqs]
    for r, row in enumerate(rows):
        o = 0
        for j in row:
            q, L = seqs[j], seqs[j].length
            if o + L > s:
                raise ValueError(f"build_microbatch: packed row {r} needs {o + L} tokens, more than s={s}")
            tokens[r][o : o + L] = q.tokens
            labels[r][o : o + L - 1] = q.tokens[1:]  # a sequence's last position predicts nothing (masked)
            positions[r][o : o + L] = range(L)
            segment[r][o : o + L] = [j] * L
            unpack[j][:L] = range(r * s + o, r * s + o + L)
            o += L
    seg = torch.tensor(segment, dtype=torch.long)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    out["attention_mask"] = ~((seg[:, :, None] == seg[:, None, :]) & causal)[:, None]
    out["tokens"] = torch.tensor(tokens, dtype=torch.long).reshape(b, s)
    out["labels"] = torch.tensor(labels, dtype=torch.long).reshape(b, s)
    out["position_ids"] = torch.tensor(positions, dtype=torch.long).reshape(b, s)
    out["unpack"] = torch.tensor(unpack, dtype=torch.long).reshape(len(seqs), s)
    return out


def unpack_values(values_bs: torch.Tensor, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-position values of the model rows [b, s] in the one-sequence-per-row layout [n_seq, s] of the rest of
    ``mb`` (identity for an unpacked micro-batch). Differentiable (a gather)."""
    idx = mb.get("unpack")
    if idx is None:
        return values_bs
    return values_bs.reshape(-1)[idx.to(values_bs.device)]


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

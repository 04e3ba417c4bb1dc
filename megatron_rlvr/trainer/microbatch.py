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
tests/integration/test_trainer_packing.py checks it against unpacked rows). The model's work follows the real tokens,
not rows x the longest. Everything the loss reads stays in the one-sequence-per-row layout [n_seq, s]: the
micro-batch carries ``unpack`` [n_seq, s], the flat packed position of every (sequence, position), and the token
statistics are gathered through it right after the vocab-parallel ops.

A micro-batch is a :class:`MicroBatch` (typed fields, shapes in their docstrings); what is optional is None, never a
missing key.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from megatron_rlvr.models.mrope import rope_index
from megatron_rlvr.rollout.mismatch import MismatchCorrectionConfig, correction_weights


@dataclass(frozen=True)
class VisionInputs:
    """The images of one prompt (vision-language policies), shared by the sequences of its group."""

    pixel_values: torch.Tensor
    """[n_patches, D]: the image processor's output for the prompt's images, in prompt order."""
    image_grid_thw: torch.Tensor
    """[n_images, 3] long: each image's (temporal, height, width) patch grid."""
    prompt_image_mask: torch.Tensor
    """[P] bool: the prompt's image tokens (one per merged patch; a sampled image token is text)."""
    spatial_merge_size: int
    """Patches merged per side into one token (M-RoPE positions count merged patches)."""


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
    engine_routes: torch.Tensor | None = None
    """The engine's MoE routes [MoE layers, length - 1, k] int16 (routing replay R3); None when not returned."""
    engine_route_weights: torch.Tensor | None = None
    """The engine's gate weights of those experts [MoE layers, length - 1, k] float32; None when not returned."""
    vision: VisionInputs | None = None
    """The prompt's images (vision-language policies); None: text only."""
    loss_mask: list[int] | None = None
    """Multi-turn trajectories: per response token (length R), 1 where the policy sampled it, 0 at observation
    tokens, which then carry no loss and count in no statistic; None: every response token carries loss."""
    demo: bool = False
    """An environment's demonstration (off-policy guidance, ``agent.guidance``), not sampled by the engine: its
    ``rollout_logprobs`` are placeholders (its behaviour log-probs come from the trainer; the train/inference
    mismatch skips it)."""

    def __post_init__(self) -> None:
        if self.loss_mask is not None and len(self.loss_mask) != self.response_len:
            raise ValueError(
                f"Sequence: loss_mask has {len(self.loss_mask)} entries for {self.response_len} response tokens"
            )

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def loss_tokens(self) -> int:
        """Response tokens that carry loss when the sequence trains (all of them without a loss mask)."""
        return self.response_len if self.loss_mask is None else sum(1 for m in self.loss_mask if m)

    @property
    def response_len(self) -> int:
        return len(self.tokens) - self.prompt_len


@dataclass(frozen=True)
class MicroBatch:
    """The tensors of one micro-batch (CPU; moved to the device by the consumer). ``b`` model rows of length ``s``;
    ``n`` sequences (``n == b`` unless rows are packed)."""

    tokens: torch.Tensor
    """[b, s] long: input token ids (right-padded; packed rows hold several sequences)."""
    position_ids: torch.Tensor
    """[b, s] long: positions (restart at 0 for each sequence of a packed row); [3, b, s] (temporal, height, width:
    M-RoPE, models/mrope.py) when the micro-batch holds images."""
    labels: torch.Tensor
    """[b, s] long: the next token of every model position."""
    mask: torch.Tensor
    """[n, s] bool: response tokens that carry loss (one sequence per row)."""
    adv: torch.Tensor
    """[n] float32: advantage of each sequence (0 for dummy rows)."""
    mastered: torch.Tensor
    """[n] bool: the sequence's prompt is mastered (MCPO hinge-KL)."""
    rollout_logp: torch.Tensor
    """[n, s] float32: the engine's log-probs of the response tokens (0 elsewhere)."""
    old_logp: torch.Tensor
    """[n, s] float32: behaviour log-probs (0 where unknown, e.g. taken from the first update's own forward)."""
    ref_logp: torch.Tensor
    """[n, s] float32: reference-policy log-probs (0 where unknown)."""
    seq_ids: torch.Tensor
    """[n] long: the sequences' indices in the step's batch (-1 for dummy rows)."""
    is_weight: torch.Tensor | None = None
    """[n, s] float32: truncated importance-sampling weights min(pi_old / pi_rollout, C) from ``old_logp`` (None:
    no correction, or computed in the loss from the forward's own log-probs)."""
    attention_mask: torch.Tensor | None = None
    """[b, 1, s, s] bool, True = not attended: block-diagonal causal mask of packed rows (None: causal)."""
    unpack: torch.Tensor | None = None
    """[n, s] long: flat position in the packed [b * s] model output of each (sequence, position) (None: unpacked)."""
    pixel_values: torch.Tensor | None = None
    """[n_patches, D]: the images of the micro-batch's model rows, in the order their tokens appear in [b, s]
    (None: no images)."""
    image_grid_thw: torch.Tensor | None = None
    """[n_images, 3] long: their patch grids, same order."""
    image_mask: torch.Tensor | None = None
    """[b, s] bool: the image tokens of the model rows (prompt positions only)."""
    teacher_logp: torch.Tensor | None = None
    """[n, s] float32: the distillation teacher's log-probs of the response tokens (0 elsewhere); None: none given."""
    demo: torch.Tensor | None = None
    """[n] bool: the sequence is an environment's demonstration (off-policy guidance): it has no engine log-probs, so
    its correction weight (train/inference or staleness, :func:`importance_weights`) is 1 (None: no demonstration)."""

    def vision_kwargs(self, device) -> dict[str, torch.Tensor]:
        """The model's image inputs on ``device`` (empty without images)."""
        if self.pixel_values is None:
            return {}
        return dict(
            pixel_values=self.pixel_values.to(device),
            image_grid_thw=self.image_grid_thw.to(device),
            image_mask=self.image_mask.to(device),
        )


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
    correction: MismatchCorrectionConfig | None = None,
    rows: list[list[int]] | None = None,
    teacher_logp: list[torch.Tensor | None] | None = None,
) -> MicroBatch:
    """One micro-batch of ``seqs`` in ``b`` rows of length ``s`` (see :class:`MicroBatch`); ``correction`` (with
    ``old_logp``): the importance weights of the train/inference mismatch correction.

    Rows are assembled as Python lists and converted once per field: a step builds hundreds of sequences, and
    per-sequence tensor writes cost more than the lists (on CPU each torch call also passes the CPU shims).

    ``rows`` (row packing, see the module docstring): indices into ``seqs``, the sequences of each of the b model
    rows; the model inputs are then packed, everything else stays one sequence per row."""
    if rows is not None:
        packed = _packed_microbatch(
            seqs, rows, b, s, pad_id, old_logp=old_logp, ref_logp=ref_logp, ids=ids, correction=correction
        )
        return _with_teacher(packed, seqs, len(seqs), s, teacher_logp)
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
        if n and q.loss_mask is not None:  # multi-turn: observation tokens carry no loss
            mask.append([False] * (P - 1) + [bool(m) for m in q.loss_mask] + [False] * (s - P + 1 - n))
        else:
            mask.append([False] * (P - 1) + [True] * n + [False] * (s - P + 1 - n) if n else [False] * s)
        rollout.append(_response_row(q.rollout_logprobs, P - 1, s, "rollout log-probs"))
        old.append(_response_row(None if old_logp is None else old_logp[r], P - 1, s, "old log-probs"))
        ref.append(_response_row(None if ref_logp is None else ref_logp[r], P - 1, s, "reference log-probs"))
    dummy = b - len(seqs)
    zeros = [0.0] * s
    vision = _vision_fields([[q] for q in seqs] + [[]] * dummy, [[0] for _ in seqs] + [[]] * dummy, b, s)
    mask_t = torch.tensor(mask + [[False] * s] * dummy, dtype=torch.bool).reshape(b, s)
    rollout_t = torch.tensor(rollout + [zeros] * dummy, dtype=torch.float32).reshape(b, s)
    old_t = torch.tensor(old + [zeros] * dummy, dtype=torch.float32).reshape(b, s)
    demo_t = torch.tensor([bool(q.demo) for q in seqs] + [False] * dummy, dtype=torch.bool)
    weight = None
    if correction is not None and correction.enabled and old_logp is not None:
        weight = importance_weights(old_t, rollout_t, mask_t, correction, demo_t)
    mb = MicroBatch(
        tokens=torch.tensor(tokens + [[pad_id] * s] * dummy, dtype=torch.long).reshape(b, s),
        position_ids=vision.pop(
            "position_ids", torch.arange(s, dtype=torch.long).unsqueeze(0).expand(b, s).contiguous()
        ),
        labels=torch.tensor(labels + [[pad_id] * s] * dummy, dtype=torch.long).reshape(b, s),
        mask=mask_t,
        adv=torch.tensor([float(q.adv) for q in seqs] + [0.0] * dummy, dtype=torch.float32),
        mastered=torch.tensor([bool(q.mastered) for q in seqs] + [False] * dummy, dtype=torch.bool),
        rollout_logp=rollout_t,
        old_logp=old_t,
        ref_logp=torch.tensor(ref + [zeros] * dummy, dtype=torch.float32).reshape(b, s),
        seq_ids=torch.tensor(
            ([-1] * len(seqs) if ids is None else [int(i) for i in ids[: len(seqs)]]) + [-1] * dummy, dtype=torch.long
        ),
        is_weight=weight,
        demo=demo_t if bool(demo_t.any()) else None,
        **vision,
    )
    return _with_teacher(mb, seqs, b, s, teacher_logp)


def _with_teacher(mb: MicroBatch, seqs: list[Sequence], n: int, s: int, teacher_logp) -> MicroBatch:
    """``mb`` with the teacher's response-aligned log-probs scattered to [n, s] (unchanged when None)."""
    if teacher_logp is None:
        return mb
    rows = [_response_row(v, q.prompt_len - 1, s, "teacher log-probs") for q, v in zip(seqs, teacher_logp)]
    rows += [[0.0] * s] * (n - len(seqs))
    return dataclasses.replace(mb, teacher_logp=torch.tensor(rows, dtype=torch.float32).reshape(n, s))


def _vision_fields(rows: list[list[Sequence]], offsets: list[list[int]], b: int, s: int) -> dict:
    """M-RoPE positions [3, b, s], image mask [b, s], pixel values and grids of model rows holding the sequences
    ``rows[r]`` at ``offsets[r]``; {} when no sequence has images (text-only rows keep 1-D positions)."""
    if not any(q.vision is not None for row in rows for q in row):
        return {}
    positions = torch.arange(s, dtype=torch.long).expand(3, b, s).clone()
    mask = torch.zeros(b, s, dtype=torch.bool)
    pixels, grids = [], []
    for r, (row, offs) in enumerate(zip(rows, offsets)):
        for q, o in zip(row, offs):
            L = q.length
            positions[:, r, o : o + L] = torch.arange(L)
            v = q.vision
            if v is None:
                continue
            m = torch.zeros(L, dtype=torch.bool)
            m[: q.prompt_len] = v.prompt_image_mask
            positions[:, r, o : o + L] = rope_index(m, v.image_grid_thw, v.spatial_merge_size)
            mask[r, o : o + L] = m
            pixels.append(v.pixel_values)
            grids.append(v.image_grid_thw)
    return dict(
        position_ids=positions,
        image_mask=mask,
        pixel_values=torch.cat(pixels),
        image_grid_thw=torch.cat(grids).long(),
    )


def _packed_microbatch(seqs, rows, b, s, pad_id, *, old_logp, ref_logp, ids, correction) -> MicroBatch:
    if len(rows) > b:
        raise ValueError(f"build_microbatch: {len(rows)} packed rows do not fit micro-batch size {b}")
    placed = sorted(j for row in rows for j in row)
    if placed != list(range(len(seqs))):
        raise ValueError("build_microbatch: rows must place every sequence exactly once")
    flat = build_microbatch(
        seqs, len(seqs), s, pad_id, old_logp=old_logp, ref_logp=ref_logp, ids=ids, correction=correction
    )
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
    offsets = [[sum(seqs[k].length for k in row[:i]) for i in range(len(row))] for row in rows]
    vision = _vision_fields(
        [[seqs[j] for j in row] for row in rows] + [[]] * (b - len(rows)), offsets + [[]] * (b - len(rows)), b, s
    )
    return dataclasses.replace(
        flat,
        **{k: v for k, v in vision.items() if k != "position_ids"},
        tokens=torch.tensor(tokens, dtype=torch.long).reshape(b, s),
        labels=torch.tensor(labels, dtype=torch.long).reshape(b, s),
        position_ids=vision.get("position_ids", torch.tensor(positions, dtype=torch.long).reshape(b, s)),
        attention_mask=~((seg[:, :, None] == seg[:, None, :]) & causal)[:, None],
        unpack=torch.tensor(unpack, dtype=torch.long).reshape(len(seqs), s),
    )


def unpack_values(values_bs: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
    """Per-position values of the model rows [b, s] in the one-sequence-per-row layout [n, s] of the rest of ``mb``
    (identity for an unpacked micro-batch). Differentiable (a gather)."""
    if mb.unpack is None:
        return values_bs
    return values_bs.reshape(-1)[mb.unpack.to(values_bs.device)]


def importance_weights(
    old_bs: torch.Tensor,
    rollout_bs: torch.Tensor,
    mask_bs: torch.Tensor,
    correction: MismatchCorrectionConfig,
    demo_b: torch.Tensor | None = None,
) -> torch.Tensor:
    """[b, s] float32 weights of the train/inference mismatch correction (megatron_rlvr.rollout.mismatch: truncated
    IS min(pi_old / pi_rollout, C), Yao et al. 2025), 1 off the mask, folded into the advantage (every policy loss
    here is positively homogeneous in A, so w * loss(A) == loss(w * A)).

    ``demo_b`` [b] bool: the rows that are an environment's demonstration (off-policy guidance) get 1 at every token:
    nothing sampled them, so their behaviour policy is taken to be the proximal one (``old_bs``), as in the
    synchronous schedule where the trainer's recomputed log-probs are their behaviour log-probs (LUFFY, Yan et al.
    2025, weighs an off-policy demonstration by the current policy only); their placeholder engine log-probs never
    enter a weight."""
    if demo_b is not None:
        mask_bs = mask_bs & ~demo_b.to(mask_bs.device)[:, None]
    w, _, _ = correction_weights(old_bs, rollout_bs, mask_bs, correction)
    return torch.where(mask_bs, w.float(), torch.ones_like(w, dtype=torch.float32))


def response_values(values_bs: torch.Tensor, seqs: list[Sequence]) -> list[torch.Tensor]:
    """Inverse of the scatter: per sequence its response-aligned values (length R) from a [b, s] tensor."""
    values = values_bs.detach().float().cpu()
    return [values[r, q.prompt_len - 1 : q.length - 1].clone() for r, q in enumerate(seqs)]

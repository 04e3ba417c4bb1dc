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

"""Reduction of per-micro-batch loss metrics over micro-batches and ranks (each key as algorithms.reductions says)."""

from __future__ import annotations

import math

from megatron_rlvr.algorithms.reductions import reduction_of


class LossMetrics:
    """Accumulates the info dicts of training micro-batches on one rank; ``merge`` combines ranks.

    Each key is reduced as the table of megatron_rlvr.algorithms.reductions says: shares of the
    global loss are summed within a mini-batch (over micro-batches and data-parallel ranks) and averaged over
    updates, max / min take the extreme, everything else is a mean weighted by the micro-batch's valid tokens.
    """

    def __init__(self):
        self.sums: dict[str, float] = {}
        self.weights: dict[str, float] = {}
        self.shares: dict[str, float] = {}
        self.maxima: dict[str, float] = {}
        self.minima: dict[str, float] = {}

    def add(self, info: dict[str, float]) -> None:
        w = float(info.get("loss/num_tokens", 0.0))
        for k, v in info.items():
            v = float(v)
            kind = reduction_of(k)
            if kind == "share":
                self.shares[k] = self.shares.get(k, 0.0) + v
            elif kind == "max":
                self.maxima[k] = max(self.maxima.get(k, -math.inf), v)
            elif kind == "min":
                self.minima[k] = min(self.minima.get(k, math.inf), v)
            elif w > 0:
                self.sums[k] = self.sums.get(k, 0.0) + v * w
                self.weights[k] = self.weights.get(k, 0.0) + w

    def state(self) -> dict:
        return {
            "sums": self.sums,
            "weights": self.weights,
            "shares": self.shares,
            "maxima": self.maxima,
            "minima": self.minima,
        }

    @staticmethod
    def merge(states: list[dict], num_updates: int) -> dict[str, float]:
        total = LossMetrics()
        for st in states:
            for name in ("sums", "weights", "shares"):
                acc = getattr(total, name)
                for k, v in st[name].items():
                    acc[k] = acc.get(k, 0.0) + v
            for k, v in st["maxima"].items():
                total.maxima[k] = max(total.maxima.get(k, -math.inf), v)
            for k, v in st["minima"].items():
                total.minima[k] = min(total.minima.get(k, math.inf), v)
        out = {k: total.sums[k] / total.weights[k] for k in total.sums if total.weights.get(k, 0) > 0}
        out.update({k: v / max(num_updates, 1) for k, v in total.shares.items()})
        out.update(total.maxima)
        out.update(total.minima)
        return out

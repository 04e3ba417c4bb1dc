"""How each loss metric is reduced over micro-batches, data-parallel ranks and mini-batch updates, declared by the
module that produces it (next to the code that emits the key), so no central list must be kept in sync.

Kinds:
- ``mean`` (the default, nothing to declare): mean over micro-batches and ranks weighted by each micro-batch's
  valid tokens (``loss/num_tokens``), e.g. clip fractions, entropy, approx KL.
- ``share``: the micro-batch's share of a loss normalised by GLOBAL token / sequence counts (algorithms.aggregation):
  summed over micro-batches and ranks within an update, averaged over updates (``loss/policy``, ``loss/num_tokens``).
- ``max`` / ``min``: the extreme over everything (``loss/ratio_max``, non-finite flags).

A new regulariser declares its loss term's kind where it computes it, e.g. ``declare("share", "myreg/loss")``;
an undeclared key is a token-weighted mean. Torch-free.
"""

from __future__ import annotations

KINDS = ("mean", "share", "max", "min")
_DECLARED: dict[str, str] = {}


def declare(kind: str, *keys: str) -> None:
    """Declare the reduction of metric ``keys``; a key declared twice with different kinds is an error."""
    if kind not in KINDS:
        raise ValueError(f"metric reduction must be one of {KINDS}, got {kind!r}")
    for key in keys:
        old = _DECLARED.setdefault(key, kind)
        if old != kind:
            raise ValueError(f"metric {key!r} is declared as {old!r} and as {kind!r}")


def reduction_of(key: str) -> str:
    """The declared reduction of a metric key (``mean`` when undeclared)."""
    return _DECLARED.get(key, "mean")


def declared() -> dict[str, str]:
    """A copy of every declaration (docs, tests)."""
    return dict(_DECLARED)

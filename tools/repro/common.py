"""Shared helpers of the repro scripts: seeds' mean with a 95% t-interval, JSON output, quiet plotting."""

from __future__ import annotations

import json
import math
import os

# two-sided 97.5% Student-t quantiles by degrees of freedom (scipy is not a dependency)
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def mean_ci(xs: list[float]) -> tuple[float, float]:
    """(mean, half-width of the 95% t-interval over seeds); half-width 0 for one value."""
    xs = [float(x) for x in xs]
    n = len(xs)
    if n == 0:
        return float("nan"), float("nan")
    m = sum(xs) / n
    if n == 1:
        return m, 0.0
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))
    return m, _T975.get(n - 1, 1.96) * sd / math.sqrt(n)


def fmt_ci(xs: list[float], digits: int = 3) -> str:
    m, h = mean_ci(xs)
    return f"{m:.{digits}f} ± {h:.{digits}f}"


def write_json(path: str, obj) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt

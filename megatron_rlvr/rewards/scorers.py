"""Resolve ``RewardConfig.fn`` (a built-in name or a user function's dotted path) into a scorer callable."""

from __future__ import annotations

import importlib
import inspect
import math
import numbers
import os
import sys
from collections.abc import Callable
from typing import Any

from megatron_rlvr.rewards.builtin import REWARD_FNS

__all__ = ["NonFiniteReward", "Scorer", "build_scorer", "load_reward_fn"]


class NonFiniteReward(ValueError):
    """The reward function returned NaN or +-inf (counted in reward/n_nonfinite, scored 0)."""


def _import_user_module(name: str):
    """Import a reward function's module; a module in the working directory is found as with ``python -m`` (the
    installed ``megatron-rlvr`` script's sys.path starts with its bin/ folder instead). The working directory is
    appended, so installed packages still win; reward workers copy this sys.path."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        cwd = os.getcwd()
        if e.name != name.partition(".")[0] or cwd in sys.path or "" in sys.path:
            raise
        sys.path.append(cwd)
        return importlib.import_module(name)


def load_reward_fn(spec: str) -> Callable[..., float]:
    """Import a user reward function from ``"pkg.mod:fn"`` or ``"pkg.mod.fn"``.

    The function's signature must be ``fn(response: str, ground_truth: str, **metadata) -> float``. Raises a
    ValueError that names the path and what is wrong (module not importable, attribute missing, not callable, or a
    signature that cannot take two positional arguments).
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"reward fn path must be a non-empty string like 'my_pkg.my_mod:fn', got {spec!r}")
    spec = spec.strip()
    if ":" in spec:
        module_name, _, attr = spec.partition(":")
    elif "." in spec:
        module_name, _, attr = spec.rpartition(".")
    else:
        raise ValueError(
            f"reward fn {spec!r} is neither a built-in ({sorted(REWARD_FNS)}) nor a dotted path "
            "like 'my_pkg.my_mod:fn' or 'my_pkg.my_mod.fn'"
        )
    if not module_name or not attr:
        raise ValueError(f"reward fn path {spec!r}: expected 'module:function' with both parts non-empty")
    try:
        module = _import_user_module(module_name)
    except ModuleNotFoundError as e:
        hint = ""
        if e.name == module_name.partition(".")[0]:
            hint = (
                f"; it is looked for in the working directory ({os.getcwd()}) and on PYTHONPATH: run from its folder "
                "or add that folder to PYTHONPATH"
            )
        raise ValueError(
            f"reward fn {spec!r}: cannot import module {module_name!r}: {type(e).__name__}: {e}{hint}"
        ) from e
    except Exception as e:  # the user's module raising at import
        raise ValueError(f"reward fn {spec!r}: cannot import module {module_name!r}: {type(e).__name__}: {e}") from e
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            public = sorted(n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n, None)))
            raise ValueError(
                f"reward fn {spec!r}: module {module_name!r} has no attribute {attr!r} (callables there: {public[:20]})"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"reward fn {spec!r} is not callable (got {type(obj).__name__})")
    try:
        inspect.signature(obj).bind("response", "ground_truth")
    except TypeError as e:
        raise ValueError(
            f"reward fn {spec!r} must have the signature fn(response, ground_truth, **metadata) -> float: {e}"
        ) from e
    except ValueError:  # builtins without an introspectable signature: accept
        pass
    return obj


class Scorer:
    """A reward function plus the per-item contract: metadata keys are passed as keyword arguments (only those the
    function accepts, when it has no ``**metadata``), and the result must be a finite float."""

    def __init__(self, fn: Callable[..., float], name: str):
        self.fn = fn
        self.name = name
        self._accepted: set[str] | None = None  # None: takes **kwargs
        try:
            params = inspect.signature(fn).parameters.values()
            if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
                self._accepted = {p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)} - {
                    "response",
                    "ground_truth",
                }
        except (TypeError, ValueError):
            pass

    def __call__(self, response: str, ground_truth: str, metadata: dict | None) -> float:
        kwargs = dict(metadata or {})
        if self._accepted is not None:
            kwargs = {k: v for k, v in kwargs.items() if k in self._accepted}
        value = self.fn(response, ground_truth, **kwargs)
        # Numbers only (int, float, bool, numpy scalars, 0-dim tensors: anything with __float__): a string "1.0",
        # None or a list is a bug in the function, not a reward to parse.
        if not isinstance(value, numbers.Real) and not hasattr(type(value), "__float__"):
            raise TypeError(
                f"reward fn {self.name} returned {type(value).__name__} {value!r:.200}; it must return a number "
                "(float, int or bool)"
            )
        reward = float(value)
        if not math.isfinite(reward):
            raise NonFiniteReward(f"reward fn {self.name} returned a non-finite reward {reward}")
        return reward

    def warmup(self) -> None:
        warm = getattr(self.fn, "warmup", None)
        if callable(warm):
            warm()


class RuleMix:
    """The weighted sum of rule rewards (``reward.mix``'s terms other than the judge), scored as one item: each
    term through its own :class:`Scorer` (its metadata filter and number check), so any term's failure fails the
    item."""

    def __init__(self, terms: list[tuple[str, float, Scorer]]):
        self.terms = terms

    def __call__(self, response: str, ground_truth: str, **metadata) -> float:
        return sum(weight * scorer(response, ground_truth, metadata) for _, weight, scorer in self.terms)

    def warmup(self) -> None:
        for _, _, scorer in self.terms:
            scorer.warmup()


def build_scorer(fn: str, extraction: str = "boxed", options: dict | None = None) -> Scorer:
    """A built-in reward (``"math"``, ``"gsm8k"``, ``"reasoning_gym"``, ``"code"``, ...) built with ``extraction``
    and its ``options`` (``RewardConfig.scorer_options()``), a user function loaded from its dotted path, or
    ``"mix"``: the weighted rule terms ``options["terms"]`` = [(fn, weight, options)]."""
    if fn == "mix":
        terms = [(name, weight, build_scorer(name, extraction, opts)) for name, weight, opts in options["terms"]]
        return Scorer(RuleMix(terms), "mix")
    if fn in REWARD_FNS:
        return Scorer(REWARD_FNS[fn](extraction=extraction, **(options or {})), fn)
    return Scorer(load_reward_fn(fn), fn)

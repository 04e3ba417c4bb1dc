"""The metric-reduction table (megatron_rlvr.algorithms.reductions): every key in it is emitted by the module its
comment names, an extreme (``*_max`` / ``*_min``) is reduced as that extreme and never as a sum or a mean, and
importing modules changes nothing."""

import ast
import importlib
import re
from pathlib import Path

import pytest
import torch

import megatron_rlvr
from megatron_rlvr.algorithms import AlgorithmConfig, LossNormalizers, PolicyLossInputs, compute_policy_loss
from megatron_rlvr.algorithms.advantages import compute_advantages
from megatron_rlvr.algorithms.reductions import KINDS, REDUCTIONS, reduction_of
from megatron_rlvr.rollout.mismatch import mismatch_metrics

PKG = Path(megatron_rlvr.__file__).resolve().parent
EXTREME = re.compile(r"^[a-z_]+/[a-z0-9_]*_(max|min)$")
TRAINER_KEYS = (
    "ratio/abs_log_ratio_max",
    "train/nonfinite",
    "response/length_max",
    "response/length_min",
    "async/staleness_max",
    "async/sample_version_min",
    "agent/turns_max",
    "moe/expert_bias_abs_max",
    "moe/load_imbalance_max",
)
"""Emitted inside the trainer's step or the router metrics it calls (checked in their sources: their functions need a
model and process groups)."""


def _loss_keys() -> set[str]:
    """The metric keys of compute_policy_loss with every term on (drift, ref KL, entropy, MCPO hinge, margin credit,
    distillation)."""
    cfg = AlgorithmConfig.from_dict(
        {
            "drift": {"coef": 0.1},
            "ref_kl": {"coef": 0.1, "estimator": "k3"},
            "entropy": {"coef": 0.01},
            "hinge_kl": {"enabled": True},
            "margin_credit": {"enabled": True},
            "distill": {"teacher": "tiny"},
        }
    )
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(2, 3, dtype=torch.bool)
    old = -torch.rand(2, 3, generator=g) - 0.1
    inp = PolicyLossInputs(
        old + 0.05,
        old,
        mask,
        adv_B=torch.tensor([1.0, -1.0]),
        ref_logp_BT=old - 0.1,
        entropy_BT=torch.rand(2, 3, generator=g),
        margin_BT=torch.rand(2, 3, generator=g),
        mastered_B=torch.tensor([True, False]),
        teacher_logp_BT=old - 0.2,
    )
    _, metrics = compute_policy_loss(cfg, inp, LossNormalizers.from_batch(mask, inp.mastered_B))
    return set(metrics)


def _advantage_keys() -> set[str]:
    _, metrics = compute_advantages(AlgorithmConfig(), torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0]]))
    return set(metrics)


def _mismatch_keys() -> set[str]:
    lp = -torch.rand(2, 3, generator=torch.Generator().manual_seed(1)) - 0.1
    return set(mismatch_metrics(lp, lp - 0.01, torch.ones(2, 3)))


def _trainer_literals() -> set[str]:
    found = set()
    for path in [*(PKG / "trainer").glob("*.py"), PKG / "megatron" / "router_loss.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found.add(node.value)
    return found


def test_every_key_of_the_table_is_emitted_by_its_producer():
    emitted = _loss_keys() | _advantage_keys() | _mismatch_keys()
    in_trainer = _trainer_literals()
    assert set(TRAINER_KEYS) <= in_trainer, f"no longer in megatron_rlvr/trainer: {set(TRAINER_KEYS) - in_trainer}"
    stale = set(REDUCTIONS) - emitted - set(TRAINER_KEYS)
    assert not stale, f"keys in REDUCTIONS that no producer emits (renamed or removed?): {sorted(stale)}"


def test_the_table_holds_only_non_mean_kinds_and_extremes_take_their_extreme():
    assert set(REDUCTIONS.values()) <= set(KINDS) - {"mean"}
    for key, kind in REDUCTIONS.items():
        m = EXTREME.match(key)
        if m:
            assert kind == m.group(1), f"{key} is reduced as {kind!r}, not as its {m.group(1)}"


def test_every_extreme_the_package_emits_is_reduced_as_that_extreme():
    """A ``*_max`` / ``*_min`` key anywhere in the package's sources or in a producer's output is in the table with
    its extreme (so it cannot be averaged or summed by default)."""
    keys = _loss_keys() | _advantage_keys() | _mismatch_keys()
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and "/" in node.value:
                keys.add(node.value)
    extremes = {k: EXTREME.match(k).group(1) for k in keys if EXTREME.match(k)}
    assert extremes, "no *_max / *_min metric found: the scan is broken"
    wrong = {k: reduction_of(k) for k, kind in extremes.items() if reduction_of(k) != kind}
    assert not wrong, f"extremes reduced as something else (add them to REDUCTIONS): {wrong}"


def test_shares_are_the_loss_terms():
    shares = {k for k, v in REDUCTIONS.items() if v == "share"}
    assert {"loss/policy", "loss/total", "loss/num_tokens", "drift/kl", "mcpo/hinge_kl"} <= shares
    assert reduction_of("loss/clip_frac_high") == "mean" and reduction_of("an/unknown_key") == "mean"


def test_importing_modules_changes_no_reduction():
    probe = sorted(REDUCTIONS) + ["loss/clip_frac_high", "loss/entropy", "an/unknown_key", "ratio/q99"]
    before = {k: reduction_of(k) for k in probe}
    table = dict(REDUCTIONS)
    for path in sorted(PKG.rglob("*.py")):
        if path.name == "__main__.py":
            continue  # runs a command when imported
        rel = path.relative_to(PKG.parent).with_suffix("").parts
        name = ".".join(rel[:-1] if rel[-1] == "__init__" else rel)
        try:
            importlib.import_module(name)
        except ImportError:  # an optional dependency (vllm, ...) missing here
            continue
    assert {k: reduction_of(k) for k in probe} == before and dict(REDUCTIONS) == table
    with pytest.raises(TypeError):
        REDUCTIONS["loss/policy"] = "mean"  # read-only: no module can re-declare a key

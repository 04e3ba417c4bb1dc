"""One RL step, ours against TRL's GRPOTrainer on the same work, alternating runs in one invocation.

The work (both sides): a randomly initialised Llama (hidden 256, 4 layers, 8 query / 4 KV heads, FFN 512) over the
built-in character tokenizer, the same start weights (transformers' init under the same seed), 8 single-digit
"a+b=" prompts x 8 rollouts x at most 8 new tokens (temperature 1), exact-answer reward, GRPO (no KL term), Adam at
lr 1e-3 with gradient clipping 1.0, fp32, no activation recomputation (TRL's default gradient checkpointing and our
``train.recompute=full`` default are both switched off), 2 CPU threads in all. Generation on both sides is
transformers ``generate`` (our ``rollout.engine=hf``, set explicitly).

Each run is a fresh process doing ``--steps`` steps; the first ``--warmup`` are dropped and a run reports the
median of the rest per phase. Runs alternate (ours TP=1, TRL, ours TP=2, ours TP=1, ...) so machine noise hits all
sides alike; the summary is the median over runs, each run's numbers are printed too, and the last lines are

    step_vs_trl=<ours TP=1 median step / TRL median step>
    step_vs_trl_tp2=<ours TP=2 on 2 ranks (1 thread each) / TRL>

TRL has no tensor parallelism: its baseline is the same single process with 2 threads.

TRL (the ``bench`` extra, trl==1.16.0) may live in another environment: ``--trl-python`` (or
$MEGATRON_RLVR_TRL_PYTHON) names its interpreter; it needs trl, transformers and torch only (not this package).
Without TRL the benchmark says so and exits 0.

    PYTHONPATH=$PWD .venv/bin/python tools/bench_step.py --runs 5 --trl-python /path/to/trl-venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=64,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    tie_word_embeddings=False,
    initializer_range=0.02,
    attention_bias=False,
    mlp_bias=False,
)
PROMPTS, N, MAX_NEW, LR, SEED, THREADS = 8, 8, 8, 1e-3, 1234, 2


# ---------------------------------------------------------------------------------------------------- shared inputs


def prepare(workdir: str) -> None:
    """config.json + tokenizer folder + prompts.jsonl (the procedural single-digit addition task) in ``workdir``."""
    sys.path.insert(0, REPO)
    from megatron_rlvr.data.procedural import ProceduralConfig, generate_examples
    from megatron_rlvr.families.tiny import save_tiny_tokenizer, tiny_tokenizer

    tok = tiny_tokenizer()
    save_tiny_tokenizer(os.path.join(workdir, "tok"))
    cfg = dict(MODEL, vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    cfg.update(bos_token_id=None, dtype="float32")
    with open(os.path.join(workdir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    examples = generate_examples(ProceduralConfig(task="arithmetic", style="terse", num_examples=1000))
    with open(os.path.join(workdir, "prompts.jsonl"), "w") as f:
        for e in examples:
            f.write(json.dumps({"prompt": e.prompt, "answer": e.answer}) + "\n")


# ---------------------------------------------------------------------------------------------------- our side


def ours_overrides(workdir: str, run_dir: str, tp: int, steps: int) -> list[str]:
    return [
        "model.name=bench-llama",
        f"model.hf_config={workdir}/config.json",
        f"model.tokenizer={workdir}/tok",
        f"parallel.tp={tp}",
        f"launch.nproc={tp}",
        f"launch.threads_per_rank={max(1, THREADS // tp)}",
        "rollout.engine=hf",  # the comparison is transformers generate on both sides (never vLLM)
        f"rollout.n={N}",
        f"rollout.max_response_len={MAX_NEW}",
        "rollout.max_prompt_len=16",
        "rollout.temperature=1.0",
        "algorithm.preset=grpo",
        "algorithm.ref_kl.coef=0",  # TRL's GRPO default beta = 0: no reference model
        "data.procedural.task=arithmetic",
        "data.procedural.style=terse",
        "data.procedural.num_examples=1000",
        "reward.fn=gsm8k",
        "reward.extraction=lenient",
        "reward.num_workers=0",
        f"train.prompts_per_step={PROMPTS}",
        "train.micro_batch_tokens=4096",  # the whole batch in one micro-batch, as TRL's one forward
        "train.recompute=none",
        f"train.seed={SEED}",
        f"optimizer.lr={LR}",
        "optimizer.clip_grad=1.0",
        "optimizer.weight_decay=0",
        f"schedule.steps={steps}",
        "schedule.warmup_steps=0",
        "schedule.lr_decay=constant",
        "eval.at_end=false",
        "checkpoint.save_every=0",
        "checkpoint.save_at_end=false",
        "checkpoint.export_hf=false",
        "logging.progress=false",
        "logging.tensorboard=off",
        "logging.plot_at_end=false",
        f"logging.run_dir={run_dir}",
    ]


OURS_PHASES = {
    "generate": "time/generate_s",
    "reward": "time/reward_s",
    "logprobs": "time/logprobs_s",
    "update": "time/update_s",
    "sync": "sync/time_s",
    "step": "time/step_s",
}


def run_ours(workdir: str, tp: int, steps: int, warmup: int, index: int, repo: str = REPO) -> dict[str, float]:
    """``repo``: the checkout whose trainer runs (``--baseline-repo`` compares another commit in the same run)."""
    tag = "ours" if repo == REPO else "base"
    run_dir = os.path.join(workdir, f"{tag}-tp{tp}-{index}")
    cmd = [sys.executable, "-m", "megatron_rlvr.commands.cli", "train", os.path.join(repo, "configs", "tiny.yaml")]
    cmd += ours_overrides(workdir, run_dir, tp, steps)
    env = dict(os.environ, PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("OMP_NUM_THREADS", None)  # launch.threads_per_rank decides
    proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        raise RuntimeError(f"our trainer failed (exit {proc.returncode}):\n{tail}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    recs = [r for r in recs if "time/step_s" in r][warmup:]
    return {p: statistics.median(r.get(k, 0.0) for r in recs) for p, k in OURS_PHASES.items()}


# ---------------------------------------------------------------------------------------------------- TRL's side


def trl_worker(workdir: str, steps: int, warmup: int, out_path: str) -> None:
    """Runs inside the TRL interpreter (trl, transformers, torch; not this package)."""
    import torch

    torch.set_num_threads(THREADS)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    with open(os.path.join(workdir, "config.json")) as f:
        cfg = json.load(f)
    cfg.pop("architectures", None)
    cfg.pop("model_type", None)
    cfg.pop("dtype", None)
    torch.manual_seed(SEED)  # the same init as ours (megatron_rlvr.megatron.policy.random_hf_state_dict)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**cfg), dtype=torch.float32)
    tok = PreTrainedTokenizerFast.from_pretrained(os.path.join(workdir, "tok"))
    with open(os.path.join(workdir, "prompts.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    ds = Dataset.from_list(rows)

    def exact_answer(completions, answer, **_):
        return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]

    args = GRPOConfig(
        output_dir=os.path.join(workdir, "trl-out"),
        per_device_train_batch_size=PROMPTS * N,  # completions per step: 8 prompts x 8 generations
        num_generations=N,
        max_completion_length=MAX_NEW,
        temperature=1.0,
        learning_rate=LR,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        weight_decay=0.0,
        beta=0.0,
        num_iterations=1,
        gradient_checkpointing=False,
        use_cpu=True,
        bf16=False,
        fp16=False,
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=SEED,
        dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=exact_answer, args=args, train_dataset=ds, processing_class=tok)
    times: dict[str, list[float]] = {"generate": [], "prepare": [], "step": []}
    marks: dict[str, float] = {}

    gen = trainer._generate

    def timed_generate(*a, **k):
        t0 = time.perf_counter()
        try:
            return gen(*a, **k)
        finally:
            marks["generate"] = marks.get("generate", 0.0) + time.perf_counter() - t0

    prep = trainer._generate_and_score_completions

    def timed_prepare(*a, **k):
        t0 = time.perf_counter()
        try:
            return prep(*a, **k)
        finally:
            marks["prepare"] = marks.get("prepare", 0.0) + time.perf_counter() - t0

    trainer._generate = timed_generate
    trainer._generate_and_score_completions = timed_prepare

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *_a, **_k):
            marks.clear()
            marks["t0"] = time.perf_counter()

        def on_step_end(self, *_a, **_k):
            times["step"].append(time.perf_counter() - marks["t0"])
            times["generate"].append(marks.get("generate", 0.0))
            times["prepare"].append(marks.get("prepare", 0.0))

    trainer.add_callback(StepTimer())
    trainer.train()
    g, p, s = (times[k][warmup:] for k in ("generate", "prepare", "step"))
    out = {
        "generate": statistics.median(g),
        "score+adv": statistics.median(a - b for a, b in zip(p, g)),
        "update": statistics.median(a - b for a, b in zip(s, p)),
        "step": statistics.median(s),
    }
    with open(out_path, "w") as f:
        json.dump(out, f)


def find_trl_python(flag: str | None) -> str | None:
    for cand in (flag, os.environ.get("MEGATRON_RLVR_TRL_PYTHON"), sys.executable):
        if not cand:
            continue
        ok = subprocess.run([cand, "-c", "import trl"], capture_output=True).returncode == 0
        if ok:
            return cand
        if cand is flag:
            raise SystemExit(f"bench_step: --trl-python {flag}: cannot import trl there")
    return None


def run_trl(python: str, workdir: str, steps: int, warmup: int, index: int) -> dict[str, float]:
    out = os.path.join(workdir, f"trl-{index}.json")
    cmd = [python, os.path.abspath(__file__), "--trl-worker", workdir, "--steps", str(steps)]
    cmd += ["--warmup", str(warmup), "--out", out]
    env = dict(os.environ, OMP_NUM_THREADS=str(THREADS), TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"TRL run failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    with open(out) as f:
        return json.load(f)


# ---------------------------------------------------------------------------------------------------- driver


def fmt(d: dict[str, float]) -> str:
    return " ".join(f"{k}={v:.3f}" for k, v in d.items())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5, help="runs of each side (alternating)")
    ap.add_argument("--steps", type=int, default=8, help="RL steps per run")
    ap.add_argument("--warmup", type=int, default=2, help="first steps of a run left out of its median")
    ap.add_argument("--tp", default="1,2", help="our layouts to run: comma-separated TP sizes (1 and/or 2)")
    ap.add_argument("--trl-python", default=None, help="interpreter with trl installed (default: this one)")
    ap.add_argument("--workdir", default=None, help="where inputs and run dirs go (default: a temp dir)")
    ap.add_argument(
        "--baseline-repo", default=None, help="another checkout (e.g. the previous commit) run as 'base_tp1' too"
    )
    ap.add_argument("--trl-worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.trl_worker:
        trl_worker(a.trl_worker, a.steps, a.warmup, a.out)
        return 0
    if a.steps <= a.warmup:
        ap.error("--steps must exceed --warmup")
    trl_python = find_trl_python(a.trl_python)
    if trl_python is None:
        print("bench_step: skipped: TRL is not installed (pip install -e '.[bench]', or --trl-python PATH)")
        return 0
    tps = [int(x) for x in a.tp.split(",") if x]
    workdir = a.workdir or tempfile.mkdtemp(prefix="bench_step-")
    os.makedirs(workdir, exist_ok=True)
    prepare(workdir)
    print(f"bench_step: {a.runs} runs per side x {a.steps} steps ({a.warmup} warm-up); workdir {workdir}")
    print(f"bench_step: TRL interpreter {trl_python}")
    results: dict[str, list[dict[str, float]]] = {"trl": [], **{f"ours_tp{tp}": [] for tp in tps}}
    if a.baseline_repo:
        results["base_tp1"] = []
    for i in range(a.runs):
        for side in results:
            t0 = time.perf_counter()
            if side == "trl":
                r = run_trl(trl_python, workdir, a.steps, a.warmup, i)
            elif side == "base_tp1":
                r = run_ours(workdir, 1, a.steps, a.warmup, i, repo=os.path.abspath(a.baseline_repo))
            else:
                r = run_ours(workdir, int(side.removeprefix("ours_tp")), a.steps, a.warmup, i)
            results[side].append(r)
            print(f"run {i} {side:9s} {fmt(r)}  (process {time.perf_counter() - t0:.1f} s)", flush=True)
    print("medians over runs (seconds per step and phase):")
    med = {}
    for side, runs in results.items():
        med[side] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(f"  {side:9s} {fmt(med[side])}")
    per_run = [o["step"] / t["step"] for o, t in zip(results.get("ours_tp1", []), results["trl"])]
    if per_run:
        print("step_vs_trl per run pair: " + " ".join(f"{x:.3f}" for x in per_run))
    if "base_tp1" in med:
        print(f"ours_vs_base={med['ours_tp1']['step'] / med['base_tp1']['step']:.3f}")
    if "ours_tp2" in med:
        print(f"step_vs_trl_tp2={med['ours_tp2']['step'] / med['trl']['step']:.3f}")
    if "ours_tp1" in med:
        print(f"step_vs_trl={med['ours_tp1']['step'] / med['trl']['step']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

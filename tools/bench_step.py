"""One RL step, ours against TRL's GRPOTrainer on the same work, alternating runs in one invocation.

The work (both sides): a randomly initialised Llama over the built-in character tokenizer, the same start weights
(transformers' init under the same seed), 8 single-digit "a+b=" prompts x 8 rollouts x at most 8 new tokens
(temperature 1), exact-answer reward, GRPO (no KL term) with one optimizer update per step (TRL's
``num_iterations=1``; ours ``train.mini_batch_prompts`` = the step's prompts, whatever the preset's mini-batch),
Adam at lr 1e-3 with gradient clipping 1.0, fp32, no
activation recomputation (TRL's default gradient checkpointing and our ``train.recompute=full`` default are both
switched off), 2 CPU threads in all (``--threads``). Generation on both sides is transformers ``generate`` (our
``rollout.engine=hf``, set explicitly). Two model sizes (``--model``, both by default):

    base   hidden 256, 4 layers, 8 query / 4 KV heads, FFN 512
    small  hidden 64, 2 layers, 4 query / 2 KV heads, FFN 128 (the step is almost all fixed per-step cost)

Our side runs in up to three modes (``--modes``; lean and defaults by default). All three set the work itself:
model, tokenizer, data, batch sizes and lengths, temperature, algorithm (GRPO, no KL), reward function, seed, lr,
clipping, weight decay, constant schedule, ``rollout.engine=hf`` (TRL generates with transformers),
``train.recompute=none`` (TRL's gradient checkpointing is off too), threads and TP; and they switch off what TRL's run
does not do and is not per-step work: checkpoints, evaluation, HF export, the end-of-run plot.

    lean      configs/tiny.yaml, plus overrides that switch off everything else TRL does not do: rewards scored in the
              trainer's process (``reward.num_workers=0``), no TensorBoard, no progress line, the whole batch in one
              micro-batch (``train.micro_batch_tokens=4096``). Compared on the step's own timer (``time/step_s``).
    defaults  what a new user gets from ``megatron-rlvr train``: its default config (configs/tiny.yaml, which the
              shipped configs resemble) with the work set and nothing else, so reward worker processes
              (``reward.num_workers``: 1 there, crash isolation and timeouts on), TensorBoard when the package is
              installed (``logging.tensorboard=auto``), the progress line and that config's micro-batch size
              (``train.micro_batch_tokens=1024``: the batch in 2 micro-batches) stay on.
    bare      a config file holding only the work (and the prompt template), so every other option keeps its
              built-in default: 2 reward workers, TensorBoard when installed, the progress line, no
              ``train.micro_batch_tokens`` (one sequence per micro-batch: 64 forward/backward passes, no row
              packing), the distributed optimizer (one data-parallel rank: it shards nothing).

The defaults and bare modes are compared on the wall-clock time between two steps (``wall``: the interval of the
``wall_time`` stamps of metrics.jsonl, so TensorBoard, the progress line and the stop check between steps count),
against the same interval of TRL's steps (``on_step_begin`` to the next one; TRL's per-step log line included).

Each run is a fresh process doing ``--steps`` steps; the first ``--warmup`` are dropped and a run reports the
median of the rest per phase. Runs alternate (TRL, ours TP=1, ours TP=2, ours at defaults, per size, ...) so machine
noise hits all sides alike; the summary is the median over runs, each run's numbers are printed too, and the last
lines are, per size (``_small`` appended for the small model):

    step_vs_trl=<ours TP=1 lean median step / TRL median step>
    step_vs_trl_defaults=<ours TP=1 at defaults median wall / TRL median wall>
    (step_vs_trl_bare=<the same for the bare mode>, when run)

and, for the base model with TP=2 in ``--tp``, ``step_vs_trl_tp2=<ours TP=2 lean on 2 ranks (1 thread each) / TRL>``.
TRL has no tensor parallelism: its baseline is the same single process with 2 threads.

On a machine busy with other work, ``--threads 1`` (both sides): with two threads every parallel op waits at its
barrier for the second thread to get a core again, and a step took 14 s instead of 0.17 s; one thread degrades
with the load, not with the scheduler's time slice.

TRL (the ``bench`` extra, trl==1.16.0) may live in another environment: ``--trl-python`` (or
$MEGATRON_RLVR_TRL_PYTHON) names its interpreter; it needs trl, transformers and torch only (not this package).
Without TRL the benchmark says so and exits 0; ``--ours-only`` runs our sides alone (their medians, no ratios: a
check that they run at the current presets). ``--baseline-repo`` runs another checkout's trainer too (``base``
sides, in the same modes; older checkouts' entry point ``megatron_rlvr.cli`` is found as well).

    PYTHONPATH=$PWD .venv/bin/python tools/bench_step.py --runs 5 --trl-python /path/to/trl-venv/bin/python
    PYTHONPATH=$PWD .venv/bin/python tools/bench_step.py --ours-only --model small --modes lean --tp 1 --runs 1 \
        --steps 3 --warmup 1      # the smallest run: our side only, seconds
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
_LLAMA = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    max_position_embeddings=64,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    tie_word_embeddings=False,
    initializer_range=0.02,
    attention_bias=False,
    mlp_bias=False,
)
MODELS = {
    "base": dict(
        _LLAMA,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
    ),
    "small": dict(
        _LLAMA, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    ),
}
MODEL = MODELS["base"]
PROMPTS, N, MAX_NEW, LR, SEED, THREADS = 8, 8, 8, 1e-3, 1234, 2
MODES = ("lean", "defaults", "bare")


# ---------------------------------------------------------------------------------------------------- shared inputs


def config_path(workdir: str, model: str = "base") -> str:
    return os.path.join(workdir, "config.json" if model == "base" else f"config-{model}.json")


def prepare(workdir: str) -> None:
    """config.json (base), config-small.json, the tokenizer folder, prompts.jsonl (the procedural single-digit
    addition task) and bench.yaml (the config file of the bare mode: only the prompt template) in ``workdir``."""
    if REPO not in sys.path:  # last: a checkout already on the path (PYTHONPATH) keeps its own code
        sys.path.append(REPO)
    from megatron_rlvr.data.procedural import ProceduralConfig, generate_examples
    from megatron_rlvr.families.tiny import save_tiny_tokenizer, tiny_tokenizer

    tok = tiny_tokenizer()
    save_tiny_tokenizer(os.path.join(workdir, "tok"))
    for name, model in MODELS.items():
        cfg = dict(model, vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        cfg.update(bos_token_id=None, dtype="float32")
        with open(config_path(workdir, name), "w") as f:
            json.dump(cfg, f, indent=1)
    examples = generate_examples(ProceduralConfig(task="arithmetic", style="terse", num_examples=1000))
    with open(os.path.join(workdir, "prompts.jsonl"), "w") as f:
        for e in examples:
            f.write(json.dumps({"prompt": e.prompt, "answer": e.answer}) + "\n")
    with open(os.path.join(workdir, "bench.yaml"), "w") as f:  # "{problem}" is YAML flow syntax on a command line
        f.write('data:\n  template: plain\n  prompt_template: "{problem}"\n')


# ---------------------------------------------------------------------------------------------------- our side


def work_overrides(workdir: str, run_dir: str, tp: int, steps: int, model: str = "base") -> list[str]:
    """The work itself and what TRL's run does not do (no checkpoints, evaluation, export, plot): both modes."""
    return [
        "model.name=bench-llama",
        f"model.hf_config={config_path(workdir, model)}",
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
        f"train.prompts_per_step={PROMPTS}",
        f"train.mini_batch_prompts={PROMPTS}",  # one optimizer update per step, as TRL (num_iterations=1)
        "train.ppo_epochs=1",
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
        "logging.plot_at_end=false",
        f"logging.run_dir={run_dir}",
    ]


LEAN = [
    "reward.num_workers=0",
    "train.micro_batch_tokens=4096",  # the whole batch in one micro-batch, as TRL's one forward
    "logging.progress=false",
    "logging.tensorboard=off",
]
"""The lean mode's settings on top of the work: switch off what TRL does not do."""


def ours_overrides(workdir: str, run_dir: str, tp: int, steps: int, model: str = "base") -> list[str]:
    """The lean mode (on configs/tiny.yaml)."""
    return work_overrides(workdir, run_dir, tp, steps, model) + LEAN


def ours_config(workdir: str, run_dir: str, tp: int, steps: int, mode: str, model: str, repo: str = REPO):
    """(config file, overrides) of our side in ``mode``."""
    work = work_overrides(workdir, run_dir, tp, steps, model)
    if mode == "bare":
        return os.path.join(workdir, "bench.yaml"), work
    return os.path.join(repo, "configs", "tiny.yaml"), work + (LEAN if mode == "lean" else [])


OURS_PHASES = {
    "generate": "time/generate_s",
    "reward": "time/reward_s",
    "logprobs": "time/logprobs_s",
    "update": "time/update_s",
    "sync": "sync/time_s",
    "step": "time/step_s",
}


def cli_module(repo: str) -> str:
    """The train entry point of a checkout (``megatron_rlvr.commands.cli``; older ones: ``megatron_rlvr.cli``)."""
    new = os.path.isfile(os.path.join(repo, "megatron_rlvr", "commands", "cli.py"))
    return "megatron_rlvr.commands.cli" if new else "megatron_rlvr.cli"


def run_ours(
    workdir: str,
    tp: int,
    steps: int,
    warmup: int,
    index: int,
    repo: str = REPO,
    mode: str = "lean",
    model: str = "base",
) -> dict[str, float]:
    """``repo``: the checkout whose trainer runs (``--baseline-repo`` compares another commit in the same run).
    Returns the per-phase medians over the steps after ``warmup``, and ``wall``: the median interval between two
    steps' ``wall_time`` stamps (everything the loop does per step)."""
    tag = "ours" if repo == REPO else "base"
    run_dir = os.path.join(workdir, f"{tag}-{model}-{mode}-tp{tp}-{index}")
    conf, over = ours_config(workdir, run_dir, tp, steps, mode, model, repo)
    cmd = [sys.executable, "-m", cli_module(repo), "train", conf, *over]
    env = dict(os.environ, PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("OMP_NUM_THREADS", None)  # launch.threads_per_rank decides
    proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        raise RuntimeError(f"our trainer failed (exit {proc.returncode}):\n{tail}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    recs = [r for r in recs if "time/step_s" in r]
    walls = [b["wall_time"] - a["wall_time"] for a, b in zip(recs[warmup:], recs[warmup + 1 :])]
    recs = recs[warmup:]
    out = {p: statistics.median(r.get(k, 0.0) for r in recs) for p, k in OURS_PHASES.items()}
    out["wall"] = statistics.median(walls)
    out["tb"] = float(os.path.isdir(os.path.join(run_dir, "tensorboard")))
    return out


# ---------------------------------------------------------------------------------------------------- TRL's side


def trl_worker(workdir: str, steps: int, warmup: int, out_path: str, model_name: str = "base") -> None:
    """Runs inside the TRL interpreter (trl, transformers, torch; not this package)."""
    import torch

    torch.set_num_threads(THREADS)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    with open(config_path(workdir, model_name)) as f:
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
    times: dict[str, list[float]] = {"generate": [], "prepare": [], "step": [], "begin": []}
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
            times["begin"].append(marks["t0"])

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
        "wall": statistics.median(b - a for a, b in zip(times["begin"][warmup:], times["begin"][warmup + 1 :])),
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


def run_trl(python: str, workdir: str, steps: int, warmup: int, index: int, model: str = "base") -> dict[str, float]:
    out = os.path.join(workdir, f"trl-{model}-{index}.json")
    cmd = [python, os.path.abspath(__file__), "--trl-worker", workdir, "--steps", str(steps)]
    cmd += ["--warmup", str(warmup), "--out", out, "--model", model, "--threads", str(THREADS)]
    env = dict(os.environ, OMP_NUM_THREADS=str(THREADS), TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"TRL run failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    with open(out) as f:
        return json.load(f)


# ---------------------------------------------------------------------------------------------------- driver


def fmt(d: dict[str, float]) -> str:
    return " ".join(f"{k}={v:.3f}" for k, v in d.items())


def sides(tps: list[int], modes: list[str], baseline: bool, trl: bool = True) -> list[str]:
    """The sides of one run, in the order they alternate: TRL (unless ``trl`` is false), ours lean per TP, ours at
    defaults and bare (TP=1), the baseline checkout's."""
    out = ["trl"] if trl else []
    if "lean" in modes:
        out += [f"ours_tp{tp}" for tp in tps]
    out += [f"ours_{SIDE_TAG[m]}" for m in ("defaults", "bare") if m in modes]
    if baseline:
        out += [f"base_{'tp1' if m == 'lean' else SIDE_TAG[m]}" for m in MODES if m in modes]
    return out


SIDE_TAG = {"defaults": "def", "bare": "bare"}
TAG_MODE = {v: k for k, v in SIDE_TAG.items()}


def run_side(side: str, a, trl_python: str, workdir: str, i: int, model: str) -> dict[str, float]:
    if side == "trl":
        return run_trl(trl_python, workdir, a.steps, a.warmup, i, model)
    repo = os.path.abspath(a.baseline_repo) if side.startswith("base") else REPO
    tag = side.split("_", 1)[1]
    if tag in TAG_MODE:
        return run_ours(workdir, 1, a.steps, a.warmup, i, repo=repo, mode=TAG_MODE[tag], model=model)
    tp = int(tag.removeprefix("tp"))
    return run_ours(workdir, tp, a.steps, a.warmup, i, repo=repo, mode="lean", model=model)


def report(model: str, results: dict[str, list[dict[str, float]]]) -> list[str]:
    """Print the medians of one model size; returns its ratio lines (printed last, after every size's medians)."""
    sfx = "" if model == "base" else f"_{model}"
    print(f"medians over runs, model {model} (seconds per step and phase):")
    med = {}
    for side, runs in results.items():
        med[side] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(f"  {side:9s} {fmt(med[side])}")
    trl = results.get("trl")
    if trl is None:  # --ours-only: nothing to compare with
        return []
    for side, key, label in RATIOS:
        if side in results:
            pairs = " ".join(f"{o[key] / t[key]:.3f}" for o, t in zip(results[side], trl))
            print(f"{label}{sfx} per run pair: {pairs}")
    lines = []
    if "base_tp1" in med:
        lines.append(f"ours_vs_base{sfx}={med['ours_tp1']['step'] / med['base_tp1']['step']:.3f}")
    for tag, mode in TAG_MODE.items():
        if f"base_{tag}" in med:
            lines.append(f"ours_vs_base_{mode}{sfx}={med[f'ours_{tag}']['wall'] / med[f'base_{tag}']['wall']:.3f}")
    if "ours_tp2" in med:
        lines.append(f"step_vs_trl_tp2{sfx}={med['ours_tp2']['step'] / med['trl']['step']:.3f}")
    for side, key, label in RATIOS:
        if side in med:
            lines.append(f"{label}{sfx}={med[side][key] / med['trl'][key]:.3f}")
    return lines


RATIOS = (
    ("ours_tp1", "step", "step_vs_trl"),
    ("ours_bare", "wall", "step_vs_trl_bare"),
    ("ours_def", "wall", "step_vs_trl_defaults"),
)
"""(side, the compared time, the ratio's name): the lean mode on the step's timer, the others on the wall clock."""


def main() -> int:
    global THREADS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5, help="runs of each side (alternating)")
    ap.add_argument("--steps", type=int, default=8, help="RL steps per run")
    ap.add_argument("--warmup", type=int, default=2, help="first steps of a run left out of its median")
    ap.add_argument("--tp", default="1,2", help="our lean layouts to run: comma-separated TP sizes (1 and/or 2)")
    ap.add_argument("--model", default="base,small", help=f"model sizes, comma-separated: {', '.join(MODELS)}")
    ap.add_argument("--modes", default="lean,defaults", help=f"our side's modes, comma-separated: {', '.join(MODES)}")
    ap.add_argument(
        "--threads", type=int, default=THREADS, help="CPU threads of each side (1 on a busy machine, see the docstring)"
    )
    ap.add_argument("--trl-python", default=None, help="interpreter with trl installed (default: this one)")
    ap.add_argument("--ours-only", action="store_true", help="run our sides alone (no TRL, no ratios)")
    ap.add_argument("--workdir", default=None, help="where inputs and run dirs go (default: a temp dir)")
    ap.add_argument(
        "--baseline-repo", default=None, help="another checkout (e.g. the previous commit) run as 'base_*' too"
    )
    ap.add_argument("--trl-worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    THREADS = a.threads
    if a.trl_worker:
        trl_worker(a.trl_worker, a.steps, a.warmup, a.out, a.model)
        return 0
    if a.steps <= a.warmup + 1:
        ap.error("--steps must exceed --warmup by 2 or more (the wall time is an interval between two steps)")
    models = [m for m in a.model.split(",") if m]
    modes = [m for m in a.modes.split(",") if m]
    for m in models:
        if m not in MODELS:
            ap.error(f"--model {m!r}: choose from {', '.join(MODELS)}")
    for m in modes:
        if m not in MODES:
            ap.error(f"--modes {m!r}: choose from {', '.join(MODES)}")
    trl_python = None if a.ours_only else find_trl_python(a.trl_python)
    if trl_python is None and not a.ours_only:
        print("bench_step: skipped: TRL is not installed (pip install -e '.[bench]', or --trl-python PATH)")
        return 0
    tps = [int(x) for x in a.tp.split(",") if x]
    workdir = a.workdir or tempfile.mkdtemp(prefix="bench_step-")
    os.makedirs(workdir, exist_ok=True)
    prepare(workdir)
    print(f"bench_step: {a.runs} runs per side x {a.steps} steps ({a.warmup} warm-up); workdir {workdir}")
    print(f"bench_step: models {', '.join(models)}; modes {', '.join(modes)}; TRL interpreter {trl_python}")
    order = sides(tps, modes, bool(a.baseline_repo), trl=trl_python is not None)
    results = {m: {side: [] for side in order} for m in models}
    for i in range(a.runs):
        for m in models:
            for side in order:
                t0 = time.perf_counter()
                r = run_side(side, a, trl_python, workdir, i, m)
                results[m][side].append(r)
                print(f"run {i} {m:5s} {side:9s} {fmt(r)}  (process {time.perf_counter() - t0:.1f} s)", flush=True)
    lines = [line for m in models for line in report(m, results[m])]
    for line in lines:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())

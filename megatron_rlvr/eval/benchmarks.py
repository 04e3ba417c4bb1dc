"""Evaluation on benchmark files: k samples per problem, avg@k and pass@k with the unbiased estimator.

pass@k (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", eq. 1): with n samples of which c are
correct, pass@k = 1 - C(n - c, k) / C(n, k), averaged over problems; computed as a running product to avoid huge
binomials. avg@k is the mean correctness of the k samples (the expected single-sample accuracy).

Used during training (every ``eval.every`` steps, on the trainer's rollout engines) and by ``megatron-rlvr eval``
(one process, an HF folder or an exported run).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from megatron_rlvr.config import EvalConfig, RunConfig
from megatron_rlvr.data import DataConfig, Example, load_dataset, shard_range
from megatron_rlvr.megatron.parallel import all_gather_objects
from megatron_rlvr.rollout.engine import SamplingParams
from megatron_rlvr.rollout.groups import EngineInfo, round_seed, tokenize_prompts


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with ``c`` correct among ``n`` samples (k <= n)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    prob_all_wrong = 1.0
    for i in range(n - c + 1, n + 1):  # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k / i)
        prob_all_wrong *= 1.0 - k / i
    return 1.0 - prob_all_wrong


@dataclass
class BenchmarkResult:
    name: str
    problems: int
    k: int
    avg_at_k: float
    pass_at_k: dict[int, float]
    """pass@j for j in 1, 2, 4, ... up to k (and k itself)."""
    mean_length: float


def summarize(name: str, correct: list[list[bool]], lengths: list[list[int]]) -> BenchmarkResult:
    """Per-problem correctness lists (all of length k) -> avg@k and pass@j for powers of two up to k."""
    if not correct:
        return BenchmarkResult(name, 0, 0, 0.0, {}, 0.0)
    k = len(correct[0])
    if any(len(c) != k for c in correct):
        raise ValueError("every problem needs the same number of samples")
    ks = sorted({j for j in (1, 2, 4, 8, 16, 32, 64, 128) if j <= k} | {k})
    flat = [x for c in correct for x in c]
    lens = [x for row in lengths for x in row]
    return BenchmarkResult(
        name=name,
        problems=len(correct),
        k=k,
        avg_at_k=sum(flat) / len(flat),
        pass_at_k={j: sum(pass_at_k(k, sum(c), j) for c in correct) / len(correct) for j in ks},
        mean_length=sum(lens) / max(len(lens), 1),
    )


def format_table(results: list[BenchmarkResult]) -> str:
    """A plain-text table: one row per benchmark."""
    if not results:
        return "(no benchmarks)"
    ks = sorted({j for r in results for j in r.pass_at_k})
    head = ["benchmark", "problems", "k", "avg@k"] + [f"pass@{j}" for j in ks] + ["mean len"]
    rows = [head]
    for r in results:
        rows.append(
            [r.name, str(r.problems), str(r.k), f"{r.avg_at_k:.4f}"]
            + [f"{r.pass_at_k[j]:.4f}" if j in r.pass_at_k else "-" for j in ks]
            + [f"{r.mean_length:.1f}"]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def bench_name(path: str) -> str:
    stem = os.path.splitext(os.path.basename(path))[0]
    parent = os.path.basename(os.path.dirname(os.path.abspath(path)))
    return f"{parent}/{stem}" if stem in ("test", "train", "validation", "eval") else stem


@dataclass(frozen=True)
class EvalSpec:
    """How a benchmark is sampled and scored: ``k`` samples per problem, the sampling settings, the prompt
    rendering, and how many prompts go to the engine per call."""

    data: DataConfig
    """Prompt rendering (template, system prompt) of the examples."""
    k: int
    """Samples per problem (avg@k, pass@j for j <= k)."""
    temperature: float
    """Sampling temperature; 0: greedy (one sample, repeated k times)."""
    top_p: float
    """Nucleus sampling mass, in (0, 1]."""
    max_tokens: int
    """Generation limit per sample."""
    max_prompt_len: int
    """Prompts longer than this (in tokens) are not generated and count as wrong."""
    seed: int
    """Evaluation seed: each prompt's sampling seed derives from it and the prompt's index in the examples."""
    chunk_prompts: int | None = None
    """Prompts per engine call (progress is reported after each); None: all of this engine's share at once. The
    samples do not depend on it."""
    correct_threshold: float = 0.5
    """A sample is correct when its reward is >= this (the midpoint of the built-in rewards' 1 and 0)."""

    def __post_init__(self) -> None:
        for name in ("k", "max_tokens", "max_prompt_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"EvalSpec.{name} must be >= 1, got {getattr(self, name)}")
        if not self.temperature >= 0:
            raise ValueError(f"EvalSpec.temperature must be >= 0 (0: greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"EvalSpec.top_p must be in (0, 1], got {self.top_p}")
        if self.chunk_prompts is not None and self.chunk_prompts < 1:
            raise ValueError(f"EvalSpec.chunk_prompts must be >= 1 or None, got {self.chunk_prompts}")


def evaluate_examples(
    engine,
    reward_manager,
    tokenizer,
    examples: list[Example],
    spec: EvalSpec,
    info: EngineInfo | None = None,
    progress=None,
) -> tuple[list[list[bool]], list[list[int]]]:
    """Generate ``spec.k`` samples per example on this engine's share, score, gather: (correct, lengths) per
    example, in example order, on every rank. Prompts longer than ``spec.max_prompt_len`` count as wrong.

    ``info``: this rank's engine (its share of the examples, whether it leads); the results are then gathered over
    all ranks (collective). None: one engine on one process. Every rank of an engine's tensor-parallel group
    generates (a vLLM engine with rollout TP > 1 is SPMD: its ranks run the same requests together); only the
    group's leader scores. ``progress(done, total)`` is called after each chunk of ``spec.chunk_prompts``."""
    index, count, leader = (info.index, info.count, info.leader) if info is not None else (0, 1, True)
    share = shard_range(len(examples), index, count)
    local: list[tuple[int, list[bool], list[int]]] = []
    if len(share):
        mine = [examples[i] for i in share]
        kept, outputs = _generate_share(engine, tokenizer, share, mine, spec, progress)
        if leader:
            local = _score_share(reward_manager, tokenizer, share, mine, kept, outputs, spec)
    parts = all_gather_objects(local) if info is not None else [local]
    merged = sorted((x for part in parts for x in part), key=lambda x: x[0])
    return [c for _, c, _ in merged], [n for _, _, n in merged]


def _generate_share(engine, tokenizer, share, mine: list[Example], spec: EvalSpec, progress):
    """(the examples whose prompts fit, their outputs of ``spec.k`` completions each), in chunks of prompts."""
    kept, ids, _ = tokenize_prompts(mine, tokenizer, spec.data, spec.max_prompt_len)
    kept_idx = {id(e) for e in kept}
    greedy = spec.temperature == 0  # k identical samples: draw one (vLLM refuses n > 1 with greedy sampling)
    params = SamplingParams(
        n=1 if greedy else spec.k,
        temperature=spec.temperature,
        top_p=spec.top_p,
        max_tokens=spec.max_tokens,
        seed=round_seed(spec.seed, 0, 0),
    )
    keys = [i for i, ex in zip(share, mine) if id(ex) in kept_idx]
    outputs = []
    step = spec.chunk_prompts or max(len(ids), 1)
    images = [ex.images for ex in kept]  # vision-language benchmarks: each prompt's images
    for start in range(0, len(ids), step):
        chunk = images[start : start + step]
        kw = {"images": chunk} if any(chunk) else {}
        outputs += engine.generate(ids[start : start + step], params, prompt_keys=keys[start : start + step], **kw)
        if greedy:
            for out in outputs[start:]:
                out.completions = out.completions * spec.k
        if progress is not None:
            progress(min(start + step, len(ids)), len(ids))
    return kept, outputs


def _score_share(reward_manager, tokenizer, share, mine, kept, outputs, spec: EvalSpec):
    """(example index, correct per sample, response lengths) of each example of this engine's share; a prompt that
    did not fit counts as k wrong samples of length 0."""
    texts, gts, metas = [], [], []
    for ex, out in zip(kept, outputs):
        for c in out.completions:
            texts.append(c.text if c.text is not None else tokenizer.decode(c.token_ids, skip_special_tokens=True))
            gts.append(ex.answer)
            metas.append({**ex.metadata, "finish_reason": c.finish_reason})
    rewards, _ = reward_manager.score(texts, gts, metas) if texts else ([], {})
    kept_idx = {id(e) for e in kept}
    k = spec.k
    local = []
    it_out = iter(outputs)
    pos = 0
    for i, ex in zip(share, mine):
        if id(ex) not in kept_idx:
            local.append((i, [False] * k, [0] * k))
            continue
        out = next(it_out)
        correct = [r >= spec.correct_threshold for r in rewards[pos : pos + k]]
        local.append((i, correct, [len(c.token_ids) for c in out.completions]))
        pos += k
    return local


@dataclass
class PeriodicEval:
    """The run's evaluation: avg@k / pass@k on every eval file with the engines' current weights (collective)."""

    cfg: EvalConfig
    """The ``eval`` section (k, sampling, cadence)."""
    data: DataConfig
    """Prompt rendering (template, system prompt) and row schema."""
    max_tokens: int
    """Generation limit (eval.max_response_len, else rollout.max_response_len)."""
    max_prompt_len: int
    """Prompts longer than this are skipped (rollout.max_prompt_len)."""
    sets: list[tuple[str, list[Example]]] = field(default_factory=list)
    """(file, examples) of each benchmark, loaded once."""

    @classmethod
    def from_run_config(cls, cfg: RunConfig) -> PeriodicEval:
        e = cfg.eval
        sets = []
        for path in cfg.eval_files:
            ds = load_dataset([path], cfg.data.schema, cfg.data.skip_malformed)
            sets.append((path, list(ds.examples)[: e.max_problems] if e.max_problems else list(ds.examples)))
        return cls(e, cfg.data, e.max_response_len or cfg.rollout.max_response_len, cfg.rollout.max_prompt_len, sets)

    @property
    def spec(self) -> EvalSpec:
        e = self.cfg
        return EvalSpec(self.data, e.k, e.temperature, e.top_p, self.max_tokens, self.max_prompt_len, e.seed)

    def due(self, step: int) -> bool:
        return bool(self.sets) and bool(self.cfg.every) and step % self.cfg.every == 0

    def run(self, engine, reward_manager, tokenizer, engine_info) -> dict[str, float]:
        """Metrics namespaced ``eval/<benchmark>/...`` (avg@k, pass@j for j <= k, mean length) and ``time/eval_s``."""
        out: dict[str, float] = {}
        t0 = time.perf_counter()
        for path, examples in self.sets:
            correct, lengths = evaluate_examples(engine, reward_manager, tokenizer, examples, self.spec, engine_info)
            r = summarize(bench_name(path), correct, lengths)
            out[f"eval/{r.name}/avg@{r.k}"] = r.avg_at_k
            for j, v in r.pass_at_k.items():
                out[f"eval/{r.name}/pass@{j}"] = v
            out[f"eval/{r.name}/mean_length"] = r.mean_length
        out["time/eval_s"] = time.perf_counter() - t0
        return out

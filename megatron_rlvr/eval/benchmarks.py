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


def evaluate_examples(
    engine,
    reward_manager,
    tokenizer,
    data_cfg,
    examples,
    *,
    k: int,
    temperature: float,
    top_p: float,
    max_tokens: int,
    max_prompt_len: int,
    seed: int,
    engine_index: int = 0,
    engine_count: int = 1,
    leader: bool = True,
    gather=None,
    chunk_prompts: int | None = None,
    progress=None,
) -> tuple[list[list[bool]], list[list[int]]]:
    """Generate ``k`` samples per example on this engine's share, score, gather: (correct, lengths) per example,
    in example order, on every rank. Prompts longer than ``max_prompt_len`` count as wrong.

    Every rank of an engine's tensor-parallel group generates (a vLLM engine with rollout TP > 1 is SPMD: its ranks
    run the same requests together); only the group's leader scores. ``chunk_prompts``: generate that many prompts
    per engine call, calling ``progress(done, total)`` after each; the samples do not depend on it (each prompt's
    seed derives from the evaluation seed and its index in ``examples``)."""
    from megatron_rlvr.rollout.engine import SamplingParams
    from megatron_rlvr.rollout.groups import round_seed, tokenize_prompts

    share = shard_range(len(examples), engine_index, engine_count)
    local: list[tuple[int, list[bool], list[int]]] = []
    if len(share):
        mine = [examples[i] for i in share]
        kept, ids, _ = tokenize_prompts(mine, tokenizer, data_cfg, max_prompt_len)
        kept_idx = {id(e) for e in kept}
        greedy = temperature == 0  # k identical samples: draw one (vLLM refuses n > 1 with greedy sampling)
        params = SamplingParams(
            n=1 if greedy else k,
            temperature=temperature,
            top_p=top_p,
            max_tokens=max_tokens,
            seed=round_seed(seed, 0, 0),
        )
        keys = [i for i, ex in zip(share, mine) if id(ex) in kept_idx]
        outputs = []
        step = chunk_prompts or max(len(ids), 1)
        images = [ex.images for ex in kept]  # vision-language benchmarks: each prompt's images
        for start in range(0, len(ids), step):
            chunk = images[start : start + step]
            kw = {"images": chunk} if any(chunk) else {}
            outputs += engine.generate(ids[start : start + step], params, prompt_keys=keys[start : start + step], **kw)
            if greedy:
                for out in outputs[start:]:
                    out.completions = out.completions * k
            if progress is not None:
                progress(min(start + step, len(ids)), len(ids))
    if leader and len(share):
        texts, gts, metas = [], [], []
        for ex, out in zip(kept, outputs):
            for c in out.completions:
                texts.append(c.text if c.text is not None else tokenizer.decode(c.token_ids, skip_special_tokens=True))
                gts.append(ex.answer)
                metas.append({**ex.metadata, "finish_reason": c.finish_reason})
        rewards, _ = reward_manager.score(texts, gts, metas) if texts else ([], {})
        it_out = iter(outputs)
        pos = 0
        for i, ex in zip(share, mine):
            if id(ex) not in kept_idx:
                local.append((i, [False] * k, [0] * k))
                continue
            out = next(it_out)
            local.append((i, [r >= 0.5 for r in rewards[pos : pos + k]], [len(c.token_ids) for c in out.completions]))
            pos += k
    parts = gather(local) if gather is not None else [local]
    merged = sorted((x for part in parts for x in part), key=lambda x: x[0])
    return [c for _, c, _ in merged], [n for _, _, n in merged]


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

    def due(self, step: int) -> bool:
        return bool(self.sets) and bool(self.cfg.every) and step % self.cfg.every == 0

    def run(self, engine, reward_manager, tokenizer, engine_info) -> dict[str, float]:
        """Metrics namespaced ``eval/<benchmark>/...`` (avg@k, pass@j for j <= k, mean length) and ``time/eval_s``."""
        e = self.cfg
        out: dict[str, float] = {}
        t0 = time.perf_counter()
        for path, examples in self.sets:
            correct, lengths = evaluate_examples(
                engine,
                reward_manager,
                tokenizer,
                self.data,
                examples,
                k=e.k,
                temperature=e.temperature,
                top_p=e.top_p,
                max_tokens=self.max_tokens,
                max_prompt_len=self.max_prompt_len,
                seed=e.seed,
                engine_index=engine_info.index,
                engine_count=engine_info.count,
                leader=engine_info.leader,
                gather=all_gather_objects,
            )
            r = summarize(bench_name(path), correct, lengths)
            out[f"eval/{r.name}/avg@{r.k}"] = r.avg_at_k
            for j, v in r.pass_at_k.items():
                out[f"eval/{r.name}/pass@{j}"] = v
            out[f"eval/{r.name}/mean_length"] = r.mean_length
        out["time/eval_s"] = time.perf_counter() - t0
        return out

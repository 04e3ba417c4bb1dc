"""Data: loaders on the shared benchmark files and on DAPO-schema parquet, malformed rows, templates, deterministic
shuffling/sharding with resume, and the procedural task source."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from megatron_rlvr.data import (
    DataConfig,
    Example,
    MalformedRowError,
    ProceduralConfig,
    PromptLoader,
    PromptSampler,
    build_train_dataset,
    build_train_loader,
    detect_schema,
    generate_examples,
    load_dataset,
    load_examples,
    render,
    render_prompt,
    shard_range,
)

SHARED_DATA = Path(os.environ.get("MEGATRON_RLVR_SHARED_DATA", Path(__file__).resolve().parents[3] / "shared" / "data"))
needs_shared = pytest.mark.skipif(not SHARED_DATA.is_dir(), reason=f"shared data not found at {SHARED_DATA}")


def _raw_rows(path: Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# --------------------------------------------------------------------------------------------- shared benchmark files
# Row counts from the data folder's README.md; first-row values read by hand from the files.
SHARED_CASES = [
    ("gsm8k/train.jsonl", 7473, "gsm8k", "72", "Natalia sold clips", "gsm8k/train.jsonl:1"),
    ("gsm8k/test.jsonl", 1319, "gsm8k", "18", "Janet\u2019s ducks lay 16 eggs", "gsm8k/test.jsonl:1"),
    ("math500/test.jsonl", 500, "problem_answer", r"\left( 3, \frac{\pi}{2} \right)", "Convert the point", None),
    ("aime24/test.jsonl", 30, "problem_answer", "204", "Every morning Aya", "60"),
    ("amc23/test.jsonl", 40, "problem_answer", "27", "Cities $A$ and $B$", "0"),
    ("minerva_math/test.jsonl", 272, "boxed_solution", "1.6", "Each of the two Magellan", "0"),
]


@needs_shared
@pytest.mark.parametrize("rel,n_rows,schema,answer0,prompt0,id0", SHARED_CASES)
def test_shared_benchmarks_load(rel, n_rows, schema, answer0, prompt0, id0):
    """Every row of each shared file loads with the auto-detected schema; counts and first-row values match."""
    path = SHARED_DATA / rel
    assert detect_schema(_raw_rows(path)[0]) == schema
    ds = load_examples(str(path))
    assert len(ds) == n_rows and ds.n_malformed == 0
    first = ds[0]
    assert first.answer == answer0
    assert isinstance(first.prompt, str) and first.prompt.startswith(prompt0)
    assert first.id == (id0 if id0 is not None else "test/precalculus/807.json")
    assert len({e.id for e in ds}) == n_rows  # ids are unique


@needs_shared
def test_shared_field_values():
    """Answers are normalised per source: GSM8K after '#### ' (commas stripped), AMC23 floats -> integers,
    Minerva from the last \\boxed{} of the solution; MATH-500 keeps level/subject as metadata."""
    gsm = load_examples(str(SHARED_DATA / "gsm8k/test.jsonl"))
    for ex, raw in zip(gsm, _raw_rows(SHARED_DATA / "gsm8k/test.jsonl")):
        assert ex.answer == raw["answer"].split("####")[-1].strip().replace(",", "")
        assert ex.prompt == raw["question"]
    assert any("," in r["answer"].split("####")[-1] for r in _raw_rows(SHARED_DATA / "gsm8k/train.jsonl"))

    amc = load_examples(str(SHARED_DATA / "amc23/test.jsonl"))
    assert [e.answer for e in amc[:5]] == ["27", "36", "45", "3159", "36"]

    minerva = load_examples(str(SHARED_DATA / "minerva_math/test.jsonl"))
    assert [e.answer for e in minerva[:3]] == ["1.6", "4.5e33", "41.8"]  # read by hand from the solutions

    math500 = load_examples(str(SHARED_DATA / "math500/test.jsonl"))
    assert math500[0].level == 2 and math500[0].metadata["subject"] == "Precalculus"
    assert math500[1].answer == "p - q"
    assert {e.level for e in math500} == {1, 2, 3, 4, 5}


# ------------------------------------------------------------------------------------------------ DAPO parquet schema
def _write_dapo_parquet(path: Path, rows: list[dict]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), str(path))


def _dapo_row(i: int, truth: str) -> dict:
    return {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": f"Solve problem {i}. The last line should be Answer: $Answer"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": truth, "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": f"uuid-{i}"},
    }


def test_dapo_parquet(tmp_path):
    """DAPO-Math-17k rows (parquet: prompt messages, reward_model.ground_truth, data_source) load as chat messages
    with their ground truth, source and id, and render verbatim with the plain template."""
    path = tmp_path / "dapo.parquet"
    _write_dapo_parquet(path, [_dapo_row(0, "34"), _dapo_row(1, "\\frac{1}{2}")])
    ds = load_examples(str(path))
    assert len(ds) == 2
    ex = ds[1]
    assert ex.prompt == [{"role": "user", "content": "Solve problem 1. The last line should be Answer: $Answer"}]
    assert ex.answer == "\\frac{1}{2}" and ex.source == "math_dapo" and ex.id == "uuid-1"
    assert ex.metadata["ability"] == "MATH"
    assert render_prompt(ex, "plain") == "Solve problem 1. The last line should be Answer: $Answer"


def test_parquet_malformed_row_names_row(tmp_path):
    """A parquet row with an empty ground truth is an error naming the file and the 1-based row."""
    path = tmp_path / "bad.parquet"
    _write_dapo_parquet(path, [_dapo_row(0, "3"), _dapo_row(1, "  ")])
    with pytest.raises(MalformedRowError, match=rf"{path}:row 2: field 'reward_model.ground_truth' is empty"):
        load_examples(str(path))


# ------------------------------------------------------------------------------------------------------ malformed rows
def _write_lines(path: Path, lines: list[str]) -> str:
    path.write_text("\n".join(lines) + "\n")
    return str(path)


GOOD = json.dumps({"problem": "1+1?", "answer": 2})


@pytest.mark.parametrize(
    "bad_line,expected",
    [
        ('{"problem": "2+2?", "answer": ', "invalid JSON"),
        ('["not", "an", "object"]', "expected a JSON object, got list"),
        (json.dumps({"problem": "2+2?"}), "missing field 'answer'"),
        (json.dumps({"problem": "", "answer": "4"}), "field 'problem' must be a non-empty string"),
        (json.dumps({"problem": "x?", "answer": None}), "field 'answer' must be a string or number"),
    ],
)
def test_malformed_row_error_names_file_and_line(tmp_path, bad_line, expected):
    """The default is to fail loudly: a ValueError with file:line (blank lines count) and what is wrong."""
    path = _write_lines(tmp_path / "d.jsonl", [GOOD, "", bad_line, GOOD])
    with pytest.raises(ValueError, match=rf"{path}:3: {expected}"):
        load_examples(path)


def test_gsm8k_row_without_marker(tmp_path):
    rows = [json.dumps({"question": "q1", "answer": "so 3\n#### 3"}), json.dumps({"question": "q2", "answer": "4"})]
    path = _write_lines(tmp_path / "g.jsonl", rows)
    with pytest.raises(ValueError, match=rf"{path}:2: field 'answer' has no '#### <final answer>' marker"):
        load_examples(path)


def test_skip_malformed_counts(tmp_path):
    """skip_malformed=True keeps the good rows and counts the bad ones, with file:line messages."""
    lines = [GOOD, "{oops", GOOD, json.dumps({"problem": "p"}), "7", GOOD]
    path = _write_lines(tmp_path / "d.jsonl", lines)
    ds = load_examples(path, skip_malformed=True)
    assert len(ds) == 3 and ds.n_malformed == 3
    assert [m.split(": ")[0] for m in ds.malformed] == [f"{path}:2", f"{path}:4", f"{path}:5"]
    assert [e.id for e in ds] == [f"{tmp_path.name}/d.jsonl:{n}" for n in (1, 3, 6)]
    both = load_dataset([path, path], skip_malformed=True)
    assert len(both) == 6 and both.n_malformed == 6


def test_schema_override(tmp_path):
    """An explicit schema is applied instead of detection: forcing gsm8k on problem/answer rows fails clearly."""
    path = _write_lines(tmp_path / "d.jsonl", [json.dumps({"prompt": "What is 2+3?", "answer": 5.0})])
    assert load_examples(path)[0].answer == "5" and load_examples(path, schema="problem_answer")[0].prompt.startswith(
        "What"
    )
    with pytest.raises(ValueError, match=r":1: missing field 'question'.*schema 'gsm8k'"):
        load_examples(path, schema="gsm8k")
    with pytest.raises(ValueError, match="unknown data schema 'nope'"):
        load_examples(path, schema="nope")


# ------------------------------------------------------------------------------------------------------------ config
def test_data_config_validation(tmp_path):
    good = _write_lines(tmp_path / "ok.jsonl", [GOOD])
    assert DataConfig(train_files=good).train_files == [good]
    missing = str(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match=rf"data.train_files\[1\]: file not found: {missing}"):
        DataConfig(train_files=[good, missing]).check_files()  # the loader runs it (plan may skip it)
    with pytest.raises(ValueError, match=r"unsupported file type '.csv'"):
        DataConfig(eval_files=[str(tmp_path / "x.csv")])
    with pytest.raises(ValueError, match="data.schema"):
        DataConfig(schema="json")
    with pytest.raises(ValueError, match="data.seed must be an int >= 0"):
        DataConfig(seed=-1)
    with pytest.raises(ValueError, match="data.template"):
        DataConfig(template="alpaca")
    with pytest.raises(ValueError, match="must contain '{problem}'"):
        DataConfig(prompt_template="Solve it.")
    with pytest.raises(ValueError, match=r"data.procedural: unknown keys \['digits'\]"):
        DataConfig(procedural={"digits": 2})
    with pytest.raises(ValueError, match="min_digits <= max_digits"):
        ProceduralConfig(min_digits=3, max_digits=2)
    with pytest.raises(ValueError, match="operators"):
        ProceduralConfig(operators="+/")
    assert DataConfig(procedural={"task": "copy"}).procedural.task == "copy"


# --------------------------------------------------------------------------------------------------------- templates
def _tiny_chat_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({"[UNK]": 0, "<s>": 1, "</s>": 2}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", bos_token="<s>", eos_token="</s>")
    tok.chat_template = (
        "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    return tok


def test_chat_and_plain_templates():
    """Chat: the tokenizer's template over a user turn holding the problem + boxed instruction (system prompt
    first if set); plain: the template text alone. Expected strings written out by hand."""
    tok = _tiny_chat_tokenizer()
    ex = Example("What is 2+3?", "5", "t", "t:1")
    instr = "Please reason step by step, and put your final answer within \\boxed{}."
    assert render(ex, DataConfig(), tok) == f"<s><|user|>What is 2+3?\n{instr}</s><|assistant|>"
    cfg = DataConfig(system_prompt="Be brief.", prompt_template="Q: {problem} A in \\boxed{}")
    assert render(ex, cfg, tok) == "<s><|system|>Be brief.</s><|user|>Q: What is 2+3? A in \\boxed{}</s><|assistant|>"
    msgs = Example([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}], "1", "t", "t:2")
    assert render(msgs, cfg, tok) == "<s><|system|>S</s><|user|>U</s><|assistant|>"  # own system turn kept
    assert render(ex, DataConfig(template="plain")) == f"What is 2+3?\n{instr}"
    assert render(ex, DataConfig(template="plain", prompt_template="{problem}")) == "What is 2+3?"
    with pytest.raises(ValueError, match="needs a tokenizer with a chat_template"):
        render(ex, DataConfig(), None)


# --------------------------------------------------------------------------------------- shuffling, sharding, resume
def _epoch_of_batches(n, b, world, seed, shuffle=True):
    samplers = [PromptSampler(n, b, r, world, seed, shuffle) for r in range(world)]
    steps = []
    for _ in range(-(-n // b)):
        steps.append([s.next_indices() for s in samplers])
    return samplers, steps


def test_shuffle_is_deterministic_and_shards_are_disjoint_and_covering():
    n, b, world = 103, 8, 4
    _, steps = _epoch_of_batches(n, b, world, seed=7)
    _, again = _epoch_of_batches(n, b, world, seed=7)
    _, other = _epoch_of_batches(n, b, world, seed=8)
    assert steps == again and steps != other
    for per_rank in steps:
        assert all(len(x) == b // world for x in per_rank)
        flat = [i for x in per_rank for i in x]
        assert len(set(flat)) == len(flat)  # ranks disjoint within a step
    stream = [i for per_rank in steps for x in per_rank for i in x]
    assert sorted(stream[:n]) == list(range(n))  # epoch 0: each example exactly once over all ranks and steps
    assert stream[:n] != list(range(n))  # and shuffled
    # The batch straddling the epoch boundary continues with epoch 1, a different permutation.
    s = PromptSampler(n, n, seed=7)
    e0, e1 = s.next_indices(), s.next_indices()
    assert stream[n:] == e1[: len(stream) - n] and e0 == stream[:n] and sorted(e1) == list(range(n)) and e0 != e1
    _, plain = _epoch_of_batches(12, 4, 2, seed=0, shuffle=False)
    assert plain[0] == [[0, 1], [2, 3]] and plain[2] == [[8, 9], [10, 11]]


def test_sampler_resume_restores_the_stream():
    """state_dict after k steps + load_state_dict in a fresh sampler reproduces the next steps exactly, also with a
    different DP size (the state is a position in the global stream); a mismatched data set is refused."""
    ref = PromptSampler(50, 6, 1, 2, seed=3)
    for _ in range(11):  # past an epoch boundary
        ref.next_indices()
    state = json.loads(json.dumps(ref.state_dict()))  # survives a JSON round trip
    assert state["epoch"] == 1 and state["position"] == 16
    expected = [ref.next_indices() for _ in range(7)]
    resumed = PromptSampler(50, 6, 1, 2, seed=3)
    resumed.load_state_dict(state)
    assert [resumed.next_indices() for _ in range(7)] == expected
    g_ref = PromptSampler(50, 6, 0, 1, seed=3)
    g_ref.load_state_dict(state)
    wider = [PromptSampler(50, 6, r, 3, seed=3) for r in range(3)]
    for w in wider:
        w.load_state_dict(state)
    for _ in range(4):
        assert [i for w in wider for i in w.next_indices()] == g_ref.next_global_indices()
    with pytest.raises(ValueError, match="num_examples=50 but this run has num_examples=51"):
        PromptSampler(51, 6, seed=3).load_state_dict(state)
    with pytest.raises(ValueError, match="divisible by the data-parallel size 4"):
        PromptSampler(50, 6, 0, 4)


def test_loader_and_shard_range():
    exs = generate_examples(ProceduralConfig(num_examples=20))
    loader = PromptLoader(exs, 4, dp_rank=1, dp_world=2, seed=5)
    batch = next(loader)
    assert len(batch) == 2 and all(isinstance(e, Example) for e in batch)
    st = loader.state_dict()
    nxt = loader.next_batch()
    loader2 = build_train_loader(DataConfig(seed=5, procedural={"num_examples": 20}), 4, 1, 2)
    loader2.load_state_dict(st)
    assert [e.id for e in loader2.next_batch()] == [e.id for e in nxt]
    blocks = [list(shard_range(10, r, 3)) for r in range(3)]
    assert blocks == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]


def test_shard_range_is_balanced_and_contiguous():
    """The one split of prompts over engines, of groups over mini-batches and of sequences over data-parallel ranks:
    contiguous blocks covering range(n), sizes differing by at most one, the larger ones first."""
    assert [shard_range(2, r, 4) for r in range(4)] == [range(0, 1), range(1, 2), range(2, 2), range(2, 2)]
    for n in range(13):
        for world in range(1, 6):
            blocks = [shard_range(n, r, world) for r in range(world)]
            assert [i for b in blocks for i in b] == list(range(n))
            sizes = [len(b) for b in blocks]
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    with pytest.raises(ValueError, match="rank must be in"):
        shard_range(5, 2, 2)
    with pytest.raises(ValueError, match="rank must be in"):
        shard_range(5, 0, 0)


# ------------------------------------------------------------------------------------------------ procedural tasks
def test_procedural_arithmetic_is_correct_and_deterministic():
    """Answers equal Python's own evaluation of the generated expression; same config -> same examples; example i
    does not depend on num_examples; operands respect the digit knobs."""
    cfg = ProceduralConfig(num_examples=300, min_digits=2, max_digits=3, num_terms=3, operators="+-*", seed=11)
    exs = generate_examples(cfg)
    assert exs == generate_examples(cfg)
    assert generate_examples(ProceduralConfig(**{**cfg.__dict__, "num_examples": 40})) == exs[:40]
    assert [e.prompt for e in generate_examples(ProceduralConfig(**{**cfg.__dict__, "seed": 12}))] != [
        e.prompt for e in exs
    ]
    ops_seen = set()
    for e in exs:
        expr = e.prompt.removeprefix("What is ").removesuffix("?")
        tokens = expr.split(" ")
        operands, ops = tokens[0::2], tokens[1::2]
        ops_seen.update(ops)
        assert all(2 <= len(t) <= 3 and t[0] != "0" for t in operands)
        assert e.answer == str(eval(expr))  # only digits and + - * here: safe, and Python's precedence is the reference
        assert e.level == max(len(t) for t in operands)
    assert ops_seen == {"+", "-", "*"}


def test_procedural_tiny_tasks():
    """The easiest settings the tiny CPU run uses: single-digit addition and copying, terse style."""
    add = generate_examples(ProceduralConfig(num_examples=200, style="terse"))
    assert all(len(e.prompt) == 4 and e.prompt[1] == "+" and e.prompt[3] == "=" for e in add)
    assert all(int(e.answer) == int(e.prompt[0]) + int(e.prompt[2]) for e in add)
    assert len({e.prompt for e in add}) > 50  # covers most of the 100 pairs
    copy = generate_examples(ProceduralConfig(task="copy", num_examples=50, style="sentence"))
    assert all(e.prompt == f"Repeat the number {e.answer}." for e in copy)
    ds = build_train_dataset(DataConfig(template="plain", procedural={"task": "copy", "num_examples": 7}))
    assert len(ds) == 7 and ds[0].source == "procedural:copy"


def test_reasoning_gym_source():
    """reasoning-gym tasks (optional dependency) become Examples whose answers its own scorer accepts."""
    rg = pytest.importorskip("reasoning_gym")
    exs = generate_examples(ProceduralConfig(task="reasoning_gym:basic_arithmetic", num_examples=5, seed=3))
    assert len(exs) == 5 and exs == generate_examples(
        ProceduralConfig(task="reasoning_gym:basic_arithmetic", num_examples=5, seed=3)
    )
    score = rg.get_score_answer_fn("basic_arithmetic")
    assert all(score(e.answer, e.metadata["rg_entry"]) == 1.0 for e in exs)
    assert all(score(str(int(e.answer) + 1), e.metadata["rg_entry"]) < 1.0 for e in exs)
    assert np.all([e.metadata["rg_dataset"] == "basic_arithmetic" for e in exs])

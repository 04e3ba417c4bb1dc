"""Row schemas: each turns one raw row (a dict) into the fields of an :class:`Example`, or raises ValueError saying
what is wrong (the loader adds file and line).

- ``problem_answer``: ``problem`` (or ``prompt``, or ``question``) text + ``answer`` (string or number; 27.0 ->
  "27"). MATH-500, AIME24, AMC23, most "problem/answer" jsonl files, and the multimodal sets that add ``images`` /
  ``image`` (geometry3k, MMK12; :mod:`megatron_rlvr.data.images` reads those fields for every schema).
- ``dapo``: DAPO-Math-17k: ``prompt`` = list of chat messages, ``reward_model.ground_truth``, ``data_source``.
- ``gsm8k``: ``question`` + ``answer`` whose final answer follows ``#### ``.
- ``boxed_solution``: ``problem`` + ``solution`` whose final answer is the last ``\\boxed{}`` (Minerva math).
- ``code``: ``question`` (or ``problem``, or ``prompt``) text + test cases in ``input_output`` (APPS, TACO: a JSON
  string) or ``tests`` (a JSON string, an object, or a list of ``{"input", "output"}``); the answer is the test
  cases as one JSON string (:func:`megatron_rlvr.rewards.code_reward.normalize_tests`), read by ``reward.fn=code``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

from megatron_rlvr.rewards.code_reward import normalize_tests
from megatron_rlvr.rewards.extract import last_boxed

__all__ = ["SCHEMAS", "ParsedRow", "answer_to_str", "detect_schema"]

ParsedRow = tuple[str | list[dict[str, str]], str, str | None, dict[str, Any]]
"""(prompt, answer, id or None, metadata)."""

_ID_KEYS = ("id", "unique_id", "idx", "index")


def answer_to_str(value: Any, field: str = "answer") -> str:
    """A ground-truth answer as a non-empty string; integral floats lose their ``.0`` (AMC23's 27.0 -> "27")."""
    if isinstance(value, bool):
        raise ValueError(f"field {field!r} must be a string or number, got bool {value!r}")
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"field {field!r} is not finite: {value!r}")
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, str):
        s = value.strip()
        if not s:
            raise ValueError(f"field {field!r} is empty")
        return s
    raise ValueError(f"field {field!r} must be a string or number, got {type(value).__name__}")


def _text(row: dict, key: str) -> str:
    if key not in row:
        raise ValueError(f"missing field {key!r} (fields present: {sorted(row)})")
    v = row[key]
    if not isinstance(v, str) or not v.strip():
        raise ValueError(f"field {key!r} must be a non-empty string, got {type(v).__name__} {str(v)[:60]!r}")
    return v


def _row_id(row: dict) -> str | None:
    for k in _ID_KEYS:
        if k in row and isinstance(row[k], (str, int)) and not isinstance(row[k], bool):
            return str(row[k])
    return None


def _scalar_metadata(row: dict, consumed: set[str]) -> dict[str, Any]:
    consumed = consumed | {"image", "images"}  # read by megatron_rlvr.data.images
    return {k: v for k, v in row.items() if k not in consumed and (v is None or isinstance(v, (str, int, float, bool)))}


def parse_problem_answer(row: dict) -> ParsedRow:
    key = next((k for k in ("problem", "prompt") if k in row), "question" if "question" in row else "problem")
    text = _text(row, key)
    if "answer" not in row:
        raise ValueError(f"missing field 'answer' (fields present: {sorted(row)})")
    answer = answer_to_str(row["answer"])
    return text, answer, _row_id(row), _scalar_metadata(row, {key, "answer"})


def parse_dapo(row: dict) -> ParsedRow:
    messages = row.get("prompt")
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"field 'prompt' must be a non-empty list of chat messages, got {type(messages).__name__}")
    clean = []
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"prompt[{j}] must be a {{'role': str, 'content': str}} message, got {str(m)[:80]!r}")
        clean.append({"role": m["role"], "content": m["content"]})
    rm = row.get("reward_model")
    if not isinstance(rm, dict) or "ground_truth" not in rm:
        raise ValueError("missing field 'reward_model.ground_truth'")
    answer = answer_to_str(rm["ground_truth"], "reward_model.ground_truth")
    meta = _scalar_metadata(row, {"prompt", "reward_model"})
    extra = row.get("extra_info")
    row_id = _row_id(row)
    if isinstance(extra, dict):
        meta.update({f"extra_info.{k}": v for k, v in extra.items() if isinstance(v, (str, int, float, bool))})
        row_id = row_id or _row_id(extra)
    return clean, answer, row_id, meta


def parse_gsm8k(row: dict) -> ParsedRow:
    question = _text(row, "question")
    full = _text(row, "answer")
    if "####" not in full:
        raise ValueError("field 'answer' has no '#### <final answer>' marker")
    solution, _, final = full.rpartition("####")
    final = final.strip().replace(",", "")
    if not final:
        raise ValueError("field 'answer' has nothing after '####'")
    meta = _scalar_metadata(row, {"question", "answer"})
    meta["solution"] = solution.strip()
    return question, final, _row_id(row), meta


def parse_boxed_solution(row: dict) -> ParsedRow:
    problem = _text(row, "problem")
    solution = _text(row, "solution")
    answer = last_boxed(solution)
    if not answer:
        raise ValueError("field 'solution' has no \\boxed{...} final answer")
    return problem, answer, _row_id(row), _scalar_metadata(row, {"problem"})


_CODE_TESTS = ("input_output", "tests")
_CODE_CONSUMED = {"input_output", "tests", "solutions", "starter_code"}
"""Fields of a code row that are not metadata: the tests (they are the answer) and reference solutions."""


def parse_code(row: dict) -> ParsedRow:
    key = next((k for k in ("question", "problem", "prompt") if k in row), "question")
    text = _text(row, key)
    field = next((k for k in _CODE_TESTS if k in row), None)
    if field is None:
        raise ValueError(f"missing test cases: field 'input_output' or 'tests' (fields present: {sorted(row)})")
    try:
        tests = normalize_tests(row[field])
    except ValueError as e:
        raise ValueError(f"field {field!r}: {e}") from None
    starter = row.get("starter_code")
    if isinstance(starter, str) and starter.strip():  # APPS / TACO: the signature the program must complete
        text = f"{text}\n\n{starter.strip()}"
    return text, json.dumps(tests), _row_id(row), _scalar_metadata(row, _CODE_CONSUMED | {key})


SCHEMAS: dict[str, Callable[[dict], ParsedRow]] = {
    "problem_answer": parse_problem_answer,
    "dapo": parse_dapo,
    "gsm8k": parse_gsm8k,
    "boxed_solution": parse_boxed_solution,
    "code": parse_code,
}
"""Schema name (``DataConfig.schema``) -> row parser."""


def detect_schema(row: dict) -> str | None:
    """The schema a row looks like, or None. Checked most specific first."""
    if isinstance(row.get("prompt"), list) and "reward_model" in row:
        return "dapo"
    if any(k in row for k in _CODE_TESTS) and any(k in row for k in ("question", "problem", "prompt")):
        return "code"
    if "question" in row and isinstance(row.get("answer"), str) and "####" in row["answer"]:
        return "gsm8k"
    if ("problem" in row or "prompt" in row or "question" in row) and "answer" in row:
        return "problem_answer"
    if "problem" in row and "solution" in row:
        return "boxed_solution"
    return None

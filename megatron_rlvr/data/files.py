"""Read jsonl / parquet files into :class:`Example` lists, with schema auto-detection and malformed-row handling."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from megatron_rlvr.data.images import count_markers, row_images
from megatron_rlvr.data.records import Example, MalformedRowError
from megatron_rlvr.data.schemas import SCHEMAS, detect_schema

__all__ = ["SUPPORTED_EXTENSIONS", "PromptDataset", "iter_rows", "load_dataset", "load_examples"]

logger = logging.getLogger(__name__)

SUPPORTED_EXTENSIONS = (".jsonl", ".parquet")
_MAX_KEPT_ERRORS = 20


@dataclass
class PromptDataset:
    """Examples in file order, plus what was skipped as malformed (``skip_malformed=True``)."""

    examples: list[Example]
    n_malformed: int = 0
    """Rows skipped as malformed."""
    malformed: list[str] = field(default_factory=list)
    """The first few skip messages, each naming file and line."""

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> Example:
        return self.examples[i]


def iter_rows(path: str) -> Iterator[tuple[str, Any, str | None]]:
    """Yield ``(location, row, error)`` for every non-blank row: ``location`` is ``"file:LINE"`` (jsonl, 1-based)
    or ``"file:row N"`` (parquet, 1-based); ``error`` says why the row is not a JSON object (row is then None)."""
    ext = os.path.splitext(path)[1].lower()
    if ext == ".jsonl":
        # Bytes, decoded per line: one non-UTF-8 row is a malformed row (file:line, skippable), not a whole-file
        # UnicodeDecodeError naming nothing.
        with open(path, "rb") as f:
            for line_no, raw in enumerate(f, start=1):
                loc = f"{path}:{line_no}"
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    yield loc, None, f"not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})"
                    continue
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    yield loc, None, f"invalid JSON ({e.msg} at column {e.colno})"
                    continue
                if not isinstance(row, dict):
                    yield loc, None, f"expected a JSON object, got {type(row).__name__}"
                    continue
                yield loc, row, None
    elif ext == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise ValueError(f"{path}: reading parquet needs `pip install pyarrow`") from e
        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as e:
            raise ValueError(f"{path}: cannot read parquet file: {type(e).__name__}: {e}") from e
        for i, row in enumerate(rows, start=1):
            yield f"{path}:row {i}", row, None
    else:
        raise ValueError(f"{path}: unsupported file type {ext!r} (supported: {', '.join(SUPPORTED_EXTENSIONS)})")


def load_examples(path: str, schema: str = "auto", skip_malformed: bool = False) -> PromptDataset:
    """Load one jsonl or parquet file.

    ``schema="auto"`` detects it from the first well-formed row and applies it to every row. A row that does not
    fit raises :class:`MalformedRowError` (a ValueError) naming ``file:line`` and the problem, or with
    ``skip_malformed=True`` is skipped and counted (``n_malformed``; the first messages are kept and logged).
    Images (``images`` / ``image`` fields, any schema; :mod:`megatron_rlvr.data.images`) are decoded here: a missing
    or undecodable image, or ``<image>`` markers that do not match the image count, make the row malformed.
    """
    if schema != "auto" and schema not in SCHEMAS:
        raise ValueError(f"unknown data schema {schema!r}; choose 'auto' or one of {sorted(SCHEMAS)}")
    if not os.path.isfile(path):
        raise ValueError(f"data file not found: {path}")
    examples: list[Example] = []
    malformed: list[str] = []
    n_malformed = 0
    parser = None if schema == "auto" else SCHEMAS[schema]
    # "<folder>/<file>:<line>" ids: benchmark folders reuse file names (gsm8k/test.jsonl, math500/test.jsonl).
    base = os.path.join(os.path.basename(os.path.dirname(os.path.abspath(path))), os.path.basename(path))
    image_dir = os.path.dirname(os.path.abspath(path))  # relative image paths are relative to the data file

    def bad(msg: str) -> None:
        nonlocal n_malformed
        if not skip_malformed:
            raise MalformedRowError(msg)
        n_malformed += 1
        if len(malformed) < _MAX_KEPT_ERRORS:
            malformed.append(msg)

    for loc, row, error in iter_rows(path):
        if error is not None:
            bad(f"{loc}: {error}")
            continue
        if parser is None:
            detected = detect_schema(row)
            if detected is None:
                bad(
                    f"{loc}: cannot detect the schema from fields {sorted(row)}; expected problem/prompt+answer, "
                    "DAPO (prompt messages + reward_model.ground_truth), GSM8K (question + '#### ' answer), "
                    "problem+solution with \\boxed{} or question + input_output/tests (code); or set the schema "
                    "explicitly"
                )
                continue
            schema = detected
            parser = SCHEMAS[detected]
        try:
            prompt, answer, row_id, meta = parser(row)
        except ValueError as e:
            bad(f"{loc}: {e} (schema {schema!r})")
            continue
        try:
            images = row_images(row, image_dir)
        except ValueError as e:
            bad(f"{loc}: {e}")
            continue
        markers = count_markers(prompt)
        if markers and markers != len(images):
            bad(f"{loc}: the prompt has {markers} '<image>' markers for {len(images)} images")
            continue
        line = loc.rsplit(":", 1)[1].replace("row ", "")
        source = meta.get("data_source") if isinstance(meta.get("data_source"), str) else path
        row_id = row_id if row_id is not None else f"{base}:{line}"
        examples.append(Example(prompt, answer, source, row_id, meta, images))
    if n_malformed:
        logger.warning("%s: skipped %d malformed rows; first: %s", path, n_malformed, malformed[0])
    return PromptDataset(examples, n_malformed, malformed)


def load_dataset(paths: Sequence[str] | str, schema: str = "auto", skip_malformed: bool = False) -> PromptDataset:
    """Load and concatenate several files (each with its own schema detection)."""
    if isinstance(paths, str):
        paths = [paths]
    if not paths:
        raise ValueError("load_dataset needs at least one file")
    out = PromptDataset([])
    for p in paths:
        ds = load_examples(p, schema, skip_malformed)
        out.examples.extend(ds.examples)
        out.n_malformed += ds.n_malformed
        out.malformed.extend(ds.malformed[: max(0, _MAX_KEPT_ERRORS - len(out.malformed))])
    if not out.examples:
        raise ValueError(f"no usable rows in {list(paths)} ({out.n_malformed} malformed)")
    return out

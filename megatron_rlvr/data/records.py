"""The normalised record every data source produces."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Example", "MalformedRowError"]


class MalformedRowError(ValueError):
    """A row that does not fit its schema; the message names the file and line (or parquet row) and the problem."""


@dataclass
class Example:
    """One verifiable problem.

    ``prompt`` is the problem text (rendered with a prompt template later) or, for chat-format data such as
    DAPO-Math-17k, the list of chat messages ``[{"role": ..., "content": ...}, ...]`` used verbatim.
    """

    prompt: str | list[dict[str, str]]
    """Problem text, or chat messages used as they are."""
    answer: str
    """Ground-truth final answer as a string (LaTeX for MATH-style sets, a plain number for GSM8K)."""
    source: str
    """Where it came from: the file path (or the row's ``data_source`` field), or the procedural task name."""
    id: str
    """Stable identifier: the row's own id field if it has one, else ``<folder>/<file name>:<line>``."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Extra scalar fields (e.g. ``level``, ``subject``, ``solution``); passed to reward functions as keywords."""
    images: list = field(default_factory=list)
    """The example's images for a vision-language policy, in the order their placeholders appear in the prompt:
    decoded PIL images in RGB mode. Empty for text-only examples."""

    @property
    def level(self) -> Any:
        """Difficulty bucket if the source has one (MATH ``level``, procedural digit count), else None."""
        return self.metadata.get("level")

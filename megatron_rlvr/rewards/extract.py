"""Answer extraction and numeric normalisation: pure string functions, no heavy imports.

Used by the reward functions (in worker processes) and by the data loaders (the MATH-style `solution` field keeps
its final answer in the last ``\\boxed{}``).
"""

from __future__ import annotations

import re
from fractions import Fraction

__all__ = [
    "EXTRACTION_MODES",
    "extract_answer",
    "last_boxed",
    "last_number",
    "parse_number",
]

# \boxed{...}, \fbox{...} (and \boxed 5, which models emit without braces for short answers).
_BOX_START_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
# "Answer: 42" on its own line: DAPO-Math-17k's prompt asks for this form.
_ANSWER_LINE_RE = re.compile(r"(?im)^[ \t>*_#]*answer[ \t*_]*[:：][ \t]*(.+?)[ \t]*$")
_HASH_ANSWER_RE = re.compile(r"####[ \t]*([^\n]+)")
_FINAL_ANSWER_IS_RE = re.compile(r"(?i)final answer is[:\s]*([^\n]+)")
_NUMBER_RE = re.compile(r"[-+−]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+)?|[-+−]?\.\d+")

EXTRACTION_MODES = ("boxed", "lenient", "full")
"""How the candidate answer is taken from a response:

- ``boxed``: the content of the last complete ``\\boxed{...}`` / ``\\fbox{...}``; none -> no answer.
- ``lenient``: ``boxed``, else the last ``Answer: X`` line (DAPO's format), else ``#### X`` (GSM8K's), else
  ``final answer is X``; the reward functions then fall back on the whole response.
- ``full``: the whole stripped response is the answer (tiny procedural tasks whose responses are just a number).
"""


def _match_braces(text: str, open_pos: int) -> int | None:
    """Index of the ``}`` closing the ``{`` at ``open_pos``, or None if unbalanced. Escaped braces (``\\{``,
    ``\\}``, as in LaTeX sets) are not counted."""
    depth = 0
    i = open_pos
    n = len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2  # skip the escaped character, e.g. \{ or \}
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last complete ``\\boxed{...}`` or ``\\fbox{...}`` in ``text`` (nested braces allowed), or
    None. ``\\boxed 5`` (no braces) yields ``5``. An unclosed last box (a truncated response) is skipped in favour
    of the previous complete one."""
    starts = [m.end() for m in _BOX_START_RE.finditer(text)]
    for start in reversed(starts):
        j = start
        while j < len(text) and text[j] in " \t":
            j += 1
        if j < len(text) and text[j] == "{":
            close = _match_braces(text, j)
            if close is not None:
                return text[j + 1 : close].strip()
        elif j > start:  # "\boxed 5": a single token up to whitespace or '$'
            m = re.match(r"[^\s$]+", text[j:])
            if m:
                return m.group(0)
    return None


def extract_answer(response: str, mode: str = "boxed") -> str | None:
    """The candidate answer string in ``response`` under extraction ``mode`` (see :data:`EXTRACTION_MODES`), or
    None when there is none."""
    if mode == "full":
        s = response.strip()
        return s or None
    if mode not in ("boxed", "lenient"):
        raise ValueError(f"extraction mode must be one of {EXTRACTION_MODES}, got {mode!r}")
    boxed = last_boxed(response)
    if boxed is not None or mode == "boxed":
        return boxed
    for pattern in (_ANSWER_LINE_RE, _HASH_ANSWER_RE, _FINAL_ANSWER_IS_RE):
        matches = pattern.findall(response)
        if matches:
            s = matches[-1].strip().rstrip(".").strip()
            if s:
                return s
    return None


def last_number(text: str) -> str | None:
    """The last number-looking token in ``text`` (GSM8K's flexible extraction), or None."""
    matches = _NUMBER_RE.findall(text)
    return matches[-1] if matches else None


_TEXT_CMD_RE = re.compile(r"\\(?:text|mbox|mathrm|textbf|mathbf|operatorname)\s*\{([^{}]*)\}")
_FRAC_RE = re.compile(r"\\[dt]?frac\s*\{\s*([-+]?\d+)\s*\}\s*\{\s*(\d+)\s*\}")
_NUMERIC_FULL_RE = re.compile(
    r"(?P<sign>[-+]?)\s*(?P<num>\d+(?:\.\d*)?|\.\d+)(?:\s*/\s*(?P<den>\d+(?:\.\d*)?))?"
    r"\s*(?:%|percent)?\s*(?P<unit>[A-Za-z][A-Za-z .'/^0-9]*)?\.?"
)


def parse_number(text: str) -> Fraction | None:
    """Parse a GSM8K-style final answer into an exact Fraction, or None if it is not a single number.

    Strips ``$``/``\\$``, thousands commas, LaTeX spacing, ``\\text{...}`` units, trailing unit words ("18 dollars",
    "5 cm"), a trailing ``%`` and a leading ``x =``; accepts ``a/b`` and ``\\frac{a}{b}``. Compared exactly, so
    "18.00" == "18" but "18.5" != "18".
    """
    s = text.strip()
    if not s:
        return None
    inner = last_boxed(s)
    if inner is not None:
        s = inner
    s = _FRAC_RE.sub(r"\1/\2", s)
    s = _TEXT_CMD_RE.sub(r" \1 ", s)  # keep the words: "12 \text{ cm}" -> "12 cm", a unit
    for tok in ("\\$", "$", "\\%", "\\!", "\\,", "\\;", "\\ ", "~", "\\left", "\\right"):
        s = s.replace(tok, " " if tok in ("~", "\\ ", "\\,", "\\;") else "")
    s = s.replace("−", "-").replace("\u00a0", " ")
    if "=" in s:  # "x = 18": the value after the last '='
        s = s.rsplit("=", 1)[1]
    s = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", s)  # 1,000,000 -> 1000000
    s = s.strip().strip("()").strip()
    m = _NUMERIC_FULL_RE.fullmatch(s)
    if m is None:
        return None
    unit = m.group("unit")
    if unit is not None and re.search(r"\d", unit.split("^")[0]):
        return None  # "3 4" or "5 x 3": more than one number, not a unit
    value = Fraction(m.group("num"))
    if m.group("den") is not None:
        den = Fraction(m.group("den"))
        if den == 0:
            return None
        value /= den
    return -value if m.group("sign") == "-" else value

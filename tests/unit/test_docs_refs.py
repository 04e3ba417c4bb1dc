"""Docs that cannot go stale: every reference to the repository in docs/*.md and README.md resolves.

Checked, in prose, inline code and fenced blocks alike:
- repository paths (``tools/bench_step.py``, ``configs/tiny.yaml``, ``docs/lora.md``, ``megatron_rlvr/a/b.py``,
  ``slurm/*.sh``): a path under a top-level folder of the repository names a file or folder the repository holds
  (``<placeholder>`` parts and ``*`` match any name, ``{a,b}`` expands); a module path inside the package
  (``trainer/batch.py``) names a module of megatron_rlvr/; a bare file name (``advantages.py``) names some file of
  the repository;
- dotted names ``megatron_rlvr.x.y[.attr]``: a module of the package, or a name its source defines;
- ``path.py: name`` (inside inline code) and ``path.py::name``: the file defines ``name``;
- relative markdown links: the target exists;
- commands that run a script of tools/ (``python tools/bench_step.py --runs 3 ...``): the script's own argument
  parser accepts the arguments (it is run up to its ``parse_args`` and stopped there, nothing else runs).

"The repository" is the files git would commit (tracked, or untracked and not ignored), so a run's output under
runs/ or a local virtual environment never counts as existing. Each failure names the doc file, the line and the
reference.
"""

from __future__ import annotations

import ast
import fnmatch
import json
import re
import shlex
import subprocess
import sys
from bisect import bisect_right
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = "megatron_rlvr"

ALLOWED_BARE_NAMES = {
    # Written into every run directory by `megatron-rlvr train` (the resolved config), not a file of the repository.
    "config.yaml",
    # vLLM's own module (vllm/model_executor/model_loader/reload/), named where the docs explain its weight reload.
    "layerwise.py",
    # megatron-core's own module (megatron/core/transformer/), named where docs/moe.md explains its MLA traps.
    "multi_latent_attention.py",
}
"""Bare file names the docs may use for files outside the repository (each with the reason)."""

ALLOWED_PATHS = {
    # The README's example of the user's own config file (copy a preset, then edit it).
    "configs/my_run.yaml",
}
"""Repository-looking paths that name a file the reader makes, not one the repository holds."""


def doc_files() -> list[Path]:
    return sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]


@cache
def repo_files() -> frozenset[str]:
    """Paths (relative, '/'-separated) of the files git would commit."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.fail(f"git cannot list the repository's files ({e}): the docs' references need that list")
    # a file deleted in the work tree but still in the index is gone
    return frozenset(p for p in out.decode().split("\0") if p and (ROOT / p).is_file())


@cache
def repo_dirs() -> frozenset[str]:
    dirs = set()
    for f in repo_files():
        parts = f.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            dirs.add("/".join(parts[:i]))
    return frozenset(dirs)


@cache
def basenames() -> frozenset[str]:
    return frozenset(f.rsplit("/", 1)[-1] for f in repo_files())


def top_folders() -> list[str]:
    return sorted(d for d in repo_dirs() if "/" not in d)


def package_folders() -> list[str]:
    """Sub-packages of megatron_rlvr (``trainer``, ``rollout``, ...): a ``trainer/x.py`` in the docs is inside it."""
    return sorted(d.split("/", 1)[1] for d in repo_dirs() if d.startswith(PKG + "/") and d.count("/") == 1)


# ------------------------------------------------------------------------------------------------ reading a doc


class Doc:
    """A markdown text split into fenced blocks and prose, with line numbers for offsets."""

    def __init__(self, name: str, text: str):
        self.name, self.text = name, text
        self.starts = [0] + [m.end() for m in re.finditer("\n", text)]
        self.fenced: list[tuple[int, str]] = []  # (offset, block body)
        self.prose: list[tuple[int, str]] = []  # (offset, text between fences)
        pos = 0
        for m in re.finditer(r"^(```|~~~)[^\n]*\n(.*?)^\1[ \t]*$", text, re.S | re.M):
            self.prose.append((pos, text[pos : m.start()]))
            self.fenced.append((m.start(2), m.group(2)))
            pos = m.end()
        self.prose.append((pos, text[pos:]))

    def line(self, offset: int) -> int:
        return bisect_right(self.starts, offset)

    def code_spans(self) -> list[tuple[int, str]]:
        """Inline code spans of the prose (a span may wrap onto the next line), with their offsets."""
        out = []
        for base, chunk in self.prose:
            for m in re.finditer(r"(?<!`)`([^`]+)`(?!`)", chunk):
                out.append((base + m.start(1), m.group(1)))
        return out


# A reference starts after whitespace or punctuation, never inside another path, URL, variable or dotted name.
_START = r"(?<![\w./$~@:%+-])"
_PATH_CHARS = r"(?:[\w.*<>-]|\{[\w.,-]*\}|/)*"


def _expand_braces(path: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [x for alt in m.group(1).split(",") for x in _expand_braces(path[: m.start()] + alt + path[m.end() :])]


def path_exists(path: str) -> bool:
    """``path`` (a file or folder of the repository; ``<...>`` and ``*`` match any name) is in the repository."""
    path = path.rstrip("/")
    for alt in _expand_braces(path):
        pattern = re.sub(r"<[^<>]*>", "*", alt)
        if any(c in pattern for c in "*?["):
            if not (fnmatch.filter(repo_files(), pattern) or fnmatch.filter(repo_dirs(), pattern)):
                return False
        elif alt not in repo_files() and alt not in repo_dirs():
            return False
    return True


def _clean(token: str) -> str:
    return token.rstrip(".,:;")  # the sentence's punctuation, not the path's


def stale_paths(doc: Doc) -> list[str]:
    bad = []
    tops = "|".join(re.escape(t) for t in top_folders())
    rooted = re.compile(_START + rf"((?:{tops})/{_PATH_CHARS})")
    subs = "|".join(re.escape(s) for s in package_folders())
    in_package = re.compile(_START + rf"((?:{subs})/[\w/]*\w\.py)\b")
    bare = re.compile(_START + r"(?<!\]\()(\w[\w-]*\.(?:py|sh|md|yaml))(?![\w/-])")  # link targets: below
    for m in rooted.finditer(doc.text):
        token = _clean(m.group(1))
        if "..." in token or token in ALLOWED_PATHS:
            continue
        if not path_exists(token):
            bad.append(f"{doc.name}:{doc.line(m.start(1))}: `{token}` is not in the repository")
    for m in in_package.finditer(doc.text):
        token = m.group(1)
        if not path_exists(f"{PKG}/{token}"):
            bad.append(f"{doc.name}:{doc.line(m.start(1))}: `{token}` is not a module of {PKG}/")
    for m in bare.finditer(doc.text):
        name = m.group(1)
        if name not in basenames() and name not in ALLOWED_BARE_NAMES:
            bad.append(f"{doc.name}:{doc.line(m.start(1))}: `{name}`: no file of that name in the repository")
    for m in re.finditer(r"\]\(([^)\s]+)\)", doc.text):
        target = m.group(1).split("#", 1)[0]
        if not target or re.match(r"[a-z][a-z+.-]*:", target):  # an anchor, a URL, mailto:
            continue
        rel = (Path(doc.name).parent / target).as_posix()
        resolved = str(Path("/", rel).resolve())[1:]  # ../ folded, still relative to the root
        if not path_exists(resolved):
            bad.append(f"{doc.name}:{doc.line(m.start(1))}: link target `{target}` is not in the repository")
    return bad


# ------------------------------------------------------------------------------------------------ python names


@cache
def defined_names(path: str) -> dict[str, ast.AST | None]:
    """Names a module's source binds at its top level (functions, classes, assignments, imports; inside top-level
    if / try / with blocks too), with the class node for classes; a package's sub-modules count as its names."""
    tree = ast.parse((ROOT / path).read_text(), filename=path)
    names: dict[str, ast.AST | None] = {}

    def targets(t):
        if isinstance(t, ast.Name):
            names[t.id] = None
        elif isinstance(t, (ast.Tuple, ast.List)):
            for e in t.elts:
                targets(e)

    def visit(body):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names[node.name] = None
            elif isinstance(node, ast.ClassDef):
                names[node.name] = node
            elif isinstance(node, ast.Assign):
                for t in node.targets:
                    targets(t)
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                targets(node.target)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for a in node.names:
                    names[(a.asname or a.name).split(".")[0]] = None
            for field in ("body", "orelse", "finalbody", "handlers"):
                if isinstance(node, (ast.If, ast.Try, ast.With, ast.ExceptHandler)) and hasattr(node, field):
                    visit(getattr(node, field))

    visit(tree.body)
    if path.endswith("/__init__.py"):
        folder = path.rsplit("/", 1)[0]
        for f in repo_files():
            if f.startswith(folder + "/") and f.endswith(".py"):
                names.setdefault(f[len(folder) + 1 :].split("/")[0].removesuffix(".py"), None)
    return names


def class_names(node: ast.ClassDef) -> set[str]:
    out = set()
    for n in node.body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            out.add(n.target.id)
        elif isinstance(n, ast.Assign):
            out.update(t.id for t in n.targets if isinstance(t, ast.Name))
    return out


def attribute_problem(source: str, attrs: list[str]) -> str | None:
    """Why ``attrs`` (a name and its attributes) is not defined by the module file ``source``; None when it is."""
    names = defined_names(source)
    if attrs[0] not in names:
        return f"{source} defines no {attrs[0]!r}"
    node = names[attrs[0]]
    for a in attrs[1:]:
        if not isinstance(node, ast.ClassDef):
            return f"{source}: cannot follow {a!r} below a non-class name"
        if a not in class_names(node):
            return f"{source}: class {node.name} has no {a!r}"
        node = next((n for n in node.body if isinstance(n, ast.ClassDef) and n.name == a), None)
    return None


def dotted_problem(name: str) -> str | None:
    """Why ``megatron_rlvr.a.b.c`` is neither a module nor a name a module defines; None when it resolves."""
    parts = name.split(".")
    folder, i = parts[0], 1
    while i < len(parts):
        sub = f"{folder}/{parts[i]}"
        if sub in repo_dirs():
            folder, i = sub, i + 1
        elif f"{sub}.py" in repo_files():
            return attribute_problem(f"{sub}.py", parts[i + 1 :]) if i + 1 < len(parts) else None
        else:
            init = f"{folder}/__init__.py"
            if init not in repo_files():
                return f"{folder}/ has no module {parts[i]!r}"
            return attribute_problem(init, parts[i:])
    return None


def stale_names(doc: Doc) -> list[str]:
    bad = []
    for m in re.finditer(r"(?<![\w.])(" + PKG + r"(?:\.\w+)+)", doc.text):
        why = dotted_problem(m.group(1))
        if why:
            bad.append(f"{doc.name}:{doc.line(m.start(1))}: `{m.group(1)}`: {why}")
    file_refs = [(m.start(1), m.group(1), "::", m.group(2)) for m in re.finditer(r"([\w/.-]+\.py)::(\w+)", doc.text)]
    for offset, span in doc.code_spans():
        for m in re.finditer(r"([\w/.-]+\.py): ([A-Za-z_]\w*)", span):
            file_refs.append((offset + m.start(1), m.group(1), ": ", m.group(2)))
    for offset, path, sep, name in file_refs:
        source = resolve_py(path)
        if source is None:
            continue  # the path check reports it
        why = attribute_problem(source, [name])
        if why:
            bad.append(f"{doc.name}:{doc.line(offset)}: `{path}{sep}{name}`: {why}")
    return bad


def resolve_py(path: str) -> str | None:
    """The repository file a doc's ``x.py`` / ``trainer/x.py`` / ``tests/<tier>/x.py`` means (None: no such file); a
    bare test file name is looked up in every tier (the names are unique across them)."""
    tiers = [f"tests/{tier}/{path}" for tier in ("unit", "integration", "e2e")]
    for cand in (path, f"{PKG}/{path}", f"tests/{path}", *tiers):
        if cand in repo_files():
            return cand
    return None


# ------------------------------------------------------------------------------------------------ tool commands

_SHELL_OPS = {"|", "||", "&&", ";", "&", ">", ">>", "2>&1", "<"}


def tool_commands(doc: Doc) -> list[tuple[int, str, list[str]]]:
    """(line, script, arguments) of every command line in the doc that runs a Python script of tools/: in fenced
    blocks (``\\`` continuations joined) and in inline code; a bare mention (no interpreter, no options) is not a
    command."""
    pieces: list[tuple[int, str]] = []
    for offset, body in doc.fenced:
        pos = 0
        for logical in re.split(r"(?<!\\)\n", body):
            pieces.append((offset + pos, logical.replace("\\\n", " ")))
            pos += len(logical) + 1
    pieces += doc.code_spans()
    out = []
    for offset, text in pieces:
        for m in re.finditer(_START + r"(tools/[\w/]+\.py)(?![\w/])", text):
            before = text[: m.start()].split()
            try:
                args = shlex.split(text[m.end() :], comments=True)
            except ValueError:
                continue  # not shell syntax: prose that mentions the script
            for i, a in enumerate(args):
                if a in _SHELL_OPS:
                    args = args[:i]
                    break
            run_by_python = bool(before) and re.search(r"python[\d.]*$", before[-1]) is not None
            if run_by_python or (args and args[0].startswith("-")):
                out.append((doc.line(offset + m.start(1)), m.group(1), args))
    return out


_PARSE_ONLY = r"""
import argparse, contextlib, io, json, runpy, sys

class Parsed(BaseException):
    pass

plain = argparse.ArgumentParser.parse_args

def parse_args(self, args=None, namespace=None):
    plain(self, args, namespace)
    raise Parsed

argparse.ArgumentParser.parse_args = parse_args
results = []
for script, args in json.load(sys.stdin):
    sys.argv = [script, *args]
    err, path, result = io.StringIO(), list(sys.path), "the script ended without parsing its arguments"
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            runpy.run_path(script, run_name="__main__")
    except Parsed:
        result = None
    except SystemExit as e:
        lines = err.getvalue().strip().splitlines()
        result = None if not e.code else (lines[-1] if lines else f"exit {e.code}")
    except BaseException as e:
        result = f"{type(e).__name__}: {e}"
    finally:
        sys.path[:] = path
    results.append(result)
print(json.dumps(results))
"""
"""Runs each (script, arguments) up to its first ``ArgumentParser.parse_args`` call and stops there: the argument
errors argparse reports (an unknown option, a bad value or choice, a missing argument) are what it prints."""


def parse_problems(commands: list[tuple[str, str, list[str]]]) -> list[str]:
    """``commands``: (where, script, arguments); returns "where: `script args`: error" for each rejected one."""
    todo = [(str(ROOT / script), args) for _, script, args in commands]
    proc = subprocess.run(
        [sys.executable, "-c", _PARSE_ONLY], input=json.dumps(todo), cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, f"the argument check itself failed:\n{proc.stderr[-3000:]}"
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    return [
        f"{where}: `{script} {shlex.join(args)}`: {why}"
        for (where, script, args), why in zip(commands, results)
        if why is not None
    ]


# ------------------------------------------------------------------------------------------------ tests


def _docs() -> list[Doc]:
    return [Doc(str(p.relative_to(ROOT)), p.read_text()) for p in doc_files()]


def test_every_repository_path_in_the_docs_exists():
    bad = [line for doc in _docs() for line in stale_paths(doc)]
    assert not bad, "stale paths in the docs:\n" + "\n".join(bad)


def test_every_megatron_rlvr_name_in_the_docs_resolves():
    bad = [line for doc in _docs() for line in stale_names(doc)]
    assert not bad, "stale names in the docs:\n" + "\n".join(bad)


def test_every_tool_command_in_the_docs_parses():
    commands = [(f"{doc.name}:{line}", script, args) for doc in _docs() for line, script, args in tool_commands(doc)]
    assert len(commands) >= 10, f"found only {len(commands)} tool commands in the docs: the extraction is broken"
    missing = [f"{w}: `{s}` is not in the repository" for w, s, _ in commands if s not in repo_files()]
    assert not missing, "\n".join(missing)
    bad = parse_problems(commands)
    assert not bad, "tool commands in the docs that their script rejects:\n" + "\n".join(bad)


def test_the_checks_find_what_is_stale_and_nothing_else():
    """A hand-written doc with one live and one stale reference of each kind: exactly the stale ones are reported,
    on their lines (the checks above cannot pass by finding nothing)."""
    text = "\n".join(
        [
            "Run `tools/bench_step.py` and `tools/bench_nothing.py`.",  # 1: one stale
            "See configs/tiny.yaml, configs/repro/<name>.yaml, slurm/*.sh and docs/gone.md.",  # 2: one stale
            "The stage lives in `trainer/stages.py`; the old one in `trainer/step.py`.",  # 3: one stale
            "`megatron_rlvr.ops.kl.kl_estimator` and `megatron_rlvr.ops.kl.no_such_fn` and megatron_rlvr.nope.",  # 4
            "`config/loader.py: MOVED_KEYS` and `config/loader.py: GONE_KEYS`.",  # 5: one stale
            "`tests/unit/test_docs_refs.py::test_the_checks_find_what_is_stale_and_nothing_else`, ::test_gone in "
            "`test_docs_refs.py::test_gone`.",  # 6: one stale
            "Outputs land in runs/x/metrics.jsonl; `advantages.py` and `vanished.py`.",  # 7: one stale
            "[a link](lora.md) and [another](missing.md).",  # 8: one stale
            "```bash",
            "PYTHONPATH=$PWD python tools/bench_async.py --rounds 1 \\",
            "    --modes k0,k1  # a comment",
            "python tools/bench_async.py --no-such-option",
            "```",
        ]
    )
    doc = Doc("docs/example.md", text)
    assert stale_paths(doc) == [
        "docs/example.md:1: `tools/bench_nothing.py` is not in the repository",
        "docs/example.md:2: `docs/gone.md` is not in the repository",
        "docs/example.md:3: `trainer/step.py` is not a module of megatron_rlvr/",
        "docs/example.md:7: `vanished.py`: no file of that name in the repository",
        "docs/example.md:8: link target `missing.md` is not in the repository",
    ]
    assert stale_names(doc) == [
        "docs/example.md:4: `megatron_rlvr.ops.kl.no_such_fn`: megatron_rlvr/ops/kl.py defines no 'no_such_fn'",
        "docs/example.md:4: `megatron_rlvr.nope`: megatron_rlvr/__init__.py defines no 'nope'",
        "docs/example.md:6: `test_docs_refs.py::test_gone`: tests/unit/test_docs_refs.py defines no 'test_gone'",
        "docs/example.md:5: `config/loader.py: GONE_KEYS`: megatron_rlvr/config/loader.py defines no 'GONE_KEYS'",
    ]
    commands = tool_commands(doc)
    assert commands == [
        (10, "tools/bench_async.py", ["--rounds", "1", "--modes", "k0,k1"]),
        (12, "tools/bench_async.py", ["--no-such-option"]),
    ]
    bad = parse_problems([(f"line {n}", s, a) for n, s, a in commands])
    assert len(bad) == 1 and bad[0].startswith("line 12: `tools/bench_async.py --no-such-option`: "), bad
    assert "unrecognized arguments: --no-such-option" in bad[0], bad

"""The package layout shows the architecture (docs/architecture.md): Megatron glue is fenced, no module name is used
twice or collides with a package, and the CLI's subcommands import from the installed package (no file paths)."""

import ast
import os
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "megatron_rlvr"
MEGATRON_FENCE = ("megatron", "models", "testing")
"""Sub-packages allowed to import megatron.core at run time."""


def _modules():
    for path in sorted(PKG.rglob("*.py")):
        yield path, ast.parse(path.read_text(), filename=str(path))


def _runtime_imports(tree):
    """Imported module names, leaving out ``if TYPE_CHECKING:`` blocks (annotations only)."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for n in ast.walk(node))
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module


def test_megatron_core_is_imported_only_inside_the_fence():
    offenders = []
    for path, tree in _modules():
        sub = path.relative_to(PKG).parts[0]
        if sub in MEGATRON_FENCE:
            continue
        bad = [m for m in _runtime_imports(tree) if m == "megatron" or m.startswith("megatron.")]
        if bad:
            offenders.append(f"{path.relative_to(PKG)}: {sorted(set(bad))}")
    assert not offenders, "megatron.core imported outside megatron_rlvr/{megatron,models,testing}: " + "; ".join(
        offenders
    )


def test_no_module_name_is_used_twice_or_collides_with_a_package():
    names: dict[str, list[str]] = {}
    for path in PKG.rglob("*.py"):
        if path.name not in ("__init__.py", "__main__.py"):
            names.setdefault(path.stem, []).append(str(path.relative_to(PKG)))
    packages = {p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    twice = {k: v for k, v in names.items() if len(v) > 1}
    clash = {k: v for k, v in names.items() if k in packages}
    assert not twice and not clash, f"module names used twice: {twice}; modules named like a package: {clash}"


def test_cli_loads_nothing_by_file_path():
    src = (PKG / "cli.py").read_text()
    assert "spec_from_file_location" not in src and "tools" + os.sep + "convert" not in src

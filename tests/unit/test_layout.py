"""The package layout shows the architecture (docs/architecture.md): Megatron glue is fenced, the sub-packages form
layers with no import from a lower layer to a higher one and no import cycle between modules, no module name is used
twice or collides with a package, and the CLI's subcommands import from the installed package (no file paths)."""

import ast
import os
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "megatron_rlvr"
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
    src = (PKG / "commands" / "cli.py").read_text()
    assert "spec_from_file_location" not in src and "tools" + os.sep + "convert" not in src


LAYERS = {
    "": 0,  # megatron_rlvr/__init__.py and slurm_env.py: nothing of the package
    "families": 0,
    "sandbox": 0,
    "ops": 1,
    "rewards": 1,
    "algorithms": 2,
    "data": 2,
    "agentic": 3,
    "config": 4,
    "planner": 5,
    "models": 5,
    "megatron": 6,
    "rollout": 7,
    "eval": 8,
    "rundir": 8,
    "trainer": 9,
    "testing": 10,
    "commands": 11,
}
"""Each sub-package's layer (docs/architecture.md): a module imports only from its own sub-package or a lower layer."""


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _package_imports() -> dict[str, set[str]]:
    """Module -> the package's modules it imports at run time, function-local imports included (a cycle closed by a
    function-local import is still a cycle). ``from pkg import name`` counts as importing ``pkg.name`` when that is
    a module, else ``pkg``."""
    modules = {_module_name(p): p for p in PKG.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        skip = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                skip.update(id(n) for n in ast.walk(node))
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in modules:
                    t = t.rpartition(".")[0]
                if t and t != name:
                    found.add(t)
        graph[name] = found
    return graph


def _layer(module: str) -> tuple[str, int]:
    parts = module.split(".")
    sub = parts[1] if len(parts) > 1 and (PKG / parts[1]).is_dir() else ""
    assert sub in LAYERS, f"sub-package {sub!r} has no layer in tests/unit/test_layout.py: LAYERS (add it)"
    return sub, LAYERS[sub]


def test_every_import_goes_to_the_same_or_a_lower_layer():
    upward = []
    for module, targets in _package_imports().items():
        sub, layer = _layer(module)
        for t in targets:
            tsub, tlayer = _layer(t)
            if tsub != sub and tlayer >= layer:
                upward.append(f"{module} -> {t} (layer {layer} -> {tlayer})")
    assert not upward, "imports from a lower layer to a higher (or equal, other) one: " + "; ".join(sorted(upward))


def test_no_import_cycle_between_modules():
    graph = _package_imports()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, f"{len(cycles)} import cycle(s): {cycles}"


SCHEDULES = ("megatron_rlvr.trainer.colocated", "megatron_rlvr.trainer.disaggregated")
"""The two schedules: siblings over the parts, the stages and the run loop's helpers (docs/architecture.md)."""


def test_the_two_schedules_never_reach_each_other():
    """Neither schedule module imports the other, directly or through another module: what both need lives in the
    parts, the stages or trainer/run_loop.py (two loops sharing code by import drift apart as surely as by copy)."""
    graph = _package_imports()

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    a, b = SCHEDULES
    assert b not in reach(a) and a not in reach(b), "a schedule module reaches the other one through its imports"

"""The docs match the code: docs/architecture.md's package map lists every module of megatron_rlvr and nothing that
does not exist, and its layer list is tests/unit/test_layout.py's LAYERS."""

import re
from pathlib import Path

from test_layout import LAYERS

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "megatron_rlvr"
ARCH = ROOT / "docs" / "architecture.md"


def _block(heading: str) -> list[str]:
    """The lines of the first fenced block after ``heading`` in docs/architecture.md."""
    text = ARCH.read_text()
    assert heading in text, f"docs/architecture.md has no {heading!r} section"
    after = text[text.index(heading) :]
    m = re.search(r"```\n(.*?)```", after, re.S)
    assert m, f"no fenced block under {heading!r}"
    return m.group(1).splitlines()


def package_map() -> set[str]:
    """Paths (relative to the repository) the map lists under megatron_rlvr/: a sub-package is ``"  name/"`` at two
    spaces, its modules ``"    name.py"`` at four; top-level modules ``"  name.py"``; deeper-indented lines continue
    a description."""
    listed: set[str] = set()
    lines = _block("## Package map")
    assert lines[0].strip() == "megatron_rlvr/", "the map starts with megatron_rlvr/"
    package = None
    for line in lines[1:]:
        if not line.startswith(" "):  # a path outside the package (launch/, slurm/, ...): the map of it is over
            break
        m = re.match(r"^( {2}| {4})(\S+)(\s|$)", line)
        if not m:
            continue
        indent, name = len(m.group(1)), m.group(2)
        if indent == 2 and name.endswith("/"):
            package = name.rstrip("/")
            listed.add(f"megatron_rlvr/{package}/")
        elif indent == 2:
            listed.add(f"megatron_rlvr/{name}")
        else:
            assert package, f"module {name} listed before any sub-package"
            listed.add(f"megatron_rlvr/{package}/{name}")
    return listed


def package_files() -> set[str]:
    found = set()
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if path.name == "__init__.py" and path.parent != PKG:
            found.add(f"{rel.parent}/")  # a sub-package is listed as its folder
        else:
            found.add(str(rel))
    for d in PKG.iterdir():  # namespace packages (no __init__.py) too
        if d.is_dir() and any(d.glob("*.py")):
            found.add(f"{d.relative_to(ROOT)}/")
    return found


def test_package_map_lists_every_module_and_only_existing_ones():
    listed, actual = package_map(), package_files()
    assert len(listed) > 50, f"the map parsed to {len(listed)} entries: the parser or the map's format is broken"
    missing = sorted(actual - listed)
    stale = sorted(listed - actual)
    assert not missing, f"modules not in docs/architecture.md's package map: {missing}"
    assert not stale, f"docs/architecture.md's package map lists what does not exist: {stale}"


def test_layer_list_matches_the_layering_test():
    doc: dict[str, int] = {}
    for line in _block("## Layers"):
        if line.strip():
            layer, names = line.split(maxsplit=1)
            for name in names.split(","):
                doc[name.strip()] = int(layer)
    expected = {k: v for k, v in LAYERS.items() if k}  # "" is the top-level modules (layer 0, said in the prose)
    assert doc == expected, f"docs/architecture.md layers {doc} != tests/unit/test_layout.py LAYERS {expected}"

"""The shape of the house: dependencies point one way and nothing imports in a circle.

Layers, bottom to top (a module may import its own layer and those below, never above):

    errors, config, spec (model facts)  ->  dist (grid, bootstrap, comm, placements)
    ->  nn (layers, schedule, tuner)  ->  models  ->  training  ->  command lines (axo4d.train, ...)

``perfmodel`` reads the model facts (``axo4d.spec``) and the grid, never a model; no library
module imports a launcher (``launch``). Imports are read from the source (AST), so a lazy
import inside a function counts too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

LAYERS = {  # module prefix -> rank
    "axo4d.errors": 0,
    "axo4d.config": 0,
    "axo4d.spec": 1,
    "axo4d.parts": 1,
    "axo4d.dist": 1,
    "axo4d.nn": 2,
    "axo4d.models": 3,
    "axo4d.training": 4,
}
CLI_RANK = 5  # any other axo4d module: a command line (axo4d.train, axo4d.checkpoint, ...)


def _modules(package: str) -> dict[str, Path]:
    out = {}
    for f in sorted((ROOT / package).rglob("*.py")):
        parts = list(f.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def _imports(path: Path, module: str) -> set[str]:
    tree = ast.parse(path.read_text())
    pkg = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[: len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.add(name)
            out.update(f"{name}.{a.name}" for a in node.names)
    return out


def _rank(module: str) -> int:
    for prefix, r in sorted(LAYERS.items(), key=lambda kv: -len(kv[0])):
        if module == prefix or module.startswith(prefix + "."):
            return r
    return CLI_RANK


LIB = {**_modules("axo4d"), **_modules("perfmodel")}


def _graph() -> dict[str, set[str]]:
    names = set(LIB)
    g = {}
    for mod, path in LIB.items():
        deps = set()
        for imp in _imports(path, mod):
            while imp and imp not in names:
                imp = imp.rpartition(".")[0]
            if imp and imp != mod and not mod.startswith(imp + "."):  # a package's own __init__
                deps.add(imp)
        g[mod] = deps
    return g


def test_library_never_imports_a_launcher():
    bad = [
        f"{m} imports {i}"
        for m, p in LIB.items()
        for i in _imports(p, m)
        if i == "launch" or i.startswith("launch.") or i == "bench" or i.startswith("bench.")
    ]
    assert not bad, bad


@pytest.mark.parametrize("mod", sorted(m for m in LIB if m.startswith("axo4d")))
def test_axo4d_dependencies_point_down(mod):
    up = [d for d in _graph()[mod] if d.startswith("axo4d") and _rank(d) > _rank(mod)]
    assert not up, f"{mod} (layer {_rank(mod)}) imports higher layers: {up}"


def test_perfmodel_reads_model_facts_not_models():
    for mod in (m for m in LIB if m.startswith("perfmodel")):
        for d in _graph()[mod]:
            if d.startswith("axo4d"):
                assert _rank(d) <= 1 or d == "axo4d.dist.bootstrap", f"{mod} imports {d}"


def test_no_import_cycles():
    g = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(g.get(m, ())):
            if state.get(d) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(d) :] + [d]))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m)


def test_layout_is_interpreted_only_by_placements():
    """No module but the placement types switches on a layout: the old strings are gone."""
    for mod, path in LIB.items():
        text = path.read_text()
        for word in ('"linear3d"', '"cols"', '"replicated"', "get_sharding", ".sharding"):
            assert word not in text, f"{mod} interprets a layout ({word})"


def test_test_helpers_are_not_in_the_library():
    for mod, path in LIB.items():
        text = path.read_text()
        for helper in (
            "def shard_input",
            "def gather_output",
            "def gather_blocks",
            "def shard_rows",
            "def full_state_dict",
        ):
            assert helper not in text, f"{mod} defines the test helper {helper!r}"

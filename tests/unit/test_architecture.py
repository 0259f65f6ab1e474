"""The shape of the house: the folders are the layers, dependencies point one way and nothing
imports in a circle, neither between modules nor between packages.

Layers, bottom to top (a module may import its own layer and those below, never above):

    axo4d.config (errors, configuration)  ->  axo4d.facts (torch-free model facts: grid,
    placements, parts, spec, the architecture registry, the memory model, the schedule rules,
    the FP8 rule)  ->  axo4d.dist (runtime communication)  ->  axo4d.nn  ->  axo4d.models  ->
    axo4d.training (datasets, optim -> checkpointing -> hf -> the trainer and start-up)  ->
    perfmodel (reads axo4d.facts, never a model)  ->  the top of axo4d: the command lines
    (axo4d.train, axo4d.generate, ...)  ->  launch  ->  bench

No module of ``axo4d`` imports ``perfmodel`` (``--grid auto`` finds it through an entry point), so
the packages import in one direction: launch/bench -> perfmodel -> axo4d. Nothing imports a
launcher but the launchers above them (bench); nothing imports a benchmark. Imports are read from
the source (AST), so a lazy import inside a function counts too.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

LAYERS = {  # folder -> rank (the longest prefix wins): the folders are the layers
    "axo4d.config": 0,  # errors and the run's configuration
    "axo4d.facts": 1,  # torch-free model facts: grid, placements, parts, spec, registry, memory model
    "axo4d.dist": 1.5,  # runtime communication
    "axo4d.nn": 2,
    "axo4d.models": 3,
    "axo4d.training.datasets": 4.0,
    "axo4d.training.optim": 4.0,
    "axo4d.training.checkpointing": 4.1,
    "axo4d.training.hf": 4.2,
    "axo4d.training": 4.3,
    "perfmodel": 4.5,
    "axo4d": 5,  # the top of the package: the command lines (axo4d.train, axo4d.generate, ...) and how they end
    "launch": 6,
    "bench": 7,
}
LIBRARY_TOP = 4.3
#: what perfmodel may read of axo4d: the model facts, the grid and (for `perfmodel profile`) the bootstrap
PERFMODEL_READS = 1
#: and, for `perfmodel profile`, what it runs: the bootstrap and the two-rank exchange it times as Comm runs it
PERFMODEL_RUNS = ("axo4d.dist.bootstrap", "axo4d.dist.pairwise")


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


def _rank(module: str) -> float:
    for prefix, r in sorted(LAYERS.items(), key=lambda kv: -len(kv[0])):
        if module == prefix or module.startswith(prefix + "."):
            return r
    raise AssertionError(f"{module} is in no layer")


MODULES = {**_modules("axo4d"), **_modules("perfmodel"), **_modules("launch"), **_modules("bench")}


def _graph() -> dict[str, set[str]]:
    names = set(MODULES)
    g = {}
    for mod, path in MODULES.items():
        deps = set()
        for imp in _imports(path, mod):
            while imp and imp not in names:
                imp = imp.rpartition(".")[0]
            if imp and imp != mod and not mod.startswith(imp + "."):  # a package's own __init__
                deps.add(imp)
        g[mod] = deps
    return g


GRAPH = _graph()


@pytest.mark.parametrize("mod", sorted(MODULES))
def test_dependencies_point_down(mod):
    up = sorted(d for d in GRAPH[mod] if _rank(d) > _rank(mod))
    assert not up, f"{mod} (layer {_rank(mod)}) imports higher layers: {up}"


def test_the_library_never_imports_perfmodel_launchers_or_benchmarks():
    bad = [
        f"{m} imports {d}"
        for m in MODULES
        if m.startswith("axo4d") and _rank(m) <= LIBRARY_TOP
        for d in GRAPH[m]
        if d.split(".")[0] in ("perfmodel", "launch", "bench")
    ]
    assert not bad, bad


def test_no_module_of_axo4d_imports_perfmodel():
    bad = [f"{m} imports {d}" for m in MODULES if m.startswith("axo4d") for d in GRAPH[m] if d.startswith("perfmodel")]
    assert not bad, bad


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                return stack[stack.index(d) :] + [d]
            if d not in state and (found := visit(d)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_no_package_level_cycle(depth):
    """Packages cut at ``depth`` dotted parts (1: axo4d, perfmodel, launch, bench; 2: axo4d.facts,
    axo4d.training, ...; 3: axo4d.training.datasets, ...) import one another without a circle."""

    def pkg(m: str) -> str:
        is_pkg = MODULES[m].name == "__init__.py"
        parts = m.split(".") if is_pkg else m.split(".")[:-1]
        return ".".join(parts[:depth]) or m

    g: dict[str, set[str]] = {}
    for m, deps in GRAPH.items():
        g.setdefault(pkg(m), set()).update(pkg(d) for d in deps if pkg(d) != pkg(m))
    found = _cycle(g)
    assert found is None, "package import cycle: " + " -> ".join(found)


def test_perfmodel_reads_model_facts_not_models():
    for mod in (m for m in MODULES if m.startswith("perfmodel")):
        for d in GRAPH[mod]:
            if d.startswith("axo4d"):
                assert _rank(d) <= PERFMODEL_READS or d in PERFMODEL_RUNS, f"{mod} imports {d}"


def test_nothing_but_benchmarks_imports_a_launcher_and_nothing_imports_a_benchmark():
    for mod, deps in GRAPH.items():
        for d in deps:
            if d.startswith("launch"):
                assert mod.split(".")[0] in ("launch", "bench"), f"{mod} imports {d}"
            if d.startswith("bench"):
                assert mod.startswith("bench"), f"{mod} imports {d}"


def test_no_import_cycles():
    found = _cycle(GRAPH)
    assert found is None, "import cycle: " + " -> ".join(found)


def test_the_registry_names_model_classes_of_the_models_layer():
    """The registry sits with the model facts and names its model classes and plain references as
    ``module:Class`` strings: they must live in the models layer and exist."""
    from axo4d.facts.archs import ARCHS
    from axo4d.models.base import DecoderLM

    for arch in ARCHS.values():
        for ref in (arch.model, arch.plain):
            module = ref.partition(":")[0]
            assert _rank(module) == LAYERS["axo4d.models"], f"{arch.name}: {ref} is not in axo4d.models"
            assert importlib.util.find_spec(module) is not None, ref
        assert issubclass(arch.model_class(), DecoderLM)
        assert arch.plain_class() is not None


def test_every_arch_lookup_goes_through_the_registry():
    """No module but the registry compares ``model.arch`` with a name."""
    for mod, path in MODULES.items():
        if mod.startswith("axo4d.facts.archs"):
            continue
        text = path.read_text()
        for needle in ('arch == "llama"', 'arch == "gpt"', "arch == 'llama'", "arch == 'gpt'", 'arch != "gpt"'):
            assert needle not in text, f"{mod} looks up an architecture by name ({needle})"


def test_training_sub_packages_say_what_they_own():
    for pkg in (
        "axo4d.training",
        "axo4d.training.datasets",
        "axo4d.training.optim",
        "axo4d.training.checkpointing",
        "axo4d.training.hf",
        "axo4d.facts.archs",
    ):
        doc = ast.get_docstring(ast.parse(MODULES[pkg].read_text()))
        assert doc and len(doc.split()) >= 20, f"{pkg} needs a docstring saying what it owns"


def test_layout_is_interpreted_only_by_placements():
    """No module but the placement types switches on a layout: the old strings are gone."""
    for mod, path in MODULES.items():
        text = path.read_text()
        for word in ('"linear3d"', '"cols"', '"replicated"', "get_sharding", ".sharding"):
            assert word not in text, f"{mod} interprets a layout ({word})"


def test_test_helpers_are_not_in_the_library():
    for mod, path in MODULES.items():
        text = path.read_text()
        for helper in (
            "def shard_input",
            "def gather_output",
            "def gather_blocks",
            "def shard_rows",
            "def full_state_dict",
            "def reduce_gradients",
            "class ReduceForward",
            "class ReduceBackward",
        ):
            assert helper not in text, f"{mod} defines the test helper {helper!r}"


def test_no_two_modules_of_one_name_at_different_layers():
    """``checkpoint`` the command and ``checkpoint`` the library package, ``trace`` and ``trace``: a
    name means one thing. Packages count by their folder's name."""
    by_name: dict[str, set[str]] = {}
    for mod in MODULES:
        name = mod.rsplit(".", 1)[-1]
        if name in ("__main__",) or "." not in mod:
            continue
        by_name.setdefault(name, set()).add(mod)
    clash = {n: sorted(ms) for n, ms in by_name.items() if len({_rank(m) for m in ms}) > 1}
    assert not clash, clash

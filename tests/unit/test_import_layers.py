"""The package's layers depend only downward, and no modules import each other in a circle.

The imports are read from the source (``ast``), not by importing: every ``import`` and ``from ... import`` of
a ``lightning_parallel`` module counts, the ones under ``if TYPE_CHECKING:`` and inside functions included (a
type-only import still ties two modules together for the reader). Layers, bottom first, are those of
docs/DESIGN.md; inside ``parallelize/`` the subpackages have an order of their own.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_parallel"

#: Top-level layers, lowest first: a module may import its own layer and the ones before it.
#: ``conf``: the Hydra config groups shipped as package data (its module only says where they are; it imports nothing).
LAYERS = ("conf", "collectives", "layout", "measure", "checkpoint", "parallelize", "plan", "observe", "strategies", "dry_run", "__init__")
#: ``parallelize/`` subpackages, lowest first (the same rule one level down).
PARALLELIZE = ("common", "data", "tensor", "expert", "context", "pipeline", "placement")
#: The only modules that may import the engine: the presets, the strategies package and the package root.
ENGINE = "lightning_parallel.strategies.engine"
ENGINE_IMPORTERS = {
    "lightning_parallel",
    "lightning_parallel.strategies",
    "lightning_parallel.strategies.data",
    "lightning_parallel.strategies.tensor",
    "lightning_parallel.strategies.pipeline",
    "lightning_parallel.strategies.hybrid",
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def imported_modules(name: str) -> Iterator[str]:
    """Every ``lightning_parallel`` module ``name`` imports."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    yield from (target for target in imports_in(path.read_text(), package) if target != name)


def imports_in(source: str, package: str) -> Iterator[str]:
    """The ``lightning_parallel`` modules a source imports, from ``package`` (a name imported from a package
    counts as the package unless it is a module of its own)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target not in MODULES and "." in target:
                target = target.rpartition(".")[0]
            if target in MODULES:
                yield target


GRAPH = {name: set(imported_modules(name)) for name in MODULES}


def rank(name: str) -> tuple[int, int]:
    """(layer, parallelize subpackage) of a module: imports must not go to a higher one."""
    parts = name.split(".")[1:] or ["__init__"]
    layer = LAYERS.index(parts[0])
    sub = PARALLELIZE.index(parts[1]) if parts[0] == "parallelize" and len(parts) > 2 else -1
    return layer, sub


def test_every_module_has_a_layer():
    for name in MODULES:
        rank(name)  # raises ValueError for a top-level folder DESIGN's layers do not name


def test_imports_go_only_downward():
    upward = []
    for name, targets in GRAPH.items():
        for target in targets:
            (layer, sub), (target_layer, target_sub) = rank(name), rank(target)
            if target_layer > layer or (target_layer == layer == LAYERS.index("parallelize") and target_sub > sub >= 0):
                upward.append(f"{name} imports {target}")
    assert not upward, "upward imports:\n" + "\n".join(sorted(upward))


def test_no_import_cycles():
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1 on the path, 2 done
    path: list[str] = []

    def visit(name: str) -> None:
        state[name] = 1
        path.append(name)
        for target in sorted(GRAPH[name]):
            if state.get(target) == 1:
                cycles.append([*path[path.index(target):], target])
            elif target not in state:
                visit(target)
        path.pop()
        state[name] = 2

    for name in sorted(GRAPH):
        if name not in state:
            visit(name)
    # A package importing its own submodules (re-exports) is not a cycle of modules that use each other.
    cycles = [c for c in cycles if not any(c[i + 1].startswith(c[i] + ".") for i in range(len(c) - 1) if MODULES[c[i]].name == "__init__.py")]
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_only_the_presets_import_the_engine():
    importers = {name for name, targets in GRAPH.items() if ENGINE in targets}
    assert importers <= ENGINE_IMPORTERS, f"components reach the engine through strategies/components/host.py, not: {sorted(importers - ENGINE_IMPORTERS)}"


def test_the_reader_sees_type_only_relative_and_function_level_imports():
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from lightning_parallel.strategies.engine import ParallelEngineStrategy\n"
        "from ..tensor import fused\n"
        "def f():\n    import lightning_parallel.observe.monitor\n"
        "from lightning_parallel.parallelize.pipeline.split import SplitPlan\n"
    )
    found = set(imports_in(source, "lightning_parallel.parallelize.pipeline"))
    assert found == {ENGINE, "lightning_parallel.parallelize.tensor.fused", "lightning_parallel.observe.monitor",
                     "lightning_parallel.parallelize.pipeline.split"}
    # and a module of a lower layer importing those is reported
    assert rank("lightning_parallel.parallelize.pipeline.split") > rank("lightning_parallel.parallelize.tensor.fused")
    assert rank("lightning_parallel.observe.monitor") > rank("lightning_parallel.parallelize.pipeline.split")

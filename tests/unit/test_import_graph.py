"""The package's shape, read from the source: imports point one way and files stay readable.

Layers, top to bottom: the command line (`cli`) -> the run (`run`: the loop, its helpers, what a run writes) ->
the roles and engines (trainer, cluster, rollout client, weight_sync, checkpoint, observability, evaluation,
engines) -> the libraries (the shared `types`, `plugins` and `timing`, `formats`, `net`, config, data, rewards, algo).
Every `import` counts, also those inside functions: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "miles_lite"
REPO = PACKAGE.parent
MAX_LINES = 500

COMMAND_LINE = {"cli"}
RUN = {"run"}
ROLES = {"trainer", "cluster", "rollout", "weight_sync", "checkpoint", "observability", "evaluation", "engines"}
LIBRARIES = {"types", "plugins", "timing", "formats", "net", "config", "data", "rewards", "algo"}
LAYERS = (COMMAND_LINE, RUN, ROLES, LIBRARIES)  # top to bottom
MAX_TOP_LEVEL_MODULES = 6


def _rank(unit: str) -> int:
    if unit == "miles_lite":  # the package's empty root (`import miles_lite` to find its files)
        return len(LAYERS) - 1
    return next(i for i, layer in enumerate(LAYERS) if unit in layer)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _unit(module: str) -> str:
    """The package-level node of a module: `miles_lite.rollout.fleet` -> `rollout`, `miles_lite.types` -> `types`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def import_edges() -> dict[str, set[str]]:
    """module -> the `miles_lite` modules it imports (anywhere in its body)."""
    edges: dict[str, set[str]] = defaultdict(set)
    for path in PACKAGE.rglob("*.py"):
        module = _module_name(path)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [node.module]
            else:
                continue
            edges[module].update(t for t in targets if t == "miles_lite" or t.startswith("miles_lite."))
    return edges


def package_graph(edges: dict[str, set[str]]) -> dict[str, dict[str, list[str]]]:
    """unit -> unit it imports -> the module-level imports behind that arrow."""
    graph: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for src, targets in edges.items():
        for dst in targets:
            a, b = _unit(src), _unit(dst)
            if a != b:
                graph[a][b].append(f"{src} -> {dst}")
    return graph


def cycles(graph: dict[str, dict[str, list[str]]]) -> list[list[str]]:
    """The strongly connected components with more than one unit (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_cycle_finder_sees_a_loop() -> None:
    graph = {"a": {"b": ["x"]}, "b": {"c": ["y"]}, "c": {"a": ["z"]}, "d": {"a": ["w"]}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b": ["x"]}}) == []


def test_no_import_loops_between_packages() -> None:
    graph = package_graph(import_edges())
    loops = cycles(graph)
    detail = [f"{loop}: " + "; ".join(e for a in loop for b in loop for e in graph[a].get(b, [])) for loop in loops]
    assert not loops, "package-level import loops:\n" + "\n".join(detail)


def test_every_unit_has_a_layer() -> None:
    units = {_unit(_module_name(p)) for p in PACKAGE.rglob("*.py")} - {"miles_lite"}
    unplaced = units - set().union(*LAYERS)
    assert not unplaced, f"place these in a layer of this test (and in docs/architecture.md's map): {unplaced}"


def test_layers_point_down() -> None:
    graph = package_graph(import_edges())
    assert {"rollout", "weight_sync", "engines", "trainer", "run", "cli"} <= set(graph), "the graph misses packages"
    wrong = []
    for src, targets in graph.items():
        for dst, why in targets.items():
            if _rank(dst) < _rank(src):
                wrong.append(f"{src} imports {dst}, a layer above it: {why}")
    assert not wrong, "\n".join(wrong)


def test_layer_check_sees_an_upward_import() -> None:
    assert _rank("run") < _rank("trainer") < _rank("config")
    assert _rank("cli") == 0 and _rank("types") == len(LAYERS) - 1


def test_few_modules_at_the_top_and_every_room_says_what_it_is() -> None:
    top = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert len(top) <= MAX_TOP_LEVEL_MODULES, f"modules at the package's top: {top}"
    for init in PACKAGE.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc, f"{init.relative_to(REPO)} opens without a docstring saying what the layer does"
        assert "import" in doc, f"{init.relative_to(REPO)}'s docstring does not say what the layer may import"


def test_rollout_client_never_imports_an_engine() -> None:
    graph = package_graph(import_edges())
    assert "engines" not in graph["rollout"], graph["rollout"]["engines"]


def test_no_file_over_the_line_limit() -> None:
    files = [p for d in ("miles_lite", "tests", "benchmarks", "launcher") for p in (REPO / d).rglob("*.py")]
    assert len(files) > 100
    long = {str(p.relative_to(REPO)): n for p in files if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines (split them by responsibility): {long}"


@pytest.mark.parametrize("module", ["miles_lite.data", "miles_lite.rewards", "miles_lite.formats.answer"])
def test_libraries_import_alone_and_light(module: str) -> None:
    # Each library works as the first import of a process and does not pull in transformers.
    code = f"import {module}, sys; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


# Where the whole configuration may travel: the command line, the run layer, and config itself (validation, views).
WHOLE_CONFIG_UNITS = {"cli", "run", "config"}


def whole_config_uses(source: str, name: str) -> list[str]:
    """Where a module names `MilesConfig` (an import, a name, an attribute, a string annotation): `name:line` each."""
    found = []
    for node in ast.walk(ast.parse(source, name)):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, ast.arg) and isinstance(node.annotation, ast.Constant):
            names = [str(node.annotation.value)]
        if any("MilesConfig" in n for n in names):
            found.append(f"{name}:{node.lineno}")
    return found


def test_no_layer_below_the_run_takes_the_whole_config() -> None:
    below = [p for p in PACKAGE.rglob("*.py") if _unit(_module_name(p)) not in WHOLE_CONFIG_UNITS]
    assert len(below) > 100
    uses = [use for p in below for use in whole_config_uses(p.read_text(), str(p.relative_to(REPO)))]
    assert not uses, ("below the run layer, a component takes the config sections it reads (or a view of "
                      f"`config/views.py`), never the whole `MilesConfig`: {uses}")


def test_whole_config_check_sees_each_kind_of_use() -> None:
    assert len(whole_config_uses("from miles_lite.config.schema import MilesConfig\n", "m")) == 1
    assert len(whole_config_uses("def f(cfg: 'MilesConfig') -> None: ...\n", "m")) == 1
    assert len(whole_config_uses("import miles_lite.config.schema as s\ndef f(cfg: s.MilesConfig): ...\n", "m")) == 1
    assert whole_config_uses("def f(data: DataConfig) -> None: ...\n", "m") == []

"""The package's house rules, read from its source: no import cycle, layers that point one way, small modules.

Imports are read with ``ast`` from every module of ``resilient/``, at any depth: an import inside a function
counts (it runs when the function does), and for the cycles so does one under ``if TYPE_CHECKING:`` (it never
runs, but a type named across a circle ties the modules as much as a call does); the layers are about what runs.
From
``resilient.x import y`` where ``y`` is a submodule counts as importing ``resilient.x.y`` (and not
``resilient.x`` itself, unless a name of its ``__init__`` is imported beside it).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MAX_LINES = 800
"""One concept per module, none over 800 lines; a line cap is no reason to split a concept over files."""
OPERATOR = ("resilient.cli", "resilient.deploy", "resilient.chaos")
"""The operator side, highest first: each may import those after it, and nothing below imports any of them."""
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("core: errors, events, exit codes, files, tensors, torch state, compat", ("resilient.core",)),
    ("the package's face: version, lazy exports", ("resilient",)),
    ("parts: checkpoints, coordination, fault plans, detectors, metrics",
     ("resilient.checkpoint", "resilient.coord", "resilient.faults", "resilient.watchdog", "resilient.metrics")),
    ("elastic: batch plans, re-formation, state sync", ("resilient.elastic",)),
    ("the worker's side: data, the agent's hooks in a worker", ("resilient.data", "resilient.worker")),
    ("training: the Run", ("resilient.run",)),
    ("the node agent", ("resilient.agent",)),
    ("chaos drills", ("resilient.chaos",)),
    ("deployment", ("resilient.deploy",)),
    ("the CLI", ("resilient.cli", "resilient.__main__")),
)
"""The layers, lowest first (each a folder of ``resilient/``): a package imports only those in lower layers (and
the CLI's entry module its CLI)."""


def modules(root: Path) -> dict[str, Path]:
    """Dotted name -> file, for every module under the package folder ``root``."""
    found = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imported(name: str, path: Path, node: ast.Import | ast.ImportFrom, known: Mapping[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
    else:
        if node.level:
            package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
            package = package[:len(package) - (node.level - 1)]
            base = ".".join(package + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        submodules = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in known]
        # ``from pkg import a, b`` of submodules alone imports them, not a name of pkg's ``__init__``: like
        # ``from pkg.a import x``, it counts as importing the submodules only (a parent package's
        # ``__init__`` runs for every import below it, and is never counted as imported by one).
        targets = submodules if len(submodules) == len(node.names) else [base, *submodules]
    resolved = []
    for target in targets:
        while target and target not in known:  # a name inside a module: the module
            target = target.rpartition(".")[0]
        if target and target != name:
            resolved.append(target)
    return resolved


def import_graph(root: Path, *, types: bool = True) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (function-level included; ``types``: those under
    ``TYPE_CHECKING`` too, else only what runs)."""
    known = modules(root)
    graph: dict[str, set[str]] = {name: set() for name in known}

    def visit(name: str, path: Path, node: ast.AST) -> None:
        if not types and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(name, path, child)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            graph[name].update(_imported(name, path, node, known))
        for child in ast.iter_child_nodes(node):
            visit(name, path, child)

    for name, path in known.items():
        visit(name, path, ast.parse(path.read_text(), str(path)))
    return graph


def cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def top(name: str) -> str:
    """``resilient.agent.generation`` -> ``resilient.agent``: the top-level package or module it belongs to."""
    return ".".join(name.split(".")[:2])


def package_graph(graph: Mapping[str, Iterable[str]]) -> dict[str, set[str]]:
    tops: dict[str, set[str]] = {}
    for name, targets in graph.items():
        tops.setdefault(top(name), set()).update(top(t) for t in targets if top(t) != top(name))
    return tops


def test_no_module_of_the_package_is_part_of_an_import_cycle() -> None:
    found = cycles(import_graph(REPO / "resilient"))
    assert not found, ("import cycles (function-level and TYPE_CHECKING imports count):\n"
                       + "\n".join(" <-> ".join(c) for c in found))


def test_the_top_level_packages_import_each_other_one_way() -> None:
    found = cycles(package_graph(import_graph(REPO / "resilient")))
    assert not found, "packages that import each other:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_operator_side_is_imported_by_nothing_below_it() -> None:
    graph = import_graph(REPO / "resilient", types=False)
    wrong = []
    for name, targets in graph.items():
        mine = top(name)
        for target in targets:
            theirs = top(target)
            if theirs not in OPERATOR or theirs == mine:
                continue
            if name == "resilient.__main__" and theirs == "resilient.cli":
                continue
            if mine in OPERATOR and OPERATOR.index(mine) < OPERATOR.index(theirs):
                continue  # the CLI over deploy and chaos; deploy over chaos
            wrong.append(f"{name} imports {target}")
    assert not wrong, "\n".join(wrong)


def test_every_package_is_in_a_layer_and_imports_only_those_below() -> None:
    """What runs (a type named under ``TYPE_CHECKING`` may come from a layer above: the package's face names what
    it hands on lazily, a worker hook the loader it is given)."""
    graph = import_graph(REPO / "resilient", types=False)
    layer = {package: i for i, (_, packages) in enumerate(LAYERS) for package in packages}
    unplaced = sorted({top(name) for name in graph} - set(layer))
    assert not unplaced, f"packages in no layer (place each in LAYERS): {unplaced}"
    wrong = []
    for name, targets in graph.items():
        mine = top(name)
        for target in targets:
            theirs = top(target)
            if theirs == mine or layer[theirs] < layer[mine] or (mine, theirs) == ("resilient.__main__", "resilient.cli"):
                continue
            wrong.append(f"{name} ({LAYERS[layer[mine]][0].split(':')[0]}) imports {target} "
                         f"({LAYERS[layer[theirs]][0].split(':')[0]})")
    assert not wrong, "imports that do not point down the layers:\n" + "\n".join(sorted(wrong))


def test_the_analysis_finds_a_cycle_made_by_an_import_inside_a_function(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from .sub import b\n")
    (package / "sub" / "b.py").write_text("def f():\n    from .. import c\n")
    (package / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import d\n"
                                  "def g():\n    import pkg.a\n")
    (package / "d.py").write_text("from .c import g\n")
    (package / "e.py").write_text("from .sub import b, thing\n")  # a name of sub's __init__ beside a submodule
    running = import_graph(package, types=False)
    assert running["pkg.a"] == {"pkg.sub.b"} and running["pkg.sub.b"] == {"pkg.c"}, "submodules, not their parents"
    assert running["pkg.e"] == {"pkg.sub", "pkg.sub.b"}
    assert running["pkg.c"] == {"pkg.a"}, "an import under TYPE_CHECKING never runs"
    assert cycles(running) == [["pkg.a", "pkg.c", "pkg.sub.b"]]
    assert cycles(package_graph(running)) == [["pkg.a", "pkg.c", "pkg.sub"]]
    graph = import_graph(package)
    assert graph["pkg.c"] == {"pkg.a", "pkg.d"}, "a type named under TYPE_CHECKING ties c to d"
    assert cycles(graph) == [["pkg.a", "pkg.c", "pkg.d", "pkg.sub.b"]]


def test_no_module_is_longer_than_the_house_allows() -> None:
    long = {str(path.relative_to(REPO)): n for path in (REPO / "resilient").rglob("*.py")
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by responsibility): {long}"


def test_the_runs_parts_take_its_state_never_the_run() -> None:
    """Only the Run's own module (and the package's entry) may name ``Run``: every part of it, and everything
    below, works on a ``RunState`` (even a type annotation of ``Run`` elsewhere is a part reaching into it)."""
    allowed = {"resilient", "resilient.run", "resilient.run.core"}
    wrong = []
    for name, path in modules(REPO / "resilient").items():
        if name in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and any(alias.name == "Run" for alias in node.names):
                wrong.append(f"{name} imports Run (line {node.lineno})")
            if isinstance(node, ast.Attribute) and node.attr == "_state" and not (
                    isinstance(node.value, ast.Name) and node.value.id == "self"):
                wrong.append(f"{name} reads another object's _state (line {node.lineno})")
    assert not wrong, "\n".join(wrong)


def test_every_folder_of_the_package_is_a_regular_package() -> None:
    """A folder of modules without ``__init__.py`` imports from a checkout (a namespace package) but is left out of
    the wheel (``find_packages``): the installed package would miss it."""
    bare = sorted(str(d.relative_to(REPO)) for d in (REPO / "resilient").rglob("*")
                  if d.is_dir() and any(d.glob("*.py")) and not (d / "__init__.py").exists())
    assert not bare, f"folders of modules with no __init__.py (missing from an installed wheel): {bare}"


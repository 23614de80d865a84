"""The package's import graph has no cycle: every `import` of a refl_ddpo module, at the top of a file or inside a
function, read with `ast` (no module is imported), so that the layers stay layers (see docs/layout.md)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "refl_ddpo"

# Edges of cycles that other work removes, dropped from the graph here until it lands; each names why.
KNOWN_EDGES: set[tuple[str, str]] = set()  # an edge to leave out, with its reason (none today)


def module_names(root: Path, package: str = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under root/package (a package by its __init__.py)."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imported_modules(name: str, path: Path, modules: dict[str, Path], package: str = PACKAGE) -> set[str]:
    """The modules of `modules` that module `name` imports anywhere in its file (functions included):
    `import p.x`, `from p.x import y` (p.x, or p.x.y where y is a submodule), `from p import x`, relative imports."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's own package, up level - 1 more
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = []
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                targets.append(sub if sub in modules else source)
        else:
            continue
        for target in targets:
            if target == package or target.startswith(package + "."):
                while target not in modules:  # `import refl_ddpo.a.b.attr`-like spellings: the module part
                    target = target.rpartition(".")[0]
                if target != name:
                    found.add(target)
    return found


def import_graph(root: Path = ROOT, package: str = PACKAGE) -> dict[str, set[str]]:
    modules = module_names(root, package)
    return {name: imported_modules(name, path, modules, package) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle [a, b, ..., a] of the directed graph, or None (a depth-first search, in name order)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def assert_no_cycle(graph: dict[str, set[str]]) -> None:
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_refl_ddpo_has_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 40 and "refl_ddpo.trainers.refl" in graph  # it read the package
    for a, b in KNOWN_EDGES:
        graph[a].discard(b)
    assert_no_cycle(graph)


def test_validation_reaches_no_command_line_module():
    """Validation during training draws and scores through generate and the rewards, not through a script's module."""
    graph, seen, todo = import_graph(), set(), ["refl_ddpo.run.validation"]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    cli = {
        "refl_ddpo.apps.inference",
        "refl_ddpo.apps.inference_config",
        "refl_ddpo.apps.compare",
        "refl_ddpo.tiny",
    }
    assert "refl_ddpo.core.generate" in seen and not seen & cli, sorted(seen & cli)
    assert not any(m.startswith("refl_ddpo.trainers") for m in seen)


def test_the_import_graph_sees_every_spelling_and_finds_cycles(tmp_path):
    """The checker itself: each spelling of an import is an edge, and a cycle through them is reported."""
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "import refl_ddpo.b\n",
        "b.py": "def f():\n    from refl_ddpo.sub import c\n",  # inside a function, a submodule by name
        "sub/__init__.py": "from refl_ddpo.e import THING\n",
        "sub/c.py": "from . import d\n",  # relative
        "sub/d.py": "from ..e import THING\nimport os\n",  # relative, up one; outside the package: no edge
        "e.py": "from refl_ddpo import a\n",  # closes the cycle a -> b -> sub.c -> sub.d -> e -> a
        "f.py": "from refl_ddpo.sub.c import name\nimport refl_ddpo.sub.d as alias\n",
    }
    for rel, text in files.items():
        (pkg / rel).write_text(text)
    graph = import_graph(tmp_path)
    assert graph == {
        "refl_ddpo": set(),
        "refl_ddpo.a": {"refl_ddpo.b"},
        "refl_ddpo.b": {"refl_ddpo.sub.c"},
        "refl_ddpo.sub": {"refl_ddpo.e"},
        "refl_ddpo.sub.c": {"refl_ddpo.sub.d"},
        "refl_ddpo.sub.d": {"refl_ddpo.e"},
        "refl_ddpo.e": {"refl_ddpo.a"},
        "refl_ddpo.f": {"refl_ddpo.sub.c", "refl_ddpo.sub.d"},
    }
    assert find_cycle(graph) == [
        *("refl_ddpo.a", "refl_ddpo.b", "refl_ddpo.sub.c", "refl_ddpo.sub.d", "refl_ddpo.e", "refl_ddpo.a")
    ]
    with pytest.raises(AssertionError, match=r"import cycle: refl_ddpo\.a -> refl_ddpo\.b -> "):
        assert_no_cycle(graph)
    graph["refl_ddpo.e"].clear()
    assert_no_cycle(graph)

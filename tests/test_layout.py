"""The package's folders are its layers and its arrows point down: each module imports only from its own layer or
the layers below it (LAYERS, lowest first), the top level holds only the package root and the `tiny` shim, and the
library does not depend on its test support (no module outside refl_ddpo/testing/ imports refl_ddpo.testing or the
refl_ddpo.tiny shim, at module level or inside a function). Imports are read from the source with ast."""

import ast
from pathlib import Path

from test_imports import import_graph

PACKAGE = Path(__file__).resolve().parent.parent / "refl_ddpo"
FORBIDDEN = ("refl_ddpo.testing", "refl_ddpo.tiny")
# the shim itself: `python -m refl_ddpo.tiny` runs refl_ddpo.testing.tiny's main
SHIM = PACKAGE / "tiny.py"


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, package_dir: Path = PACKAGE) -> list[tuple[int, str]]:
    """(line, module) for every import in `path`, anywhere in it: `import a.b` gives a.b, `from a.b import c` gives
    a.b and a.b.c (c may be a module), relative imports resolved against `path`'s package."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module_name(path, package_dir).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package[: len(package) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names if alias.name != "*"]
    return found


def forbidden_imports(path: Path, package_dir: Path = PACKAGE) -> list[str]:
    """One line per import statement of `path` that reaches a FORBIDDEN module."""
    bad = {}
    for line, name in imported_modules(path, package_dir):
        if any(name == f or name.startswith(f + ".") for f in FORBIDDEN):
            bad.setdefault(line, f"{path.relative_to(package_dir.parent)}:{line} imports {name}")
    return list(bad.values())


def core_modules() -> list[Path]:
    testing = PACKAGE / "testing"
    return sorted(p for p in PACKAGE.rglob("*.py") if testing not in p.parents and p != SHIM)


def test_the_core_does_not_import_its_test_support():
    modules = core_modules()
    assert len(modules) > 40 and PACKAGE / "rewards" / "clip.py" in modules
    bad = [line for path in modules for line in forbidden_imports(path)]
    assert not bad, "\n".join(bad)


def test_the_check_sees_every_form_of_import(tmp_path):
    """The check fails on each way of spelling such an import, at module level or inside a function."""
    fake = tmp_path / "refl_ddpo"
    (fake / "rewards").mkdir(parents=True)
    forms = {
        "import refl_ddpo.testing.tiny": 1,
        "import refl_ddpo.tiny as t": 1,
        "from refl_ddpo.testing.tiny_rewards import write_clip": 1,
        "from refl_ddpo import testing": 1,
        "from refl_ddpo import tiny": 1,
        "from .. import testing": 1,
        "from ..testing import tiny": 1,
        "def f():\n    from refl_ddpo.testing.toy_build import main\n    return main": 1,
        "import refl_ddpo.toy_world.world\nfrom refl_ddpo import rewards, toy_world\nfrom . import clip": 0,
        "from refl_ddpo.tinyness import x\nimport refl_ddpo.testing_tools": 0,
    }
    for i, (source, expected) in enumerate(forms.items()):
        path = fake / "rewards" / f"m{i}.py"
        path.write_text(source + "\n")
        assert len(forbidden_imports(path, fake)) == expected, source


# Lowest first: a module may import its own layer and the layers before it, never one after it.
LAYERS = ("algorithms", "core", "toy_world", "rewards", "run", "trainers", "apps", "testing")
TOP_LEVEL = {
    "refl_ddpo",
    "refl_ddpo.tiny",
}  # the package root (lazy re-exports) and `python -m refl_ddpo.tiny`


def layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """One line per import that points up a layer (or reaches into the package root's shim)."""
    bad = []
    for module, targets in sorted(graph.items()):
        if module in TOP_LEVEL:
            continue
        for target in sorted(targets - {"refl_ddpo"}):
            if target in TOP_LEVEL - {"refl_ddpo"} or LAYERS.index(layer(target)) > LAYERS.index(
                layer(module)
            ):
                bad.append(f"{module} ({layer(module)}) imports {target} ({layer(target)}), a layer above it")
    return bad


def test_every_module_sits_in_a_layer_folder():
    graph = import_graph()
    assert len(graph) > 40
    loose = sorted(m for m in graph if m not in TOP_LEVEL and layer(m) is None)
    assert not loose, f"modules outside the layer folders {LAYERS}: {loose}"
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 6, top


def test_imports_point_down_the_layers():
    bad = upward_imports(import_graph())
    assert not bad, "\n".join(bad)


def test_the_layer_check_sees_an_arrow_up():
    graph = {
        "refl_ddpo.core.lora": {"refl_ddpo.core.errors", "refl_ddpo.algorithms.policy"},
        "refl_ddpo.run.training": {"refl_ddpo.core.lora", "refl_ddpo.rewards"},
        "refl_ddpo.core.families": {"refl_ddpo.run.sharding"},  # up: core -> run
        "refl_ddpo.rewards.toy": {"refl_ddpo.toy_world.world", "refl_ddpo.tiny"},  # the shim: never
        "refl_ddpo": {"refl_ddpo.core.steps.ddim"},  # the root may re-export
    }
    assert upward_imports(graph) == [
        "refl_ddpo.core.families (core) imports refl_ddpo.run.sharding (run), a layer above it",
        "refl_ddpo.rewards.toy (rewards) imports refl_ddpo.tiny (None), a layer above it",
    ]

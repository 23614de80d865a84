"""The library does not depend on its test support: no module of refl_ddpo outside refl_ddpo/testing/ imports
refl_ddpo.testing or the refl_ddpo.tiny shim (at module level or inside a function), read from the source with ast."""

import ast
from pathlib import Path

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
        "import refl_ddpo.toy_world\nfrom refl_ddpo import rewards, toy_world\nfrom . import clip": 0,
        "from refl_ddpo.tinyness import x\nimport refl_ddpo.testing_tools": 0,
    }
    for i, (source, expected) in enumerate(forms.items()):
        path = fake / "rewards" / f"m{i}.py"
        path.write_text(source + "\n")
        assert len(forbidden_imports(path, fake)) == expected, source

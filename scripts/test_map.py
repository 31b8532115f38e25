"""Which test files import which package modules: the test-to-module map.

Every module of ``lightning_nanguard`` that holds logic (a function or a class of its own, beyond re-exports) and
the test files that import it by name (``import lightning_nanguard.a.b``, ``from lightning_nanguard.a.b import
...``, ``from lightning_nanguard.a import b``), read with ``ast``: nothing is imported or run. A module no test
imports is only reached through others, so a bug in it shows up, if at all, as a failure somewhere else.

    python scripts/test_map.py            # the map, modules without a test of their own first
    python scripts/test_map.py --missing  # only the modules no test imports, one per line

``tests/test_test_map.py`` keeps the list of modules without a test from growing.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path
from typing import Iterator, Optional

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "lightning_nanguard"

__all__ = ["modules", "imports_of", "test_map", "missing", "main"]


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted name -> file of every module of the package (``__init__`` as its package's name)."""
    out = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def has_logic(path: Path) -> bool:
    """The module defines a function or a class of its own (a module of constants or re-exports does not)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return any(isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) for node in tree.body)


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The package modules ``path`` imports by name (of ``known``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        for name in _imported(node):
            while name and name not in known:  # ``a.b.c`` where ``c`` is a name in module ``a.b``
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def _imported(node: ast.AST) -> Iterator[str]:
    if isinstance(node, ast.Import):
        yield from (a.name for a in node.names if a.name.startswith(PACKAGE))
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.startswith(PACKAGE):
        yield node.module
        yield from (f"{node.module}.{a.name}" for a in node.names)


def test_map(root: Path = ROOT) -> dict[str, list[str]]:
    """Module (those with logic) -> the test files that import it, by name."""
    mods = modules(root)
    logic = {name for name, path in mods.items() if has_logic(path)}
    out: dict[str, list[str]] = {name: [] for name in sorted(logic)}
    for test in sorted((root / "tests").rglob("*.py")):
        for name in imports_of(test, set(mods)) & logic:
            out[name].append(str(test.relative_to(root)))
    return out


def missing(root: Path = ROOT) -> list[str]:
    """The modules with logic that no test file imports."""
    return [name for name, tests in test_map(root).items() if not tests]


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--missing", action="store_true", help="only the modules no test imports")
    args = parser.parse_args(argv)
    mapping = test_map()
    if args.missing:
        print("\n".join(name for name, tests in mapping.items() if not tests))
        return 0
    bare = [name for name, tests in mapping.items() if not tests]
    print(f"{len(mapping)} modules with logic; {len(bare)} imported by no test:")
    for name in bare:
        print(f"  {name}")
    print()
    for name, tests in mapping.items():
        if tests:
            print(f"{name}: {', '.join(t.removeprefix('tests/') for t in tests)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

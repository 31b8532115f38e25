"""The package is a stack (CONTRIBUTING.md, docs/architecture.md): each part imports only from the parts below it.
Read from the package's own imports (every ``import`` and ``from ... import``, lazy ones and TYPE_CHECKING ones
included): no import runs back up, so there is no circle; a new part has to be given its place here."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import lightning_nanguard

PACKAGE = Path(lightning_nanguard.__file__).resolve().parent

# bottom (0) to top: a part may import only from parts of a lower rank (its own modules aside)
RANKS = {
    "core/": 0, "errors": 0,
    "usage_errors": 1, "state_schema": 1, "faults": 1,
    "config": 2,
    "detect/": 3,
    "store/": 4,
    "recover/": 5,
    "diagnose/": 6, "report/": 6,
    "respond/": 7, "__main__": 7,
    "callback": 8,
    "classic": 9, "lightning": 9,
    "testing": 10, "__init__": 10,
}


def _part(module: str) -> str:
    """The part a module of the package belongs to: its sub-package (``respond/``) or its root module."""
    parts = module.split(".")[1:]
    if not parts:
        return "__init__"
    return parts[0] + "/" if (PACKAGE / parts[0]).is_dir() else parts[0]


def imports() -> dict[tuple[str, str], list[str]]:
    """(importing part, imported part) -> the files that make that import."""
    found: dict[tuple[str, str], list[str]] = defaultdict(list)
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        module = ".".join(rel.parts[:-1] if path.name == "__init__.py" else rel.parts)
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                targets = [target] if node.module else [f"{target}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            for target in targets:
                if target.split(".")[0] == "lightning_nanguard" and _part(module) != _part(target):
                    found[_part(module), _part(target)].append(str(path.relative_to(PACKAGE.parent)))
    return found


def test_every_part_of_the_package_has_its_place_in_the_stack():
    parts = {_part(".".join(("lightning_nanguard", *p.relative_to(PACKAGE).with_suffix("").parts)))
             for p in PACKAGE.rglob("*.py")}
    assert parts == set(RANKS), f"give each new part a rank in RANKS: {sorted(parts ^ set(RANKS))}"


def test_no_import_runs_back_up_the_stack():
    edges = imports()
    assert edges, "no import read"
    upward = {f"{a} -> {b}": files for (a, b), files in edges.items() if RANKS[b] >= RANKS[a]}
    assert upward == {}, upward

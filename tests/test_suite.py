"""The suite's own shape: every test function has a name no other test in tests/ has, so a name finds a test."""

from __future__ import annotations

import ast
import collections
import functools
from pathlib import Path
from typing import Iterable

TESTS = Path(__file__).parent


@functools.lru_cache(maxsize=None)
def parsed(path: Path) -> ast.Module:
    """The syntax tree of a source file (parsed once per session)."""
    return ast.parse(path.read_text(), filename=str(path))


def defined_tests(paths: Iterable[Path] = ()) -> dict[str, list[str]]:
    """Test function name -> ``file:line`` of each definition (module level, or in a ``Test*`` class), read
    from the source of ``paths`` (default: every ``tests/**/test_*.py``)."""
    found: dict[str, list[str]] = collections.defaultdict(list)
    for path in sorted(paths) or sorted(TESTS.rglob("test_*.py")):
        tree = parsed(path)
        nodes = list(tree.body) + [n for c in tree.body if isinstance(c, ast.ClassDef) and c.name.startswith("Test")
                                   for n in c.body]
        for node in nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
                found[node.name].append(f"{path.relative_to(path.parents[1]).as_posix()}:{node.lineno}")
    return dict(found)


def test_the_name_scan_finds_a_name_defined_twice(tmp_path):
    (tmp_path / "tests").mkdir()
    a, b = tmp_path / "tests" / "test_a.py", tmp_path / "tests" / "test_b.py"
    a.write_text("def test_one():\n    pass\n\n\ndef helper():\n    pass\n")
    b.write_text("class TestThings:\n    def test_one(self):\n        pass\n\n\ndef test_two():\n    pass\n")
    assert defined_tests([a, b]) == {"test_one": ["tests/test_a.py:1", "tests/test_b.py:2"],
                                     "test_two": ["tests/test_b.py:6"]}


def test_no_two_tests_share_a_name():
    found = defined_tests()
    assert "test_no_two_tests_share_a_name" in found and len(found) > 100  # the scan read the whole suite
    assert {name: where for name, where in found.items() if len(where) > 1} == {}

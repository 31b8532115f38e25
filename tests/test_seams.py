"""Stages hand each other typed values, never ``event.details``: the details are written for the user, and only the
report reads them back (docs/architecture.md, "Typed seams").

The rule, read from the package's source with ``ast``: every use of an attribute named ``details`` is a *write*, or
it is in one of the report's modules (:data:`READERS`, which render the details to the user). A write is

- an assignment target: ``x.details = ...``, ``x.details[k] = ...``, ``x.details[k] += ...``, ``del x.details[k]``;
- ``x.details.update(...)`` or ``x.details.setdefault(...)`` as a statement of its own (its result unused);
- the argument of such an ``update`` (``event.details.update(done.details)``: one record of user-facing values
  written into another, nothing read out of it).

Anything else is a read: ``x.details.get(k)``, ``x.details[k]`` as a value, ``k in x.details``, ``x.details.pop(k)``,
``dict(x.details)``, ``v = x.details.setdefault(k, d)``, ``for k in x.details``, passing ``x.details`` along.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "lightning_nanguard"
READERS = {"report/render.py", "report/sinks.py", "report/recorder.py"}  # they render the details to the user
_WRITE_CALLS = ("update", "setdefault")


def _is_details(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "details"


def details_reads(source: str) -> list[int]:
    """The lines of ``source`` that read an attribute named ``details`` (module docstring's rule)."""
    tree = ast.parse(source)
    parent: dict[ast.AST, ast.AST] = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parent[child] = node
    reads = []
    for node in ast.walk(tree):
        if not _is_details(node):
            continue
        assert isinstance(node, ast.Attribute)
        if isinstance(node.ctx, (ast.Store, ast.Del)):
            continue  # x.details = ...
        up = parent.get(node)
        if isinstance(up, ast.Subscript) and up.value is node and isinstance(up.ctx, (ast.Store, ast.Del)):
            continue  # x.details[k] = ... (and +=, del)
        if (isinstance(up, ast.Attribute) and up.attr in _WRITE_CALLS and isinstance(parent.get(up), ast.Call)
                and parent[up].func is up and isinstance(parent.get(parent[up]), ast.Expr)):
            continue  # x.details.update(...) as a statement
        if (isinstance(up, ast.Call) and node in up.args and isinstance(up.func, ast.Attribute)
                and up.func.attr == "update" and _is_details(up.func.value)
                and isinstance(parent.get(up), ast.Expr)):
            continue  # event.details.update(done.details)
        reads.append(node.lineno)
    return reads


def package_reads() -> dict[str, list[int]]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in READERS:
            continue
        lines = details_reads(path.read_text())
        if lines:
            found[rel] = lines
    return found


def test_no_stage_reads_event_details_outside_the_report():
    assert package_reads() == {}, "pass a typed value (e.g. core.diagnosis.Diagnosis) instead of reading details"


@pytest.mark.parametrize("line", [
    "x = ev.details.get('inputs')",
    "x = ev.details['replay']",
    "ok = 'replay' in ev.details",
    "ev.details.pop('replay_outputs', [])",
    "ev.details = dict(ev.details)",
    "note = ev.details.setdefault('replay', {})",
    "for key in ev.details: pass",
    "f(ev.details)",
    "ev.details['replica'] = dict(ev.details.get('replica') or {})",
    "ev.details.update({k: prev.details[k] for k in keys})",
    "ev.details['replay']['note'] = 'x'",
])
def test_a_read_is_caught(line):
    assert details_reads(line) == [1]


@pytest.mark.parametrize("line", [
    "ev.details = {}",
    "ev.details['ranks'] = named",
    "ev.details['n'] += 1",
    "del ev.details['n']",
    "ev.details.update(grad_scale=1.0)",
    "ev.details.setdefault('domain', {})",
    "ev.details.update(done.details)",
    "details = {}; details.get('x')",  # a local dict named details is not the attribute
])
def test_a_write_is_not_a_read(line):
    assert details_reads(line) == []

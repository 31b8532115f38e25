"""Every module, class or function the docs and the package's docstrings point at exists: a dotted
``lightning_nanguard.*`` path resolves (imported, then looked up), a ``lightning_nanguard/...py`` or
``<layer>/<module>.py`` path is a file, and a Sphinx role whose target starts with a module of the package
(``:class:`~.store.snapshots.X```) resolves from the package's root. A module that moved leaves no pointer to where
it was (the CHANGELOG, the history, and scripts/mutants.py's notes of what a file was called keep the old names on
purpose, and are not read)."""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = "lightning_nanguard"
DOCS = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "CONTRACT.md"]
SOURCES = sorted((ROOT / PKG).rglob("*.py"))
LAYERS = "core|detect|diagnose|recover|report|respond|store"
TOP = {p.stem for p in (ROOT / PKG).iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}

DOTTED = re.compile(r"\blightning_nanguard(?:\.\w+)+")
FILE = re.compile(r"\blightning_nanguard/[\w/]+\.py")
LAYER_FILE = re.compile(rf"(?<![\w/.])((?:{LAYERS})/\w+\.py)")
ROLE = re.compile(r":\w+:`~?([\w.]+)`")


def resolves(dotted: str) -> bool:
    """``dotted`` names a module, or an attribute of one (a class's annotated or ``self.``-assigned field too)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        break
    else:
        return False
    for name in parts[i:]:
        if hasattr(obj, name):
            obj = getattr(obj, name)
            continue
        if inspect.isclass(obj):
            fields = {k for c in obj.__mro__ for k in getattr(c, "__annotations__", {})}
            return name in fields or re.search(rf"self\.{name}\b", inspect.getsource(obj)) is not None
        return False
    return True


def _pointers(path: Path, text: str) -> list[tuple[str, bool]]:
    found = [(m[0], resolves(m[0])) for m in DOTTED.finditer(text)]
    found += [(m[0], (ROOT / m[0]).is_file()) for m in FILE.finditer(text)]
    found += [(m[1], (ROOT / PKG / m[1]).is_file()) for m in LAYER_FILE.finditer(text)]
    if path.suffix == ".py":
        for m in ROLE.finditer(text):
            target = m[1]
            if target.startswith(".") and target[1:].split(".")[0] in TOP:
                found.append((target, resolves(PKG + target)))
    return found


def test_every_pointer_of_the_docs_and_docstrings_exists():
    missing = [f"{path.relative_to(ROOT)}: {what}" for path in DOCS + SOURCES if path.exists()
               for what, ok in _pointers(path, path.read_text(encoding="utf-8")) if not ok]
    assert not missing, "pointers to modules or names that do not exist:\n" + "\n".join(missing)


def test_a_pointer_to_a_moved_module_is_caught():
    """The check itself: the old home of the snapshot store, in each form it was written in, is reported."""
    text = ("see lightning_nanguard.recover.snapshots.SnapshotStore, lightning_nanguard/recover/snapshots.py, "
            "recover/snapshots.py and :class:`~.recover.snapshots.SnapshotStore`; "
            "lightning_nanguard.store.snapshots.SnapshotStore is where it is")
    assert _pointers(Path("x.py"), text) == [
        ("lightning_nanguard.recover.snapshots.SnapshotStore", False),
        ("lightning_nanguard.store.snapshots.SnapshotStore", True),
        ("lightning_nanguard/recover/snapshots.py", False), ("recover/snapshots.py", False),
        (".recover.snapshots.SnapshotStore", False)]

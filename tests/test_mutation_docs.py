"""docs/mutation.md's figures are rendered from the stored runs (scripts/gen_mutation_docs.py), never typed: the
page is what the script renders from benchmarks/results/mutation*.json, and every stored run is on the page. Cheap:
no mutant runs, no test is collected."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _gen():
    spec = importlib.util.spec_from_file_location("gen_mutation_docs", ROOT / "scripts" / "gen_mutation_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_mutation_page_is_what_the_stored_runs_render():
    gen = _gen()
    text = gen.DOCS.read_text(encoding="utf-8")
    assert text == gen.regenerate(text), "docs/mutation.md is out of date: python scripts/gen_mutation_docs.py"


def test_every_stored_run_is_on_the_page_with_its_provenance():
    gen = _gen()
    cited = [m["file"] for m in map(gen.BEGIN.match, gen.DOCS.read_text(encoding="utf-8").splitlines()) if m]
    stored = sorted(p.name for p in gen.RESULTS.glob("mutation*.json"))
    assert sorted(cited) == stored
    for name in stored:
        run = json.loads((gen.RESULTS / name).read_text(encoding="utf-8"))["run"]
        assert run["commit"] and run["date"], name  # what the page says the figure was measured on


def test_a_figure_says_what_its_run_found():
    """The render of a made-up run: the counts, the judged survivors and the provenance come from the file."""
    gen = _gen()
    results = [{"id": "a-one", "status": "killed", "seconds": 10.0},
               {"id": "a-two", "status": "killed", "seconds": 30.0},
               {"id": "doc-three", "status": "survived", "seconds": 50.0}]
    run = {"run": {"date": "2030-01-02 03:04 UTC", "commit": "abc1234", "tests": 1500, "jobs": 2},
           "kill_rate": 2 / 3, "killed": 2, "survived": 1, "survived_harmless": 1, "timeout": 0, "stale": 0,
           "wall_s": 600.0, "baseline_suite_s": 100.0, "per_area": {"ladder": {"killed": 2, "survived": 1}},
           "results": results}
    text = gen.render("x.json", run)
    assert text.startswith("**2 of 3 mutants killed (66.7%)**; the 1 survivor is judged harmless (equivalent, "
                           "below), so **2 of 2** otherwise; none by timeout, none stale")
    for part in ("run on 2030-01-02", "package at `abc1234`", "suite of 1,500 tests", "`--jobs 2`", "10.0 minutes",
                 "the unmutated suite 100 s", "a killed mutant 10-30 s, median 20 s", "ladder 2/3",
                 "The project's own 2 mutants: 2 killed; the `doc-*` audit's 1: 0 killed."):
        assert part in text, part

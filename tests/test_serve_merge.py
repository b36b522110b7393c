"""bench/serve/merge.py: several serving-benchmark runs as one results file. Inputs are two
committed H200 results that share scenarios (resident-base, resident-32): the 2026-12-02 check
run and the 2026-12-05 row-LoRA run."""
from __future__ import annotations

import importlib.util
import json
import pathlib

from bench.serve import merge as serve_merge

RESULTS = pathlib.Path(__file__).resolve().parent.parent / "bench" / "results"
OLD, NEW = RESULTS / "serve-h200-check.json", RESULTS / "serve-h200-rowlora.json"


def _docs() -> tuple[dict, dict]:
    return json.loads(OLD.read_text()), json.loads(NEW.read_text())


def _by_run(doc: dict) -> dict[tuple, dict]:
    return {(r["scenario"], r.get("cold_tier"), r["run"]): r for r in doc["rows"]}


def test_without_supersede_every_runs_rows_are_kept_and_say_their_run():
    old, new = _docs()
    doc = serve_merge.merge([old, new])
    assert len(doc["rows"]) == len(old["rows"]) + len(new["rows"])
    assert [r["run"] for r in doc["rows"]] == [0] * len(old["rows"]) + [1] * len(new["rows"])
    assert doc["header"]["runs"] == [old["header"], new["header"]]
    assert "superseded" not in doc["header"]


def test_supersede_keeps_a_repeated_scenarios_latest_run_and_the_rest_of_the_first():
    old, new = _docs()
    doc = serve_merge.merge([old, new], supersede=True)
    rows = _by_run(doc)
    again = {r["scenario"] for r in new["rows"]}
    assert {"resident-base", "resident-32"} <= again
    for r in old["rows"]:
        kept = (r["scenario"], r.get("cold_tier"), 0) in rows
        assert kept == (r["scenario"] not in again), r["scenario"]
    for r in new["rows"]:                       # the later run's rows, figures untouched
        got = rows[(r["scenario"], r.get("cold_tier"), 1)]
        assert {k: got[k] for k in r} == r
    assert len(doc["rows"]) == len(new["rows"]) + sum(r["scenario"] not in again
                                                      for r in old["rows"])
    assert doc["header"]["commit"] == old["header"]["commit"]
    assert [h["commit"] for h in doc["header"]["runs"]] == [old["header"]["commit"],
                                                           new["header"]["commit"]]


def test_the_merged_markdown_lists_each_kept_row_under_its_own_run(tmp_path):
    old, new = _docs()
    assert serve_merge.main([str(OLD), str(NEW), "--supersede", "--out", str(tmp_path),
                             "--name", "merged"]) == 0
    doc = json.loads((tmp_path / "merged.json").read_text())
    md = (tmp_path / "merged.md").read_text()
    sections = md.split("\n## ")[1:]
    assert len(sections) == 2
    first, second = sections
    old_res = next(r for r in old["rows"] if r["scenario"] == "resident-32")
    new_res = next(r for r in new["rows"] if r["scenario"] == "resident-32")
    assert f"| {new_res['out_tok_s']:.0f} |" in second
    assert "| resident-32 |" not in first and f"| {old_res['out_tok_s']:.0f} |" not in md
    assert "| cold-store |" in first and "| cold-store |" not in second
    assert "keeps its latest run's rows" in md
    assert {r["run"] for r in doc["rows"]} == {0, 1}
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "merged-cdf.png").stat().st_size > 0

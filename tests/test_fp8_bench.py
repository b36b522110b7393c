"""bench.engine.fp8's merge of runs of one card (issue 46: the 7B and the 70B rows come from
separate device calls) and its refusal of runs of different cards."""
from __future__ import annotations

import json

import pytest

from bench.engine import fp8


def _doc(card: str, model: str, rows: list[tuple[str, int, float]]) -> dict:
    return {"header": {"card": card, "card_slug": "h200", "date": f"d-{model}", "commit": "c",
                       "models": [model], "notes": [f"{model} note"], "prompt": 128, "new": 128,
                       "copy_tb_s": 4.0},
            "rows": [{"model": model, "dtype": d, "batch": 64, "distinct": n,
                      "decode_step_ms": ms, "bytes_floor_ms": 1.0, "ratio": ms,
                      "weight_gb": 1.0, "compiles_after_warmup": 0} for d, n, ms in rows],
            "served": []}


def test_merge_keeps_every_run_and_compares_within_a_model(tmp_path):
    a = tmp_path / "a.json"
    b = tmp_path / "b.json"
    a.write_text(json.dumps(_doc("H200", "llama-7b", [("bf16", 32, 8.0), ("fp8", 32, 6.0)])))
    b.write_text(json.dumps(_doc("H200", "llama-70b", [("fp8", 32, 30.0)])))
    doc = fp8.merge([str(a), str(b)])
    assert [r["model"] for r in doc["rows"]] == ["llama-7b", "llama-7b", "llama-70b"]
    assert doc["header"]["models"] == ["llama-7b", "llama-70b"]
    assert [r["date"] for r in doc["header"]["runs"]] == ["d-llama-7b", "d-llama-70b"]
    vs = {(r["model"], r["dtype"]): r["vs_bf16"] for r in doc["rows"]}
    assert vs[("llama-7b", "fp8")] == pytest.approx(0.75)
    assert vs[("llama-70b", "fp8")] is None          # no bf16 row of the 70B to compare with
    stem = fp8.write(tmp_path / "out", doc)
    md = stem.with_suffix(".md").read_text()
    assert "| llama-70b | fp8 | 32 |" in md and "llama-70b note" in md


def test_merge_refuses_runs_of_different_cards(tmp_path):
    a = tmp_path / "a.json"
    b = tmp_path / "b.json"
    a.write_text(json.dumps(_doc("H200", "llama-7b", [("bf16", 32, 8.0)])))
    b.write_text(json.dumps(_doc("H100", "llama-70b", [("fp8", 32, 30.0)])))
    with pytest.raises(SystemExit, match="different cards"):
        fp8.merge([str(a), str(b)])

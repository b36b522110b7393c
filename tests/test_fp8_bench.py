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


def _saturation(path, quant: str | None, tok_s: dict[str, float], kv: str | None = None) -> str:
    """A saturation result's header and closed rows as bench.serve's suite writes them."""
    argv = ["--suite", "saturation", "--worker-flag=--precompile-procs=8"]
    if quant:
        argv.append(f"--worker-flag=--quantization={quant}")
    if kv:
        argv.append(f"--worker-flag=--kv-cache-dtype={kv}")
    rows = [{"scenario": name, "mode": "closed", "streams": 64, "out_tok_s": v,
             "ttft_p50_ms": 150.0, "itl_p50_ms": 8.0} for name, v in tok_s.items()]
    rows.append({"scenario": "base-goodput", "mode": "goodput", "streams": None,
                 "out_tok_s": 1.0, "ttft_p50_ms": 1.0, "itl_p50_ms": 1.0})
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"header": {"argv": argv}, "rows": rows}))
    return str(path)


def test_served_rows_put_each_fp8_stack_beside_the_bf16_one(tmp_path):
    """--served: two stacks' saturation results (same file name in two folders); each row
    knows its worker's --quantization, and the markdown sets FP8's closed loops against the
    bf16 stack's row of the same scenario."""
    files = [_saturation(tmp_path / "auto" / "saturation-h100.json", None,
                         {"base-closed64": 7000.0, "resident-32-closed64": 6000.0}),
             _saturation(tmp_path / "fp8" / "saturation-h100.json", "fp8",
                         {"base-closed64": 9100.0, "resident-32-closed64": 8100.0}),
             _saturation(tmp_path / "fp8-kv8" / "saturation-h100.json", "fp8",
                         {"resident-32-closed64": 9000.0}, kv="fp8")]
    served = fp8.served_rows(files)
    assert {(r["source"], r["quantization"], r["kv_cache_dtype"]) for r in served} == {
        ("auto/saturation-h100.json", "auto", "auto"),
        ("fp8/saturation-h100.json", "fp8", "auto"),
        ("fp8-kv8/saturation-h100.json", "fp8", "fp8")}
    doc = _doc("H100", "llama-7b", [("bf16", 32, 8.0), ("fp8", 32, 6.0)])
    doc["served"] = served
    md = fp8.write(tmp_path / "out", doc).with_suffix(".md").read_text()
    assert "| fp8 | resident-32-closed64 | 64 | 8100 | 150.0 | 8.00 | 1.35x |" in md
    assert "| fp8 | base-closed64 | 64 | 9100 | 150.0 | 8.00 | 1.30x |" in md
    assert "| auto | base-closed64 | 64 | 7000 | 150.0 | 8.00 | - |" in md
    assert "| fp8+kv8 | resident-32-closed64 | 64 | 9000 | 150.0 | 8.00 | 1.50x |" in md
    assert "base-goodput" not in md

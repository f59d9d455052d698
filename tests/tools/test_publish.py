"""``syncasync-bench report``: docs regenerated from results files. The committed docs must match their results
(a stale table fails here), and the generator itself is checked on made-up records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_syncasync.bench.__main__ import main as bench_main
from lightning_syncasync.bench.publish import headline_block, headline_rows, render

ROOT = Path(__file__).resolve().parents[2]


def _rec(strategy: str, repeat: int, tt: float | None, final: float, eff: float, scenario: str = "straggler_long"):
    return {"scenario": scenario, "strategy": strategy, "repeat": repeat, "time_to_target_s": tt,
            "final_val_metric": final, "efficiency": eff, "samples_per_s": 100 * eff, "val_metric_name": "val_acc",
            "command": f"syncasync-bench --scenario {scenario}"}  # fmt: skip


def test_the_committed_docs_match_their_results_files(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    code = bench_main(["report", "--from", "docs/results", "--to", "docs/benchmarks.md", "--to", "README.md",
                       "--check"])  # fmt: skip
    assert code == 0, capsys.readouterr().out  # HINT: syncasync-bench report --from docs/results --to ... regenerates


def test_headline_picks_the_soonest_contender_that_reached_in_most_repeats():
    records = [_rec("ddp", r, 40.0 + r, 0.971, 0.67) for r in range(3)]
    records += [_rec("async_ssp", r, 30.0 + r, 0.969, 0.95) for r in range(3)]
    # Sooner, but reached the target in one repeat of three: not a winner.
    records += [_rec("lucky", 0, 10.0, 0.97, 0.8)] + [_rec("lucky", r, None, 0.95, 0.8) for r in (1, 2)]
    (row,) = headline_rows({"a.json": records})
    assert row["best"] == "async_ssp" and row["speedup"] == pytest.approx(41.0 / 31.0)
    assert row["gap_points"] == pytest.approx(-0.2) and row["file"] == "a.json"
    assert (row["reached"], row["repeats"]) == (3, 3)
    # A winner that missed the target in one repeat says so beside its speed-up.
    records[3]["time_to_target_s"] = None
    assert "| 2/3 |" in headline_block({"a.json": records})
    # A --quick run ranks nothing, however soon it got there.
    quick = [{**_rec(s, 0, 1.0, 0.97, 0.9, scenario="homogeneous_long"), "quick": True} for s in ("ddp", "fast")]
    assert [r["scenario"] for r in headline_rows({"a.json": records, "b.json": quick})] == ["straggler_long"]


def test_a_rerun_in_a_later_file_replaces_the_rows_and_the_table_follows(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    (results / "a.json").write_text(
        json.dumps([_rec("ddp", 0, 40.0, 0.97, 0.6), _rec("hier_sync", 0, 30.0, 0.97, 0.8)])
    )
    doc = tmp_path / "doc.md"
    doc.write_text(
        "intro\n<!-- bench:table a.json -->\nold\n<!-- bench:end -->\n<!-- bench:headline -->\n<!-- bench:end -->\n"
    )
    assert bench_main(["report", "--from", str(results), "--to", str(doc), "--check"]) == 1  # stale
    assert bench_main(["report", "--from", str(results), "--to", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith("intro\n") and "| hier_sync | 80.0 " in text and "1.33x sooner" in text
    assert bench_main(["report", "--from", str(results), "--to", str(doc), "--check"]) == 0
    # hier_sync re-run alone into a later results folder: its rows follow, but it no longer ranks against a ddp
    # measured in another invocation (a ratio is of runs side by side).
    (results / "b").mkdir()
    (results / "b" / "results.json").write_text(json.dumps([_rec("hier_sync", 0, 35.0, 0.97, 0.5)]))
    assert bench_main(["report", "--from", str(results), "--to", str(doc)]) == 0
    assert "`hier_sync` | 1.14x sooner" not in doc.read_text() and "| hier_sync | 50.0 " not in doc.read_text()
    # Re-run beside ddp, it ranks again.
    (results / "b" / "results.json").write_text(
        json.dumps([_rec("ddp", 0, 42.0, 0.97, 0.6), _rec("hier_sync", 0, 35.0, 0.97, 0.5)])
    )
    assert bench_main(["report", "--from", str(results), "--to", str(doc)]) == 0
    assert "`hier_sync` | 1.20x sooner" in doc.read_text()


def test_a_marker_naming_a_missing_results_file_is_refused(tmp_path):
    with pytest.raises(ValueError, match="HINT"):
        render("<!-- bench:table nope.json -->\n<!-- bench:end -->\n", {})


def test_flat_rows_render_as_a_table(tmp_path):
    (tmp_path / "rows.json").write_text(json.dumps([{"method": "int8", "ratio": 0.25412}, {"method": "sign"}]))
    out = render("<!-- bench:rows rows.json -->\n<!-- bench:end -->", {}, tmp_path, tmp_path)
    assert "| method | ratio |" in out and "| int8 | 0.2541 |" in out and "| sign | n/a |" in out

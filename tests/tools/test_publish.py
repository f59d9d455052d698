"""``syncasync-bench report``: docs regenerated from results files. The committed docs must match their results
(a stale table fails here), and the generator itself is checked on made-up records."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from lightning_syncasync.bench.__main__ import main as bench_main
from lightning_syncasync.bench.headline import COMPACT_CELL_CHARS, headline_block, headline_rows
from lightning_syncasync.bench.publish import load_results, render

ROOT = Path(__file__).resolve().parents[2]


CURVE = [0.90, 0.94, 0.955, 0.962, 0.966, 0.968, 0.969, 0.970, 0.970, 0.971]  # ddp reaches 0.965 at 50%


def _rec(strategy: str, seed: int, seconds_per_epoch: float, eff: float, curve: list[float] = CURVE,
         scenario: str = "straggler_long", command: str = "cmd") -> dict:  # fmt: skip
    """A run validated at every epoch end (10 epochs), ``curve`` its validation accuracies."""
    history = [{"elapsed_s": (i + 1) * seconds_per_epoch, "train_s": (i + 1) * seconds_per_epoch,
                "step": 25 * (i + 1), "value": v} for i, v in enumerate(curve)]  # fmt: skip
    return {"scenario": scenario, "strategy": strategy, "repeat": seed, "train_seed": seed, "steps": 250,
            "val_history": history, "final_val_metric": curve[-1], "efficiency": eff, "samples_per_s": 100 * eff,
            "time_to_target_s": None, "val_metric_name": "val_acc", "config": {"trainer": {}},
            "command": f"syncasync-bench --scenario {scenario} {command}"}  # fmt: skip


def test_the_committed_docs_match_their_results_files(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    code = bench_main(["report", "--from", "docs/results", "--to", "docs/benchmarks.md", "--to",
                       "docs/benchmarks_archive.md", "--to", "docs/strategies.md", "--to", "README.md",
                       "--check"])  # fmt: skip
    assert code == 0, capsys.readouterr().out  # HINT: syncasync-bench report --from docs/results --to ... regenerates


def test_headline_names_a_winner_only_where_its_interval_excludes_one():
    records = [_rec("ddp", s, 4.0 + 0.1 * s, 0.67) for s in range(5)]
    records += [_rec("async_ssp", s, 2.0 + 0.1 * s, 0.95) for s in range(5)]
    # Sooner on two seeds, but it levels off below the target on three: censored at its budget, not a winner.
    plateau = [0.9, 0.94, 0.955, 0.96, 0.96, 0.96, 0.96, 0.96, 0.96, 0.96]
    records += [_rec("lucky", s, 1.5, 0.8, CURVE if s < 2 else plateau) for s in range(5)]
    (row,) = headline_rows({"a.json": records})
    assert row["best"] == "async_ssp" and row["speedup"] == pytest.approx(4.2 / 2.2)
    assert row["ranking"].target == pytest.approx(0.965) and (row["reached"], row["repeats"]) == (5, 5)
    # lucky's two early seeds make its interval reach below 1: first by the median, but not a winner over it.
    assert [s.strategy for s in row["ranking"].standings] == ["async_ssp", "lucky", "ddp"]
    assert row["ranking"].verdict == "tie" and "tie: `async_ssp` and `lucky`" in headline_block({"a.json": records})
    # Without it, async_ssp's 1.9x over every seed of ddp is a winner.
    clear = [r for r in records if r["strategy"] != "lucky"]
    block = headline_block({"a.json": clear})
    assert "| `straggler_long` | 0.965 | `async_ssp` | 1.91x [" in block and "`async_ssp` wins" in block
    assert headline_rows({"a.json": clear})[0]["file"] == "a.json"
    # Seeds that overlap make it a tie, naming both.
    slow = [_rec("ddp", s, t, 0.67) for s, t in enumerate([4.0, 2.5, 3.0, 2.2, 3.8])]
    close = [_rec("async_ssp", s, t, 0.95) for s, t in enumerate([2.4, 3.9, 2.3, 3.6, 2.8])]
    assert "tie: `async_ssp` and `ddp`" in headline_block({"a.json": slow + close})
    # Three seeds rank nothing; a --quick run ranks nothing, however soon it got there.
    assert "not ranked: 3 seeds" in headline_block({"a.json": [r for r in records if r["train_seed"] < 3]})
    quick = [{**_rec(s, 0, 0.1, 0.9, scenario="homogeneous_long"), "quick": True} for s in ("ddp", "fast")]
    assert [r["scenario"] for r in headline_rows({"a.json": records, "b.json": quick})] == ["straggler_long"]
    # A later file of ddp against itself in another order (the noise floor) does not replace the ranked one.
    floor = [_rec(s, seed, 4.0, 0.67, command="floor") for s in ("ddp", "ddp_other_order") for seed in range(5)]
    assert headline_rows({"a.json": clear, "z.json": floor})[0]["file"] == "a.json"


def _table(text: str) -> list[list[str]]:
    """The cells of a Markdown table's rows (header, then body; the separator row left out)."""
    rows = [line.strip().strip("|").split("|") for line in text.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in row] for row in rows if not set("".join(row)) <= set("-: ")]


def test_the_compact_headline_fits_a_readme_and_links_each_scenario_to_its_section():
    from test_readme import _anchors

    text = render("<!-- bench:headline compact -->\n<!-- bench:end -->\n", load_results(ROOT / "docs" / "results"),
                  ROOT / "docs" / "results", ROOT / "scripts", target=ROOT / "README.md")  # fmt: skip
    header, *rows = _table(text)
    assert header[0] == "scenario" and len(header) <= 5 and len(rows) >= 10
    assert all(len(row) == len(header) for row in rows)
    long = [cell for row in rows for cell in row if len(cell) > COMPACT_CELL_CHARS]
    assert not long, long
    for row in rows:
        (link,) = re.findall(r"\]\(([^)]+)\)", row[-1])
        page, _, anchor = link.partition("#")
        assert page == "docs/benchmarks.md" and anchor in _anchors(ROOT / page), row
        assert re.fullmatch(r"\d+\.\dx( \(vs `\w+`\))?", row[3]), row
    # What the cluster suffers from is the scenario section's own heading where it names that scenario alone.
    jitter = next(row for row in rows if row[0] == "`jitter_long`")
    assert jitter[1] == "Transient pauses" and jitter[-1].endswith("(docs/benchmarks.md#transient-pauses-jitter_long)")


def test_a_compact_or_one_scenario_headline_is_rendered_from_the_same_rows(tmp_path):
    results = tmp_path / "docs" / "results"
    results.mkdir(parents=True)
    records = [_rec("ddp", s, 4.0 + 0.1 * s, 0.67) for s in range(5)]
    records += [_rec("async_ssp", s, 2.0 + 0.1 * s, 0.95) for s in range(5)]
    records += [_rec("ddp", s, 4.0, 0.6, scenario="changing_conditions") for s in range(5)]
    records += [
        _rec("hier_sync", s, t, 0.8, scenario="changing_conditions") for s, t in enumerate([3, 4.5, 3.2, 4.6, 3.4])
    ]
    (results / "a.json").write_text(json.dumps(records))
    (tmp_path / "docs" / "benchmarks.md").write_text(
        "# Benchmarks\n\n## Headline\n\n## A slow rank: `straggler_long`\n\n### `straggler_long` again\n"
    )
    readme = tmp_path / "README.md"
    readme.write_text("<!-- bench:headline compact -->\n<!-- bench:end -->\n")
    section = tmp_path / "docs" / "section.md"
    section.write_text("<!-- bench:headline straggler_long -->\n<!-- bench:end -->\n"
                       "<!-- bench:headline scale_out -->\n<!-- bench:end -->\n")  # fmt: skip
    assert bench_main(["report", "--from", str(results), "--to", str(readme), "--to", str(section)]) == 0
    header, *rows = _table(readme.read_text())
    assert header == ["scenario", "what the cluster suffers from", "best strategy", "how much sooner than DDP",
                      "evidence"]  # fmt: skip
    by = {row[0]: row for row in rows}
    assert by["`straggler_long`"] == ["`straggler_long`", "A slow rank", "`async_ssp`", "1.9x",
                                      "[5 seeds](docs/benchmarks.md#a-slow-rank-straggler_long)"]  # fmt: skip
    # No section names it: the scenario's description, cut at a word to fit the cell; the link to the page.
    cc = by["`changing_conditions`"]
    assert cc[1].endswith("…") and len(cc[1]) <= COMPACT_CELL_CHARS and cc[1].startswith("2 nodes x 2 ranks")
    assert cc[2] == "`hier_sync`, tied with `ddp`" and cc[-1] == "[5 seeds](docs/benchmarks.md)"
    # One scenario's rows: the full headline's columns, that scenario only; one never measured says so.
    text = section.read_text()
    assert "| `straggler_long` | 0.965 | `async_ssp` | 1.91x [" in text and "changing_conditions" not in text
    assert "No verdict for `scale_out`" in text


def test_a_rerun_in_a_later_file_replaces_the_rows_and_the_table_follows(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    first = [_rec("ddp", s, 4.0, 0.6) for s in range(5)] + [_rec("hier_sync", s, 3.0, 0.8) for s in range(5)]
    (results / "a.json").write_text(json.dumps(first))
    doc = tmp_path / "doc.md"
    doc.write_text(
        "intro\n<!-- bench:table a.json -->\nold\n<!-- bench:end -->\n<!-- bench:headline -->\n<!-- bench:end -->\n"
    )
    assert bench_main(["report", "--from", str(results), "--to", str(doc), "--check"]) == 1  # stale
    assert bench_main(["report", "--from", str(results), "--to", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith("intro\n") and "| hier_sync | 80.0 " in text and "`hier_sync` | 1.33x [1.33-1.33]" in text
    assert "| hier_sync | 15.0 | 5/5 | 1.33x [1.33-1.33] |" in text  # the table's ranking, under the scenario
    assert bench_main(["report", "--from", str(results), "--to", str(doc), "--check"]) == 0
    # hier_sync re-run alone into a later results folder: its rows follow, but it no longer ranks against a ddp
    # measured in another invocation (a ratio is of runs side by side).
    (results / "b").mkdir()
    (results / "b" / "results.json").write_text(json.dumps([_rec("hier_sync", s, 3.5, 0.5, command="b")
                                                            for s in range(5)]))  # fmt: skip
    assert bench_main(["report", "--from", str(results), "--to", str(doc)]) == 0
    assert "`hier_sync` | 1.14x" not in doc.read_text() and "| hier_sync | 50.0 " not in doc.read_text()
    # Re-run beside ddp, it ranks again.
    (results / "b" / "results.json").write_text(
        json.dumps([_rec("ddp", s, 4.2, 0.6, command="b") for s in range(5)]
                   + [_rec("hier_sync", s, 3.5, 0.5, command="b") for s in range(5)])
    )  # fmt: skip
    assert bench_main(["report", "--from", str(results), "--to", str(doc)]) == 0
    assert "`hier_sync` | 1.20x [1.20-1.20]" in doc.read_text()


def test_the_advisor_is_scored_against_the_measured_ranking(tmp_path):
    from lightning_syncasync.bench.publish import advice_block, score_advice

    records = [_rec("ddp", s, 4.0 + 0.1 * s, 0.67) for s in range(5)]
    records += [_rec("async_ssp", s, 2.0 + 0.1 * s, 0.95) for s in range(5)]
    records += [_rec("hier_sync", s, t, 0.9) for s, t in enumerate([1.8, 2.4, 1.9, 2.6, 2.1])]
    results = {"a.json": records}
    first = score_advice({"scenario": "straggler_long", "pick": "async_ssp"}, results)
    assert first["score"] == "tied" and first["vs_first"] is not None  # behind hier_sync, within the interval
    assert score_advice({"scenario": "straggler_long", "pick": "hier_sync"}, results)["score"] == "best"
    wrong = score_advice({"scenario": "straggler_long", "pick": "ddp"}, results)
    assert wrong["score"] == "wrong" and wrong["vs_first"].low > 1.0
    assert "not measured" in score_advice({"scenario": "straggler_long", "pick": "ddp_int8"}, results)["score"]
    assert score_advice({"scenario": "jitter_long", "pick": "ddp"}, results)["score"].startswith("no measurement")
    few = {"a.json": [r for r in records if r["train_seed"] < 3]}
    assert score_advice({"scenario": "straggler_long", "pick": "ddp"}, few)["score"].startswith("not ranked")
    path = tmp_path / "advice.json"
    path.write_text(json.dumps({"advice": [
        {"scenario": "straggler_long", "pick": "ddp", "runner_up": "async_ssp", "margin": 1.02, "model_error": 0.15,
         "tie_with": "async_ssp"}]}))  # fmt: skip
    block = advice_block(path, results)
    assert "| `straggler_long` | `ddp` | 1.02x over `async_ssp`; +-15%; says tie with `async_ssp` |" in block
    assert "in 0 of the 1 scenarios that could be scored" in block
    with pytest.raises(ValueError, match="HINT"):
        advice_block(tmp_path / "nope.json", results)


def test_an_adaptive_contender_is_set_against_the_best_fixed_contender_of_its_own_file():
    from lightning_syncasync.bench.publish import against_block

    records = [_rec("ddp", s, 4.0 + 0.1 * s, 0.67) for s in range(5)]
    records += [_rec("hier_sync", s, 2.0, 0.9) for s in range(5)]
    # auto_sync_async is sooner than every fixed contender but never "the best fixed" one itself.
    records += [_rec("auto_sync_async", s, 1.0, 0.9) for s in range(5)]
    records += [_rec("auto_sync", s, t, 0.9) for s, t in enumerate([2.1, 2.5, 2.2, 2.6, 2.2])]
    block = against_block("a.json:auto_sync,a.json:auto_sync_async", {"a.json": records})
    # hier_sync reaches 0.965 at epoch 5 (10 s) on every seed; auto_sync at 10.5/12.5/11/13/11 s:
    # behind on every seed, by under 10% on some.
    auto = next(line for line in block.splitlines() if "| `auto_sync` |" in line)
    assert "| `hier_sync` | 10.0 | 11.0 | 0.91x [" in auto and "| 5/5 | no / yes | `a.json` |" in auto
    fast = next(line for line in block.splitlines() if "| `auto_sync_async` |" in line)
    assert "| `hier_sync` | 10.0 | 5.0 | 2.00x [2.00-2.00] | 5/5 | yes / yes |" in fast
    few = {"a.json": [r for r in records if r["train_seed"] < 3]}
    assert "not ranked: 3 seeds" in against_block("a.json:auto_sync", few)
    for bad in ("a.json", "b.json:auto_sync", "a.json:async_ssp"):
        with pytest.raises(ValueError, match="HINT"):
            against_block(bad, {"a.json": records})


def test_a_self_tuned_contender_is_set_against_every_fixed_setting_of_its_sweep():
    from lightning_syncasync.bench.publish import sweep_block

    records = [_rec("ddp", s, 4.0 + 0.1 * s, 0.67) for s in range(5)]
    records += [_rec("async_ssp_k4", s, 2.0, 0.9) for s in range(5)]  # 0.965 at epoch 5: 10 s
    records += [_rec("async_ssp_k16", s, 3.0, 0.9) for s in range(5)]  # 15 s
    records += [_rec("async_ssp", s, t, 0.9) for s, t in enumerate([2.1, 2.1, 2.2, 2.0, 2.1])]  # 10.5 s median
    block = sweep_block(["a.json", "async_ssp:async_ssp_k"], {"a.json": records})
    head, _, row = block.splitlines()
    assert "| 4 steps | 16 steps | `async_ssp` (self-tuned) |" in head  # fixed settings in numeric order
    assert "| 10.0 (5/5) | 15.0 (5/5) | 10.5 (5/5) | 4 steps | 0.95x [" in row and "| yes |" in row
    assert row.endswith("| `a.json` |")
    slow = [r for r in records if r["strategy"] != "async_ssp"] + [_rec("async_ssp", s, 3.0, 0.9) for s in range(5)]
    assert "| no |" in sweep_block(["a.json", "async_ssp:async_ssp_k"], {"a.json": slow}).splitlines()[2]
    for bad in (["a.json"], ["b.json", "async_ssp:async_ssp_k"], ["a.json", "hier_sync:hier_sync_p"]):
        with pytest.raises(ValueError, match="HINT"):
            sweep_block(bad, {"a.json": records})


def test_a_marker_naming_a_missing_results_file_is_refused(tmp_path):
    with pytest.raises(ValueError, match="HINT"):
        render("<!-- bench:table nope.json -->\n<!-- bench:end -->\n", {})


def test_flat_rows_render_as_a_table(tmp_path):
    (tmp_path / "rows.json").write_text(json.dumps([{"method": "int8", "ratio": 0.25412}, {"method": "sign"}]))
    out = render("<!-- bench:rows rows.json -->\n<!-- bench:end -->", {}, tmp_path, tmp_path)
    assert "| method | ratio |" in out and "| int8 | 0.2541 |" in out and "| sign | n/a |" in out


def _learning_rec(strategy: str, seed: int, hits: list[float], final: float, tt: float | None, sps: float):
    """A long-scenario record (validation at epoch ends, 4 epochs of 100 steps x 4 ranks x batch 10)."""
    return {
        "scenario": "straggler_long", "strategy": strategy, "repeat": seed, "train_seed": seed, "command": "cmd",
        "target": 0.97, "steps": 400, "final_val_metric": final, "time_to_target_s": tt, "samples_per_s": sps,
        "val_history": [{"step": 100 * (i + 1), "value": v} for i, v in enumerate(hits)],
        "config": {"trainer": {"devices": 4, "num_nodes": 1, "val_check_interval": None},
                   "data": {"batch_size": 10}},
    }  # fmt: skip


def test_learning_per_sample_is_matched_seed_by_seed_against_ddp():
    from lightning_syncasync.bench.tables import learning_table, samples_to_target, summarise

    ddp0 = _learning_rec("ddp", 0, [0.9, 0.97, 0.97, 0.98], 0.98, 10.0, 100.0)  # target at epoch 2 of 4
    assert samples_to_target(ddp0) == 2 / 4 * 400 * 4 * 10
    records = [
        ddp0,
        _learning_rec("ddp", 1, [0.97, 0.97, 0.97, 0.97], 0.97, 5.0, 100.0),  # epoch 1
        _learning_rec("async_ssp", 0, [0.9, 0.9, 0.97, 0.97], 0.975, 10.0, 200.0),  # epoch 3: 1.5x the samples
        _learning_rec("async_ssp", 1, [0.9, 0.9, 0.9, 0.96], 0.96, None, 200.0),  # never: the budget, 4x
    ]
    lines = learning_table(summarise(records)["straggler_long"])
    row = next(line for line in lines if line.startswith("| async_ssp"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    # median of 1.5 and 4.0; 1 seed of 2 reached; final -0.5 and -1.0 points; speed-up 1.0 over throughput 2.0
    assert cells[1:] == [
        "2.75x [1.50-4.00]; geometric mean 2.45x [1.50-4.00]",
        "1/2",
        "-0.8 [-1.0--0.5]",
        "0.50 (1 seeds)",
    ]
    # A step-based validation counts the step's global batch; a run of another invocation is not matched.
    lm = {**ddp0, "config": {"trainer": {"devices": 2, "num_nodes": 2, "val_check_interval": 5},
                             "data": {"batch_size": 16}}}  # fmt: skip
    assert samples_to_target(lm) == 200 * 4 * 16
    other = {**records[2], "command": "another"}
    assert learning_table(summarise([ddp0, other])["straggler_long"]) == []


def test_which_strategy_rows_take_their_figure_from_the_files_ranking(tmp_path):
    """The README's "Which strategy?" (issue 67): one figure per row, the contender's entry of its file's ranking (the
    same ratio the scenario's tables show), a link to the scenario's section; a bad row is refused."""
    results = {"s.json": [_rec(s, seed, t, 0.5) for seed in range(5)
                          for s, t in (("ddp", 1.0), ("async_ssp", 0.5), ("hier_sync", 0.8))]}  # fmt: skip
    page = "# B\n\n## A persistent straggler: `straggler_long`\n"
    (tmp_path / "results").mkdir()
    (tmp_path / "benchmarks.md").write_text(page)
    (tmp_path / "results" / "s.json").write_text(json.dumps(results["s.json"]))
    marker = ("<!-- bench:which\none slow rank ; `async_ssp` ; s.json:async_ssp\nslow link ; `hier_sync` ; "
              "s.json:hier_sync\n-->\n<!-- bench:end -->\n")  # fmt: skip
    text = render(marker, results, tmp_path / "results", ROOT / "scripts", target=tmp_path / "README.md")
    header, *rows = _table(text)
    assert len(header) == 4 and [r[0] for r in rows] == ["one slow rank", "slow link"]
    assert rows[0][2] == "2.00x (5 seeds; first, by the interval)", rows[0]
    assert rows[1][2] == "1.25x (5 seeds; behind `async_ssp`)", rows[1]
    assert rows[0][3] == "[`straggler_long`](benchmarks.md#a-persistent-straggler-straggler_long)"
    for bad, match in (("one slow rank ; `async_ssp`", "situation ; use ; FILE:CONTENDER"),
                       ("x ; y ; s.json:ddp_nope", "holds it in 0 scenarios"),
                       ("x ; y ; nope.json:ddp", "not a results file"),
                       ("x" * 201 + " ; y ; s.json:async_ssp", "over 200 characters")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            render(f"<!-- bench:which\n{bad}\n-->\n<!-- bench:end -->\n", results, tmp_path / "results")

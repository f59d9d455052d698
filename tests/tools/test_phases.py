"""The changing-conditions scenario's phases, from hand-made timelines: throughput per phase, the series the plot
draws (mode bands included) and the table that ranks the contenders in each phase."""

from __future__ import annotations

import pytest

from lightning_syncasync.bench.phases import boundaries, changing, phase_series, phase_table, plot_phases
from lightning_syncasync.bench.scenarios import lookup


def _timeline(rates: list[float], steps: int = 30, samples: int = 40) -> list[dict]:
    """One line per step; the steps of phase i take samples / rates[i] seconds."""
    lines, t, total = [{"t": 100.0, "event": "start", "step": 0}], 100.0, 0
    for step in range(1, steps + 1):
        t += samples / rates[min(3 * (step - 1) // steps, len(rates) - 1)]
        total += samples
        lines.append({"t": t, "step": step, "samples": total, "participants": 2})
        if step % 10 == 0:
            lines.append({"t": t, "step": step, "val": {"val_acc": step / 30}})
    return lines


def test_the_scenario_changes_at_a_third_and_two_thirds_and_the_others_do_not():
    sc = lookup("changing_conditions")
    assert sc is not None and boundaries(sc) == [0.333, 0.667] and changing(sc)
    assert not changing(lookup("jitter_slow_link")) and changing(lookup("mid_run_straggler_long"))


def test_throughput_per_phase_modes_and_phase_starts_come_from_the_timeline():
    events = [{"kind": "switch", "step": 12, "next": "hier"}, {"kind": "rebalance", "step": 15},
              {"kind": "switch", "step": 22, "next": "async"}]  # fmt: skip
    ser = phase_series(_timeline([400.0, 100.0, 200.0]), events, 30, [0.333, 0.667], "val_acc")
    fast, slow, mid = ser["phase_samples_per_s"]
    assert fast == pytest.approx(400.0) and slow == pytest.approx(100.0) and mid == pytest.approx(200.0)
    assert [m for _, m in ser["modes"]] == ["sync", "hier", "async"]
    assert ser["modes"][1][0] == pytest.approx(9 * 0.1 + 2 * 0.4, abs=0.01)  # step 12, from step 1
    assert len(ser["phase_starts"]) == 2 and ser["val"][-1] == (pytest.approx(ser["end_s"]), 1.0)
    assert phase_series([{"t": 1.0, "event": "start", "step": 0}], [], 30, [0.5], "val_acc")["error"]


def test_the_table_ranks_each_phase_and_the_plot_draws_the_bands(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sc = lookup("changing_conditions")

    def run(rates, events=()):
        return {"series": phase_series(_timeline(rates), list(events), 30, boundaries(sc), "val_acc"),
                "events": list(events), "target": 0.9, "val_metric_name": "val_acc"}  # fmt: skip

    switches = [{"kind": "switch", "step": 11, "next": "hier"}, {"kind": "switch", "step": 21, "next": "async"}]
    by = {"ddp": {"runs": [run([400.0, 50.0, 150.0])]}, "hier_sync": {"runs": [run([380.0, 300.0, 150.0])]},
          "auto_sync": {"runs": [run([400.0, 290.0, 250.0], switches)]}}  # fmt: skip
    lines = phase_table(sc, by)
    assert "| ddp | 400 (#1) | 50 (#3) | 150 (#2) |" in lines
    assert "| hier_sync | 380 (#3) | 300 (#1) | 150 (#2) |" in lines
    assert "`auto_sync`: switches per run [2], rollbacks per run [0]." in lines
    path = plot_phases(tmp_path, "changing_conditions", by, plt)
    assert path is not None and path.stat().st_size > 10_000

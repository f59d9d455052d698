"""``results.json``, ``report.md`` and the two plots of a benchmark folder.

Records accumulate in ``results.json`` across invocations (a new run of a (scenario, strategy) replaces the old
one), so running the scenarios one by one into the same folder builds one report over all of them.

The tables it shares with the generated docs are :mod:`~lightning_syncasync.bench.tables`; the node-fault scenarios'
part is ``bench/_elastic_report.py``, the brief's questions answered ``bench/_answers.py``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from lightning_syncasync._cores import usable_cores
from lightning_syncasync.bench._answers import answers, rebalance_events, rebalance_lags, rebalancing_run
from lightning_syncasync.bench._elastic_report import elastic_answers, elastic_table, plot_elastic
from lightning_syncasync.bench._format import save_figure
from lightning_syncasync.bench.phases import changing, phase_table, plot_phases
from lightning_syncasync.bench.scenarios import lookup
from lightning_syncasync.bench.tables import (
    learning_table,
    memory_table,
    ranking_lines,
    scenario_table,
    summarise,
    wire_table,
)


def merge_results(out_dir: Path, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    path = out_dir / "results.json"
    old = json.loads(path.read_text()) if path.exists() else []
    fresh = {(r["scenario"], r["strategy"]) for r in records}
    merged = [r for r in old if (r["scenario"], r["strategy"]) not in fresh] + records
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(merged, indent=1, default=str))
    os.replace(tmp, path)  # a crash mid-write never leaves a half-written results.json
    return merged


def merge_advice(out_dir: Path, advice: dict[str, Any]) -> Path:
    """``advice.json``: the advisor's pick per scenario (``{"advice": [...]}``, a dict so that the docs generator
    never reads it as bench records); a new run of a scenario replaces its old one."""
    path = out_dir / "advice.json"
    old = json.loads(path.read_text()).get("advice", []) if path.exists() else []
    merged = [a for a in old if a["scenario"] != advice["scenario"]] + [advice]
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"advice": merged}, indent=1, default=str))
    os.replace(tmp, path)
    return path


def write_report(out_dir: Path, records: list[dict[str, Any]], command: str) -> Path:
    table = summarise(records)
    commands = list(dict.fromkeys([r["command"] for r in records if r.get("command")] + [command]))
    lines = [
        "# syncasync-bench report",
        "",
        "Commands (results accumulate in this folder):",
        "",
        *[f"- `{c}`" for c in commands],
        "",
        f"Machine: {usable_cores():g} usable cores. Every figure below was measured in the runs listed in "
        "`results.json`; timings are medians over repeats with [min-max] when there is more than one. `efficiency` is "
        "the contender's samples/s over the *ideal*: the same ranks, CPU shares and stragglers with communication "
        "switched off (each rank trains alone), measured in the same invocation.",
        "",
    ]
    for name, by_strategy in table.items():
        sc = lookup(name)
        any_run = next(iter(by_strategy.values()))["runs"][0]
        quick = any_run.get("quick")
        lines += [f"## {name}{' (quick)' if quick else ''}", ""]
        if sc is not None:
            lines += [
                f"{sc.description}. Budget: {any_run.get('steps')} steps per rank. Target: "
                f"{sc.metric} {'>=' if sc.mode == 'max' else '<='} {any_run.get('target')}.",
                "",
            ]
            if sc.mirrors:
                lines += [f"Compute-to-communication ratio mirrors {sc.mirrors}.", ""]
            emu = any_run.get("emulation") or {}
            lines += [f"Emulation: CPU {emu.get('cpu_mode')} shares {emu.get('cores_per_rank')}, "
                      f"netns={emu.get('netns')}.", ""]  # fmt: skip
        lines += scenario_table(by_strategy)
        learning = learning_table(by_strategy) if sc is None or not sc.elastic else []
        if learning:
            lines += ["", "Learning per sample against `ddp`, seed by seed:", "", *learning]
        if (sc is None or not sc.elastic) and not quick:
            lines += ["", *ranking_lines(name, [r for s in by_strategy.values() for r in s["runs"]])]
        if sc is not None and sc.elastic:
            lines += ["", *elastic_table(by_strategy), "", f"![{name} against time](elastic_{name}.png)"]
        phases = phase_table(sc, by_strategy) if sc is not None and changing(sc) else []
        if phases:
            lines += ["", *phases, f"![{name} by phase](phases_{name}.png)"]
        lines += [""] + wire_table(by_strategy) + memory_table(by_strategy) + answers(name, by_strategy, table)
        if sc is not None and sc.elastic:
            lines += ["", *elastic_answers(name, table)]
        lines += [""]
    lines += ["![throughput](throughput.png)", "", "![accuracy vs time](accuracy_vs_time.png)", ""]
    if any(rebalance_events(r) for r in records):
        lines += ["![per-rank batch sizes](batch_split.png)", ""]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines))
    return path


def write_plots(out_dir: Path, records: list[dict[str, Any]]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = summarise(records)
    scenarios = list(table)
    strategies = list(dict.fromkeys(s for by in table.values() for s in by))
    fig, ax = plt.subplots(figsize=(max(6, 1.8 * len(scenarios) + 2), 4))
    width = 0.8 / max(len(strategies), 1)
    for i, strategy in enumerate(strategies):
        values = [100 * (table[sc].get(strategy, {}).get("efficiency") or 0) for sc in scenarios]
        xs = [j + i * width for j in range(len(scenarios))]
        ax.bar(xs, values, width=width, label=strategy)
    ax.axhline(100, color="black", lw=1, ls="--", label="no-communication limit")
    ax.set_xticks([j + width * (len(strategies) - 1) / 2 for j in range(len(scenarios))], scenarios)
    ax.set_ylabel("throughput, % of the measured limit")
    ax.set_title("Throughput by strategy and scenario")
    ax.legend(fontsize=8)
    throughput = save_figure(fig, plt, out_dir / "throughput.png")
    for sc_name in scenarios:
        found = lookup(sc_name)
        if found is not None and found.elastic:
            plot_elastic(out_dir, sc_name, table[sc_name], plt)
        if found is not None and changing(found):
            plot_phases(out_dir, sc_name, table[sc_name], plt)

    fig, axes = plt.subplots(1, len(scenarios), figsize=(5 * len(scenarios), 4), squeeze=False)
    for ax, sc in zip(axes[0], scenarios, strict=True):
        for strategy, s in table[sc].items():
            run = next((r for r in s["runs"] if r.get("val_history")), None)
            if run is None:
                continue
            pts = [(h["elapsed_s"], h["value"]) for h in run["val_history"] if h["value"] is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker=".", label=strategy)
        first = s["runs"][0]
        ax.axhline(first.get("target"), color="gray", ls=":", label="target")
        ax.set_title(sc)
        ax.set_xlabel("wall-clock seconds since fit start")
        ax.set_ylabel(first.get("val_metric_name") or "metric")
        ax.legend(fontsize=8)
    accuracy = save_figure(fig, plt, out_dir / "accuracy_vs_time.png")
    paths = [throughput, accuracy]
    split = _plot_batch_split(out_dir, table, plt)
    return paths + ([split] if split else [])


def _plot_batch_split(out_dir: Path, table: dict[str, Any], plt: Any) -> Path | None:
    """Per-rank batch sizes over training for the runs that rebalanced, with the scheduled slowdown changes."""
    panels = []
    for sc, by_strategy in table.items():
        for strategy, s in by_strategy.items():
            run = rebalancing_run(s)
            if run is not None:
                panels.append((sc, strategy, run))
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (sc, strategy, run) in zip(axes[0], panels, strict=True):
        events = rebalance_events(run)
        world = len(events[0]["sizes"])
        steps = [0] + [e["step"] for e in events] + [run.get("steps") or events[-1]["step"]]
        for rank in range(world):
            sizes = [events[0]["previous"][rank]] + [e["sizes"][rank] for e in events]
            ax.step(steps, sizes + sizes[-1:], where="post", label=f"rank {rank}")
        for lag in rebalance_lags(sc, run):
            ax.axvline(lag["change_step"], color="gray", ls=":")
        ax.set_title(f"{sc}: {strategy}")
        ax.set_xlabel("step")
        ax.set_ylabel("batch size")
        ax.legend(fontsize=8)
    return save_figure(fig, plt, out_dir / "batch_split.png")

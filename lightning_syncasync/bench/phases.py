"""Scenarios whose conditions change during a run (``changing_conditions``): what each contender did in each phase,
and the plot that shows it.

A phase is a window of the planned steps in which the emulated conditions hold still (the link rate of
``link_schedule``, the pauses of a windowed ``jitter``, the slowdowns of ``schedule``): the emulator changes them as
the training's progress crosses each boundary, so every contender trains the same share of its steps in each phase.
From the job's timeline (global rank 0's ``SYNCASYNC_TIMELINE`` file: one line per step) each run gets its
throughput per phase, and its series against time: samples/s in 2 s windows, the validation metric, the phase
boundaries it crossed, and for ``auto_sync`` the mode it ran in (its switch and rollback events), which the plot
draws as bands under the curves, so a reader sees why the switcher did what it did.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning_syncasync.bench.scenarios import Scenario
from lightning_syncasync.callbacks.straggler import parse_jitter_window, parse_link, parse_schedule

TIMELINE_FILE = "timeline.jsonl"
_WINDOW_S = 2.0
_MODE_COLOURS = {"sync": "#4c72b0", "hier": "#dd8452", "async": "#55a868"}


def boundaries(scenario: Scenario) -> list[float]:
    """The fractions of the planned steps where a condition changes (without 0 and 1)."""
    cuts: set[float] = set()
    for w in parse_link(scenario.link_schedule):
        cuts |= {w.start, w.end}
    for w in parse_schedule(scenario.schedule):
        cuts |= {w.start, w.end}
    if scenario.jitter:
        cuts |= set(parse_jitter_window(scenario.jitter))
    return sorted(c for c in cuts if 0.0 < c < 1.0)


def changing(scenario: Scenario) -> bool:
    """Whether the scenario's conditions change during a run (it then has phases)."""
    return bool(boundaries(scenario))


def phase_series(lines: list[dict[str, Any]], events: list[dict[str, Any]], steps: int, cuts: list[float],
                 metric: str) -> dict[str, Any]:  # fmt: skip
    """From a run's timeline lines and its policy events: the samples/s of each phase, and the series of the plot
    (seconds from the first training step)."""
    rows = [x for x in lines if "samples" in x]
    if not rows:
        return {"error": "no timeline was written (did SyncMonitor run?)"}
    t0 = rows[0]["t"]
    edges = [0, *(round(c * steps) for c in cuts), steps + 1]
    phases = []
    for lo, hi in zip(edges, edges[1:], strict=False):
        inside = [x for x in rows if lo <= x["step"] < hi]
        if len(inside) >= 2:
            span = inside[-1]["t"] - inside[0]["t"]
            done = float(inside[-1]["samples"]) - float(inside[0]["samples"])
            phases.append(done / span if span > 0 else None)
        else:
            phases.append(None)
    at_step = {x["step"]: x["t"] - t0 for x in rows}
    bins: dict[int, float] = {}
    prev = 0.0
    for x in rows:
        b = int((x["t"] - t0) // _WINDOW_S)
        bins[b] = bins.get(b, 0.0) + float(x["samples"]) - prev
        prev = float(x["samples"])
    modes = [(0.0, "sync")]
    for e in events:
        if e.get("kind") in ("switch", "rollback") and e.get("next"):
            t = at_step.get(e["step"], _nearest(at_step, e["step"]))
            modes.append((round(t, 2), e["next"]))
    return {
        "phase_samples_per_s": phases,
        "samples_per_s": [((b + 0.5) * _WINDOW_S, bins.get(b, 0.0) / _WINDOW_S) for b in range(max(bins) + 1)],
        "val": [(round(x["t"] - t0, 2), x["val"].get(metric)) for x in lines if "val" in x],
        "phase_starts": [round(_nearest(at_step, e), 2) for e in edges[1:-1]],
        "modes": modes,
        "end_s": round(rows[-1]["t"] - t0, 2),
    }


def _nearest(at_step: dict[int, float], step: int) -> float:
    """The time of the first step at or after ``step`` (the last one when the run ended before it)."""
    later = [s for s in at_step if s >= step]
    return at_step[min(later)] if later else max(at_step.values())


def plot_phases(out_dir: Path, name: str, by_strategy: dict[str, dict[str, Any]], plt: Any) -> Path | None:
    """Samples/s and the metric against time, one line per contender (its first repeat with a series), its phase
    boundaries as ticks, and under each panel ``auto_sync``'s mode as coloured bands."""
    runs = {k: next((r for r in s["runs"] if r.get("series", {}).get("samples_per_s")), None)
            for k, s in by_strategy.items()}  # fmt: skip
    runs = {k: r for k, r in runs.items() if r is not None}
    if not runs:
        return None
    fig, axes = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for k, r in runs.items():
        ser = r["series"]
        line = axes[0].plot(*zip(*ser["samples_per_s"], strict=True), label=k, lw=1)[0]
        val = [(t, v) for t, v in ser["val"] if v is not None]
        if val:
            axes[1].plot(*zip(*val, strict=True), marker=".", label=k, color=line.get_color())
        for t in ser["phase_starts"]:
            for ax in axes:
                ax.axvline(t, color=line.get_color(), ls=":", lw=0.8)
    banded = [(k, r) for k, r in runs.items() if len(r["series"]["modes"]) > 1 or k.startswith("auto")]
    for i, (_, r) in enumerate(banded):
        ser = r["series"]
        spans = list(zip(ser["modes"], [*ser["modes"][1:], (ser["end_s"], None)], strict=True))
        for ax in axes:
            lo, hi = ax.get_ylim()
            height = 0.05 * (hi - lo)
            bottom = lo - (i + 1) * height
            for (start, mode), (end, _) in spans:
                colour = _MODE_COLOURS.get(mode, "gray")
                ax.broken_barh([(start, max(end - start, 0.0))], (bottom, height), color=colour)
            ax.set_ylim(lo - (len(banded) + 0.2) * height, hi)
    for mode, colour in _MODE_COLOURS.items():
        axes[1].plot([], [], color=colour, lw=6, label=f"mode band: {mode}")
    first = next(iter(runs.values()))
    axes[0].set_ylabel(f"samples/s ({_WINDOW_S:g} s windows)")
    axes[1].set_ylabel(first.get("val_metric_name") or "metric")
    if first.get("target") is not None:
        axes[1].axhline(first["target"], color="gray", ls="--", lw=0.8, label="target")
    axes[1].set_xlabel("seconds from the first training step (dotted: each run's phase boundaries)")
    axes[0].set_title(f"{name}: throughput and metric by phase; bands: the mode each switching run was in")
    axes[0].legend(fontsize=7)
    axes[1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path = out_dir / f"phases_{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def phase_table(scenario: Scenario, by_strategy: dict[str, dict[str, Any]]) -> list[str]:
    """Samples/s of each contender in each phase (median over repeats), its best and worst phase named, and how
    often each switching contender ran in each mode."""
    cuts = [0.0, *boundaries(scenario), 1.0]
    names = [f"{a:.2f}-{b:.2f}" for a, b in zip(cuts, cuts[1:], strict=False)]
    rows = []
    for k, s in by_strategy.items():
        per = [[r["series"]["phase_samples_per_s"][i] for r in s["runs"]
                if r.get("series", {}).get("phase_samples_per_s") and r["series"]["phase_samples_per_s"][i]]
               for i in range(len(names))]  # fmt: skip
        med = [sorted(v)[len(v) // 2] if v else None for v in per]
        rows.append((k, med))
    if not rows or all(all(m is None for m in med) for _, med in rows):
        return []
    lines = ["Samples/s by phase (fractions of the planned steps; median over repeats), and each contender's rank in "
             "each phase (1 = fastest):", "",
             "| strategy | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]  # fmt: skip
    for k, med in rows:
        cells = []
        for i, m in enumerate(med):
            others = sorted((x[1][i] for x in rows if x[1][i] is not None), reverse=True)
            rank = f" (#{others.index(m) + 1})" if m is not None else ""
            cells.append(f"{m:.0f}{rank}" if m is not None else "n/a")
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    for k, s in by_strategy.items():
        switches = [len([e for e in r.get("events", []) if e.get("kind") == "switch"]) for r in s["runs"]]
        if any(switches):
            rollbacks = [len([e for e in r.get("events", []) if e.get("kind") == "rollback"]) for r in s["runs"]]
            lines += ["", f"`{k}`: switches per run {switches}, rollbacks per run {rollbacks}."]
    return [*lines, ""]

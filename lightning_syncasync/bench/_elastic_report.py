"""The node-fault scenarios' part of a report (:mod:`lightning_syncasync.bench.elastic` runs and measures them): their
table, their targets answered with the folder's numbers, and the plot against wall time."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from lightning_syncasync.bench._format import fmt, pct, save_figure, spread


def elastic_table(by_strategy: dict[str, dict[str, Any]]) -> list[str]:
    """A node-fault scenario's figures (:mod:`lightning_syncasync.bench.elastic`): medians, [min-max] over repeats."""
    any_run = next(iter(by_strategy.values()))["runs"][0]
    lines = [
        f"Node faults ({any_run.get('faults') or 'none'}, seconds from the first training step; budget time "
        f"{fmt(any_run.get('budget_s'))} s). Time to target and goodput count wall time from the first training "
        "step, validation and restarts included; the limit is the capacity present (each node's no-communication "
        "rate while its job ran).",
        "",
        "| strategy | launch | time to target (s) | final metric | goodput samples/s | limit samples/s | goodput % "
        "of limit | samples lost | kill to next commit (s) | (re)start to first full commit (s) | join to heal (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for strategy, s in by_strategy.items():
        launch = s["runs"][0].get("elastic_launch", "")
        frac = s["goodput_frac_all"]
        lines.append(
            f"| {strategy} | {launch} | {fmt(s['time_to_target_s'])}{spread(s['time_to_target_s_all'], '.1f')} "
            f"| {fmt(s['final_val_metric'], '.4f')}{spread(s['final_val_metric_all'], '.4f')} "
            f"| {fmt(s['goodput_samples_per_s'], '.0f')}{spread(s['goodput_samples_per_s_all'], '.0f')} "
            f"| {fmt(s['limit_samples_per_s'], '.0f')} "
            f"| {pct(s['goodput_frac'])}{spread([None if v is None else 100 * v for v in frac], '.1f')} "
            f"| {fmt(s['samples_lost'], '.0f')} "
            f"| {fmt(s['kill_to_commit_s'], '.2f')}{spread(s['kill_to_commit_s_all'], '.2f')} "
            f"| {fmt(s['start_to_commit_s'], '.2f')}{spread(s['start_to_commit_s_all'], '.2f')} "
            f"| {fmt(s['join_to_heal_s'], '.2f')} |"
        )
    return lines


def _by_repeat(s: dict[str, Any], key: str) -> dict[int, float]:
    return {r["repeat"]: r[key] for r in s["runs"] if r.get(key) is not None}


def _ratio(a: dict[str, Any], b: dict[str, Any], key: str) -> str:
    """``a``'s median of ``key`` over ``b``'s, with the [min-max] of the per-repeat (same seed) ratios."""
    if a.get(key) is None or not b.get(key):
        return "n/a"
    pa, pb = _by_repeat(a, key), _by_repeat(b, key)
    per = [pa[r] / pb[r] for r in pa if r in pb and pb[r]]
    interval = f" [{min(per):.2f}-{max(per):.2f}]" if len(per) > 1 else ""
    return f"{a[key] / b[key]:.2f}x{interval}"


def elastic_answers(name: str, table: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    """The node-fault targets, from this folder's records (medians over repeats; ratios with the range of the
    per-seed ratios). The fault-tolerant contenders of our own are the torchft-launched ones other than torchft's
    DiLoCo; each one's fault-free reference is its own ``elastic_no_faults`` run, when the folder has it."""
    by = table[name]
    ours = {k: s for k, s in by.items() if s["runs"][0].get("elastic_launch") == "torchft" and "diloco" not in k}
    reached = {k: s for k, s in ours.items() if s.get("time_to_target_s") is not None}
    free = table.get("elastic_no_faults", {})
    out: list[str] = [f"Targets ({name}):", ""]
    if not ours:
        return []
    best_name = min(reached, key=lambda k: reached[k]["time_to_target_s"]) if reached else next(iter(ours))
    best = ours[best_name]
    if name == "preemption":
        for other in ("ddp", "hier_sync", "torchft_diloco"):
            if other in by:
                out.append(f"- `{best_name}` reaches the target {_ratio(by[other], best, 'time_to_target_s')} sooner "
                           f"than `{other}` ({by[other]['runs'][0].get('elastic_launch')}).")  # fmt: skip
    for k, s in ours.items():
        ref = free.get(k)
        if ref is not None and ref.get("final_val_metric") is not None and s.get("final_val_metric") is not None:
            diff = 100 * (s["final_val_metric"] - ref["final_val_metric"])
            out.append(f"- `{k}`: final metric {diff:+.2f} points against its own fault-free run.")
        if s.get("goodput_frac") is not None:
            line = f"- `{k}`: goodput {pct(s['goodput_frac'])} of the capacity present at the no-communication limit"
            if ref is not None and ref.get("goodput_samples_per_s") and s.get("limit_samples_per_s"):
                ideal = s.get("ideal_samples_per_s") or 0.0
                own = ref["goodput_samples_per_s"] * (s["limit_samples_per_s"] / ideal if ideal else 1.0)
                line += f", {pct(s['goodput_samples_per_s'] / own)} of its own fault-free goodput scaled to it"
            out.append(line + ".")
        kill = [v for v in s["kill_to_commit_s_all"] if v is not None]
        if kill:
            out.append(
                f"- `{k}`: longest pause from the kill to the survivors' next committed round {max(kill):.2f} s."
            )
        heal = [r.get("join_to_heal_s") for r in s["runs"] if r.get("join_to_heal_s") is not None]
        commit = [r.get("join_to_commit_s") for r in s["runs"] if r.get("join_to_commit_s") is not None]
        if heal:
            startup = fmt(s.get("start_to_commit_s"), ".1f")
            out.append(
                f"- `{k}`: joiner healed within {max(heal):.2f} s of its first quorum, first round committed within "
                f"{max(commit or [float('nan')]):.2f} s ({startup} s from its job's start to its first full round)."
            )
        before, after = _by_repeat(s, "rate_before_join"), _by_repeat(s, "rate_after_join")
        if name == "scale_out" and before and after:
            per = [after[r] / before[r] for r in after if r in before and before[r]]
            if per:
                out.append(f"- `{k}`: throughput after the join {statistics.median(per):.2f}x the one-node "
                           f"throughput [{min(per):.2f}-{max(per):.2f}].")  # fmt: skip
    if name == "elastic_no_faults":
        for k in ours:
            plain = k.removesuffix("_ft")
            if plain in by:
                out.append(f"- `{k}` runs at {_ratio(by[k], by[plain], 'samples_per_s')} `{plain}`'s samples/s.")
    return out + [""]


def plot_elastic(out_dir: Path, name: str, by_strategy: dict[str, dict[str, Any]], plt: Any) -> Path | None:
    """Participants, throughput and the validation metric against wall time, one line per contender (its first
    repeat): the dip at the fault and the recovery after it."""
    runs = {k: next((r for r in s["runs"] if r.get("series")), None) for k, s in by_strategy.items()}
    runs = {k: r for k, r in runs.items() if r is not None}
    if not runs:
        return None
    fig, axes = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    for k, r in runs.items():
        ser = r["series"]
        for ax, key in zip(axes, ("participants", "samples_per_s", "val"), strict=True):
            pts = ser.get(key) or []
            if pts:
                xs, ys = zip(*pts, strict=True)
                ax.step(xs, ys, where="post", label=k) if key == "participants" else ax.plot(xs, ys, label=k)
    first = next(iter(runs.values()))
    axes[0].set_ylabel("nodes in the update")
    axes[1].set_ylabel("samples/s (2 s windows)")
    axes[2].set_ylabel(first.get("val_metric_name") or "metric")
    if first.get("target") is not None:
        axes[2].axhline(first["target"], color="gray", ls=":", label="target")
    axes[2].set_xlabel("seconds from the first training step")
    axes[0].set_title(f"{name}: {first.get('faults') or 'no fault'}")
    axes[2].legend(fontsize=8)
    return save_figure(fig, plt, out_dir / f"elastic_{name}.png")

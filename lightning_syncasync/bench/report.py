"""``results.json``, ``report.md`` and the two plots of a benchmark folder.

Records accumulate in ``results.json`` across invocations (a new run of a (scenario, strategy) replaces the old
one), so running the scenarios one by one into the same folder builds one report over all of them.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import Any

from lightning_syncasync._cores import usable_cores
from lightning_syncasync.bench.evidence import REFERENCES, Ranking, bootstrap_geomean, budget_share
from lightning_syncasync.bench.phases import changing, phase_table, plot_phases
from lightning_syncasync.bench.runner import median_or_none
from lightning_syncasync.bench.scenarios import lookup


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


def _fmt(v: float | None, spec: str = ".1f", none: str = "n/a") -> str:
    return none if v is None else format(v, spec)


def _spread(values: list[float | None], spec: str) -> str:
    present = [v for v in values if v is not None]
    if len(present) < 2:
        return ""
    return f" [{min(present):{spec}}-{max(present):{spec}}]"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def summarise(records: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """``{scenario: {strategy: medians and spreads}}``."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for rec in records:
        out.setdefault(rec["scenario"], {}).setdefault(rec["strategy"], {"runs": []})["runs"].append(rec)
    for by_strategy in out.values():
        for s in by_strategy.values():
            runs = s["runs"]
            for key in ("samples_per_s", "ideal_samples_per_s", "efficiency", "time_to_target_s", "final_val_metric",
                        "inter_node_bytes_per_step", "wait_frac", "peak_rss_mb", "cuda_peak_mb",
                        "optimizer_state_mb", "bounded_efficiency", "bound_error", "sync_point_frac",
                        *ELASTIC_KEYS):  # fmt: skip
                s[key] = median_or_none([r.get(key) for r in runs])
                s[key + "_all"] = [r.get(key) for r in runs]
            for key in ("inter_sent", "inter_recv", "intra_sent", "intra_recv"):
                s["wire_" + key] = median_or_none([(r.get("wire") or {}).get(key) for r in runs])
            s["reached"] = sum(r.get("time_to_target_s") is not None for r in runs)
            s["failed"] = sum("error" in r for r in runs)
            per_rank = [r["ideal_per_rank_samples_per_s"] for r in runs if r.get("ideal_per_rank_samples_per_s")]
            # The best a synchronous run can do: every rank at the pace of the slowest one.
            s["ideal_sync_efficiency"] = (
                statistics.median(len(p) * min(p) / sum(p) for p in per_rank) if per_rank else None
            )
    return out


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
        lines += [""] + _wire_table(by_strategy) + _memory_table(by_strategy) + _answers(name, by_strategy, table)
        if sc is not None and sc.elastic:
            lines += ["", *elastic_answers(name, table)]
        lines += [""]
    lines += ["![throughput](throughput.png)", "", "![accuracy vs time](accuracy_vs_time.png)", ""]
    if any(_rebalance_events(r) for r in records):
        lines += ["![per-rank batch sizes](batch_split.png)", ""]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines))
    return path


def scenario_table(by_strategy: dict[str, dict[str, Any]]) -> list[str]:
    """The Markdown table of one scenario's contenders (medians, [min-max] over repeats), as ``report.md`` and the
    generated docs show it."""
    any_run = next(iter(by_strategy.values()))["runs"][0]
    lines = [
        "| strategy | samples/s | ideal samples/s | efficiency | bounded efficiency | time to target (s) | final "
        f"{any_run.get('val_metric_name')} | inter-node KB/step | wait % | sync points % | reached |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for strategy, s in by_strategy.items():
        eff = s["efficiency"]
        lines.append(
            f"| {strategy} | {_fmt(s['samples_per_s'])}{_spread(s['samples_per_s_all'], '.0f')} "
            f"| {_fmt(s['ideal_samples_per_s'])} "
            f"| {_fmt(None if eff is None else 100 * eff, '.1f')}% "
            f"| {_pct(s.get('bounded_efficiency'))} "
            f"| {_fmt(s['time_to_target_s'])}{_spread(s['time_to_target_s_all'], '.1f')} "
            f"| {_fmt(s['final_val_metric'], '.4f')}{_spread(s['final_val_metric_all'], '.4f')} "
            f"| {_fmt(None if s['inter_node_bytes_per_step'] is None else s['inter_node_bytes_per_step'] / 1024)} "
            f"| {_fmt(None if s['wait_frac'] is None else 100 * s['wait_frac'])} "
            f"| {_pct(s.get('sync_point_frac'))} "
            f"| {s['reached']}/{len(s['runs'])}{' (' + str(s['failed']) + ' failed)' if s['failed'] else ''} |"
        )
    return lines


def samples_to_target(run: dict[str, Any]) -> float | None:
    """Samples trained over all ranks when the run's validation first reached its target (``None``: never).

    Where validation runs at epoch ends every contender has trained the same whole epochs by then, whatever its
    ranks' own step counts (``async_ssp`` claims batches: a fast rank takes more steps than a slow one), so the
    samples are that share of the budget. Where it runs every so many steps, the ranks step together (DDP,
    ``hier_sync``): the step times the global batch.
    """
    target, budget = run.get("target"), _budget_samples(run)
    share = None if target is None or budget is None else budget_share(run, target)
    return None if share is None else share * budget


def samples_or_budget(run: dict[str, Any]) -> float | None:
    """:func:`samples_to_target`, or the whole budget's samples for a run that never reached it (a censored miss)."""
    got = samples_to_target(run)
    return got if got is not None else _budget_samples(run)


def learning_table(by_strategy: dict[str, dict[str, Any]]) -> list[str]:
    """Learning per sample against ``ddp`` of the same invocation, seed by seed (issue 49's targets): samples to
    the target over DDP's, median [min-max] (a seed that never reaches counts as the whole budget, and is
    counted apart), the final metric's difference, and how much of the throughput gain reached time to target
    (time-to-target speed-up over the throughput ratio, both against DDP's seed: 1.0 loses nothing to learning)."""
    ddp = by_strategy.get("ddp")
    if not ddp:
        return []
    base = {r.get("train_seed"): r for r in ddp["runs"] if "error" not in r}
    lines: list[str] = []
    for strategy, s in by_strategy.items():
        if strategy == "ddp":
            continue
        ratios, finals, kept, reached, n = [], [], [], 0, 0
        for run in s["runs"]:
            ref = base.get(run.get("train_seed"))
            if ref is None or "error" in run or ref.get("command") != run.get("command"):
                continue
            n += 1
            reached += samples_to_target(run) is not None
            mine, theirs = samples_or_budget(run), samples_to_target(ref)
            if theirs and mine:
                ratios.append(mine / theirs)
            if run.get("final_val_metric") is not None and ref.get("final_val_metric") is not None:
                finals.append(100 * (run["final_val_metric"] - ref["final_val_metric"]))
            t_me, t_ref = run.get("time_to_target_s"), ref.get("time_to_target_s")
            sps_me, sps_ref = run.get("samples_per_s"), ref.get("samples_per_s")
            if t_me and t_ref and sps_me and sps_ref:
                kept.append((t_ref / t_me) / (sps_me / sps_ref))
        if not n:
            continue
        if not lines:
            lines = [
                "| strategy | samples to target / DDP's: median [seeds' min-max]; geometric mean [90% bootstrap "
                "interval] | reached "
                "| final - DDP's (points) | time-to-target speed-up / "
                "throughput ratio |",
                "|---|---|---|---|---|",
            ]
        geo = bootstrap_geomean(ratios)
        interval = "" if geo is None else f"; geometric mean {geo}"
        lines.append(
            f"| {strategy} | {_fmt(median_or_none(ratios), '.2f')}x{_spread(ratios, '.2f')}{interval} | {reached}/{n} "
            f"| {_fmt(median_or_none(finals), '+.1f')}{_spread(finals, '+.1f')} "
            f"| {_fmt(median_or_none(kept), '.2f')}{_spread(kept, '.2f')} ({len(kept)} seeds) |"
        )
    return lines


def ranking_lines(scenario: str, records: list[dict[str, Any]]) -> list[str]:
    """Issue 48's ranking of one scenario's records (:class:`~lightning_syncasync.bench.evidence.Ranking`): the
    contenders of the invocation that ran its reference, by median time to a target the reference's runs chose,
    with bootstrap intervals and the verdict."""
    return Ranking.of(scenario, side_by_side(records)).table()


def side_by_side(records: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """``{strategy: runs}`` of one scenario's records, keeping only runs of the invocation(s) that ran its reference
    (a ratio is of runs side by side; a contender re-run alone into the same file does not rank against them)."""
    commands = {r.get("command") for r in records if r["strategy"] in REFERENCES}
    by: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        if not commands or r.get("command") in commands:
            by.setdefault(r["strategy"], []).append(r)
    return by


def _budget_samples(run: dict[str, Any]) -> float | None:
    """The samples of the whole budget (steps x ranks x batch; a seed that never reached the target counts as
    that), if the record says."""
    cfg = run.get("config") or {}
    trainer, data = cfg.get("trainer") or {}, cfg.get("data") or {}
    steps = run.get("steps")
    total = (steps if isinstance(steps, int) else 0) * (trainer.get("devices") or 0) * (trainer.get("num_nodes") or 1)
    return float(total * data["batch_size"]) if total and data.get("batch_size") else None


ELASTIC_KEYS = (
    "goodput_samples_per_s",
    "limit_samples_per_s",
    "goodput_frac",
    "samples_lost",
    "kill_to_commit_s",
    "start_to_commit_s",
    "join_to_heal_s",
    "samples_useful",
    "samples_trained",
)


def elastic_table(by_strategy: dict[str, dict[str, Any]]) -> list[str]:
    """A node-fault scenario's figures (:mod:`lightning_syncasync.bench.elastic`): medians, [min-max] over repeats."""
    any_run = next(iter(by_strategy.values()))["runs"][0]
    lines = [
        f"Node faults ({any_run.get('faults') or 'none'}, seconds from the first training step; budget time "
        f"{_fmt(any_run.get('budget_s'))} s). Time to target and goodput count wall time from the first training "
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
            f"| {strategy} | {launch} | {_fmt(s['time_to_target_s'])}{_spread(s['time_to_target_s_all'], '.1f')} "
            f"| {_fmt(s['final_val_metric'], '.4f')}{_spread(s['final_val_metric_all'], '.4f')} "
            f"| {_fmt(s['goodput_samples_per_s'], '.0f')}{_spread(s['goodput_samples_per_s_all'], '.0f')} "
            f"| {_fmt(s['limit_samples_per_s'], '.0f')} "
            f"| {_pct(s['goodput_frac'])}{_spread([None if v is None else 100 * v for v in frac], '.1f')} "
            f"| {_fmt(s['samples_lost'], '.0f')} "
            f"| {_fmt(s['kill_to_commit_s'], '.2f')}{_spread(s['kill_to_commit_s_all'], '.2f')} "
            f"| {_fmt(s['start_to_commit_s'], '.2f')}{_spread(s['start_to_commit_s_all'], '.2f')} "
            f"| {_fmt(s['join_to_heal_s'], '.2f')} |"
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
    spread = f" [{min(per):.2f}-{max(per):.2f}]" if len(per) > 1 else ""
    return f"{a[key] / b[key]:.2f}x{spread}"


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
            line = f"- `{k}`: goodput {_pct(s['goodput_frac'])} of the capacity present at the no-communication limit"
            if ref is not None and ref.get("goodput_samples_per_s") and s.get("limit_samples_per_s"):
                ideal = s.get("ideal_samples_per_s") or 0.0
                own = ref["goodput_samples_per_s"] * (s["limit_samples_per_s"] / ideal if ideal else 1.0)
                line += f", {_pct(s['goodput_samples_per_s'] / own)} of its own fault-free goodput scaled to it"
            out.append(line + ".")
        kill = [v for v in s["kill_to_commit_s_all"] if v is not None]
        if kill:
            out.append(
                f"- `{k}`: longest pause from the kill to the survivors' next committed round {max(kill):.2f} s."
            )
        heal = [r.get("join_to_heal_s") for r in s["runs"] if r.get("join_to_heal_s") is not None]
        commit = [r.get("join_to_commit_s") for r in s["runs"] if r.get("join_to_commit_s") is not None]
        if heal:
            startup = _fmt(s.get("start_to_commit_s"), ".1f")
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
    return _save(fig, plt, out_dir / f"elastic_{name}.png")


def _wire_table(by_strategy: dict[str, dict[str, Any]]) -> list[str]:
    """Bytes on the wire per rank per step (medians), from the emulated interfaces' counters: what the collectives
    moved, headers included, set-up and validation spread over the steps."""
    rows = [(k, s) for k, s in by_strategy.items() if s.get("wire_inter_sent") is not None]
    if not rows:
        return []
    lines = [
        "Bytes on the wire per rank per step, from the emulated nodes' interface counters (whole run / steps):",
        "",
        "| strategy | inter-node sent KB | inter-node received KB | intra-node sent KB | intra-node received KB |",
        "|---|---|---|---|---|",
    ]
    for k, s in rows:
        cells = [_fmt(s[f"wire_{key}"] / 1024) for key in ("inter_sent", "inter_recv", "intra_sent", "intra_recv")]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return lines + [""]


def _memory_table(by_strategy: dict[str, dict[str, Any]]) -> list[str]:
    """Memory per rank (largest rank), with the optimizer state relative to DDP's when DDP ran."""
    rows = [(k, s) for k, s in by_strategy.items() if s.get("optimizer_state_mb") is not None]
    if not rows:
        return []
    ddp = by_strategy.get("ddp", {}).get("optimizer_state_mb")
    lines = [
        "| strategy | peak RSS MB/rank | peak CUDA MB/rank | optimizer state MB/rank | optimizer state vs ddp |",
        "|---|---|---|---|---|",
    ]
    for k, s in rows:
        if k == "ddp":
            ratio = "reference"
        else:
            ratio = _size_ratio(ddp, s["optimizer_state_mb"])
        lines.append(
            f"| {k} | {_fmt(s['peak_rss_mb'], '.0f')} | {_fmt(s['cuda_peak_mb'], '.0f')} "
            f"| {_fmt(s['optimizer_state_mb'], '.2f')} | {ratio} |"
        )
    return lines + [""]


def _size_ratio(reference: float | None, value: float | None) -> str:
    """``value`` against ``reference`` in words: "4.00x smaller", "1.50x larger", "the same" (within 1%)."""
    if not reference or not value:
        return "n/a"
    ratio = reference / value
    if abs(ratio - 1.0) < 0.01:
        return "the same"
    return f"{ratio:.2f}x smaller" if ratio > 1 else f"{1 / ratio:.2f}x larger"


def _answers(name: str, by_strategy: dict[str, dict[str, Any]], table: dict[str, Any]) -> list[str]:
    """The design brief's questions, answered with this folder's numbers."""
    out: list[str] = []
    ddp = by_strategy.get("ddp")
    if ddp and ddp["efficiency"] is not None:
        eff = 100 * ddp["efficiency"]
        sync_bound = ddp["ideal_sync_efficiency"]
        if name == "straggler":
            out.append(
                f"- One worker 1.5x slower costs synchronous training {100 - eff:.0f}% of the cluster's "
                f"no-communication throughput: DDP runs at {eff:.1f}% of it. Even a perfect synchronous run "
                f"(everyone at the slowest rank's pace, no communication) reaches only "
                f"{_fmt(None if sync_bound is None else 100 * sync_bound)}%."
            )
        elif name == "jitter":
            out.append(f"- Transient pauses (p=0.1, 4x) cost DDP {100 - eff:.0f}%: it runs at {eff:.1f}% of the limit.")
        elif name == "mid_run_straggler":
            out.append(f"- A straggler for the middle third of training: DDP at {eff:.1f}% of the limit overall.")
        elif name == "slow_link":
            homo = table.get("homogeneous", {}).get("ddp")
            extra = (
                f" (on the unlimited network, `homogeneous`: {100 * homo['efficiency']:.1f}%)"
                if homo and homo["efficiency"] is not None
                else ""
            )
            out.append(
                f"- With 100 Mbit/s between nodes DDP runs at {eff:.1f}% of the no-communication limit{extra}, "
                f"waiting on the network {_fmt(None if ddp['wait_frac'] is None else 100 * ddp['wait_frac'])}% "
                "of each step."
            )
        else:
            out.append(f"- DDP runs at {eff:.1f}% of the no-communication limit.")
        ttt = ddp["time_to_target_s"]
        ddp_cmds = {r.get("command") for r in ddp["runs"]}
        for strategy, s in by_strategy.items():
            if strategy != "ddp" and ttt and s["time_to_target_s"]:
                same = ddp_cmds == {r.get("command") for r in s["runs"]}
                note = "" if same else " (measured in a different invocation than DDP: rerun both together to compare)"
                out.append(f"- {strategy} reaches the target {ttt / s['time_to_target_s']:.2f}x as fast as DDP{note}.")
            why = _explain(name, strategy, s)
            if why:
                out.append(why)
    for strategy, s in by_strategy.items():
        out.extend(_rebalances(name, strategy, s))
    return out


def rebalance_lags(scenario: str, run: dict[str, Any]) -> list[dict[str, Any]]:
    """For each scheduled slowdown change, the steps until a rebalance moved the slow rank's share the right way.

    ``[{"rank", "change_step", "direction" ("slower"/"recovered"), "decision_step" or None, "lag" or None}]``.
    """
    from lightning_syncasync.callbacks.straggler import parse_schedule

    sc = lookup(scenario)
    if sc is None or not sc.schedule:
        return []
    steps = run.get("steps") or 0
    events = _rebalance_events(run)
    out = []
    for w in parse_schedule(sc.schedule):
        for frac, direction in ((w.start, "slower"), (w.end, "recovered")):
            if frac >= 1.0:
                continue
            change = round(frac * steps)
            hit = next(
                (
                    e
                    for e in events
                    if e["step"] >= change
                    and (e["sizes"][w.rank] < e["previous"][w.rank]) == (direction == "slower")
                    and e["sizes"][w.rank] != e["previous"][w.rank]
                ),
                None,
            )
            out.append(
                {
                    "rank": w.rank,
                    "change_step": change,
                    "direction": direction,
                    "decision_step": None if hit is None else hit["step"],
                    "lag": None if hit is None else hit["step"] - change,
                }
            )
    return out


def _rebalancing_run(s: dict[str, Any]) -> dict[str, Any] | None:
    """The first run of a contender in which AdaptiveBatchSize rebalanced, if any."""
    return next((r for r in s["runs"] if _rebalance_events(r)), None)


def _rebalance_events(run: dict[str, Any]) -> list[dict[str, Any]]:
    """AdaptiveBatchSize's rebalancing decisions recorded in a run (its ``grow_batch`` events left out)."""
    return [e for e in run.get("events", []) if e.get("kind") == "rebalance"]


def _rebalances(scenario: str, strategy: str, s: dict[str, Any]) -> list[str]:
    """AdaptiveBatchSize's decisions in this scenario: how often, the final split, and reaction times."""
    run = _rebalancing_run(s)
    if run is None:
        return []
    events = _rebalance_events(run)
    out = [
        f"- {strategy} rebalanced {len(events)} times (first at step {events[0]['step']}: {events[0]['previous']} "
        f"-> {events[0]['sizes']}); final split {events[-1]['sizes']}."
    ]
    for lag in rebalance_lags(scenario, run):
        when = (
            f"{lag['lag']} steps after it (step {lag['decision_step']})"
            if lag["lag"] is not None
            else "never (no rebalance in that direction)"
        )
        out.append(
            f"- {strategy}: rank {lag['rank']} {'slowed down' if lag['direction'] == 'slower' else 'recovered'} at "
            f"step {lag['change_step']}; its batch was rebalanced {when}."
        )
    return out


def _explain(scenario: str, strategy: str, s: dict[str, Any]) -> str:
    """What the design brief's reader needs to read a bounded-staleness result under a persistent straggler."""
    config = (s["runs"][0].get("config") or {}).get("strategy") or {}
    if not isinstance(config, dict):  # a registered name given as trainer.strategy (no strategy group)
        return ""
    target = str(config.get("_target_", ""))
    if not target.endswith("AsyncSSPStrategy") or scenario not in ("straggler", "mid_run_straggler"):
        return ""
    staleness = config.get("staleness")
    eff = s.get("efficiency")
    wait = s.get("wait_frac")
    if staleness is None:
        return (
            f"- {strategy} (ASP, no bound) at {_fmt(None if eff is None else 100 * eff)}% of the limit: no rank ever "
            "waits for the slow one, which simply contributes fewer updates."
        )
    return (
        f"- {strategy} (SSP, staleness {staleness}) at {_fmt(None if eff is None else 100 * eff)}% of the limit, "
        f"waiting {_fmt(None if wait is None else 100 * wait)}% of each step: against a *persistently* slower rank a "
        f"finite bound only delays the wait; once the fast ranks are {staleness} steps ahead they move at the slow "
        "rank's pace, like synchronous training. SSP pays off under transient slowness (`jitter`); persistent "
        "heterogeneity is for ASP with compensation or per-rank batch sizes."
    )


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
    throughput = _save(fig, plt, out_dir / "throughput.png")
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
    accuracy = _save(fig, plt, out_dir / "accuracy_vs_time.png")
    paths = [throughput, accuracy]
    split = _plot_batch_split(out_dir, table, plt)
    return paths + ([split] if split else [])


def _plot_batch_split(out_dir: Path, table: dict[str, Any], plt: Any) -> Path | None:
    """Per-rank batch sizes over training for the runs that rebalanced, with the scheduled slowdown changes."""
    panels = []
    for sc, by_strategy in table.items():
        for strategy, s in by_strategy.items():
            run = _rebalancing_run(s)
            if run is not None:
                panels.append((sc, strategy, run))
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (sc, strategy, run) in zip(axes[0], panels, strict=True):
        events = _rebalance_events(run)
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
    return _save(fig, plt, out_dir / "batch_split.png")


def _save(fig: Any, plt: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

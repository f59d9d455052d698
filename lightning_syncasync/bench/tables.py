"""A scenario's records summarised (medians, [min-max] over repeats) and the Markdown tables that ``report.md``
(:mod:`~lightning_syncasync.bench.report`) and the generated docs (:mod:`~lightning_syncasync.bench.publish`) share:
the contenders' figures, learning per sample against DDP, issue 48's ranking, bytes on the wire and memory.
"""

from __future__ import annotations

import statistics
from typing import Any

from lightning_syncasync.bench._format import fmt, pct, spread
from lightning_syncasync.bench.evidence import REFERENCES, Ranking, bootstrap_geomean, budget_share
from lightning_syncasync.bench.runner import median_or_none

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
            f"| {strategy} | {fmt(s['samples_per_s'])}{spread(s['samples_per_s_all'], '.0f')} "
            f"| {fmt(s['ideal_samples_per_s'])} "
            f"| {fmt(None if eff is None else 100 * eff, '.1f')}% "
            f"| {pct(s.get('bounded_efficiency'))} "
            f"| {fmt(s['time_to_target_s'])}{spread(s['time_to_target_s_all'], '.1f')} "
            f"| {fmt(s['final_val_metric'], '.4f')}{spread(s['final_val_metric_all'], '.4f')} "
            f"| {fmt(None if s['inter_node_bytes_per_step'] is None else s['inter_node_bytes_per_step'] / 1024)} "
            f"| {fmt(None if s['wait_frac'] is None else 100 * s['wait_frac'])} "
            f"| {pct(s.get('sync_point_frac'))} "
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
            f"| {strategy} | {fmt(median_or_none(ratios), '.2f')}x{spread(ratios, '.2f')}{interval} | {reached}/{n} "
            f"| {fmt(median_or_none(finals), '+.1f')}{spread(finals, '+.1f')} "
            f"| {fmt(median_or_none(kept), '.2f')}{spread(kept, '.2f')} ({len(kept)} seeds) |"
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


def wire_table(by_strategy: dict[str, dict[str, Any]]) -> list[str]:
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
        cells = [fmt(s[f"wire_{key}"] / 1024) for key in ("inter_sent", "inter_recv", "intra_sent", "intra_recv")]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return lines + [""]


def memory_table(by_strategy: dict[str, dict[str, Any]]) -> list[str]:
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
            ratio = size_ratio(ddp, s["optimizer_state_mb"])
        lines.append(
            f"| {k} | {fmt(s['peak_rss_mb'], '.0f')} | {fmt(s['cuda_peak_mb'], '.0f')} "
            f"| {fmt(s['optimizer_state_mb'], '.2f')} | {ratio} |"
        )
    return lines + [""]


def size_ratio(reference: float | None, value: float | None) -> str:
    """``value`` against ``reference`` in words: "4.00x smaller", "1.50x larger", "the same" (within 1%)."""
    if not reference or not value:
        return "n/a"
    ratio = reference / value
    if abs(ratio - 1.0) < 0.01:
        return "the same"
    return f"{ratio:.2f}x smaller" if ratio > 1 else f"{1 / ratio:.2f}x larger"

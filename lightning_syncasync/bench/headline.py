"""The headline of the generated docs (:mod:`~lightning_syncasync.bench.publish`): per scenario, the contender that
reaches the target soonest, over every results file, each scenario from the latest file that holds its reference's
runs beside a contender (so that every ratio is of runs side by side in one invocation).

    <!-- bench:headline -->              every scenario: target, soonest, ratio and interval, verdict, ... (the full
    <!-- bench:end -->                     table of docs/benchmarks.md)
    <!-- bench:headline SCENARIO[,SCENARIO] -->   those scenarios' rows of it: a scenario section's current verdict
    <!-- bench:end -->
    <!-- bench:headline compact -->      five columns for a README: scenario, what the cluster suffers from, best
    <!-- bench:end -->                     strategy, how much sooner than DDP, and a link to the scenario's section

The compact form reads the benchmarks page (``benchmarks.md`` beside the results folder): a scenario's section is the
first level-2 heading that names it in backticks (else the first heading of any level that does), and what the
cluster suffers from is that heading's text before ``: `SCENARIO` `` where the heading names that scenario alone
(``## Transient pauses: `jitter_long` ``), else the scenario's own description.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from lightning_syncasync.bench.evidence import REFERENCES, Ranking
from lightning_syncasync.bench.scenarios import lookup
from lightning_syncasync.bench.tables import side_by_side, summarise

HEADLINE_FIGURE = "headline.png"
# The page the compact headline links to, beside the results folder (docs/results -> docs/benchmarks.md).
BENCHMARKS_PAGE = "benchmarks.md"
# A compact cell longer than this is cut at a word (a README table must stay readable).
COMPACT_CELL_CHARS = 200


# DDP against itself, its batches in another order (``data_order=1``): the noise floor of a learning-per-sample ratio,
# not a contender.
NOISE_FLOOR = ("ddp_other_order",)


def headline_sources(results: dict[str, list[dict[str, Any]]]) -> list[tuple[str, str, list[dict[str, Any]]]]:
    """``[(scenario, file, its records of that scenario)]``: each scenario's contenders from the latest file holding
    its reference's (``ddp``'s, or ``fsdp``'s where it shards) rows, so that every ratio is of runs side by side in
    one invocation (a contender re-run alone into a later file does not rank against them). ``--quick`` records
    (a few steps, an easier target) check throughput and rank nothing."""
    results = {name: [r for r in records if not r.get("quick")] for name, records in results.items()}
    ref_file: dict[str, str] = {}
    for name, records in results.items():
        refs = {r["scenario"] for r in records if r["strategy"] in REFERENCES}
        # A file of the reference against itself only (the noise floor) ranks nothing a headline may name.
        contenders = {r["scenario"] for r in records if r["strategy"] not in (*REFERENCES, *NOISE_FLOOR)}
        for rec in records:
            if rec["scenario"] in refs and rec["scenario"] in contenders:
                ref_file[rec["scenario"]] = name
    order = list(dict.fromkeys(r["scenario"] for records in results.values() for r in records))
    return [
        (scenario, ref_file[scenario], [r for r in results[ref_file[scenario]] if r["scenario"] == scenario])
        for scenario in sorted(ref_file, key=order.index)
    ]


def headline_rows(results: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per scenario with a reference (``ddp``, or ``fsdp`` where it shards): the contender with the soonest median
    time to the target that the reference's runs alone choose, its time against the reference's with a bootstrap
    interval over seeds, and the verdict (a winner only where the interval of the runner-up's time over its own
    excludes 1; :mod:`~lightning_syncasync.bench.evidence`), with its fraction of the no-communication limit and
    its final metric against the reference's. Node-fault scenarios, whose records have no validation curve, keep
    the soonest median over the repeats that reached the scenario's own target (``ranking`` None)."""
    rows = []
    for scenario, name, records in headline_sources(results):
        by_strategy = summarise(records)[scenario]
        found = lookup(scenario)
        if found is not None and found.elastic:
            row = _elastic_headline_row(by_strategy)
        else:
            ranking = Ranking.of(scenario, side_by_side(records))
            first = ranking.first
            if first is None:  # nothing to rank (no reference, or no level every reference seed reaches): say why
                if ranking.reference not in by_strategy:
                    continue
                row = {"best": ranking.reference, "ranking": ranking, "reached": 0, "repeats": 0,
                       "reference": ranking.reference, "speedup": None}  # fmt: skip
            else:
                speedup = None if first.vs_ddp is None else first.vs_ddp.value
                row = {"best": first.strategy, "ranking": ranking, "reached": first.reached, "repeats": first.seeds,
                       "reference": ranking.reference, "speedup": speedup}  # fmt: skip
        if row is None:
            continue
        best, ref = by_strategy[row["best"]], by_strategy[row["reference"]]
        gap = None
        if best["final_val_metric"] is not None and ref["final_val_metric"] is not None:
            gap = best["final_val_metric"] - ref["final_val_metric"]
        row.update(
            scenario=scenario,
            efficiency=best["efficiency"],
            ddp_efficiency=ref["efficiency"],
            gap_points=None if gap is None else 100 * gap,
            metric=best["runs"][0].get("val_metric_name", "val metric"),
            file=name,
        )
        rows.append(row)
    return rows


def _elastic_headline_row(by_strategy: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """A node-fault scenario: the soonest median to the scenario's target among contenders that reached it in most
    repeats (their records carry the time to target, not the curve)."""
    ddp = by_strategy.get("ddp")
    if ddp is None or ddp["time_to_target_s"] is None:
        return None
    reached = {
        k: s for k, s in by_strategy.items() if s["time_to_target_s"] is not None and 2 * s["reached"] > len(s["runs"])
    }
    best_name = min(reached, key=lambda k: reached[k]["time_to_target_s"]) if reached else "ddp"
    best = by_strategy[best_name]
    return {"best": best_name, "ranking": None, "reached": best["reached"], "repeats": len(best["runs"]),
            "reference": "ddp", "speedup": ddp["time_to_target_s"] / best["time_to_target_s"]}  # fmt: skip


def headline_block(results: dict[str, list[dict[str, Any]]], scenarios: list[str] | None = None) -> str:
    """The headline table: every scenario's row, or those of ``scenarios`` alone (a scenario section's current
    verdict)."""
    rows = headline_rows(results)
    if scenarios is not None:
        rows = [r for r in rows if r["scenario"] in scenarios]
        if not rows:
            return (
                f"No verdict for {', '.join(f'`{s}`' for s in scenarios)}: no results file holds the reference's runs "
                f"({' or '.join(f'`{r}`' for r in REFERENCES)}) beside a contender's.\n"
            )
    lines = [
        "| scenario | target (from the reference's runs) | soonest (median) | time to target: reference's over its "
        "(90% CI) | verdict | fraction of the no-communication limit (reference) | final metric vs reference "
        "| reached target | records |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    elastic = []
    for r in rows:
        eff = "n/a" if r["efficiency"] is None else f"{100 * r['efficiency']:.1f}%"
        ref_eff = "n/a" if r["ddp_efficiency"] is None else f"{100 * r['ddp_efficiency']:.1f}%"
        gap = "n/a" if r["gap_points"] is None else f"{r['gap_points']:+.1f} points {r['metric']}"
        ranking: Ranking | None = r["ranking"]
        if ranking is None:
            elastic.append(
                f"| `{r['scenario']}` | `{r['best']}` | {r['speedup']:.2f}x sooner | {eff} ({ref_eff}) | {gap} "
                f"| {r['reached']}/{r['repeats']} | `{r['file']}` |"
            )
            continue
        first = ranking.first
        if first is None:
            cells = " | ".join(["n/a"] * 3 + [ranking.sentence()] + ["n/a"] * 3)
            lines.append(f"| `{r['scenario']}` | {cells} | `{r['file']}` |")
            continue
        ratio = "reference" if first.vs_ddp is None else str(first.vs_ddp)
        lines.append(
            f"| `{r['scenario']}` | {ranking.target:g} | `{r['best']}` | {ratio} (`{ranking.reference}`) "
            f"| {ranking.sentence()} | {eff} ({ref_eff}) | {gap} | {r['reached']}/{r['repeats']} | `{r['file']}` |"
        )
    if elastic:
        lines += [
            "",
            "Node faults (records without validation curves: medians over the repeats that reached the scenario's "
            "own target, not ranked by an interval):",
            "",
            "| scenario | best strategy | time to target vs `ddp` | fraction of the no-communication limit (`ddp`) "
            "| final metric vs `ddp` | reached target | records |",
            "|---|---|---|---|---|---|---|",
            *elastic,
        ]
        if len(rows) == len(elastic):  # node-fault rows only: their table alone
            lines = lines[-len(elastic) - 4 :]
    return "\n".join(lines) + "\n"


def write_headline_figure(results: dict[str, list[dict[str, Any]]], path: Path) -> Path | None:
    """The headline's ratios: per scenario, the reference's time to target over the soonest contender's, with its
    90% bootstrap interval where the scenario is ranked by one (``None`` when matplotlib is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [r for r in headline_rows(results) if r["speedup"] is not None]
    fig, ax = plt.subplots(figsize=(7.2, 0.8 + 0.55 * max(1, len(rows))))
    labels, values, low, high, colors = [], [], [], [], []
    for r in rows:
        ranking = r["ranking"]
        interval = ranking.first.vs_ddp if ranking is not None and ranking.first is not None else None
        verdict = "node faults, 3 seeds" if ranking is None else ranking.verdict.split(":")[0]
        labels.append(f"{r['scenario']}\n{r['best']} ({verdict})")
        values.append(r["speedup"])
        low.append(r["speedup"] - (interval.low if interval else r["speedup"]))
        high.append((interval.high if interval else r["speedup"]) - r["speedup"])
        colors.append("tab:blue" if ranking is not None and ranking.verdict == "winner" else "tab:gray")
    ax.barh(labels, values, xerr=[low, high], color=colors, capsize=3)
    ax.axvline(1.0, color="black", lw=1, ls="--")
    ax.set_xlabel("time to target: reference / soonest (x sooner; 90% bootstrap interval)")
    ax.tick_params(axis="y", labelsize=7)
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Software": None})  # no version stamp: regenerating is reproducible
    plt.close(fig)
    return path


_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading's text: lowercase, a link's text only, markup and punctuation other than '-' and
    '_' dropped, spaces to '-' (a repeated heading's -1, -2, ... suffixes are :func:`scenario_sections`')."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text.replace("`", ""))
    return text.replace(" ", "-")


def scenario_sections(page: str) -> dict[str, tuple[str, str | None]]:
    """``{name in backticks: (anchor, trouble)}`` of a Markdown page's headings: each name's first level-2 heading
    (else its first heading of any level), and, where that level-2 heading names it alone as ``TROUBLE: `name` ``,
    the text before the name (what the scenario's cluster suffers from); ``None`` otherwise."""
    seen: dict[str, int] = {}
    level2: dict[str, tuple[str, str | None]] = {}
    anywhere: dict[str, tuple[str, str | None]] = {}
    for line in _FENCE.sub("", page).splitlines():
        m = _HEADING.match(line)
        if m is None:
            continue
        text = m.group(2)
        slug = anchor(text)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        slug = slug if n == 0 else f"{slug}-{n}"
        names = re.findall(r"`([^`]+)`", text)
        for name in names:
            anywhere.setdefault(name, (slug, None))
            if len(m.group(1)) == 2 and name not in level2:
                trouble = text.split(": `", 1)[0] if len(set(names)) == 1 and ": `" in text else None
                level2[name] = (slug, trouble)
    return {**anywhere, **level2}


def _clip(text: str, limit: int = COMPACT_CELL_CHARS) -> str:
    if len(text) <= limit:
        return text
    return text[: limit - 1].rsplit(" ", 1)[0].rstrip(",;:") + "…"


def compact_block(
    results: dict[str, list[dict[str, Any]]], page: str | None = None, link: str = BENCHMARKS_PAGE
) -> str:
    """The headline in five columns (``bench:headline compact``), for a README: each scenario, what its cluster
    suffers from, the soonest contender (and the one it ties with), its time to target against the reference's in
    one figure, and a link to the scenario's section of the benchmarks page (``page``: that page's text, ``link``:
    the way to it from the file being rendered). The full table, with intervals and verdicts, is the page's."""
    sections = scenario_sections(page) if page is not None else {}
    lines = [
        "| scenario | what the cluster suffers from | best strategy | how much sooner than DDP | evidence |",
        "|---|---|---|---|---|",
    ]
    for r in headline_rows(results):
        scenario = r["scenario"]
        where, trouble = sections.get(scenario, (None, None))
        if trouble is None:
            found = lookup(scenario)
            trouble = found.description if found is not None else "n/a"
        ranking: Ranking | None = r["ranking"]
        best = f"`{r['best']}`"
        if ranking is not None and ranking.first is None:
            best = ranking.verdict
        elif ranking is not None and ranking.verdict == "tie":
            best += f", tied with `{ranking.standings[1].strategy}`"
        elif ranking is not None and ranking.verdict != "winner":
            best += f" ({ranking.verdict})"
        sooner = "n/a"
        if r["speedup"] is not None:
            sooner = f"{r['speedup']:.1f}x" + ("" if r["reference"] == "ddp" else f" (vs `{r['reference']}`)")
        target = link if where is None else f"{link}#{where}"
        seeds = f"{r['repeats']} seeds" if r["repeats"] else "section"
        cells = [f"`{scenario}`", trouble, best, sooner, f"[{seeds}]({target})"]
        lines.append("| " + " | ".join(_clip(c) if i == 1 else c for i, c in enumerate(cells)) + " |")
    return "\n".join(lines) + "\n"

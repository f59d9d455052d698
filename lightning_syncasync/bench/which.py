"""The README's "Which strategy?" table, generated (:mod:`~lightning_syncasync.bench.publish`): each row a situation in
plain words, the strategy for it, and one measured figure, the reference's median time to the scenario's target over
that strategy's, from a named results file, with a link to the scenario's section where the intervals are.

    <!-- bench:which
    ranks alike, no straggler ; `auto_sync` (or `ddp`) ; homogeneous_long_5seeds-auto_async.json:auto_sync
    one slow rank or node ; `AdaptiveBatchSize` with `ddp` ; straggler_long_5seeds.json:ddp_adaptive_batch
    -->
    <!-- bench:end -->

A row is ``situation ; use ; FILE:CONTENDER`` (``;`` since the cells hold ``|`` nowhere and Markdown code spans may
hold ``,``); the figure is the contender's entry of that file's ranking (:class:`~lightning_syncasync.bench.evidence.
Ranking`), so it is the number the scenario's own tables show. No figure is typed by hand.
"""

from __future__ import annotations

from typing import Any

from lightning_syncasync.bench.evidence import Ranking
from lightning_syncasync.bench.headline import COMPACT_CELL_CHARS, scenario_sections
from lightning_syncasync.bench.tables import side_by_side


def which_block(spec: str, results: dict[str, list[dict[str, Any]]], page: str | None, link: str) -> str:
    """The table of ``spec``'s rows (the marker's text after ``which``), with links into ``page`` (the benchmarks
    page's text) reached as ``link`` from the file being rendered."""
    sections = scenario_sections(page) if page is not None else {}
    lines = [
        "| your cluster | use | measured: DDP's time to target over its | evidence |",
        "|---|---|---|---|",
    ]
    for raw in spec.strip().splitlines():
        if not raw.strip():
            continue
        parts = [p.strip() for p in raw.split(";")]
        if len(parts) != 3 or ":" not in parts[2]:
            raise ValueError(
                f"a bench:which row must be 'situation ; use ; FILE:CONTENDER', got {raw.strip()!r}; HINT: e.g. "
                "'one slow rank ; `async_ssp` ; straggler_long_5seeds.json:async_ssp'"
            )
        situation, use, source = parts
        name, contender = source.rsplit(":", 1)
        scenario, figure = _figure(name, contender, results)
        where = sections.get(scenario, (None, None))[0]
        target = link if where is None else f"{link}#{where}"
        cells = [situation, use, figure, f"[`{scenario}`]({target})"]
        long = [c for c in cells if len(c) > COMPACT_CELL_CHARS]
        if long:
            raise ValueError(
                f"a bench:which cell is over {COMPACT_CELL_CHARS} characters: {long[0]!r}; HINT: shorten it"
            )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _figure(name: str, contender: str, results: dict[str, list[dict[str, Any]]]) -> tuple[str, str]:
    """``(scenario, "1.63x (5 seeds, tied)")``: the contender's standing in the file's ranking."""
    if name not in results:
        raise ValueError(
            f"a bench:which row names {name!r}, which is not a results file of bench records; HINT: choose from "
            f"{sorted(results)}"
        )
    records = [r for r in results[name] if not r.get("quick")]
    scenarios = sorted({r["scenario"] for r in records if r["strategy"] == contender})
    if len(scenarios) != 1:
        raise ValueError(
            f"a bench:which row names {contender!r} in {name}, which holds it in {len(scenarios)} scenarios "
            f"({scenarios}); HINT: a contender of the file: {sorted({r['strategy'] for r in records})}"
        )
    scenario = scenarios[0]
    ranking = Ranking.of(scenario, side_by_side([r for r in records if r["scenario"] == scenario]))
    standing = next((s for s in ranking.standings if s.strategy == contender), None)
    if standing is None or standing.vs_ddp is None:
        return scenario, f"not ranked ({ranking.verdict})"
    if ranking.verdict == "tie" and standing in ranking.standings[:2]:
        order = "tied for first"
    elif ranking.first is standing:
        order = "first, by the interval" if ranking.verdict == "winner" else "first, not ranked"
    else:
        order = f"behind `{ranking.standings[0].strategy}`"
    reference = "" if ranking.reference == "ddp" else f" (vs `{ranking.reference}`)"
    return scenario, f"{standing.vs_ddp.value:.2f}x{reference} ({standing.seeds} seeds; {order})"

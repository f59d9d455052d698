"""Docs generated from committed benchmark results: ``syncasync-bench report --from docs/results --to
docs/benchmarks.md --to docs/benchmarks_archive.md --to docs/strategies.md --to README.md``.

A Markdown file keeps its prose by hand and its figures from the results, between markers that regenerating
rewrites (and nothing else)::

    <!-- bench:table straggler_long.json -->            every scenario table of that results file
    <!-- bench:end -->
    <!-- bench:headline -->                            the best contender per scenario, over every results file
    <!-- bench:end -->                                   (:mod:`~lightning_syncasync.bench.headline`)
    <!-- bench:headline straggler_long -->             that scenario's row (comma-separated: those scenarios')
    <!-- bench:end -->
    <!-- bench:headline compact -->                    five columns for a README, each scenario linked to its
    <!-- bench:end -->                                   section of the benchmarks.md beside the results folder
    <!-- bench:rows slow_link_compression.json -->      a file of flat rows (a study's own records), as a table
    <!-- bench:end -->
    <!-- bench:advice advice.json -->                  the advisor's picks (syncasync-bench --advise) scored
    <!-- bench:end -->                                   against each scenario's measured ranking
    <!-- bench:script collective_bytes.py collective_bytes.json -->   what ``python scripts/collective_bytes.py
    <!-- bench:end -->                                   --table <from>/collective_bytes.json`` prints (a study script)
    <!-- bench:pooled a.json,b.json async_ssp_h4:async_ssp -->   learning per sample pooled over those files' pairs
    <!-- bench:end -->                                   of seeds (:mod:`~lightning_syncasync.bench.pooled`)
    <!-- bench:against a.json:auto_sync,b.json:auto_sync_async -->   each named contender against the soonest
    <!-- bench:end -->                                   fixed contender of its own file (issue 48's auto_sync target)
    <!-- bench:which ROWS -->                      the README's "Which strategy?": a situation, a strategy, one figure
    <!-- bench:end -->                                   per row (:mod:`~lightning_syncasync.bench.which`)
    <!-- bench:sweep a.json,b.json async_ssp:async_ssp_k -->   a self-tuned contender against the fixed settings
    <!-- bench:end -->                                   of its file named PREFIX<N> (issue 64's round-length sweep)

A results file is a ``syncasync-bench`` folder's ``results.json`` copied into ``--from`` (any ``*.json`` there, or
``<name>/results.json``, holding a list of bench records); re-running one scenario into it and regenerating
updates that scenario's rows. ``--check`` writes nothing and fails when a file is stale, which is what the test
suite runs, so a table that no longer matches its results cannot stay in the docs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from lightning_syncasync.bench._elastic_report import elastic_answers, elastic_table
from lightning_syncasync.bench.evidence import Ranking, bootstrap_ratio
from lightning_syncasync.bench.headline import (
    BENCHMARKS_PAGE,
    HEADLINE_FIGURE,
    compact_block,
    headline_block,
    headline_sources,
    write_headline_figure,
)
from lightning_syncasync.bench.phases import changing, phase_table
from lightning_syncasync.bench.pooled import PooledLearning
from lightning_syncasync.bench.scenarios import lookup
from lightning_syncasync.bench.tables import learning_table, ranking_lines, scenario_table, side_by_side, summarise
from lightning_syncasync.bench.which import which_block

_BLOCK = re.compile(
    r"(<!-- bench:(headline(?: [^>]+?)?|which\s[^>]+?|(?:table|rows|script|advice|pooled|against|sweep) [^>]+?)\s-->\n)"
    r"(.*?)"
    r"(<!-- bench:end -->)",
    re.S,
)


def load_results(folder: Path) -> dict[str, list[dict[str, Any]]]:
    """``{file name relative to folder: bench records}`` for every results file of bench records in ``folder``
    (other JSON there, e.g. a study's own format, is left out)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for path in sorted([*folder.glob("*.json"), *folder.glob("*/results.json")]):
        data = json.loads(path.read_text())
        if isinstance(data, list) and data and all(isinstance(r, dict) and "scenario" in r for r in data):
            out[path.relative_to(folder).as_posix()] = data
    return out


def _commands(records: list[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(r["command"] for r in records if r.get("command")))


def table_block(name: str, records: list[dict[str, Any]]) -> str:
    """Every scenario of one results file: its table and the command(s) that measured it."""
    lines: list[str] = []
    table = summarise(records)
    for scenario, by_strategy in table.items():
        if len(table) > 1:
            lines += [f"`{scenario}`:", ""]
        lines += scenario_table(by_strategy) + [""]
        found = lookup(scenario)
        learning = learning_table(by_strategy) if found is None or not found.elastic else []
        if learning:
            lines += ["Learning per sample against `ddp`, seed by seed:", "", *learning, ""]
        if found is None or not found.elastic:
            ranked = [r for r in records if r["scenario"] == scenario and not r.get("quick")]
            if ranked:
                lines += ranking_lines(scenario, ranked) + [""]
        if found is not None and found.elastic:
            lines += elastic_table(by_strategy) + [""] + elastic_answers(scenario, table)
        if found is not None and changing(found):
            lines += phase_table(found, by_strategy)
    cmds = _commands(records)
    lines.append(f"Measured by {', '.join(f'`{c}`' for c in cmds) or 'an unrecorded command'} (records: `{name}`).")
    return "\n".join(lines) + "\n"


def score_advice(advice: dict[str, Any], results: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """One scenario's advisor pick against its measured ranking (issue 48): ``score`` is ``"best"`` (the measured
    first), ``"tied"`` (the interval of the pick's median time over the first's includes 1), ``"wrong"``, or why
    it cannot be scored (the pick was not measured there, the scenario is not ranked)."""
    scenario = advice["scenario"]
    source = next((s for s in headline_sources(results) if s[0] == scenario), None)
    out: dict[str, Any] = {"scenario": scenario, "pick": advice.get("pick"), "ranking": None, "vs_first": None}
    if "error" in advice:
        return {**out, "score": f"advisor failed: {advice['error']}"}
    if source is None:
        return {**out, "score": "no measurement of this scenario"}
    ranking = Ranking.of(scenario, side_by_side(source[2]))
    out["ranking"] = ranking
    first = ranking.first
    if first is None or ranking.verdict.startswith("not ranked"):
        return {**out, "score": f"{ranking.verdict}"}
    mine = next((s for s in ranking.standings if s.strategy == advice.get("pick")), None)
    if mine is None:
        return {**out, "score": f"`{advice.get('pick')}` not measured here"}
    if mine is first:
        return {**out, "score": "best"}
    interval = bootstrap_ratio(mine.times, first.times)
    out["vs_first"] = interval
    tied = interval is not None and not interval.excludes_one()
    return {**out, "score": "tied" if tied else "wrong"}


def advice_block(path: Path, results: dict[str, list[dict[str, Any]]]) -> str:
    """The advisor scored (``syncasync-bench --advise``'s ``advice.json``): per scenario its pick and confidence
    next to the measured ranking, and how many of the scored scenarios it got right."""
    if not path.is_file():
        raise ValueError(f"bench:advice needs {path}; HINT: syncasync-bench --scenario ... --advise --out DIR writes "
                         "DIR/advice.json")  # fmt: skip
    entries = json.loads(path.read_text()).get("advice", [])
    lines = [
        "| scenario | advisor's pick | its confidence (predicted margin over the runner-up; model error) "
        "| measured first (verdict) | pick's time over the first's (90% CI) | score |",
        "|---|---|---|---|---|---|",
    ]
    right = scored = 0
    for a in entries:
        sc = score_advice(a, results)
        margin = (
            f"{a['margin']:.2f}x over `{a.get('runner_up')}`; +-{a.get('model_error', 0):.0%}"
            + (f"; says tie with `{a['tie_with']}`" if a.get("tie_with") else "")
            if a.get("margin") is not None
            else "n/a"
        )
        ranking = sc["ranking"]
        first = "n/a" if ranking is None or ranking.first is None else f"`{ranking.first.strategy}` ({ranking.verdict})"
        vs = "n/a" if sc["vs_first"] is None else str(sc["vs_first"])
        if sc["score"] in ("best", "tied", "wrong"):
            scored += 1
            right += sc["score"] != "wrong"
        lines.append(f"| `{a['scenario']}` | `{sc['pick']}` | {margin} | {first} | {vs} | {sc['score']} |")
    lines += ["", f"The advisor's pick is the measured best or tied with it in {right} of the {scored} scenarios "
              f"that could be scored (of {len(entries)} advised; records: `{path.name}`)."]  # fmt: skip
    return "\n".join(lines) + "\n"


def rows_block(path: Path) -> str:
    """A results file of flat rows (a list of dicts of numbers and strings) as a Markdown table, in file order."""
    rows = json.loads(path.read_text())
    if not (isinstance(rows, list) and rows and all(isinstance(r, dict) for r in rows)):
        raise ValueError(f"{path} is not a list of rows; HINT: bench:rows renders a JSON list of flat objects")
    keys = list(dict.fromkeys(k for r in rows for k in r))

    def cell(v: Any) -> str:
        if v is None:
            return "n/a"
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(cell(r.get(k)) for k in keys) + " |" for r in rows]
    return "\n".join(lines) + f"\n\nRecords: `{path.name}`.\n"


def script_block(script: Path, data: Path) -> str:
    """What a study script prints for ``--table data`` (its own Markdown, from its own results file)."""
    if not script.is_file() or not data.is_file():
        raise ValueError(
            f"bench:script needs {script} and {data}; HINT: run from the repository root (scripts/ beside --from)"
        )
    done = subprocess.run(
        [sys.executable, str(script), "--table", str(data)], capture_output=True, text=True, check=False, timeout=300
    )
    if done.returncode != 0:
        raise ValueError(f"{script.name} --table {data} failed: {done.stderr.strip()[-500:]}")
    return done.stdout.rstrip("\n") + "\n"


def pooled_block(args: list[str], results: dict[str, list[dict[str, Any]]]) -> str:
    """``bench:pooled FILES [A:B ...]``: learning per sample pooled over the files (comma-separated), every
    contender against its reference and each ``A:B`` against each other."""
    between = []
    for item in args[1:]:
        a, sep, b = item.partition(":")
        if not sep or not a or not b:
            raise ValueError(
                f"bench:pooled pair {item!r} is not CONTENDER:REFERENCE; HINT: e.g. async_ssp_h4:async_ssp"
            )
        between.append((a, b))
    files = [f for f in args[0].split(",") if f]
    return "\n".join(PooledLearning.of(results, files, between).table(between)) + "\n"


# Contenders that choose their algorithm while they run: never "the best fixed contender" of a file.
ADAPTIVE_PREFIX = "auto_sync"


def against_block(arg: str, results: dict[str, list[dict[str, Any]]]) -> str:
    """``bench:against FILE:CONTENDER,...``: per pair, the contender against the soonest fixed contender (any other
    strategy not named ``auto_sync*``) of the same file, ranked as the headline ranks (the reference's rule target,
    censored misses, paired seeds): the fixed one's median time over the contender's with its bootstrap interval.
    Issue 48's targets read its upper end: >= 1.0 is "at least the best fixed", >= 0.9 "within 10% of it"."""
    lines = [
        "| scenario | contender | best fixed contender | its median time to target (s) | contender's (s) "
        "| best fixed's time over the contender's (90% CI) | contender reached | upper end >= 1.0 / >= 0.9 | records |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for item in (i for i in arg.split(",") if i):
        name, sep, contender = item.rpartition(":")
        if not sep or name not in results or not contender:
            raise ValueError(
                f"bench:against item {item!r} is not FILE:CONTENDER of a results file; HINT: e.g. "
                f"slow_link_5seeds-auto_sync.json:auto_sync, files from {sorted(results)}"
            )
        records = [r for r in results[name] if not r.get("quick")]
        for scenario in dict.fromkeys(r["scenario"] for r in records):
            by = side_by_side([r for r in records if r["scenario"] == scenario])
            if contender not in by:
                raise ValueError(f"bench:against: {name} has no {contender!r} runs of {scenario}; HINT: it has "
                                 f"{sorted(by)}")  # fmt: skip
            ranking = Ranking.of(scenario, by)
            mine = next((s for s in ranking.standings if s.strategy == contender), None)
            fixed = next((s for s in ranking.standings if not s.strategy.startswith(ADAPTIVE_PREFIX)), None)
            if mine is None or fixed is None or ranking.verdict.startswith("not ranked"):
                lines.append(f"| `{scenario}` | `{contender}` | n/a | n/a | n/a | {ranking.verdict} | n/a | n/a "
                             f"| `{name}` |")  # fmt: skip
                continue
            ratio = bootstrap_ratio(fixed.times, mine.times)
            meets = "n/a" if ratio is None else " / ".join("yes" if ratio.high >= t else "no" for t in (1.0, 0.9))
            lines.append(
                f"| `{scenario}` | `{contender}` | `{fixed.strategy}` | {fixed.median:.1f} | {mine.median:.1f} "
                f"| {ratio or 'n/a'} | {mine.reached}/{mine.seeds} | {meets} | `{name}` |"
            )
    return "\n".join(lines) + "\n"


def sweep_block(args: list[str], results: dict[str, list[dict[str, Any]]]) -> str:
    """``bench:sweep FILES TUNED:PREFIX``: per file and scenario, the self-tuned contender ``TUNED`` beside every
    contender named ``PREFIX<N>`` (a fixed setting N), ranked as the headline ranks (the reference's rule target,
    misses censored at the budget, seeds paired): each one's median time to target, the best fixed setting, the best
    fixed's time over the self-tuned's with its 90% interval, and the reference's (DDP's) time over the self-tuned's.
    Issue 64's targets: the self-tuned median within 10% of the best fixed's, and not behind DDP by the interval
    (the upper end of DDP's time over its own >= 1). A setting a file did not run reads n/a."""
    if len(args) != 2 or ":" not in args[1]:
        raise ValueError(f"bench:sweep takes FILES TUNED:PREFIX, got {' '.join(args)!r}; HINT: e.g. "
                         "'link_bound_5seeds.json async_ssp:async_ssp_k'")  # fmt: skip
    tuned, prefix = args[1].split(":", 1)

    def setting(name: str) -> int | None:
        rest = name[len(prefix) :]
        return int(rest) if name.startswith(prefix) and rest.isdigit() else None

    rankings: list[tuple[str, str, Ranking]] = []
    for name in (f for f in args[0].split(",") if f):
        if name not in results:
            raise ValueError(f"bench:sweep names {name!r}, not a results file; HINT: choose from {sorted(results)}")
        records = [r for r in results[name] if not r.get("quick")]
        for scenario in dict.fromkeys(r["scenario"] for r in records):
            by = side_by_side([r for r in records if r["scenario"] == scenario])
            if tuned not in by or not any(setting(k) is not None for k in by):
                raise ValueError(f"bench:sweep: {name} has no {tuned!r} or no {prefix}<N> runs of {scenario}; "
                                 f"HINT: it has {sorted(by)}")  # fmt: skip
            rankings.append((name, scenario, Ranking.of(scenario, by)))
    fixed = sorted({n for _, _, rk in rankings for s in rk.standings if (n := setting(s.strategy)) is not None})
    reference = rankings[0][2].reference if rankings else "ddp"
    lines = [
        "| scenario | target | " + " | ".join(f"{n} steps" for n in fixed)
        + f" | `{tuned}` (self-tuned) | best fixed | its time over the self-tuned's (90% CI) "
        f"| self-tuned within 10% of the best fixed | {reference}'s time over the self-tuned's (90% CI) | records |",
        "|---|---|" + "---|" * len(fixed) + "---|---|---|---|---|---|",
    ]  # fmt: skip
    for name, scenario, ranking in rankings:
        standing = {s.strategy: s for s in ranking.standings}
        cells = [
            f"{st.median:.1f} ({st.reached}/{st.seeds})" if (st := standing.get(f"{prefix}{n}")) else "n/a"
            for n in fixed
        ]
        present = [s for s in ranking.standings if setting(s.strategy) is not None]
        mine = standing.get(tuned)
        if mine is None or not present or ranking.target is None:
            lines.append(f"| `{scenario}` | n/a | " + " | ".join(cells) + f" | n/a | n/a | {ranking.verdict} | n/a "
                         f"| n/a | `{name}` |")  # fmt: skip
            continue
        best = min(present, key=lambda st: st.median)
        ratio = bootstrap_ratio(best.times, mine.times)
        ref = standing.get(ranking.reference)
        vs_ref = bootstrap_ratio(ref.times, mine.times) if ref is not None else None
        within = "yes" if mine.median <= 1.1 * best.median else "no"
        lines.append(
            f"| `{scenario}` | {ranking.target:g} | " + " | ".join(cells)
            + f" | {mine.median:.1f} ({mine.reached}/{mine.seeds}) | {setting(best.strategy)} steps "
            f"| {ratio or 'n/a'} | {within} | {vs_ref or 'n/a'} | `{name}` |"
        )  # fmt: skip
    return "\n".join(lines) + "\n"


def render(
    text: str,
    results: dict[str, list[dict[str, Any]]],
    source: Path | None = None,
    scripts: Path | None = None,
    target: Path | None = None,
) -> str:
    """``text`` with every marked block regenerated from ``results`` (the bench records of ``source``; ``rows`` and
    ``script`` blocks read their files from ``source`` and run ``scripts``' study scripts; the compact headline links
    to ``benchmarks.md`` beside ``source`` from ``target``, the file ``text`` is written to)."""

    def block(m: re.Match[str]) -> str:
        kind = m.group(2)
        if kind == "headline":
            body = headline_block(results)
        elif kind == "headline compact" or kind.startswith("which"):
            page = None if source is None else source.parent / BENCHMARKS_PAGE
            link = BENCHMARKS_PAGE
            if page is not None and target is not None:
                link = Path(os.path.relpath(page, target.parent)).as_posix()
            text_of_page = page.read_text() if page is not None and page.exists() else None
            if kind.startswith("which"):
                body = which_block(kind[len("which") :], results, text_of_page, link)
            else:
                body = compact_block(results, text_of_page, link)
        elif kind.startswith("headline "):
            body = headline_block(results, kind.split()[1].split(","))
        elif kind.startswith("pooled "):
            body = pooled_block(kind.split()[1:], results)
        elif kind.startswith("against "):
            body = against_block(kind.split(" ", 1)[1], results)
        elif kind.startswith("sweep "):
            body = sweep_block(kind.split()[1:], results)
        elif kind.startswith("advice "):
            if source is None:
                raise ValueError(f"{kind}: needs the results folder")
            body = advice_block(source / kind.split()[1], results)
        elif kind.startswith(("rows ", "script ")):
            if source is None or scripts is None:
                raise ValueError(f"{kind}: needs the results folder and the scripts folder")
            args = kind.split()
            body = (
                rows_block(source / args[1]) if args[0] == "rows" else script_block(scripts / args[1], source / args[2])
            )
        else:
            name = kind.split(" ", 1)[1]
            if name not in results:
                raise ValueError(
                    f"a bench:table marker names {name!r}, which is not a results file of bench records; HINT: "
                    f"copy a bench folder's results.json there, or choose from {sorted(results)}"
                )
            body = table_block(name, results[name])
        return m.group(1) + body + m.group(4)

    return _BLOCK.sub(block, text)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="syncasync-bench report", description="regenerate docs from results files")
    p.add_argument("--from", dest="source", required=True, help="folder of results files (e.g. docs/results)")
    p.add_argument("--to", action="append", required=True, help="Markdown file with bench markers; repeatable")
    p.add_argument("--figure", default=None, help=f"also write the headline figure here (e.g. docs/{HEADLINE_FIGURE})")
    p.add_argument("--scripts", default="scripts", help="folder of the study scripts of bench:script blocks")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file is stale")
    args = p.parse_args(argv)
    source = Path(args.source)
    if not source.is_dir():
        p.error(f"--from {source} is not a folder; HINT: the folder holding the results files, e.g. docs/results")
    results = load_results(source)
    stale = []
    for target in map(Path, args.to):
        if not target.exists():
            p.error(f"--to {target} does not exist; HINT: create it with bench markers (see --help of this module)")
        text = target.read_text()
        try:
            new = render(text, results, source, Path(args.scripts), target)
        except ValueError as err:
            p.error(str(err))
        if new != text:
            stale.append(str(target))
            if not args.check:
                target.write_text(new)
    if args.figure and not args.check:
        write_headline_figure(results, Path(args.figure))
    if args.check and stale:
        print(f"stale: {', '.join(stale)}; HINT: syncasync-bench report --from {source} --to FILE regenerates it")
        return 1
    print(f"regenerated: {', '.join(stale)}" if stale else "up to date")
    return 0

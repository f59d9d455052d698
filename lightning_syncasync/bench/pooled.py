"""Learning per sample pooled over the scenarios of one workload (issue 49): the resolution 5 seeds lack.

One invocation's 5 seeds cannot tell a 10% difference in samples to a plateau target from the metric's own noise
(DDP with its batches in another order moves the crossing of 0.97 by up to 1.5x), and a per-scenario table says
"3 of 5 reached" four times without saying whether that is one effect or four draws. The scenarios of the long
MNIST workload (``straggler_long``, ``jitter_long``, ``mid_run_straggler_long``, ``hetero_slow_link``) train the
same model, data and schedule and differ in timing, so their runs of a contender against ``ddp`` are pairs of the
same question. Pooled:

* **A pair** is one seed of one invocation: a contender's run and its reference's (``ddp``'s) run of the same seed,
  side by side (the same ``command``). Runs that failed are left out (the scenario tables count them).
* **Against the reference**, per contender: the geometric mean over pairs of its samples to the scenario's target
  over the reference's (a miss counts as the whole budget), the mean of its final metric minus the reference's, in
  points, and the reference's time to the invocation's rule target (:func:`~lightning_syncasync.bench.evidence.
  rule_target`) over its own; each with a ``CONFIDENCE`` bootstrap interval resampling the pairs.
* **Pairs that share a reference run.** ``ddp``'s learning is bitwise the same run after run for one seed and
  workload (its curve does not depend on timing: 23 invocations of the long MNIST workload hold 5 distinct ``ddp``
  curves, one per seed), so every invocation pairs its contender with the same 5 reference runs. The pairs are then
  not independent draws: the samples column also gives the interval that resamples the distinct reference runs
  (clusters of pairs), which is the one to read when it is wider.
* **Between two contenders** that ran side by side (``async_ssp_h4:async_ssp``): the same three figures with the
  second as the reference, over the seeds where both ran: a paired comparison of two settings of one strategy. A
  side may name one setting under the names it had over time (``async_ssp_h4:async_ssp_h8|async_ssp``: rounds of 8
  were ``async_ssp`` until they stopped being its default); the first name that ran in an invocation is used.

A docs block: ``<!-- bench:pooled a.json,b.json async_ssp_h4:async_ssp -->`` (the files, then any pairs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lightning_syncasync.bench.evidence import (
    CONFIDENCE,
    REFERENCES,
    bootstrap_geomean,
    bootstrap_geomean_clustered,
    bootstrap_mean,
    budget_time,
    rule_target,
    time_to,
)
from lightning_syncasync.bench.tables import samples_or_budget, samples_to_target, side_by_side


@dataclass(frozen=True)
class _Pair:
    source: str  # results file
    run: dict[str, Any]
    ref: dict[str, Any]
    rule: float | None  # the invocation's rule target (from its reference's runs alone)


def _present(names: str, by: dict[str, list[dict[str, Any]]]) -> str | None:
    """The first of ``names`` (``a|b``: one setting under the names it had over time) that ran here."""
    return next((n for n in names.split("|") if by.get(n)), None)


def _identity(run: dict[str, Any]) -> tuple[Any, ...]:
    """Runs with the same seed and the same validation curve are one run repeated (``ddp`` is deterministic)."""
    return run.get("train_seed"), tuple(round(float(h["value"]), 6) for h in run.get("val_history") or [])


def _time(run: dict[str, Any], level: float | None) -> float | None:
    got = None if level is None else time_to(run, level)
    return got if got is not None else budget_time(run)


@dataclass(frozen=True)
class PooledLearning:
    """Pairs of runs from several results files, grouped by what they compare (see the module's doc)."""

    files: tuple[str, ...]
    pairs: dict[tuple[str, str], list[_Pair]]  # (contender, its reference) -> pairs

    @classmethod
    def of(
        cls, results: dict[str, list[dict[str, Any]]], files: list[str], between: Sequence[tuple[str, str]] = ()
    ) -> PooledLearning:
        """Pair every contender of ``files`` with its reference seed by seed, and each ``(a, b)`` of ``between``
        with each other.

        Raises:
            ValueError: a file that is not a results file of ``results``, or a pair naming the same contender twice.
        """
        missing = [f for f in files if f not in results]
        if missing:
            raise ValueError(
                f"bench:pooled names {missing}, not results files of bench records; HINT: choose from {sorted(results)}"
            )
        for a, b in between:
            if a == b:
                raise ValueError(f"bench:pooled pair {a}:{b} compares a contender with itself; HINT: e.g. "
                                 "async_ssp_h4:async_ssp")  # fmt: skip
        pairs: dict[tuple[str, str], list[_Pair]] = {}
        for name in files:
            records = [r for r in results[name] if not r.get("quick")]
            for scenario in dict.fromkeys(r["scenario"] for r in records):
                by = side_by_side([r for r in records if r["scenario"] == scenario])
                reference = next((k for k in REFERENCES if by.get(k)), None)
                if reference is None:
                    continue
                rule = rule_target(by[reference])
                comparisons = [(s, reference) for s in by if s != reference] + list(between)
                for mine, theirs in comparisons:
                    a, b = _present(mine, by), _present(theirs, by)
                    if a is None or b is None:
                        continue
                    ref_of = {(r.get("command"), r.get("train_seed")): r for r in by[b] if "error" not in r}
                    for run in by[a]:
                        ref = ref_of.get((run.get("command"), run.get("train_seed")))
                        if ref is not None and "error" not in run:
                            pairs.setdefault((mine, theirs), []).append(_Pair(name, run, ref, rule))
        return cls(tuple(files), pairs)

    def row(self, mine: str, theirs: str) -> dict[str, Any] | None:
        """The pooled figures of ``mine`` against ``theirs`` (``None``: no pair)."""
        pairs = self.pairs.get((mine, theirs))
        if not pairs:
            return None
        ratios, finals, speedups = [], [], []
        by_reference: dict[tuple[Any, ...], list[float]] = {}
        for p in pairs:
            a, b = samples_or_budget(p.run), samples_or_budget(p.ref)
            if a and b:
                ratios.append(a / b)
                by_reference.setdefault(_identity(p.ref), []).append(a / b)
            fa, fb = p.run.get("final_val_metric"), p.ref.get("final_val_metric")
            if fa is not None and fb is not None:
                finals.append(100 * (fa - fb))
            ta, tb = _time(p.run, p.rule), _time(p.ref, p.rule)
            if ta and tb:
                speedups.append(tb / ta)
        return {
            "pairs": len(pairs),
            "files": len({p.source for p in pairs}),
            "reached": sum(samples_to_target(p.run) is not None for p in pairs),
            "reference_reached": sum(samples_to_target(p.ref) is not None for p in pairs),
            "samples": bootstrap_geomean(ratios),
            "references": len(by_reference),
            "samples_by_reference": bootstrap_geomean_clustered(list(by_reference.values())),
            "final": bootstrap_mean(finals),
            "speedup": bootstrap_geomean(speedups),
        }

    def table(self, between: Sequence[tuple[str, str]] = ()) -> list[str]:
        """Markdown: every contender against its reference, then each pair of ``between``."""
        refs = set(REFERENCES)
        against = [k for k in self.pairs if k[1] in refs and k[0] not in refs and k not in between]
        lines = [
            f"Pooled over {len(self.files)} results file(s) ({', '.join(f'`{f}`' for f in self.files)}); a pair is "
            f"one seed of one invocation, {CONFIDENCE:.0%} bootstrap intervals resample the pairs:",
            "",
            "| contender | against | pairs (files) | reached the scenario's target (contender; reference) | samples to "
            "it over the reference's, geometric mean | the same, resampling the distinct reference runs (how many) "
            "| final - reference's (points), mean | reference's time to the rule target over the contender's, "
            "geometric mean |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for mine, theirs in [*against, *between]:
            row = self.row(mine, theirs)
            mine, theirs = mine.replace("|", " or "), theirs.replace("|", " or ")  # a "|" would split the cell
            if row is None:
                lines.append(f"| {mine} | {theirs} | 0 | n/a | n/a | n/a | n/a | n/a |")
                continue
            final = row["final"]
            final_s = "n/a" if final is None else f"{final.value:+.2f} [{final.low:+.2f}..{final.high:+.2f}]"
            lines.append(
                f"| {mine} | {theirs} | {row['pairs']} ({row['files']}) | {row['reached']}/{row['pairs']}; "
                f"{row['reference_reached']}/{row['pairs']} | {row['samples'] or 'n/a'} | "
                f"{row['samples_by_reference'] or 'n/a'} ({row['references']}) | {final_s} "
                f"| {row['speedup'] or 'n/a'} |"
            )
        return lines

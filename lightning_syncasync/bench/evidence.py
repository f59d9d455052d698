"""Rankings a user can act on (issue 48): time-to-accuracy curves, a target chosen from ``ddp``'s runs alone, and
bootstrap confidence intervals over seeds.

Why not the scenario's own target and medians with [min-max]: the long workload's target (0.97) sits on DDP's
plateau, where the same algorithm with its batches in another order crosses it up to 1.5x later, and a [min-max]
over 3 seeds cannot tell a 10-20% difference from that noise. The method here:

* **Curves.** Every run's time-to-accuracy curve is the training time (validation left out, as for
  ``time_to_target_s``) at which each level of a fixed grid (multiples of ``GRID_STEP``) is first reached.
* **The target, from ``ddp`` alone.** The highest grid level that every ``ddp`` seed reaches within
  ``TARGET_BUDGET_SHARE`` of the budget's samples. It depends on nothing but ``ddp``'s records, so no other
  contender can move it, and it lies below DDP's plateau by construction (every seed gets there with 40% of the
  budget to spare), where curves are steep and a crossing moves with learning, not with a wobble.
* **Censoring.** A run that never reaches the target counts as a miss at its whole budget's training time (a run
  that failed, at its ``ddp`` seed's): its median shows it, and the table counts the misses.
* **Intervals.** Each ratio of median times to the target (a contender's over ``ddp``'s, the winner's over the
  runner-up's) carries a ``CONFIDENCE`` percentile bootstrap interval over seeds: the seeds are resampled with
  replacement, paired (a resampled seed brings both contenders' runs of that seed; they ran side by side in one
  invocation), ``BOOTSTRAP_RESAMPLES`` times with a fixed generator so that regenerating the docs is reproducible.
* **Winner or tie.** A ranking needs at least ``MIN_SEEDS`` seeds per contender. The contender with the lowest
  median time wins only where the interval of the runner-up's time over its own excludes 1; otherwise the verdict
  is a tie between the two.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lightning_syncasync.bench.scenarios import lookup

GRID_STEP = 0.005  # the curves' level grid: half a point of accuracy
TARGET_BUDGET_SHARE = 0.6  # every ddp seed must reach the ranking's target within this share of the budget
MIN_SEEDS = 5  # seeds per contender below which nothing is ranked
# The synchronous reference whose runs alone choose the target: DDP, or, where the scenario shards the model, FSDP
# over every rank (DDP's update, sharded).
REFERENCES = ("ddp", "fsdp")
CONFIDENCE = 0.9
BOOTSTRAP_RESAMPLES = 4000


def _maximise(run: dict[str, Any]) -> bool:
    sc = lookup(run.get("scenario", ""))
    return sc is None or sc.mode != "min"


def _reaches(value: float, level: float, maximise: bool) -> bool:
    # A level of the grid is reached within a float32 metric's rounding error (0.965 is stored as 0.96499997).
    return value >= level - 1e-6 if maximise else value <= level + 1e-6


def _grid_level(k: int) -> float:
    return round(k * GRID_STEP, 6)


def _first_hit(run: dict[str, Any], level: float) -> int | None:
    """The index of the run's first validation that reached ``level`` (``None``: none did)."""
    maximise = _maximise(run)
    history = run.get("val_history") or []
    return next(
        (i for i, h in enumerate(history) if h.get("value") is not None and _reaches(h["value"], level, maximise)),
        None,
    )


def tta_curve(run: dict[str, Any]) -> list[tuple[float, float]]:
    """``[(level, training seconds when first reached)]`` over the grid, up to the best level the run reached."""
    values = [h["value"] for h in run.get("val_history") or [] if h.get("value") is not None]
    if not values:
        return []
    # Upwards from the grid's first level for a metric to maximise, downwards from above the worst value otherwise.
    k, direction = (1, 1) if _maximise(run) else (int(max(values) / GRID_STEP) + 1, -1)
    out: list[tuple[float, float]] = []
    while k > 0:
        level = _grid_level(k)
        seconds = time_to(run, level)
        if seconds is None:
            break
        out.append((level, seconds))
        k += direction
    return out


def time_to(run: dict[str, Any], level: float) -> float | None:
    """Training seconds until the run's validation first reached ``level`` (``None``: never)."""
    hit = _first_hit(run, level)
    if hit is None:
        return None
    h = run["val_history"][hit]
    return float(h.get("train_s", h["elapsed_s"]))


def budget_time(run: dict[str, Any]) -> float | None:
    """The training seconds of the run's whole budget (its last validation's): a miss's time."""
    times = [h.get("train_s", h["elapsed_s"]) for h in run.get("val_history") or []]
    return float(max(times)) if times else None


def budget_share(run: dict[str, Any], level: float) -> float | None:
    """The share of the budget's samples trained when ``level`` was first reached (``None``: never). At epoch-end
    validations every contender has trained the same whole epochs by then, whatever its ranks' step counts; at
    step-interval validations the ranks step together and the share is the step's."""
    hit = _first_hit(run, level)
    if hit is None:
        return None
    history = run["val_history"]
    if ((run.get("config") or {}).get("trainer") or {}).get("val_check_interval") is None:
        return (hit + 1) / len(history)
    steps = run.get("steps")
    return history[hit]["step"] / steps if isinstance(steps, int) and steps else None


def rule_target(ddp_runs: list[dict[str, Any]]) -> float | None:
    """The highest grid level every ``ddp`` run reaches within ``TARGET_BUDGET_SHARE`` of its budget (``None`` when
    a run failed or none qualifies). It reads ``ddp``'s records and nothing else."""
    runs = [r for r in ddp_runs if "error" not in r]
    if not runs or len(runs) < len(ddp_runs):
        return None
    levels = [lvl for lvl, _ in tta_curve(runs[0])]
    ok = [
        lvl
        for lvl in levels
        if all((s := budget_share(r, lvl)) is not None and s <= TARGET_BUDGET_SHARE + 1e-9 for r in runs)
    ]
    if not ok:
        return None
    return max(ok) if _maximise(runs[0]) else min(ok)


@dataclass(frozen=True)
class Interval:
    """A ratio of medians with its bootstrap interval."""

    value: float
    low: float
    high: float

    def excludes_one(self) -> bool:
        return self.low > 1.0 or self.high < 1.0

    def __str__(self) -> str:
        return f"{self.value:.2f}x [{self.low:.2f}-{self.high:.2f}]"


def bootstrap_ratio(
    numerator: dict[Any, float], denominator: dict[Any, float], resamples: int = BOOTSTRAP_RESAMPLES
) -> Interval | None:
    """``median(numerator) / median(denominator)`` with its ``CONFIDENCE`` percentile interval, resampling seeds
    (the dicts' keys) with replacement: paired over the seeds both have, each side on its own otherwise."""
    if not numerator or not denominator:
        return None
    rng = random.Random(0)  # the same interval every time the docs are regenerated
    shared = sorted(set(numerator) & set(denominator), key=str)
    paired = len(shared) == len(numerator) == len(denominator)
    value = statistics.median(numerator.values()) / statistics.median(denominator.values())
    nums, dens = list(numerator.values()), list(denominator.values())
    ratios = []
    for _ in range(resamples):
        if paired:
            pick = [rng.choice(shared) for _ in shared]
            num = statistics.median(numerator[s] for s in pick)
            den = statistics.median(denominator[s] for s in pick)
        else:
            num = statistics.median(rng.choice(nums) for _ in nums)
            den = statistics.median(rng.choice(dens) for _ in dens)
        ratios.append(num / den)
    return Interval(value, *_percentile_interval(ratios))


def _percentile_interval(resampled: list[float]) -> tuple[float, float]:
    """The ``CONFIDENCE`` percentile interval of a bootstrap's resampled statistics."""
    ordered = sorted(resampled)
    tail = (1 - CONFIDENCE) / 2
    return ordered[int(tail * (len(ordered) - 1))], ordered[int(round((1 - tail) * (len(ordered) - 1)))]


def geometric_mean(values: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(v) for v in values))


def bootstrap_geomean(values: list[float], resamples: int = BOOTSTRAP_RESAMPLES) -> Interval | None:
    """The geometric mean of per-seed ratios (e.g. a contender's samples to the target over ``ddp``'s, seed by
    seed) with its ``CONFIDENCE`` percentile interval, resampling the seeds with replacement; ``None`` below 2.

    Why not the median's interval: with 5 seeds a resampled median is the smallest value with probability
    P(at least 3 of 5 draws are it) = 5.8% > 5%, so the 90% interval of a median of 5 is always the seeds' whole
    [min-max]; the geometric mean uses every seed's value and is the mean that treats 2x and 0.5x alike."""
    if len(values) < 2 or any(v <= 0 for v in values):
        return None
    rng = random.Random(0)
    means = [geometric_mean([rng.choice(values) for _ in values]) for _ in range(resamples)]
    return Interval(geometric_mean(values), *_percentile_interval(means))


def bootstrap_geomean_clustered(
    clusters: Sequence[Sequence[float]], resamples: int = BOOTSTRAP_RESAMPLES
) -> Interval | None:
    """The geometric mean of ratios that come in clusters sharing a term (pairs whose reference is one and the same
    run), with its ``CONFIDENCE`` percentile interval resampling whole clusters: what the data say when the clusters,
    not the ratios, are the independent draws. ``None`` below 2 clusters."""
    groups = [list(c) for c in clusters if c]
    values = [v for c in groups for v in c]
    if len(groups) < 2 or any(v <= 0 for v in values):
        return None
    rng = random.Random(0)
    means = [geometric_mean([v for _ in groups for v in rng.choice(groups)]) for _ in range(resamples)]
    return Interval(geometric_mean(values), *_percentile_interval(means))


def bootstrap_mean(values: list[float], resamples: int = BOOTSTRAP_RESAMPLES) -> Interval | None:
    """The mean of per-pair differences with its ``CONFIDENCE`` percentile interval (pairs resampled with
    replacement, a fixed generator); ``None`` below 2 values."""
    if len(values) < 2:
        return None
    rng = random.Random(0)
    means = [statistics.fmean(rng.choice(values) for _ in values) for _ in range(resamples)]
    return Interval(statistics.fmean(values), *_percentile_interval(means))


@dataclass(frozen=True)
class Standing:
    """One contender's time to the ranking's target over its seeds."""

    strategy: str
    times: dict[Any, float]  # seed -> training seconds to the target (a miss counts as its budget's)
    seeds: int
    reached: int
    failed: int
    vs_ddp: Interval | None  # the reference's (ddp's) median time over this contender's: > 1 is sooner

    @property
    def median(self) -> float:
        return statistics.median(self.times.values())


@dataclass(frozen=True)
class Ranking:
    """One scenario's contenders ranked by time to a target chosen from ``ddp``'s runs (see the module's doc)."""

    scenario: str
    target: float | None
    standings: list[Standing]  # soonest first
    verdict: str  # "winner", "tie", or why nothing is ranked
    reference: str  # the synchronous contender that chose the target and that ratios are against
    margin: Interval | None  # the runner-up's median time over the first's

    @classmethod
    def of(cls, scenario: str, by_strategy: dict[str, list[dict[str, Any]]]) -> Ranking:
        """Rank the contenders of one invocation (``{strategy: its runs}``, a reference of ``REFERENCES`` among
        them)."""
        reference = next((k for k in REFERENCES if by_strategy.get(k)), None)
        if reference is None:
            return cls(scenario, None, [], f"not ranked: no {' or '.join(REFERENCES)} runs to choose the target from",
                       "ddp", None)  # fmt: skip
        ddp_runs = by_strategy[reference]
        target = rule_target(ddp_runs)
        if target is None:
            return cls(
                scenario, None, [], f"not ranked: no level that every {reference} seed reaches within "
                f"{TARGET_BUDGET_SHARE:.0%} of the budget (or a {reference} run failed)", reference, None,
            )  # fmt: skip
        ddp_budget = {r.get("train_seed"): budget_time(r) for r in ddp_runs}
        standings = []
        for strategy, runs in by_strategy.items():
            times: dict[Any, float] = {}
            reached = failed = 0
            for r in runs:
                seed = r.get("train_seed")
                t = None if "error" in r else time_to(r, target)
                failed += "error" in r
                reached += t is not None
                miss = budget_time(r) if "error" not in r else ddp_budget.get(seed)
                if t is None and miss is None:
                    continue
                times[seed] = t if t is not None else miss  # type: ignore[assignment]
            if times:
                standings.append(Standing(strategy, times, len(runs), reached, failed, None))
        ddp = next(s for s in standings if s.strategy == reference)
        standings = [
            Standing(s.strategy, s.times, s.seeds, s.reached, s.failed, bootstrap_ratio(ddp.times, s.times))
            for s in standings
        ]
        standings.sort(key=lambda s: s.median)
        fewest = min(len(s.times) for s in standings)
        if fewest < MIN_SEEDS:
            verdict = f"not ranked: {fewest} seeds (a ranking needs {MIN_SEEDS})"
            return cls(scenario, target, standings, verdict, reference, None)
        if len(standings) < 2:
            return cls(scenario, target, standings, "not ranked: a single contender", reference, None)
        margin = bootstrap_ratio(standings[1].times, standings[0].times)
        verdict = "winner" if margin is not None and margin.low > 1.0 else "tie"
        return cls(scenario, target, standings, verdict, reference, margin)

    @property
    def first(self) -> Standing | None:
        return self.standings[0] if self.standings else None

    def sentence(self) -> str:
        """The headline's words: a winner only where the interval says so."""
        if not self.standings or self.margin is None:
            return self.verdict
        a, b = self.standings[0], self.standings[1]
        if self.verdict == "winner":
            return f"`{a.strategy}` wins: `{b.strategy}` takes {self.margin} its time"
        return f"tie: `{a.strategy}` and `{b.strategy}` (the runner-up's time over the first's {self.margin})"

    def table(self) -> list[str]:
        """Markdown: the rule's target, every contender's median time (censored misses counted) and its ratio to
        ``ddp`` with the interval, then the verdict."""
        if self.target is None:
            return [f"Ranking (issue 48's method): {self.verdict}."]
        lines = [
            f"Ranking to {self.target:g} (the highest level every `{self.reference}` seed reaches within "
            f"{TARGET_BUDGET_SHARE:.0%} of the budget; {CONFIDENCE:.0%} bootstrap intervals over seeds):",
            "",
            f"| strategy | median time to target (s) | reached | {self.reference}'s time over this one's |",
            "|---|---|---|---|",
        ]
        for s in self.standings:
            miss = f" ({s.failed} failed)" if s.failed else ""
            ratio = "reference" if s.strategy == self.reference else str(s.vs_ddp) if s.vs_ddp else "n/a"
            lines.append(f"| {s.strategy} | {s.median:.1f} | {s.reached}/{s.seeds}{miss} | {ratio} |")
        return lines + ["", f"Verdict: {self.sentence()}."]

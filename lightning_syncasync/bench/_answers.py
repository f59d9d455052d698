"""The design brief's questions answered in ``report.md`` with a folder's numbers: what the cluster's trouble costs
DDP, how much sooner each contender reaches the target, why a staleness bound waits behind a persistent straggler, and
what AdaptiveBatchSize decided (how many steps after each scheduled slowdown it moved the slow rank's batch)."""

from __future__ import annotations

from typing import Any

from lightning_syncasync.bench._format import fmt
from lightning_syncasync.bench.scenarios import lookup


def answers(name: str, by_strategy: dict[str, dict[str, Any]], table: dict[str, Any]) -> list[str]:
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
                f"{fmt(None if sync_bound is None else 100 * sync_bound)}%."
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
                f"waiting on the network {fmt(None if ddp['wait_frac'] is None else 100 * ddp['wait_frac'])}% "
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
            why = explain(name, strategy, s)
            if why:
                out.append(why)
    for strategy, s in by_strategy.items():
        out.extend(rebalances(name, strategy, s))
    return out


def explain(scenario: str, strategy: str, s: dict[str, Any]) -> str:
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
            f"- {strategy} (ASP, no bound) at {fmt(None if eff is None else 100 * eff)}% of the limit: no rank ever "
            "waits for the slow one, which simply contributes fewer updates."
        )
    return (
        f"- {strategy} (SSP, staleness {staleness}) at {fmt(None if eff is None else 100 * eff)}% of the limit, "
        f"waiting {fmt(None if wait is None else 100 * wait)}% of each step: against a *persistently* slower rank a "
        f"finite bound only delays the wait; once the fast ranks are {staleness} steps ahead they move at the slow "
        "rank's pace, like synchronous training. SSP pays off under transient slowness (`jitter`); persistent "
        "heterogeneity is for ASP with compensation or per-rank batch sizes."
    )


def rebalance_lags(scenario: str, run: dict[str, Any]) -> list[dict[str, Any]]:
    """For each scheduled slowdown change, the steps until a rebalance moved the slow rank's share the right way.

    ``[{"rank", "change_step", "direction" ("slower"/"recovered"), "decision_step" or None, "lag" or None}]``.
    """
    from lightning_syncasync.callbacks.straggler import parse_schedule

    sc = lookup(scenario)
    if sc is None or not sc.schedule:
        return []
    steps = run.get("steps") or 0
    events = rebalance_events(run)
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


def rebalancing_run(s: dict[str, Any]) -> dict[str, Any] | None:
    """The first run of a contender in which AdaptiveBatchSize rebalanced, if any."""
    return next((r for r in s["runs"] if rebalance_events(r)), None)


def rebalance_events(run: dict[str, Any]) -> list[dict[str, Any]]:
    """AdaptiveBatchSize's rebalancing decisions recorded in a run (its ``grow_batch`` events left out)."""
    return [e for e in run.get("events", []) if e.get("kind") == "rebalance"]


def rebalances(scenario: str, strategy: str, s: dict[str, Any]) -> list[str]:
    """AdaptiveBatchSize's decisions in this scenario: how often, the final split, and reaction times."""
    run = rebalancing_run(s)
    if run is None:
        return []
    events = rebalance_events(run)
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

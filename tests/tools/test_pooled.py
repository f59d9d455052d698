"""Learning per sample pooled over results files (``bench.pooled``), on made-up records: pairs are matched by
invocation and seed, misses count as the budget, and a docs block renders it."""

from __future__ import annotations

import pytest

from lightning_syncasync.bench.evidence import bootstrap_geomean, bootstrap_geomean_clustered, bootstrap_mean
from lightning_syncasync.bench.pooled import PooledLearning
from lightning_syncasync.bench.publish import render

DDP = [0.90, 0.94, 0.955, 0.962, 0.966, 0.970, 0.971, 0.972, 0.972, 0.973]
LATE = [0.88, 0.93, 0.950, 0.958, 0.962, 0.965, 0.967, 0.969, 0.970, 0.970]  # reaches 0.97 at epoch 9 of 10
NEVER = [0.88, 0.93, 0.950, 0.958, 0.962, 0.965, 0.966, 0.966, 0.967, 0.967]


def run(strategy: str, seed: int, values: list[float], seconds: float, command: str, scenario: str = "jitter_long"):
    """A run of 10 epochs (25 steps each, 4 ranks of batch 40) validated at every epoch end."""
    history = [
        {"elapsed_s": (i + 1) * seconds + 1.0, "train_s": (i + 1) * seconds, "step": 25 * (i + 1), "value": v}
        for i, v in enumerate(values)
    ]
    return {"scenario": scenario, "strategy": strategy, "train_seed": seed, "steps": 250, "target": 0.97,
            "val_history": history, "final_val_metric": values[-1], "command": command,
            "config": {"trainer": {"devices": 4}, "data": {"batch_size": 40}}}  # fmt: skip


def invocation(command: str, scenario: str, late_seeds: set[int]) -> list[dict]:
    out = []
    for s in range(5):
        out.append(run("ddp", s, DDP, 3.0, command, scenario))
        out.append(run("async_ssp", s, LATE if s in late_seeds else NEVER, 1.5, command, scenario))
        out.append(run("async_ssp_h4", s, DDP, 1.6, command, scenario))
    return out


def test_pairs_are_matched_by_invocation_and_seed_and_a_miss_counts_as_the_budget():
    results = {
        "a.json": invocation("bench a", "jitter_long", late_seeds={0, 1, 2}),
        "b.json": invocation("bench b", "straggler_long", late_seeds={0, 1, 2, 3}),
    }
    # A contender re-run alone into a file (another command) has no ddp of its invocation: not paired.
    results["b.json"].append(run("async_ssp", 7, DDP, 1.0, "bench alone", "straggler_long"))
    pooled = PooledLearning.of(results, ["a.json", "b.json"], [("async_ssp_h4", "async_ssp")])
    row = pooled.row("async_ssp", "ddp")
    assert row is not None and row["pairs"] == 10 and row["files"] == 2
    assert row["reached"] == 7 and row["reference_reached"] == 10
    # DDP reaches 0.97 at epoch 6; LATE at epoch 9 (1.5x its samples); NEVER counts as the whole budget (10/6).
    assert row["samples"].value == pytest.approx((1.5**7 * (10 / 6) ** 3) ** 0.1)
    assert row["samples"].low <= row["samples"].value <= row["samples"].high
    assert row["final"].value == pytest.approx(100 * (0.7 * 0.970 + 0.3 * 0.967 - 0.973))
    assert row["final"].high < 0  # every pair ends below DDP: the interval excludes 0
    # ddp's 5 seeds are the same 5 runs in both invocations (deterministic): 10 pairs, 5 distinct reference runs.
    assert row["references"] == 5 and row["samples_by_reference"].value == pytest.approx(row["samples"].value)
    # The invocations' rule target is 0.97 (ddp's epoch 6 of 10, 18 s): LATE reaches it at epoch 9 (13.5 s), NEVER
    # counts its whole budget (15 s).
    assert row["speedup"].value == pytest.approx((18 / 13.5) ** 0.7 * (18 / 15) ** 0.3)
    between = pooled.row("async_ssp_h4", "async_ssp")
    assert between is not None and between["pairs"] == 10 and between["reached"] == 10
    assert between["samples"].value < 1 and between["final"].low > 0


def test_the_docs_block_renders_every_contender_and_refuses_bad_input():
    results = {"a.json": invocation("bench a", "jitter_long", late_seeds={0})}
    text = "x\n<!-- bench:pooled a.json async_ssp_h4:async_ssp -->\nstale\n<!-- bench:end -->\n"
    out = render(text, results)
    assert "stale" not in out and "| async_ssp | ddp | 5 (1) | 1/5; 5/5 |" in out
    assert "| async_ssp_h4 | async_ssp | 5 (1) | 5/5; 1/5 |" in out
    with pytest.raises(ValueError, match="not results files"):
        render(text.replace("a.json", "missing.json"), results)
    with pytest.raises(ValueError, match="CONTENDER:REFERENCE"):
        render(text.replace("async_ssp_h4:async_ssp", "async_ssp_h4"), results)
    with pytest.raises(ValueError, match="itself"):
        render(text.replace("async_ssp_h4:async_ssp", "ddp:ddp"), results)


def test_the_mean_interval_resamples_the_pairs():
    assert bootstrap_mean([1.0]) is None
    got = bootstrap_mean([-1.0, -0.5, 0.0, -0.2, -0.3])
    assert got is not None and got.value == pytest.approx(-0.4) and -1.0 <= got.low < got.value < got.high <= 0.0


def test_one_setting_under_two_names_pools_across_invocations():
    old = invocation("bench a", "jitter_long", late_seeds={0, 1})
    new = [{**r, "strategy": "async_ssp_h8"} if r["strategy"] == "async_ssp" else r
           for r in invocation("bench b", "jitter_long", late_seeds={0, 1, 2})]  # fmt: skip
    pooled = PooledLearning.of({"a.json": old, "b.json": new}, ["a.json", "b.json"],
                               [("async_ssp_h4", "async_ssp_h8|async_ssp")])  # fmt: skip
    row = pooled.row("async_ssp_h4", "async_ssp_h8|async_ssp")
    assert row is not None and row["pairs"] == 10 and row["files"] == 2 and row["reference_reached"] == 5


def test_pairs_sharing_a_reference_run_are_resampled_together():
    # Two invocations of the same 5 seeds: each seed's ratio twice (one reference run each), the seeds far apart.
    seeds = [0.8, 1.0, 1.1, 1.3, 1.6]
    pairs = bootstrap_geomean(seeds * 4)  # 20 pairs taken as independent
    clusters = bootstrap_geomean_clustered([[v] * 4 for v in seeds])  # 5 independent draws
    alone = bootstrap_geomean(seeds)
    assert pairs is not None and clusters is not None and alone is not None
    assert clusters.value == pytest.approx(pairs.value)
    # Repeating the same draws narrows the pairs' interval; resampling the clusters gives back the 5 seeds' width.
    assert clusters.high - clusters.low > 1.5 * (pairs.high - pairs.low)
    assert clusters.high - clusters.low == pytest.approx(alone.high - alone.low, rel=0.35)
    assert bootstrap_geomean_clustered([[1.0, 1.2]]) is None  # one cluster: nothing to resample

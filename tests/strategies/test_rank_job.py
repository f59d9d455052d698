"""The two-rank job that ``tests/gpu`` runs on one shared GPU, run here on the CPU: so the GPU tests' machinery (the
torchrun-style start, the tensor walk, the records) is exercised on every machine, not first on a GPU."""

from __future__ import annotations

import pytest
import torch
from _ranks import run_ranks

CASES = {
    # sign: the replicas differed in the last bit after the end-of-fit cut before it copied the global model.
    "hier_sync_sign": ("hier_sync", {"compression": "sign", "inter_period": 2}, "averager.compressor.residuals"),
    "async_ssp_int8": (
        "async_ssp",
        {"compression": "int8", "local_steps": 2, "staleness": 1, "dynamic_local_steps": False},
        "compressor.residuals",
    ),
    # The background exchange's groups over gloo whatever the job's backend (on the CPU both are gloo: this runs the
    # setting through the strategy's setup; on GPUs it takes that hop off NCCL, docs/gpu.md).
    "hier_sync_int8_exchange_backend_gloo": (
        "hier_sync",
        {"compression": "int8", "inter_period": 2},
        "averager.compressor.residuals",
        {"SYNCASYNC_EXCHANGE_BACKEND": "gloo"},
    ),
}


@pytest.mark.spawn
@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", sorted(CASES))
def test_two_ranks_started_like_torchrun_report_what_the_strategy_holds(tmp_path, case):
    strategy, options, expected, *env = CASES[case]
    ranks = run_ranks(tmp_path, strategy, "cpu", options, steps=8, env=env[0] if env else None)
    assert [r["rank"] for r in ranks] == [0, 1]
    # max_steps=8 on each rank (claimed batches: 16 over both, async_ssp's budget).
    assert sum(len(r["losses"]) for r in ranks) == 16
    for r in ranks:
        assert all(torch.isfinite(torch.tensor(r["losses"])))
        paths = [t[0] for t in r["tensors"]]
        # The walk reaches the strategy's own state (the compressor's residuals), on the CPU here.
        assert any(expected in p for p in paths), paths
        assert {t[1] for t in r["tensors"]} == {"cpu"}
        assert r["groups"] and set(r["groups"].values()) == {"gloo"}, r["groups"]  # the report reads the groups
    # The ranks saw different data (so the exchange had something to do), and end on one model: the end-of-fit cut,
    # then every buffer rank 0's, BatchNorm's integer step counter too (with claimed batches the ranks take 7 and 9
    # steps at times; issue 65 found the counters differing at the end of fit).
    assert ranks[0]["losses"] != ranks[1]["losses"]
    for name, value in ranks[0]["state"].items():
        assert torch.equal(value, ranks[1]["state"][name]), name

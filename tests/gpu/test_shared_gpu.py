"""Two ranks sharing one GPU over gloo, with the model and the strategies' state on CUDA: the multi-rank CUDA paths
that one GPU can host (NCCL cannot put two ranks on one device). Each case is checked three ways:

* every tensor the strategy holds is on the GPU (host-side figures excepted, ``_gpu.misplaced``);
* the result matches the CPU run of the same seeds, within what CUDA's arithmetic and the compressors' rounding of
  it can change (loose for ``sign``: an element whose sign flips moves by its chunk's whole scale);
* with the side streams off (``SYNCASYNC_SIDE_STREAM=0``) the result is bitwise the same (deterministic kernels).
"""

from __future__ import annotations

import pytest
import torch
from _gpu import ACCELERATOR, EMULATED, ROUNDS, STEPS, TOLERANCE, distance, gpu_tests, misplaced
from _ranks import RankJob

pytestmark = gpu_tests


def _no_sync_every_step(rank: dict) -> None:
    """No host sync asked for by the pack's code in every steady step (``tests/_rank_job.py``'s ``_HostSyncs``)."""
    every_step = {where: steps for where, steps in rank["syncs"].items() if len(steps) >= STEPS - 3}
    assert not every_step, rank["syncs"]


STRATEGIES = {
    "hier_sync": ("hier_sync", {"inter_period": 2}),  # 2 nodes of 1 rank: the cross-node averager runs
    "async_ssp": ("async_ssp", {**ROUNDS, "claim_batches": False}),
    "auto_sync": ("auto_sync", {"mode": "hier", "switcher": False, "inter_period": 2}),
    "ddp_measured": ("ddp_measured", {}),  # compressed DDP buckets (CompressedAllReduce)
}
METHODS = ("int8", "sign", "powersgd")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("case", sorted(STRATEGIES))
def test_two_ranks_on_one_gpu_match_the_cpu_and_keep_their_state_on_the_gpu(tmp_path, case, method):
    name, options = STRATEGIES[case]
    options = {**options, "compression": method}
    # The GPU run and its CPU reference side by side (the check must fit its minutes on one GPU).
    gpu_job = RankJob(tmp_path / "gpu", name, ACCELERATOR, options, steps=STEPS)
    cpu_job = RankJob(tmp_path / "cpu", name, "cpu", options, steps=STEPS)
    gpu, cpu = gpu_job.wait(), cpu_job.wait()
    for rank in gpu:
        assert not misplaced(rank["tensors"], "gloo"), misplaced(rank["tensors"], "gloo")
        paths = " ".join(t[0] for t in rank["tensors"])
        assert "residuals" in paths or "factors" in paths, f"no compressor state found: {paths}"
    # The same first loss (same model, same batch), then the same trajectory within the tolerance.
    for g, c in zip(gpu, cpu, strict=True):
        assert g["losses"][0] == pytest.approx(c["losses"][0], rel=1e-4)
        assert distance(g["state"], c["state"]) < TOLERANCE[method], (case, method)
    # Both ranks end with one model, bit for bit (the end-of-fit cut), DDP's BatchNorm statistics excepted (DDP
    # broadcasts them before each forward, and the last forward updates each rank's own).
    for key, value in gpu[0]["state"].items():
        if "running_" not in key and "num_batches" not in key:
            assert torch.equal(value, gpu[1]["state"][key]), key


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", sorted(STRATEGIES))
def test_the_side_stream_changes_no_bit(tmp_path, case):
    if EMULATED:
        pytest.skip("side streams are CUDA's: on the emulated device both runs would be the same run")
    name, options = STRATEGIES[case]
    options = {**options, "compression": "int8"}
    # Deterministic kernels in both runs (cuBLAS needs its workspace fixed for that).
    env = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    off_env = {**env, "SYNCASYNC_SIDE_STREAM": "0"}
    on_job = RankJob(tmp_path / "on", name, ACCELERATOR, options, STEPS, env=env, deterministic=True)
    off_job = RankJob(tmp_path / "off", name, ACCELERATOR, options, STEPS, env=off_env, deterministic=True)
    on, off = on_job.wait(), off_job.wait()
    for a, b in zip(on, off, strict=True):
        assert a["losses"] == b["losses"]
        for key, value in a["state"].items():
            assert torch.equal(value, b["state"][key]), (case, key)


# State the compression cases above do not create: the outer momentum (hier_sync's Nesterov), the per-step SSP
# exchange's buffers and its staleness compensation, and AdaptiveBatchSize's per-rank batch weights and noise probe.
STATE_CASES = {
    "hier_sync_nesterov": ("hier_sync", {"outer": "nesterov", "inter_period": 2}, False, ["outer_opt.buffer"]),
    "async_ssp_per_step": (
        "async_ssp",
        {"local_steps": 1, "claim_batches": False},
        False,
        ["exchange._outbox", "exchange._acc", "_compensator.mean_square"],
    ),
    "ddp_measured_adaptive_batch": ("ddp_measured", {}, True, []),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", sorted(STATE_CASES))
def test_every_kind_of_state_lives_on_the_gpu(tmp_path, case):
    name, options, adaptive, expected = STATE_CASES[case]
    ranks = RankJob(tmp_path, name, ACCELERATOR, options, steps=STEPS, adaptive_batch=adaptive).wait()
    for rank in ranks:
        paths = " ".join(t[0] for t in rank["tensors"])
        assert all(e in paths for e in expected), (expected, paths)
        assert not misplaced(rank["tensors"], "gloo"), misplaced(rank["tensors"], "gloo")
        assert all(torch.isfinite(torch.tensor(rank["losses"])))
        _no_sync_every_step(rank)  # per-step SSP: its finite-loss check is read by the exchange's thread


@pytest.mark.timeout(300)
def test_auto_sync_with_its_switcher_makes_no_host_sync_per_step(tmp_path):
    # The switcher (and AdaptiveBatchSize) add a SyncMonitor when there is none; theirs leaves the GPU's queue alone
    # (cuda_sync=False), so the default auto_sync makes no host sync of the pack's in every step at 2 ranks.
    ranks = RankJob(tmp_path, "auto_sync", ACCELERATOR, {"mode": "sync"}, steps=STEPS).wait()
    for rank in ranks:
        assert len(rank["losses"]) == STEPS
        _no_sync_every_step(rank)


# The per-step async modes: each step's loss is checked for a NaN on the device, by the exchange's thread (per-step
# SSP) or by DDP's hook (auto_sync's async rounds), not read back by the training loop.
PER_STEP_ASYNC = {
    "async_ssp_per_step": ("async_ssp", {"local_steps": 1, "claim_batches": False}),
    "auto_sync_async_per_step": ("auto_sync", {"mode": "async", "local_steps": 1, "switcher": False}),
    "auto_sync_async_rounds": ("auto_sync", {"mode": "async", "local_steps": 2, "switcher": False}),
}


@pytest.mark.timeout(300)
def test_a_nan_loss_in_per_step_ssp_on_the_gpu_stops_the_run_before_its_gradient_leaves(tmp_path):
    # Found by the exchange's thread when the gradient's round starts, raised by the loop at its next step.
    name, options = PER_STEP_ASYNC["async_ssp_per_step"]
    with pytest.raises(AssertionError, match="loss is nan at clock 4 under async training"):
        RankJob(tmp_path, name, ACCELERATOR, options, steps=STEPS, nan_at=4).wait()


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "case, manual",
    [("auto_sync_async_per_step", False), ("auto_sync_async_rounds", False), ("auto_sync_async_rounds", True)],
    ids=["auto_sync_async_per_step", "auto_sync_async_rounds", "auto_sync_async_rounds_manual"],
)
def test_a_nan_loss_in_auto_sync_async_on_the_gpu_is_held_back(tmp_path, case, manual):
    # No switcher here to roll back: the NaN must never have reached a replica, and rank 0 reports it; finding it
    # took no host sync in every step. Under manual optimization the strategy checks the gradients when the model
    # steps its optimizer (no DDP hook sees that step's flag), on the device too.
    name, options = PER_STEP_ASYNC[case]
    ranks = RankJob(tmp_path, name, ACCELERATOR, options, steps=STEPS, nan_at=4, manual=manual).wait()
    assert ranks[0]["diverged"] is not None and ranks[1]["diverged"] is None
    for rank in ranks:
        assert all(torch.isfinite(v).all() for v in rank["state"].values() if v.is_floating_point())
        _no_sync_every_step(rank)
    assert all(torch.equal(v, ranks[1]["state"][k]) for k, v in ranks[0]["state"].items() if "running_" not in k)

"""The sharded strategies (FSDP2 inside each node, the pack's exchange across nodes) with the model on the device:
4 ranks as 2 nodes of 2, sharing one device over gloo, as ``test_shared_gpu.py`` does with 2. Each case is checked
against the CPU run of the same seeds, with every tensor the strategy holds on the device, and no host sync of the
pack's in every step; a checkpoint taken mid-fit (torch.distributed.checkpoint's shards) resumes with that state back
on the device, on the same layout and on one node of 2.

On a GPU this needs gloo to serve FSDP2's all-gather and reduce-scatter of CUDA tensors; one GPU cannot give NCCL the
2 ranks per node that sharding needs. On the emulated device (``tests/_emulated_device.py``) it is the only run time
check of the sharded strategies' device handling on a machine without a GPU.
"""

from __future__ import annotations

import pytest
import torch
from _gpu import ACCELERATOR, ROUNDS, STEPS, TOLERANCE, distance, gpu_tests, misplaced
from _ranks import RankJob

pytestmark = gpu_tests

RANKS = 4
# 2 nodes of 2 ranks (node_size=2 over 4 single-device "nodes" of the rank job), int8 across the nodes; and FSDP2's
# own HSDP (a 2-D mesh, FSDP2's all-reduce across the nodes at every step), which takes no compression.
SHARDED = {
    "hier_sync_sharded": ("hier_sync_sharded", {"node_size": 2, "inter_period": 2, "compression": "int8"}),
    "hier_sync_sharded_hsdp": ("hier_sync_sharded", {"node_size": 2, "hsdp": True}),
    "async_ssp_sharded": ("async_ssp_sharded", {"node_size": 2, **ROUNDS, "compression": "int8"}),
}
# ||device - cpu|| / ||cpu|| allowed: the quantiser's, else fp32 reassociation.
EXACT = 1e-4


def _tolerance(options: dict) -> float:
    return TOLERANCE.get(options.get("compression", "none"), EXACT)


def _check_on_device(ranks: list[dict], steps: int) -> None:
    for rank in ranks:
        assert not misplaced(rank["tensors"], "gloo"), misplaced(rank["tensors"], "gloo")
        # No host sync of the pack's in every steady step (the steps after the first and before the last).
        every_step = {where: seen for where, seen in rank["syncs"].items() if len(seen) >= steps - 3}
        assert not every_step, rank["syncs"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", sorted(SHARDED))
def test_a_sharded_strategy_matches_the_cpu_with_its_state_on_the_device(tmp_path, case):
    name, options = SHARDED[case]
    device_job = RankJob(tmp_path / "device", name, ACCELERATOR, options, steps=STEPS, ranks=RANKS)
    cpu_job = RankJob(tmp_path / "cpu", name, "cpu", options, steps=STEPS, ranks=RANKS)
    device, cpu = device_job.wait(), cpu_job.wait()
    _check_on_device(device, STEPS)
    for rank in device:
        paths = " ".join(t[0] for t in rank["tensors"])
        assert "residuals" in paths or "compression" not in options, f"no compressor state found: {paths}"
    for d, c in zip(device, cpu, strict=True):
        assert len(d["losses"]) == STEPS
        assert d["losses"][0] == pytest.approx(c["losses"][0], rel=1e-4)  # the same model and batch
        assert distance(d["state"], c["state"]) < _tolerance(options), case
    # The end-of-fit cut leaves one model on every rank (each rank's record holds the full state dict).
    for key, value in device[0]["state"].items():
        for other in device[1:]:
            assert torch.equal(value, other["state"][key]), key


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", ["async_ssp_sharded", "hier_sync_sharded"])  # the pack's state (HSDP's is FSDP2's)
def test_a_sharded_checkpoint_resumes_with_the_strategys_state_on_the_device(tmp_path, case):
    name, options = SHARDED[case]
    # A rank's epoch here is 4 batches (the job's 512 samples over 4 ranks); the checkpoint falls at the first
    # epoch's end (_rank_job.py: where a resumed run sees the uninterrupted one's batches). The checkpoint's cut
    # flushes the compression residuals into an exact round, so the resumed run may hold none yet.
    ckpt, steps, half = tmp_path / "half.ckpt", 8, 4
    kwargs = {"deterministic": True, "epoch_steps": half}
    whole = RankJob(
        tmp_path / "whole", name, ACCELERATOR, options, steps, save=ckpt, save_step=half, ranks=RANKS, **kwargs
    )
    whole_ranks = whole.wait()
    # On the same layout, and on one node of 2 (the saved nodes' shards averaged into it: the strategies' other
    # restore path), side by side.
    same = RankJob(tmp_path / "same", name, ACCELERATOR, options, steps, resume=ckpt, ranks=RANKS, **kwargs)
    one_node = RankJob(tmp_path / "one_node", name, ACCELERATOR, options, steps, resume=ckpt, ranks=2, **kwargs)
    resumed, merged = same.wait(), one_node.wait()
    _check_on_device(resumed, steps - half)
    _check_on_device(merged, steps - half)
    for a, b in zip(resumed, whole_ranks, strict=True):
        assert len(a["losses"]) == steps - half, "the resumed fit did not start where the first one stopped"
        assert distance(a["state"], b["state"]) < _tolerance(options), case
    for rank in merged:
        assert len(rank["losses"]) == steps - half and all(torch.isfinite(torch.tensor(rank["losses"])))

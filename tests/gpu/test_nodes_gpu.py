"""Four ranks sharing one GPU over gloo, as 2 nodes of 2: the paths a node of several ranks adds to those of
``test_shared_gpu.py`` (nodes of one rank there). ``hier_sync`` and ``auto_sync`` then run DDP inside each node and
the averager's sharded cross-node rounds (reduce-scatter in the node, all-reduce across, all-gather back: each rank
holds one shard's residual and round buffers); ``ddp_measured`` compresses in two phases (node, then across nodes).
State on the GPU, results within the tolerance of the CPU run of the same seeds. In a file of its own: each case is
eight processes (the GPU run and its CPU reference), so ``scripts/gpu_check.sh`` runs it after the others."""

from __future__ import annotations

import pytest
from _gpu import ACCELERATOR, STEPS, TOLERANCE, distance, gpu_tests, misplaced
from _ranks import RankJob

pytestmark = gpu_tests

# node_size=2: the ranks are started as 4 nodes of one device (the harness's way), and the strategy groups them in 2.
NODE_CASES = {
    "hier_sync": ("hier_sync", {"node_size": 2, "inter_period": 2}, "averager.compressor.residuals"),
    "auto_sync": ("auto_sync", {"node_size": 2, "mode": "hier", "switcher": False, "inter_period": 2},
                  "averager.compressor.residuals"),
    "ddp_measured": ("ddp_measured", {"node_size": 2}, "_compressed.residuals"),
}  # fmt: skip


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", sorted(NODE_CASES))
def test_two_nodes_of_two_ranks_on_one_gpu_match_the_cpu_and_keep_their_shards_on_the_gpu(tmp_path, case):
    name, options, state = NODE_CASES[case]
    options = {**options, "compression": "int8"}
    gpu_job = RankJob(tmp_path / "gpu", name, ACCELERATOR, options, steps=STEPS, ranks=4, timeout_s=300)
    cpu_job = RankJob(tmp_path / "cpu", name, "cpu", options, steps=STEPS, ranks=4, timeout_s=300)
    gpu, cpu = gpu_job.wait(), cpu_job.wait()
    for rank in gpu:
        assert not misplaced(rank["tensors"], "gloo"), misplaced(rank["tensors"], "gloo")
        assert any(state in t[0] for t in rank["tensors"]), (state, [t[0] for t in rank["tensors"]])
    for g, c in zip(gpu, cpu, strict=True):
        assert g["losses"][0] == pytest.approx(c["losses"][0], rel=1e-4)
        assert distance(g["state"], c["state"]) < TOLERANCE["int8"], case

"""The DDP compression hook's hierarchical path on 4 gloo processes as 2 virtual nodes of 2: node sum in full
precision, compressed exchange of each local rank's shard across nodes, all-gather inside the node."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_syncasync.algorithms.compressed_hook import CompressedAllReduce
from lightning_syncasync.algorithms.compression import Compressor
from lightning_syncasync.algorithms.stats import StatsRecorder
from lightning_syncasync.algorithms.topology import Topology
from lightning_syncasync.testing import run_distributed

N = 1001  # odd: the node's reduce-scatter pads, and the last int8 chunk is partial
WORLD = 4


def _x(rank: int) -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(7 + rank))


def _hierarchical_rounds(rank: int, world: int, method: str, steps: int) -> dict:
    topo = Topology(world_size=world, node_size=2)
    node_group, _ = dist.new_subgroups_by_enumeration(topo.all_nodes())
    cross_group, _ = dist.new_subgroups_by_enumeration(topo.all_cross_node())
    recorder = StatsRecorder()
    hook = CompressedAllReduce(
        Compressor(method, seed=rank), recorder, "inter", node_group=node_group, cross_group=cross_group
    )
    assert hook.hierarchical
    x, residual = _x(rank), torch.zeros(N)
    outs = []
    recorder.begin_step()
    for _ in range(steps):
        # What the DDP hook does with a bucket: the residual rides on this rank's input.
        mean, dropped = hook._hierarchical(x + residual)
        outs.append(mean)
        residual = dropped if dropped is not None else torch.zeros(N)
    stats = recorder.end_step(step=0, samples=1)
    return {"outs": outs, "residual": residual, "inter": stats.bytes_inter, "intra": stats.bytes_intra}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["int8", "fp16"])
def test_hierarchical_mean_is_the_same_everywhere_loses_nothing_and_compresses_only_the_inter_node_hop(method):
    steps = 5
    res = run_distributed(_hierarchical_rounds, WORLD, method, steps)
    want = sum(_x(r) for r in range(WORLD)) / WORLD
    for t in range(steps):
        for r in range(1, WORLD):
            torch.testing.assert_close(res[r]["outs"][t], res[0]["outs"][t], rtol=0, atol=0)  # bitwise: no drift
        err = (res[0]["outs"][t] - want).norm() / want.norm()
        assert err <= (0.02 if method == "int8" else 1e-3), (t, float(err))
    # Error feedback loses nothing: the outputs sum to steps x the mean, less what is still held back (the
    # residuals, one per rank, each on the shard that rank owns, in units of one rank's input).
    total = sum(o.double() for o in res[0]["outs"])
    held = sum(r["residual"].double() for r in res) / WORLD
    # (fp16 is summed across nodes in fp16: that rounding is not a residual, so it is only close.)
    atol = 1e-5 if method == "int8" else 5e-3
    torch.testing.assert_close(total + held, steps * want.double(), rtol=0, atol=atol)
    assert all(r["residual"].abs().sum() > 0 for r in res)
    # Bytes, measured from the tensors handed to each collective: across nodes only this rank's half of the model,
    # compressed (int8: 1 byte per element, in chunks of 256 with a 4-byte scale each, the last chunk padded);
    # inside the node the fp32 reduce-scatter input (padded to an even length) and the all-gather's shard.
    shard = (N + 1) // 2
    inter = {"int8": -(-shard // 256) * (256 + 4), "fp16": shard * 2}[method]
    for r in res:
        assert r["inter"] / steps == inter
        assert r["intra"] / steps == ((N + 1) + shard) * 4


def test_node_and_cross_groups_go_together():
    with pytest.raises(ValueError, match="node_group and cross_group go together"):
        CompressedAllReduce(Compressor("int8"), StatsRecorder(), node_group=object())  # type: ignore[arg-type]

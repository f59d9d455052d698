"""The DDP compression hook's hierarchical path on 4 gloo processes as 2 virtual nodes of 2: node sum in full
precision, compressed exchange of each local rank's shard across nodes, all-gather inside the node."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_syncasync.algorithms.compression.compressed_hook import CompressedAllReduce
from lightning_syncasync.algorithms.compression.compressor import Compressor
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


class _Linear(torch.nn.Module):
    """Three parameters whose gradients do not depend on the weights: loss = sum_p <p, c_p(rank)>."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(700))
        self.b = torch.nn.Parameter(torch.zeros(300))
        self.c = torch.nn.Parameter(torch.zeros(513))

    def forward(self, coeffs: list[torch.Tensor]) -> torch.Tensor:
        return sum((p * c).sum() for p, c in zip(self.parameters(), coeffs, strict=True))  # type: ignore[return-value]


def _coeffs(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(31 + rank)
    return [torch.randn(n, generator=g) for n in (700, 300, 513)]


def _ddp_two_phase(rank: int, world: int, steps: int, warmup: int, node_size: int | None = None) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    model = _Linear()
    # Tiny buckets: several buckets per step, each its own key (and server residual).
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.003)
    groups = {}
    if node_size is not None:  # hierarchical: the two-phase exchange runs across nodes, on each local rank's shard
        topo = Topology(world_size=world, node_size=node_size)
        groups["node_group"], _ = dist.new_subgroups_by_enumeration(topo.all_nodes())
        groups["cross_group"], _ = dist.new_subgroups_by_enumeration(topo.all_cross_node())
    hook = CompressedAllReduce(
        Compressor("sign", seed=rank, collective="two_phase"), StatsRecorder(), process_group=dist.new_group(),
        warmup_steps=warmup, warmup_compressor=Compressor("int8", seed=rank, collective="two_phase"), **groups,
    )  # fmt: skip
    assert hook.hierarchical == (node_size is not None)
    hook.register(ddp)
    for _ in range(steps):
        ddp.zero_grad()
        ddp(_coeffs(rank)).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= p.grad  # SGD, lr 1: a parameter is minus the sum of the means it received
    hook.close()
    state = hook.state_dict()  # as a checkpoint holds it: server residuals not folded
    server_keys = len(hook.compressor.server_residuals)
    # The warm-up's exchange ended after step 2: its server residuals were folded back at the end of step 3.
    warmup_left = len(hook._warmup.server_residuals)
    # Flush: every server residual (none of their keys is used any more) folds into the per-parameter residuals.
    hook._used = set()
    hook._fold_unused()
    assert not hook.compressor.server_residuals and not hook._warmup.server_residuals
    held = torch.cat([hook.residuals.get(i, torch.zeros(p.numel())) for i, p in enumerate(model.parameters())])
    dist.all_reduce(held)
    return {"params": torch.cat([p.detach() for p in model.parameters()]), "held": held / world,
            "server_keys": server_keys, "warmup_left": warmup_left, "state": state}  # fmt: skip


@pytest.mark.timeout(120)
@pytest.mark.parametrize("node_size", [None, 2], ids=["flat", "hierarchical"])
def test_ddp_hook_two_phase_over_buckets_and_warm_up_loses_nothing(node_size):
    # 4 ranks, in one flat group or as 2 nodes of 2: the two-phase layout, an int8 warm-up of 2 steps then sign; what
    # the ranks applied plus what the residuals (their own and the shard owners', folded back) hold is exactly the
    # exact sum.
    steps = 6
    res = run_distributed(_ddp_two_phase, WORLD, steps, 2, node_size)
    exact = -steps * sum(torch.cat(_coeffs(r)) for r in range(WORLD)) / WORLD
    for r in res:
        torch.testing.assert_close(r["params"], res[0]["params"], rtol=0, atol=0)  # no drift between replicas
        torch.testing.assert_close(r["params"] - r["held"], exact, rtol=0, atol=1e-4)
        assert r["server_keys"] >= 2 and r["warmup_left"] == 0  # several buckets, each with its server residual
    # A resume on another number of ranks: every rank takes resized_state's residuals, computed from the saved
    # states alone (no process group), and their mean over any number of ranks is the same debt the 4 ranks held.
    resized = CompressedAllReduce.resized_state([r["state"] for r in res], node_size)
    assert not resized["compressor"]["server_residuals"] and not resized["layouts"]
    held = torch.cat([resized["residuals"].get(i, torch.zeros(n)) for i, n in enumerate((700, 300, 513))])
    torch.testing.assert_close(held, res[0]["held"], rtol=0, atol=1e-6)
    # Without the folding (own residuals only) it would not be: the server residuals hold part of the debt.
    own = sum(torch.cat([r["state"]["residuals"].get(i, torch.zeros(n)) for i, n in enumerate((700, 300, 513))])
              for r in res) / WORLD  # fmt: skip
    assert (own - res[0]["held"]).abs().max() > 1e-3

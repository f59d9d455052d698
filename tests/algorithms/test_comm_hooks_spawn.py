"""MeasuredAllReduce on real gloo processes: DDP still averages exactly, and every gradient byte is counted."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_syncasync.algorithms.comm_hooks import MeasuredAllReduce
from lightning_syncasync.algorithms.stats import StatsRecorder
from lightning_syncasync.testing import run_distributed


def _ddp_step(rank: int, world_size: int, bucket_cap_mb: float) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    rec = StatsRecorder()
    MeasuredAllReduce(rec, scope="intra").register(ddp)
    steps = []
    for step in range(3):
        rec.begin_step()
        # Rank-valued inputs: the averaged gradient is the mean of the per-rank gradients, checkable below.
        x = torch.full((8, 16), float(rank + 1))
        ddp(x).sum().backward()
        steps.append(rec.end_step(step, samples=8))
        grads = [p.grad.clone() for p in ddp.parameters()]
        ddp.zero_grad()
    return {
        "steps": steps,
        "grads": grads,
        "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
    }


def _reference_grads(world_size: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    for rank in range(world_size):
        model(torch.full((8, 16), float(rank + 1))).sum().backward()
    return [p.grad / world_size for p in model.parameters()]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("bucket_cap_mb", [25.0, 0.001])  # one bucket; one bucket per parameter
def test_measured_allreduce_counts_every_byte_and_keeps_ddp_exact(bucket_cap_mb):
    results = run_distributed(_ddp_step, 2, bucket_cap_mb)
    reference = _reference_grads(2)
    for res in results:
        for got, want in zip(res["grads"], reference, strict=True):
            torch.testing.assert_close(got, want)
        for s in res["steps"]:
            # Bytes measured from the bucket tensors equal the gradient bytes of the model, every step.
            assert s.bytes_intra == res["param_bytes"]
            assert s.bytes_inter == 0
            assert 0.0 <= s.wait_s <= s.wall_s


def test_rejects_bad_arguments():
    with pytest.raises(TypeError, match="recorder"):
        MeasuredAllReduce(object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="scope"):
        MeasuredAllReduce(StatsRecorder(), scope="cross")  # type: ignore[arg-type]

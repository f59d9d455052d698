"""1-bit Adam: plain Adam during warm-up, frozen variance and compressed momenta after (2 gloo processes)."""

from __future__ import annotations

import pytest
import torch

from lightning_syncasync.algorithms.compression.onebit_adam import OneBitAdam
from lightning_syncasync.testing import run_distributed


def _grads(rank: int, step: int) -> torch.Tensor:
    return torch.randn(300, generator=torch.Generator().manual_seed(10 * step + rank))


def test_warmup_is_torch_adam():
    a, b = torch.zeros(300, requires_grad=True), torch.zeros(300, requires_grad=True)
    ours = OneBitAdam([a], lr=0.01, warmup_steps=5, weight_decay=0.0)
    ref = torch.optim.Adam([b], lr=0.01)
    for step in range(5):
        a.grad = _grads(0, step)
        b.grad = _grads(0, step)
        ours.step()
        ref.step()
        torch.testing.assert_close(a, b)
    assert not ours.in_warmup


def _train(rank: int, world: int, steps: int) -> dict:
    w = torch.zeros(300, requires_grad=True)
    opt = OneBitAdam([w], lr=0.01, warmup_steps=3)
    sent = []
    for step in range(steps):
        g = _grads(rank, step)
        if opt.in_warmup:  # what DDP hands over during warm-up: the averaged gradient
            torch.distributed.all_reduce(g)
            g /= world
        w.grad = g
        opt.step()
        sent.append(opt.bytes_last_step)
    return {"w": w.detach().clone(), "sent": sent, "state": opt.state_dict()}


@pytest.mark.timeout(120)
def test_after_warmup_ranks_agree_and_send_one_bit_per_element():
    res = run_distributed(_train, 2, 8)
    torch.testing.assert_close(res[0]["w"], res[1]["w"])  # averaged momenta: the same step on every rank
    assert res[0]["sent"][:3] == [0, 0, 0]  # warm-up: the gradients were averaged outside (by DDP)
    for nbytes in res[0]["sent"][3:]:
        assert nbytes == 2 * 256 // 8 + 2 * 4  # 1 bit per element (2 chunks of 256) and one fp32 scale per chunk
    # Its state (step counter, residual) travels with the optimizer state.
    assert res[0]["state"]["onebit"]["steps"] == 8 and res[0]["state"]["onebit"]["compressor"]["residuals"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"lr": 0}, "lr"), ({"warmup_steps": 0}, "warmup_steps"), ({"compression": "int3"}, "compression")],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OneBitAdam([torch.zeros(2, requires_grad=True)], **kwargs)

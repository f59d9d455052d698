"""``Compressor(collective="summable")`` on 2 and 4 gloo processes: bitwise the same mean on every rank, exact on
tensors whose values are multiples of the shared step, nothing lost over steps with error feedback, the bytes handed
and on the wire, and the settings refused (issue 68, deliverable 2)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_syncasync.algorithms.compression.compressor import Compressor
from lightning_syncasync.algorithms.compression.summable import check_groups, compress_summable, max_groups, packing
from lightning_syncasync.testing import run_distributed

N = 3000  # not a multiple of the chunk: the last chunk is padded
LEVELS = {"int8": 127, "int4": 7, "int2": 1}


def _x(rank: int, step: int) -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(1000 * step + rank))


def _steps(rank: int, world: int, method: str, rounding: str, steps: int) -> dict:
    comp = Compressor(method, collective="summable", seed=rank, rounding=rounding)
    comp.check_backend()
    received = torch.zeros(N, dtype=torch.float64)
    sames = []
    for step in range(steps):
        mean, nbytes = comp.allreduce(_x(rank, step), None, key="g")
        received += mean.double()
        everyone = [torch.empty_like(mean) for _ in range(world)]
        dist.all_gather(everyone, mean)
        sames.append(all(torch.equal(everyone[0], m) for m in everyone))
    held = comp.residuals["g"].double()
    dist.all_reduce(held)
    return {"received": received, "held": held / world, "same": all(sames), "bytes": nbytes, "wire": comp.last_wire}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(("method", "rounding"), [("int2", "nearest"), ("int4", "nearest"), ("int4", "stochastic")])
def test_the_summable_mean_is_the_same_bits_everywhere_and_error_feedback_loses_nothing(world, method, rounding):
    steps = 8
    res = run_distributed(_steps, world, method, rounding, steps, timeout_s=100)
    sent = sum(sum(_x(r, s).double() for r in range(world)) / world for s in range(steps))
    for r in res:
        assert r["same"]  # integers add exactly: every rank decodes the same sum
        # Telescoping: what every rank received plus the ranks' residuals (their mean) is exactly what was sent.
        torch.testing.assert_close(r["received"] + r["held"], sent, atol=1e-4, rtol=1e-5)
    # Bytes handed: one fp32 scale per chunk of 256, then the codes as digits packed in int64 words.
    scales = -(-N // 256) * 4
    words = -(-(scales // 4) * 256 // packing(LEVELS[method], world)[1]) * 8
    assert res[0]["bytes"] == scales + words
    # On the wire, ring all-reduces: 2 (world - 1) / world of each.
    assert res[0]["wire"][0] == 2 * (world - 1) * scales // world + 2 * (world - 1) * words // world


def _rank_filled(rank: int, world: int, method: str) -> dict:
    # Every value a multiple of the step 0.5 and every chunk holding +-levels steps on every rank: the codes are
    # the values, the mean exact (a sum of integers times 0.5, divided by a power of two).
    levels = LEVELS[method]
    codes = (torch.arange(N) * 3 + rank) % (2 * levels + 1) - levels
    x = codes.float() * 0.5
    comp = Compressor(method, collective="summable")
    mean, _ = comp.allreduce(x, None, key="x")
    return {"mean": mean, "residual": comp.residuals["x"]}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("method", ["int8", "int4", "int2"])
def test_the_summable_mean_is_exact_on_rank_filled_multiples_of_the_step(world, method):
    levels = LEVELS[method]
    expected = sum(((torch.arange(N) * 3 + r) % (2 * levels + 1) - levels).float() * 0.5 for r in range(world)) / world
    for r in run_distributed(_rank_filled, world, method, timeout_s=100):
        assert torch.equal(r["mean"], expected)
        assert torch.equal(r["residual"], torch.zeros(N))


@pytest.mark.parametrize("method", ["none", "fp16", "bf16", "sign", "powersgd"])
def test_summable_is_refused_for_methods_without_integer_codes(method):
    with pytest.raises(ValueError, match=r"collective='summable' needs integer codes.*HINT: compression='int4' or"):
        Compressor(method, collective="summable")  # type: ignore[arg-type]


@pytest.mark.parametrize("levels", [127, 7, 1])
def test_a_world_whose_sums_overflow_a_word_is_refused_with_the_limit_and_the_fix(levels):
    most = max_groups(levels)
    check_groups(levels, most)  # the limit itself fits: 2 * most * levels + 1 <= 2 ** 63
    assert packing(levels, most)[1] == 1
    limit = rf"at most {most} ranks at {levels} levels, got {most + 1}.*; HINT: collective='two_phase'"
    with pytest.raises(ValueError, match=limit):
        check_groups(levels, most + 1)
    with pytest.raises(ValueError, match=r"more than a 64-bit word holds"):
        compress_summable(torch.ones(8), levels, 8, most + 1, lambda t, op: None)


@pytest.mark.parametrize(("levels", "groups", "per"), [(1, 2, 27), (1, 4, 19), (1, 8, 15), (7, 2, 12), (127, 2, 7)])
def test_digits_per_word(levels, groups, per):
    radix, got = packing(levels, groups)
    assert got == per and radix**per <= 2**63 < radix ** (per + 1)


def test_stochastic_rounding_draws_each_groups_own_noise_and_stays_a_sum_of_integers():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    noise = torch.rand(4 * 256, generator=torch.Generator().manual_seed(1))
    total, own, _ = compress_summable(x, 1, 256, 3, lambda t, op: t.mul_(3) if op == dist.ReduceOp.SUM else None, noise)
    step = x[:256].abs().max()
    assert set((own[:256] / step).round().tolist()) <= {-1.0, 0.0, 1.0}
    assert torch.allclose(total, 3 * own, atol=1e-5)

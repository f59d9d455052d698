"""compress_summable: codes an all-reduce can add (the fault-tolerant strategies' compressed rounds), checked without
processes: ``groups`` groups that hold the same tensor, so the all-reduce is a multiplication (SUM) or nothing (MAX)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_syncasync.algorithms.compression.summable import LEVELS, compress_summable


def _identical_groups(groups: int):
    def all_reduce(t: torch.Tensor, op) -> None:
        if op == dist.ReduceOp.SUM:
            t.mul_(groups)

    return all_reduce


@pytest.mark.parametrize("method", [*sorted(LEVELS), "int2"])
@pytest.mark.parametrize("groups", [1, 2, 3, 4, 8, 64, 512])
def test_the_packed_sum_decodes_to_the_groups_sum_within_half_a_step_each(method, groups):
    levels = {**LEVELS, "int2": 1}[method]
    x = torch.randn(3001, generator=torch.Generator().manual_seed(groups))
    x[::256] = x.abs().max()  # a chunk's largest code in every field: the sum's headroom is used to the full
    x[1::256] = -x.abs().max()
    total, own, _ = compress_summable(x, levels, 256, groups, _identical_groups(groups))
    step = x.abs().max() / levels
    assert (own - x).abs().max() <= step / 2 + 1e-6
    assert torch.allclose(total, groups * own, atol=1e-4)  # no carry crossed into a neighbouring field


@pytest.mark.parametrize(
    ("method", "groups", "most"),
    [("int8", 2, 0.30), ("int4", 2, 0.18), ("int8", 4, 0.34), ("int4", 4, 0.21), ("int2", 2, 0.08), ("int2", 4, 0.11)],
)
def test_bytes_on_the_wire_against_fp32(method, groups, most):
    x = torch.randn(100_000)
    levels = {**LEVELS, "int2": 1}[method]  # int2 (ternary) through the Compressor's summable collective
    _, _, nbytes = compress_summable(x, levels, 256, groups, _identical_groups(groups))
    assert nbytes <= most * x.numel() * 4, nbytes / (x.numel() * 4)


@pytest.mark.parametrize("method", ["int8", "int4", "int2"])
@pytest.mark.parametrize("groups", [2, 4, 8, 64, 512])
def test_the_cost_models_summable_bytes_are_those_handed_to_the_all_reduces(method, groups):
    # The cost model's bytes (summable.py's packing, plus the scales) are those the collective hands its all-reduces.
    from lightning_syncasync.algorithms._costmodel_links import SUMMABLE_CODES, _Collectives, summable_ratio

    x = torch.randn(256 * 400)
    _, _, nbytes = compress_summable(x, SUMMABLE_CODES[method][0], 256, groups, _identical_groups(groups))
    assert summable_ratio(method, groups) == pytest.approx(nbytes / (x.numel() * 4), rel=1e-3)  # last word part-full
    sent = _Collectives()._sent(groups, 1.0, f"{method}@summable")  # bytes per payload byte
    assert sent == pytest.approx(2 * (groups - 1) / groups * summable_ratio(method, groups) / _ratio(method))


def _ratio(method: str) -> float:
    from lightning_syncasync.algorithms._costmodel_links import COMPRESSION

    return COMPRESSION[method][0]

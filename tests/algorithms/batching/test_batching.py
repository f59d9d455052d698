"""BatchBalancer (proportional bounded integer splits) and VariableBatchSampler (each sample once per epoch)."""

from __future__ import annotations

import pytest

from lightning_syncasync.algorithms.batching.balancer import BatchBalancer
from lightning_syncasync.algorithms.batching.batch_sampler import VariableBatchSampler


def test_split_is_proportional_to_throughput_and_sums_to_the_global_batch():
    b = BatchBalancer(global_batch=512, world_size=4)
    assert b.even_split() == [128, 128, 128, 128]
    sizes = b.propose([100.0, 100.0, 100.0, 100.0 / 1.5])
    assert sum(sizes) == 512
    assert sizes == [140, 140, 139, 93]
    # Equal finish times: the predicted step is the no-straggler one (4 x 128 samples at 100+100+100+66.7 samples/s).
    assert b.step_time(sizes, [100, 100, 100, 100 / 1.5]) == pytest.approx(512 / 366.67, rel=0.01)


def test_bounds_are_respected_and_the_rest_is_redistributed():
    b = BatchBalancer(global_batch=100, world_size=4, min_batch=10, max_batch=[40, 40, 40, 15])
    sizes = b.propose([1.0, 1.0, 1.0, 10.0])  # rank 3 is fastest but capped at 15
    assert sizes[3] == 15 and sum(sizes) == 100 and all(10 <= s <= 40 for s in sizes)
    sizes = b.propose([1000.0, 1.0, 1.0, 1.0])  # slow ranks keep min_batch, rank 0 takes at most 40
    assert sizes[0] == 40 and min(sizes) >= 10 and sum(sizes) == 100


def test_groups_keep_their_share():
    b = BatchBalancer(global_batch=64, world_size=4, groups=[[0, 1], [2, 3]])
    sizes = b.propose([1.0, 3.0, 1.0, 1.0])
    assert sizes[0] + sizes[1] == 32 and sizes[2] + sizes[3] == 32
    assert sizes == [8, 24, 16, 16]
    with pytest.raises(ValueError, match="must share 32"):
        b.check([10, 10, 22, 22])


def test_hysteresis_keeps_the_split_unless_the_gain_is_large_enough():
    b = BatchBalancer(global_batch=400, world_size=4, hysteresis=0.05)
    even = b.even_split()
    assert b.decide(even, [100.0, 100.0, 100.0, 98.0]) is None  # 2% slower rank: not worth a change
    assert b.decide(even, [100.0, 100.0, 100.0, 50.0]) is not None
    assert b.decide(even, [100.0, 0.0, 100.0, 50.0]) is None  # a rank without a measurement: keep


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"global_batch": 8, "world_size": 4, "min_batch": 3}, "must share 8 samples"),
        ({"global_batch": 64, "world_size": 4, "min_batch": 9, "max_batch": 8}, r"min_batch \(9\) > max_batch"),
        ({"global_batch": 64, "world_size": 4, "max_batch": 8}, "allow 4..32"),
        ({"global_batch": 63, "world_size": 4, "groups": [[0, 1], [2, 3]]}, "multiple of 2"),
        ({"global_batch": 64, "world_size": 4, "groups": [[0, 1], [1, 3]]}, "partition"),
        ({"global_batch": 64, "world_size": 4, "max_batch": [8, 8]}, "one bound per rank"),
        ({"global_batch": 64, "world_size": 4, "hysteresis": 1.0}, "hysteresis"),
    ],
)
def test_bad_configurations_are_refused_with_the_setting_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BatchBalancer(**kwargs)


def test_check_refuses_a_split_that_changes_the_global_batch():
    b = BatchBalancer(global_batch=32, world_size=4)
    assert b.check([3, 5, 8, 16]) == [3, 5, 8, 16]
    with pytest.raises(ValueError, match="never changed silently"):
        b.check([3, 5, 8, 15])


def _epoch(samplers: list[VariableBatchSampler], change_at: int | None = None, new: list[int] | None = None):
    """Iterate all ranks' samplers in lockstep (as synchronous training does); return the steps' slices."""
    iters = [iter(s) for s in samplers]
    steps = []
    for k in range(len(samplers[0])):
        if change_at is not None and k == change_at:
            start = max(s.produced for s in samplers) + 2  # as if the loaders had prefetched two batches
            for s in samplers:
                s.set_sizes(new, from_step=start)
        steps.append([next(it) for it in iters])
    for it in iters:
        with pytest.raises(StopIteration):
            next(it)
    return steps


@pytest.mark.parametrize("drop_last", [False, True])
def test_every_sample_is_seen_exactly_once_per_epoch_across_a_split_change(drop_last):
    n = 1000
    samplers = [VariableBatchSampler(n, r, [16, 16, 16, 16], seed=3, drop_last=drop_last) for r in range(4)]
    assert len(samplers[0]) == (n // 64 if drop_last else -(-n // 64))
    for epoch in range(2):
        for s in samplers:
            s.set_epoch(epoch)
        steps = _epoch(samplers, change_at=5, new=[30, 20, 10, 4])
        seen = [i for step in steps for part in step for i in part]
        assert len(seen) == len(set(seen))
        assert len(seen) == (n // 64) * 64 if drop_last else sorted(seen) == list(range(n))
        # The change took effect at the scheduled sampler step, on every rank at once.
        assert [len(p) for p in steps[6]] == [16, 16, 16, 16]
        assert [len(p) for p in steps[7]] == [30, 20, 10, 4]
        if not drop_last:
            last = [len(p) for p in steps[-1]]
            assert sum(last) == n % 64 and min(last) >= 1
        for s in samplers:  # back to even for the next epoch, scheduled from the next batch
            s.set_sizes([16, 16, 16, 16])
    # Each epoch is a different permutation, the same on every rank.
    assert samplers[0].issued and samplers[0].issued[-1][1] == (64 if drop_last else n % 64)


def test_issued_records_the_weight_of_each_batch_in_order():
    s = VariableBatchSampler(10, 1, [1, 3], shuffle=False)
    batches = list(s)
    assert batches == [[1, 2, 3], [5, 6, 7], [9]]  # the last step splits the 2 remaining samples 1 + 1
    assert list(s.issued) == [(3, 4), (3, 4), (1, 2)]


def test_fewer_samples_than_ranks_in_the_last_step_wraps_around():
    samplers = [VariableBatchSampler(9, r, [2, 2, 2, 2], shuffle=False) for r in range(4)]
    last = [list(s)[-1] for s in samplers]
    assert last == [[8], [0], [1], [2]]  # one left, every rank still gets one (padded from the start)


def test_sampler_refuses_bad_schedules():
    s = VariableBatchSampler(100, 0, [4, 4])
    list(s)
    with pytest.raises(ValueError, match="already produced"):
        s.set_sizes([2, 6], from_step=3)
    with pytest.raises(ValueError, match="summing to the global batch 8"):
        s.set_sizes([2, 5])
    with pytest.raises(ValueError, match="rank 2 is not in 0..1"):
        VariableBatchSampler(100, 2, [4, 4])
    with pytest.raises(ValueError, match="drop_last"):
        VariableBatchSampler(6, 0, [4, 4], drop_last=True)


def test_noise_scale_estimates_recover_the_true_gradient_and_noise():
    import torch

    from lightning_syncasync.algorithms.batching.noise_scale import GradientNoiseScale

    # Per-sample gradients G + N(0, sigma^2 I) in d dimensions: |G|^2 = 4, S = d sigma^2 = 64 -> noise scale 16.
    g = torch.Generator().manual_seed(0)
    d, sigma = 64, 1.0
    true = torch.zeros(d)
    true[:4] = 1.0
    gns = GradientNoiseScale(smoothing=0.99)
    sizes = [3, 5, 8, 16]
    for _ in range(3000):
        samples = true + sigma * torch.randn(32, d, generator=g)
        parts = samples.split(sizes)
        big = samples.mean(0).pow(2).sum().item()
        pairs = [GradientNoiseScale.pair_estimate(p.mean(0).pow(2).sum().item(), len(p), big, 32) for p in parts]
        gns.update(sum(p[0] for p in pairs) / 4, sum(p[1] for p in pairs) / 4)
    assert gns.grad_sq == pytest.approx(4.0, rel=0.25)
    assert gns.trace == pytest.approx(64.0, rel=0.15)
    assert gns.noise_scale == pytest.approx(16.0, rel=0.3)
    # AdaScale: no gain at the base batch, at most linear, and r = (S/B0 + |G|^2) / (S/B + |G|^2).
    assert gns.gain(32, 32) == 1.0
    r = gns.gain(16, 64)
    assert 1.0 < r < 4.0
    assert r == pytest.approx((gns.trace / 16 + gns.grad_sq) / (gns.trace / 64 + gns.grad_sq))
    assert GradientNoiseScale.pair_estimate(1.0, 32, 1.0, 32) is None  # one rank with the whole batch


def test_stream_mode_keeps_the_epoch_length_when_the_batch_grows():
    n = 100
    samplers = [VariableBatchSampler(n, r, [8, 8], seed=1, stream=True) for r in range(2)]
    assert len(samplers[0]) == 7  # ceil(100 / 16), announced once and kept
    seen = []
    for epoch in range(3):
        iters = [iter(s) for s in samplers]
        for k in range(len(samplers[0])):
            if epoch == 0 and k == 2:
                for s in samplers:
                    s.set_sizes([20, 12], from_step=s.produced, resize=True)
            parts = [next(it) for it in iters]
            seen += parts[0] + parts[1]
        for it in iters:
            with pytest.raises(StopIteration):
                next(it)
    assert len(samplers[0]) == 7 and samplers[0].global_batch == 32
    assert len(seen) == 2 * 16 + 19 * 32
    # A stream of passes: every consecutive block of 100 indices is a permutation of the dataset.
    for start in range(0, len(seen) - n + 1, n):
        assert sorted(seen[start : start + n]) == list(range(n))

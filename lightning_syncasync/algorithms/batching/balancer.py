"""``BatchBalancer``: split a fixed global batch across ranks in proportion to their measured speed.

In synchronous data parallelism every step waits for the slowest rank. If rank ``i`` processes ``r_i`` samples per
second of compute, a step with per-rank batches ``b_i`` lasts ``max_i b_i / r_i``; for a fixed global batch
``B = sum b_i`` that is smallest when every rank finishes at the same time, ``b_i = B * r_i / sum r``. The global batch
never changes, so the learning rate and the schedule stay valid; only who computes which part of it does.

Real splits are integers within bounds (``min_batch`` so no rank idles, ``max_batch`` for memory) and may have to
keep fixed totals per group of ranks (``hier_sync`` averages node models uniformly, so every node must keep the same
share of the global batch for the update to stay unbiased). The proportional target is found by water-filling (a
bisection on the common finish time), then rounded by largest remainder so the total is exact.

Measurements are noisy, and every change of split costs a little (the data loader's prefetched batches still carry
the old one), so :meth:`BatchBalancer.decide` only proposes a new split when it predicts a step at least
``hysteresis`` shorter than the current one.

Nothing here imports Lightning: the ``AdaptiveBatchSize`` callback feeds it measurements and applies its decisions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


class BatchBalancer:
    """Proportional, bounded, integer split of a fixed global batch (see the module docstring).

    Args:
        global_batch: samples per step summed over all ranks (kept fixed).
        world_size: number of ranks.
        min_batch: smallest batch of any rank.
        max_batch: largest batch per rank: one bound for all, a list with one bound per rank, or ``None`` for no
            bound beyond the global batch.
        groups: lists of ranks whose summed batch must stay at ``global_batch / len(groups)`` (one group of all
            ranks when ``None``). Every rank must be in exactly one group.
        hysteresis: relative reduction of the predicted step time a new split must bring to be adopted (0.05 = 5%).

    Example::

        balancer = BatchBalancer(global_batch=512, world_size=4)
        balancer.propose([100.0, 100.0, 100.0, 66.7])  # -> [140, 140, 139, 93]
    """

    def __init__(
        self,
        global_batch: int,
        world_size: int,
        min_batch: int = 1,
        max_batch: int | Sequence[int] | None = None,
        groups: Sequence[Sequence[int]] | None = None,
        hysteresis: float = 0.05,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if min_batch < 1:
            raise ValueError(f"min_batch must be >= 1 (every rank computes part of each step), got {min_batch}")
        if max_batch is None:
            highs = [global_batch] * world_size
        elif isinstance(max_batch, int):
            highs = [max_batch] * world_size
        else:
            highs = [int(m) for m in max_batch]
            if len(highs) != world_size:
                raise ValueError(
                    f"max_batch has {len(highs)} entries but there are {world_size} ranks; give one bound per rank "
                    "or a single int for all"
                )
        if min(highs) < min_batch:
            raise ValueError(
                f"min_batch ({min_batch}) > max_batch ({min(highs)}): no split satisfies both; lower min_batch or "
                "raise max_batch"
            )
        if not 0.0 <= hysteresis < 1.0:
            raise ValueError(f"hysteresis must be in [0, 1), got {hysteresis}; 0.05 adopts splits 5% faster")
        groups = [list(range(world_size))] if groups is None else [list(g) for g in groups]
        members = sorted(r for g in groups for r in g)
        if members != list(range(world_size)) or any(not g for g in groups):
            raise ValueError(f"groups {groups} must partition ranks 0..{world_size - 1} into non-empty groups")
        if global_batch % len(groups):
            raise ValueError(
                f"global batch {global_batch} cannot be shared equally by {len(groups)} groups (nodes); make it a "
                f"multiple of {len(groups)}"
            )
        per_group = global_batch // len(groups)
        for g in groups:
            lo, hi = len(g) * min_batch, sum(highs[r] for r in g)
            if not lo <= per_group <= hi:
                raise ValueError(
                    f"global batch {global_batch} does not fit the bounds: ranks {g} must share {per_group} samples "
                    f"per step but min_batch/max_batch allow {lo}..{hi}. Change the global batch (data batch_size x "
                    "ranks, or global_batch) or the bounds"
                )
        self.global_batch = global_batch
        self.world_size = world_size
        self.min_batch = min_batch
        self.max_batch = highs
        self.groups = groups
        self.hysteresis = hysteresis

    def even_split(self) -> list[int]:
        """The split of equal speeds: as even as the integers and bounds allow."""
        return self.propose([1.0] * self.world_size)

    def check(self, sizes: Sequence[int]) -> list[int]:
        """Validate a user-given split against the global batch, bounds and groups; return it as a list."""
        sizes = [int(s) for s in sizes]
        if len(sizes) != self.world_size:
            raise ValueError(f"a split needs one batch size per rank ({self.world_size}), got {sizes}")
        if sum(sizes) != self.global_batch:
            raise ValueError(
                f"split {sizes} sums to {sum(sizes)}, not the global batch {self.global_batch}; the global batch "
                "is never changed silently"
            )
        for r, s in enumerate(sizes):
            if not self.min_batch <= s <= self.max_batch[r]:
                raise ValueError(f"rank {r}'s batch {s} is outside [min_batch, max_batch] = "
                                 f"[{self.min_batch}, {self.max_batch[r]}]")  # fmt: skip
        per_group = self.global_batch // len(self.groups)
        for g in self.groups:
            if sum(sizes[r] for r in g) != per_group:
                raise ValueError(f"ranks {g} must share {per_group} samples per step, split {sizes} gives them "
                                 f"{sum(sizes[r] for r in g)}")  # fmt: skip
        return sizes

    def propose(self, throughput: Sequence[float]) -> list[int]:
        """The split proportional to ``throughput`` (samples/s per rank) within bounds and group totals."""
        if len(throughput) != self.world_size:
            raise ValueError(f"need one throughput per rank ({self.world_size}), got {len(throughput)}")
        if any(not math.isfinite(t) or t <= 0 for t in throughput):
            raise ValueError(f"throughputs must be finite and > 0, got {list(throughput)}")
        sizes = [0] * self.world_size
        per_group = self.global_batch // len(self.groups)
        for g in self.groups:
            lo = [self.min_batch] * len(g)
            hi = [self.max_batch[r] for r in g]
            for r, s in zip(g, _split(per_group, [throughput[r] for r in g], lo, hi), strict=True):
                sizes[r] = s
        return sizes

    @staticmethod
    def step_time(sizes: Sequence[int], throughput: Sequence[float]) -> float:
        """Predicted compute time of a synchronous step: the slowest rank's ``b_i / r_i``."""
        return max(b / r for b, r in zip(sizes, throughput, strict=True))

    def decide(self, current: Sequence[int], throughput: Sequence[float]) -> list[int] | None:
        """A new split if it is predicted at least ``hysteresis`` faster than ``current``, else ``None``.

        ``throughput`` must be measured as compute throughput (samples per second of compute, waits excluded): the
        wall-clock rate of a synchronous step is the same on every rank and says nothing about who is slow.
        """
        if any(not math.isfinite(t) or t <= 0 for t in throughput):
            return None  # a rank without a usable measurement: keep what we have
        proposal = self.propose(throughput)
        if list(proposal) == list(current):
            return None
        now, then = self.step_time(current, throughput), self.step_time(proposal, throughput)
        return proposal if then < (1.0 - self.hysteresis) * now else None


def _split(total: int, weights: Sequence[float], lo: Sequence[int], hi: Sequence[int]) -> list[int]:
    """Integers ``x_i`` in ``[lo_i, hi_i]`` summing to ``total``, as close to proportional to ``weights`` as allowed."""
    n = len(weights)

    def filled(t: float) -> list[float]:
        return [min(max(t * w, lo_i), hi_i) for w, lo_i, hi_i in zip(weights, lo, hi, strict=True)]

    # Water-filling: the common "finish time" t with sum(clamp(t * w_i)) == total, by bisection (the sum is
    # continuous and non-decreasing in t, from sum(lo) at 0 to sum(hi) at large t).
    low, high = 0.0, 1.0
    while sum(filled(high)) < total:
        high *= 2.0
    for _ in range(200):
        mid = (low + high) / 2
        if sum(filled(mid)) < total:
            low = mid
        else:
            high = mid
    target = filled(high)
    sizes = [min(max(math.floor(x), lo_i), hi_i) for x, lo_i, hi_i in zip(target, lo, hi, strict=True)]
    # Largest remainder: hand out (or take back) single samples where the rounding error is largest.
    order = sorted(range(n), key=lambda i: target[i] - sizes[i], reverse=True)
    while sum(sizes) < total:
        i = next(i for i in order if sizes[i] < hi[i])
        sizes[i] += 1
        order.remove(i)
        order.append(i)
    while sum(sizes) > total:
        i = next(i for i in reversed(order) if sizes[i] > lo[i])
        sizes[i] -= 1
        order.remove(i)
        order.insert(0, i)
    return sizes

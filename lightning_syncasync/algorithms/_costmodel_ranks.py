"""Who computes what in :class:`~lightning_syncasync.algorithms.costmodel.ScalingModel` (``_RankTimes``): the ranks'
compute times (the measured list repeated over a larger world, or one value with a fraction of persistent
stragglers), the distribution of a rank's step time under pauses (``jitter_p``, ``jitter_factor``), and the exact
expected maximum over independent ranks of such discrete distributions (``_expected_max``)."""

from __future__ import annotations

import math
from collections.abc import Iterable

# A discrete distribution of one rank's step time: [(value_s, probability)].
_Dist = list[tuple[float, float]]


def _expected_max(groups: Iterable[tuple[int, _Dist]]) -> float:
    """E[max] over independent ranks, ``groups`` = [(how many ranks, their step-time distribution)].

    Exact for discrete distributions: E[max] = sum_i v_i (F(v_i) - F(v_{i-1})), F(x) = prod_g P_g(X <= x)^count_g.
    """
    groups = [(c, d) for c, d in groups if c > 0]
    values = sorted({v for _, d in groups for v, _ in d})
    out, previous = 0.0, 0.0
    for v in values:
        cdf = 1.0
        for count, dist in groups:
            cdf *= sum(p for x, p in dist if x <= v) ** count
        out += v * (cdf - previous)
        previous = cdf
    return out


def _mean(dist: _Dist) -> float:
    return sum(v * p for v, p in dist)


def _binomial(k: int, p: float) -> list[float]:
    if p <= 0:
        return [1.0] + [0.0] * k
    if p >= 1:
        return [0.0] * k + [1.0]
    lp, lq = math.log(p), math.log1p(-p)
    return [
        math.exp(math.lgamma(k + 1) - math.lgamma(i + 1) - math.lgamma(k - i + 1) + i * lp + (k - i) * lq)
        for i in range(k + 1)
    ]


class _RankTimes:
    """The ranks' step times, for :class:`~lightning_syncasync.algorithms.costmodel.ScalingModel` (which sets the
    attributes below in its constructor)."""

    compute: list[float]
    procs_per_node: int
    straggler_fraction: float
    straggler_factor: float
    jitter_p: float
    jitter_factor: float

    def _rank_groups(self, ranks: int) -> list[tuple[int, float]]:
        """[(how many ranks, compute s/sample)] of a world of ``ranks``."""
        if len(self.compute) > 1:
            w = len(self.compute)
            full, rem = divmod(ranks, w)
            return [(full + (1 if i < rem else 0), c) for i, c in enumerate(self.compute)]
        c = self.compute[0]
        slow = max(1, round(self.straggler_fraction * ranks)) if self.straggler_fraction > 0 else 0
        return [(ranks - slow, c), (slow, c * self.straggler_factor)]

    def _node_patterns(self, nodes: int) -> list[tuple[int, list[float]]]:
        """[(how many nodes, compute s/sample of each of their ranks)]: a node-major world, without listing it."""
        m = self.procs_per_node
        if len(self.compute) > 1:
            w = len(self.compute)
            period = w // math.gcd(w, m)  # the rank pattern of node j repeats with this period in j
            full, rem = divmod(nodes, period)
            return [
                (full + (1 if j < rem else 0), [self.compute[(j * m + i) % w] for i in range(m)])
                for j in range(min(period, nodes))
            ]
        groups = self._rank_groups(nodes * m)
        (fast_n, c), (slow_n, cs) = groups
        full_fast, mixed_fast = divmod(fast_n, m)
        out = [(full_fast, [c] * m)]
        if mixed_fast:
            out.append((1, [c] * mixed_fast + [cs] * (m - mixed_fast)))
        out.append((nodes - full_fast - (1 if mixed_fast else 0), [cs] * m))
        return [(k, p) for k, p in out if k > 0]

    def _step_dist(self, step_s: float) -> _Dist:
        p, f = self.jitter_p, self.jitter_factor
        if p <= 0 or f <= 0:
            return [(step_s, 1.0)]
        return [(step_s, 1.0 - p), (step_s * (1.0 + f), p)]

    def _window_dist(self, step_s: float, window: int) -> _Dist:
        """Mean step time over ``window`` consecutive steps (pauses drawn independently)."""
        p, f = self.jitter_p, self.jitter_factor
        if p <= 0 or f <= 0:
            return [(step_s, 1.0)]
        return [(step_s * (1.0 + f * k / window), q) for k, q in enumerate(_binomial(window, p)) if q > 0]

    def _mean_factor(self) -> float:
        return 1.0 + self.jitter_p * self.jitter_factor

    def ideal_samples_per_s(self, nodes: int) -> float:
        """The no-communication limit: every rank at its own mean rate (pauses included)."""
        ranks = self._ranks(nodes)
        return sum(k / (c * self._mean_factor()) for k, c in self._rank_groups(ranks))

    def _ranks(self, nodes: int) -> int:
        return nodes * self.procs_per_node

"""When a measured split is adopted, and how rank 0's decision reaches every rank.

:class:`~lightning_syncasync.algorithms.batching.balancer.BatchBalancer` says which split a set of per-rank
throughputs calls for; :class:`RebalancePolicy` says when to move to it. Throughput estimates are smoothed across
measurement windows (per-sample throughput hardly depends on the batch size, so they carry over across rebalances),
and a split is adopted only once the raw measurements of ``persistence`` windows in a row have each called for the
same move: under transient pauses (``jitter_slow_link``) window means chased whichever rank paused last, 23-26
rebalances a run.

:func:`grown_batch` is the global batch that growing toward the gradient noise scale calls for, and
:func:`broadcast_decision` hands rank 0's decision (and its noise-scale state) to every rank as one tensor.

Nothing here imports Lightning: the ``AdaptiveBatchSize`` callback gathers the measurements and applies the decisions.
"""

from __future__ import annotations

import math

import torch

from lightning_syncasync.algorithms._comm import broadcast_
from lightning_syncasync.algorithms.batching.balancer import BatchBalancer
from lightning_syncasync.algorithms.batching.noise_scale import GradientNoiseScale


class RebalancePolicy:
    """Smoothed throughput, and a new split only after ``persistence`` windows in a row call for the same move.

    One per fit: the smoothed estimate and the streak are the run's. Pure arithmetic on the gathered numbers, so every
    rank that decides from the same rows keeps the same streak.

    Args:
        smoothing: weight of the previous throughput estimate when a new window's measurement arrives (0 = use each
            window alone).
        persistence: windows in a row whose measurements must each call for the same move before a split is adopted.
    """

    def __init__(self, smoothing: float, persistence: int) -> None:
        self.smoothing = smoothing
        self.persistence = persistence
        self._streak: tuple[tuple[int, ...], int] | None = None  # (the move called for, windows in a row)
        self._throughput: list[float] | None = None

    def decide(
        self, balancer: BatchBalancer, current: list[int], measured: list[float], smoothed: list[float]
    ) -> list[int] | None:
        """The split the smoothed throughput calls for, once the raw measurements of ``persistence`` windows in a row
        have each called for the same move (which ranks gain samples, which lose them), else ``None``. Each window's
        own numbers, not the smoothed ones: smoothing carries one noisy window into the next, and two windows would
        then agree on its noise. Pure arithmetic on the gathered numbers: every rank that decides keeps the same
        streak."""
        raw = balancer.decide(current, measured)
        move = None if raw is None else tuple((b > a) - (b < a) for a, b in zip(current, raw, strict=True))
        if move is None or self._streak is None or self._streak[0] != move:
            self._streak = None if move is None else (move, 1)
        else:
            self._streak = (move, self._streak[1] + 1)
        if self._streak is None or self._streak[1] < self.persistence:
            return None
        proposal = balancer.decide(current, smoothed)
        if proposal is None:
            return None
        self._streak = None  # the split moves: the next move is measured from it
        return proposal

    def smoothed(self, measured: list[float]) -> list[float]:
        """This window's throughput folded into the estimate (the window alone when either has no usable value)."""
        previous = self._throughput
        if previous is None or any(p <= 0 for p in previous) or any(m <= 0 for m in measured):
            throughput = measured
        else:
            a = self.smoothing
            throughput = [a * p + (1 - a) * m for p, m in zip(previous, measured, strict=True)]
        self._throughput = throughput
        return throughput


def grown_batch(noise: GradientNoiseScale, balancer: BatchBalancer, max_total: int) -> int | None:
    """The global batch to grow to (rank 0), or ``None``: toward the noise scale, at most 2x, by >= 25%."""
    noise_scale = noise.noise_scale
    current = balancer.global_batch
    if noise_scale is None or noise.updates < 3:
        return None  # too few windows for a trustworthy estimate
    cap = min(max_total, sum(balancer.max_batch))
    target = min(int(noise_scale), 2 * current, cap)
    target -= target % balancer.world_size  # keeps the split as even as it can be
    return target if target >= 1.25 * current else None


def broadcast_decision(
    decision: list[int] | None,
    grown: bool,
    gain: float,
    noise: GradientNoiseScale,
    world: int,
    device: torch.device,
    root: bool,
) -> tuple[list[int] | None, bool, float]:
    """Rank 0's decision, gain and noise-scale state on every rank, as one tensor (no pickled objects).

    ``root`` is true on global rank 0, whose ``decision``, ``grown``, ``gain`` and ``noise`` are sent; every rank's
    ``noise`` is loaded with rank 0's state. Layout: ``[has_decision, grown, gain, |G|^2, S, updates, b_0 .. b_{N-1}]``
    in float64 (exact for these integers); a missing noise estimate travels as NaN.
    """
    buf = torch.zeros(6 + world, dtype=torch.float64, device=device)
    if root:
        nan = float("nan")
        head = [float(decision is not None), float(grown), gain,
                nan if noise.grad_sq is None else noise.grad_sq, nan if noise.trace is None else noise.trace,
                float(noise.updates)]  # fmt: skip
        values = head + [float(b) for b in (decision or [0] * world)]
        buf.copy_(torch.tensor(values, dtype=torch.float64, device="cpu"))
    broadcast_(buf, 0)
    values = buf.cpu().tolist()
    grad_sq, trace = values[3], values[4]
    noise.load_state_dict(
        {
            "grad_sq": None if math.isnan(grad_sq) else grad_sq,
            "trace": None if math.isnan(trace) else trace,
            "updates": int(values[5]),
        }
    )
    sizes = [int(v) for v in values[6:]] if values[0] else None
    return sizes, bool(values[1]), values[2]

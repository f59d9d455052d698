"""``GradientNoiseScale``: the critical batch size of McCandlish et al. (2018) and AdaScale's learning-rate gain.

A gradient computed on ``b`` samples has expected squared norm ``|G|^2 + S / b``, where ``G`` is the true gradient and
``S`` the trace of the per-sample gradient covariance. Data parallelism measures the gradient at two batch sizes in
every step for free: each rank's local gradient (``b_i`` samples, before the all-reduce) and the averaged one (``B``
samples). From one pair (McCandlish et al., appendix A):

    |G|^2 ~ (B |g_B|^2 - b_i |g_i|^2) / (B - b_i)        S ~ (|g_i|^2 - |g_B|^2) / (1 / b_i - 1 / B)

Both are unbiased but very noisy per step, so numerator and denominator are smoothed separately (exponential moving
averages) before the ratio ``B_noise = S / |G|^2`` is taken: the *simple noise scale*, the batch size beyond which a
larger batch stops buying proportionally fewer steps.

AdaScale (Johnson et al., 2020) keeps a run at batch ``B`` on the learning-rate schedule of a base batch ``B0``: each
step at ``B`` is worth ``r = (S / B0 + |G|^2) / (S / B + |G|^2)`` steps at ``B0`` (1 at ``B = B0``, at most ``B / B0``),
so the learning rate is multiplied by ``r`` and the schedule advances by ``r`` steps. Pollux/AdaptDL use the same
quantity to pick the batch size with the best *goodput* (throughput x statistical efficiency).

Nothing here imports Lightning.
"""

from __future__ import annotations

import math


class GradientNoiseScale:
    """Running estimates of ``|G|^2``, ``S``, the noise scale and the AdaScale gain (see the module docstring).

    Args:
        smoothing: weight of the previous estimate in the moving averages (0.95 averages over ~20 updates).

    Example::

        gns = GradientNoiseScale()
        gns.update(*GradientNoiseScale.pair_estimate(2.1, 64, 1.2, 128))
        gns.noise_scale, gns.gain(base_batch=128, batch=256)
    """

    def __init__(self, smoothing: float = 0.95) -> None:
        if not 0.0 <= smoothing < 1.0:
            raise ValueError(f"smoothing must be in [0, 1), got {smoothing}")
        self.smoothing = smoothing
        self.grad_sq: float | None = None  # smoothed |G|^2
        self.trace: float | None = None  # smoothed S
        self.updates = 0

    @staticmethod
    def pair_estimate(
        local_sqnorm: float, local_batch: int, global_sqnorm: float, global_batch: int
    ) -> tuple[float, float] | None:
        """One rank's unbiased ``(|G|^2, S)`` from its local gradient and the averaged one of the same step.

        ``None`` when the pair says nothing (the rank held the whole batch, or a norm is not finite).
        """
        if not 0 < local_batch < global_batch or not (math.isfinite(local_sqnorm) and math.isfinite(global_sqnorm)):
            return None
        big, small = float(global_batch), float(local_batch)
        grad_sq = (big * global_sqnorm - small * local_sqnorm) / (big - small)
        trace = (local_sqnorm - global_sqnorm) / (1.0 / small - 1.0 / big)
        return grad_sq, trace

    def update(self, grad_sq: float, trace: float) -> None:
        """Add a measurement of ``|G|^2`` and ``S`` (e.g. the mean of :meth:`pair_estimate` over ranks and steps)."""
        if not (math.isfinite(grad_sq) and math.isfinite(trace)):
            return
        a = self.smoothing
        self.grad_sq = grad_sq if self.grad_sq is None else a * self.grad_sq + (1 - a) * grad_sq
        self.trace = trace if self.trace is None else a * self.trace + (1 - a) * trace
        self.updates += 1

    @property
    def noise_scale(self) -> float | None:
        """``S / |G|^2`` (samples), or ``None`` while the estimates are not both positive yet."""
        if self.grad_sq is None or self.trace is None or self.grad_sq <= 0 or self.trace <= 0:
            return None
        return self.trace / self.grad_sq

    def gain(self, base_batch: int, batch: int) -> float:
        """AdaScale's gain ``r`` of training at ``batch`` instead of ``base_batch`` (1 without usable estimates)."""
        if batch <= base_batch or self.noise_scale is None:
            return 1.0
        assert self.grad_sq is not None and self.trace is not None
        r = (self.trace / base_batch + self.grad_sq) / (self.trace / batch + self.grad_sq)
        return min(max(r, 1.0), batch / base_batch)

    def state_dict(self) -> dict[str, float | int | None]:
        return {"grad_sq": self.grad_sq, "trace": self.trace, "updates": self.updates}

    def load_state_dict(self, state: dict[str, float | int | None]) -> None:
        self.grad_sq = state.get("grad_sq")  # type: ignore[assignment]
        self.trace = state.get("trace")  # type: ignore[assignment]
        self.updates = int(state.get("updates") or 0)

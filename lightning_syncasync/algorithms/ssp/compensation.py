"""Stale-gradient compensation for asynchronous training.

A gradient computed on weights ``w_stale`` is applied to weights ``w_now`` that other workers' updates have moved.
Selectable remedies:

* ``none``.
* ``staleness_lr``: scale the gradient by ``1 / (1 + tau)``, ``tau`` the number of other updates merged in between
  (Zhang et al., "Staleness-aware Async-SGD", IJCAI 2016). With adaptive optimizers the scale partly cancels in the
  normalisation; it acts fully with SGD.
* ``dc_asgd``: delay compensation (Zheng et al., "Asynchronous SGD with Delay Compensation", ICML 2017): the
  first-order Taylor correction ``g(w_now) ~ g + lambda * g * g * (w_now - w_stale)``, the diagonal outer product
  ``g * g`` approximating the Hessian.
* ``dc_asgd_adaptive``: the same with ``lambda_t = lambda / sqrt(ms_t + eps)``, ``ms`` a running mean of ``g * g``
  (the paper's DC-ASGD-a), so one ``lambda`` works across layers and training phases.

Both DC-ASGD corrections are bounded elementwise: ``|correction_i| <= max_ratio * |g_i|`` (default 1.0), so the
compensated gradient lies between 0 and ``2 g`` and never points against ``g``. Why: the correction is a first-order
Taylor term, valid only while ``delta`` is small, and nothing in the formula bounds it. Per element it is ``lam *
|delta_i| * |g_i| / sqrt(ms_i)`` times the gradient, and ``|g_i| / sqrt(ms_i) <= 1 / sqrt(1 - ms_momentum) = 4.5``
because ``ms`` holds the current ``g * g`` (measured: about 1.0-1.1 at the largest element), so elements where ``ms`` is
tiny are not the problem: the ratio is ``lam`` times how far the weights moved between read and apply, in parameter
units, unbounded. Once it passes about 1 the correction, which has the sign of ``delta`` (the recent move), outweighs
the gradient; with SGD momentum the next steps swing back farther, ``delta`` grows, and the ratio with it. Measured
(``scripts/dc_asgd_slow_link.py``: BatchNorm CNN on digits, SGD lr 0.05 momentum 0.9, 250 steps, gradients applied ``d``
steps late; ``lam`` larger than 1 stands for the default on a model whose weights move that many times farther between
read and apply: more updates in flight, larger momentum steps): without the bound, ``d=2``: ``lam=1`` ratio 0.07
(largest element, median over steps), accuracy 0.96 (``none``: 0.93); ``lam=30`` ratio 1.0, 0.91-0.97; ``lam=100``
ratio 6.5-9.5, the norm ratio ``||c||/||g||`` growing from 1.05-1.6 (first 50 steps) to 1e3-1e5 (last 10), NaN by step
58-131 (3 seeds); ``lam=300`` NaN by step 20. ``d=4``, ``lam=100``: NaN by step 47 (``none`` 0.10 there, ``lam=1``
0.22). A tiny BatchNorm MLP with ``d=4, lam=100`` falls to chance (0.100; ``none`` 0.917), the symptom a real 2-node job
over 100 Mbit/s showed at ``lam=1`` (0.107 against ``none``'s 0.947; its per-exchange moves were not recorded). With the
bound every one of these runs learns: ``d=2``, ``lam`` 100 / 300: 0.93-0.97 / 0.91-0.97 (clipping 1 % / 11 % of the
elements); ``d=4``, ``lam=100``: 0.967. At ``lam=1`` the bound never acted in these runs (0 elements over 250 steps at
``d`` = 1, 2, 4): where ``delta`` is small the result is the papers' formula bit for bit. ``max_ratio=None`` restores
the unbounded formula.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

Method = Literal["none", "staleness_lr", "dc_asgd", "dc_asgd_adaptive"]
METHODS = ("none", "staleness_lr", "dc_asgd", "dc_asgd_adaptive")


class StaleGradientCompensation:
    """Correct gradients for the updates merged between reading the weights and applying the gradient.

    Args:
        method: ``none``, ``staleness_lr``, ``dc_asgd`` or ``dc_asgd_adaptive``.
        lam: the DC-ASGD ``lambda`` (>= 0).
        ms_momentum: running-mean factor of ``g * g`` for ``dc_asgd_adaptive`` (the paper's ``m``).
        eps: added under the square root.
        max_ratio: the DC-ASGD correction of each element is clipped to ``max_ratio`` times that element of the
            gradient (``None``: unbounded, the papers' formula). The default 1.0 keeps the corrected gradient between
            0 and twice the gradient, with its sign; see the module docstring for why and the numbers.

    Example::

        comp = StaleGradientCompensation("dc_asgd_adaptive", lam=1.0)
        grad = comp.apply(grad, delta, tau)  # flat gradient; delta: w_now - w_stale over the same parameters
    """

    def __init__(self, method: Method = "dc_asgd_adaptive", lam: float = 1.0, ms_momentum: float = 0.95,
                 eps: float = 1e-7, max_ratio: float | None = 1.0) -> None:  # fmt: skip
        if method not in METHODS:
            raise ValueError(
                f"compensation must be one of {METHODS}, got {method!r}; HINT: 'dc_asgd_adaptive' is the default, "
                "'none' applies stale gradients as they are"
            )
        if lam < 0:
            raise ValueError(f"lam must be >= 0, got {lam}; HINT: 0 turns DC-ASGD off")
        if not 0 <= ms_momentum < 1:
            raise ValueError(f"ms_momentum must be in [0, 1), got {ms_momentum}; HINT: the default 0.95 is the paper's")
        if eps <= 0:
            raise ValueError(f"eps must be > 0, got {eps}; HINT: the default 1e-7 only guards the square root")
        if max_ratio is not None and not max_ratio > 0:  # `not >` also refuses NaN
            raise ValueError(
                f"max_ratio must be > 0 or None, got {max_ratio}; HINT: the default 1.0 keeps each DC-ASGD correction "
                "within the gradient's own size (see the module docstring); None is the unbounded formula, which "
                "diverges once the weights move far between read and apply; lam=0 turns DC-ASGD off"
            )
        self.method = method
        self.lam = lam
        self.ms_momentum = ms_momentum
        self.eps = eps
        self.max_ratio = max_ratio
        self.mean_square: torch.Tensor | None = None  # elementwise running mean of g * g

    @property
    def needs_delta(self) -> bool:
        """Whether :meth:`apply` reads ``delta`` (DC-ASGD): callers can skip copying the weights otherwise."""
        return self.method in ("dc_asgd", "dc_asgd_adaptive")

    @torch.no_grad()
    def apply(self, grad: torch.Tensor, delta: torch.Tensor | None, tau: int) -> torch.Tensor:
        """Correct a flat gradient (in place, and returned). ``delta`` is ``w_now - w_stale`` over the same
        parameters in the same order; ``tau`` the number of updates it holds."""
        if self.method == "none":
            return grad
        if self.method == "staleness_lr":
            if tau > 0:
                grad.mul_(1.0 / (1 + tau))
            return grad
        lam: Any = self.lam
        if self.method == "dc_asgd_adaptive":
            # Elementwise running mean of g * g (the paper keeps it per parameter; elementwise is the same math).
            sq = grad * grad
            ms = self.mean_square
            if ms is None or ms.shape != sq.shape:
                ms = sq
            else:
                ms.mul_(self.ms_momentum).add_(sq, alpha=1 - self.ms_momentum)
            self.mean_square = ms
            lam = self.lam / (ms + self.eps).sqrt()
        if delta is not None:
            correction = lam * grad * grad * delta.to(grad.dtype)
            if self.max_ratio is not None:
                # The Taylor term may change no element by more than max_ratio times the element itself (module
                # docstring): where it is inside the bound, nothing changes, bit for bit.
                bound = grad.abs().mul_(self.max_ratio)
                correction = torch.minimum(torch.maximum(correction, -bound), bound)
            grad.add_(correction)
        return grad

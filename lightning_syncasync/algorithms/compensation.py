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

    Example::

        comp = StaleGradientCompensation("dc_asgd_adaptive", lam=1.0)
        grad = comp.apply(grad, delta, tau)  # flat gradient; delta: w_now - w_stale over the same parameters
    """

    def __init__(self, method: Method = "dc_asgd_adaptive", lam: float = 1.0, ms_momentum: float = 0.95,
                 eps: float = 1e-7) -> None:  # fmt: skip
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
        self.method = method
        self.lam = lam
        self.ms_momentum = ms_momentum
        self.eps = eps
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
            grad.add_(lam * grad * grad * delta.to(grad.dtype))
        return grad

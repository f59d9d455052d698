"""The outer optimizer of round-based training: how a round's global pseudo-gradient moves the global model.

Both round-based algorithms use it: ``hier_sync``'s :class:`~lightning_syncasync.algorithms.averaging.DelayedAverager`
(node replicas averaged across nodes) and ``async_ssp``'s
:class:`~lightning_syncasync.algorithms.averaging.RoundExchange` (every rank its own learner). A round produces one
pseudo-gradient ``G`` (how far the replicas moved from the global model, averaged), identical on every rank, so every
rank runs the same outer step and holds the same outer state.

* ``average``: ``global -= G`` (plain periodic averaging, local SGD; ``lr`` and ``momentum`` are not used).
* ``nesterov``: DiLoCo's outer SGD with Nesterov momentum (Douillard et al., 2023): ``m = mu m + G``,
  ``global -= lr (G + mu m)``.
* ``delayed_nesterov``: for rounds applied late (Liu et al., 2024, "Asynchronous Local-SGD Training for Language
  Modeling", delayed Nesterov momentum). Momentum amplifies a direction about ``1 / (1 - mu)`` times; when the
  pseudo-gradients it sums are themselves a round or two old, that amplification overshoots. Here each round's
  ``G`` is applied at once as a plain step (``global -= lr G``), and the momentum buffer is updated only every
  ``every`` rounds, from the mean of those rounds' pseudo-gradients, and applied then (``global -= lr mu every m``).
  With a constant ``G`` it moves as far as Nesterov does (``lr G / (1 - mu)`` per round in the steady state); the
  momentum part changes once per ``every`` rounds, from an average, so one stale round cannot swing it.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

Outer = Literal["average", "nesterov", "delayed_nesterov"]
OUTERS = ("average", "nesterov", "delayed_nesterov")


def check_outer(outer: str, outer_lr: float, outer_momentum: float, every: int = 1) -> None:
    """Validate outer-optimizer settings (strategies check them at construction, before any process starts)."""
    if outer not in OUTERS:
        raise ValueError(
            f"outer must be one of {OUTERS}, got {outer!r}; HINT: 'average' is plain periodic averaging, "
            "'nesterov' DiLoCo's outer momentum, 'delayed_nesterov' the variant for rounds applied late"
        )
    if not outer_lr > 0:
        raise ValueError(
            f"outer_lr must be > 0, got {outer_lr}; HINT: 0.7 (DiLoCo's) for the Nesterov variants; outer='average' "
            "ignores it"
        )
    if not 0 <= outer_momentum < 1:
        raise ValueError(f"outer_momentum must be in [0, 1), got {outer_momentum}; HINT: DiLoCo uses 0.9")
    if not isinstance(every, int) or every < 1:
        raise ValueError(
            f"outer_momentum_every must be an integer >= 1, got {every!r}; HINT: delayed_nesterov updates its "
            "momentum once per that many rounds (2 by default)"
        )


class OuterOptimizer:
    """One outer step per round, on the global model (or this rank's shard of it).

    Args:
        outer: ``average``, ``nesterov`` or ``delayed_nesterov`` (module docstring).
        lr: the outer learning rate of the Nesterov variants.
        momentum: ``mu`` of the Nesterov variants.
        every: rounds per momentum update of ``delayed_nesterov``.

    Example::

        outer = OuterOptimizer("nesterov", lr=0.7, momentum=0.9)
        step = outer.step(pseudo_grad)   # the change to subtract from the global model
        anchor -= step
    """

    def __init__(self, outer: Outer = "average", lr: float = 1.0, momentum: float = 0.9, every: int = 2) -> None:
        check_outer(outer, lr, momentum, every)
        self.outer, self.lr, self.momentum, self.every = outer, lr, momentum, every
        self.buffer: torch.Tensor | None = None  # the momentum
        self.pending: torch.Tensor | None = None  # delayed_nesterov: pseudo-gradients since the last momentum update
        self.count = 0  # delayed_nesterov: rounds in ``pending``

    @torch.no_grad()
    def step(self, pseudo_grad: torch.Tensor) -> torch.Tensor:
        """The change of the global model for this round's pseudo-gradient (``new = old - step``); updates the
        outer state. The same input on every rank gives the same output and state on every rank."""
        if self.outer == "average":
            return pseudo_grad.clone()
        # State restored from a checkpoint is where the checkpoint was loaded (often the CPU): move it to the data.
        device = pseudo_grad.device
        self.buffer, self.pending = (None if t is None else t.to(device) for t in (self.buffer, self.pending))
        if self.buffer is None:
            self.buffer = torch.zeros_like(pseudo_grad)
        if self.outer == "nesterov":
            self.buffer.mul_(self.momentum).add_(pseudo_grad)
            return self.lr * (pseudo_grad + self.momentum * self.buffer)
        out = self.lr * pseudo_grad  # delayed_nesterov: the fresh part at once
        self.pending = pseudo_grad.clone() if self.pending is None else self.pending.add_(pseudo_grad)
        self.count += 1
        if self.count == self.every:
            self.buffer.mul_(self.momentum).add_(self.pending, alpha=1.0 / self.every)
            out.add_(self.buffer, alpha=self.lr * self.momentum * self.every)
            self.pending, self.count = None, 0
        return out

    def state_dict(self) -> dict[str, Any]:
        # Copies: the step updates the buffers in place.
        return {"buffer": _copy(self.buffer), "pending": _copy(self.pending), "count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.buffer = _copy(state.get("buffer"))
        self.pending = _copy(state.get("pending"))
        self.count = int(state.get("count", 0))


def _copy(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.clone()

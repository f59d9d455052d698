"""``auto_sync``'s async mode on a non-finite loss: the step's update is held back (never reaches the replica or a
round) and ``diverged`` tells the switcher, whose rollback restores the last good state. On an accelerator the check
stays on the device, without a host sync per step.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from lightning_syncasync.algorithms.ssp.exchange import grads_total, loss_total
from lightning_syncasync.strategies._async_step import (
    checked_value,
    what_is_checked,
)

log = logging.getLogger(__name__)


class HoldsBackNonFinite:
    """Mixin of :class:`~lightning_syncasync.strategies.AutoSyncStrategy` (first in its bases, so its
    ``training_step`` and ``_on_nonfinite`` come before ``LocalReduceWhileAsync``'s): holds back an async step whose
    loss is not finite, and reports it through ``diverged``."""

    mode: str
    rounds: Any
    _params: list[torch.Tensor]
    _diverged: float | None
    _step_ok: torch.Tensor | None
    _zeroed_steps: torch.Tensor | None

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        out = super().training_step(*args, **kwargs)  # type: ignore[misc]
        if self._zeroes_on_device():
            loss = out.get("loss") if isinstance(out, Mapping) else out
            if isinstance(loss, torch.Tensor):
                # Before backward: DDP's hook (_mode_hook) zeroes the gradients of a step whose loss is not finite.
                ok = torch.isfinite(loss_total(loss))
                self._step_ok = ok if self._step_ok is None else self._step_ok & ok  # every micro-batch
        return out

    def _zeroes_on_device(self) -> bool:
        """Async rounds on an accelerator, under DDP: a non-finite step is found and zeroed on the device, without
        the host sync per step that reading the loss back would be (``_finite_or_held_back``)."""
        module = self.lightning_module
        return (
            self.mode == "async"
            and self.rounds is not None
            and self.root_device.type != "cpu"
            and isinstance(self.model, DistributedDataParallel)
            # Manual optimization steps inside training_step, before the flag could exist: checked on the host.
            and module is not None
            and module.automatic_optimization
        )

    @property
    def diverged(self) -> float | None:
        """A non-finite loss held back in async mode since the switcher last cleared this (it reads it once per
        window); on an accelerator in async rounds this reads the device's count (a host sync, once per window)."""
        if self._zeroed_steps is not None:
            zeroed, self._zeroed_steps = int(self._zeroed_steps), None
            if zeroed:
                self._held_back(math.nan, zeroed)
        return self._diverged

    @diverged.setter
    def diverged(self, value: float | None) -> None:
        self._diverged = value
        if value is None:
            self._zeroed_steps = None

    def _finite_or_held_back(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        """Async rounds: a non-finite loss drops this step's gradients (the optimizer then skips every parameter),
        so the NaN never reaches the replica or a round, and the switcher reads ``diverged``.

        On an accelerator reading the loss back at every step would be a host sync per step. There the check stays
        on the device: under DDP with automatic optimization ``training_step`` checks the loss and DDP's hook zeroes
        the step's gradients when it is not finite; otherwise (manual optimization, no DDP) the closure zeroes them
        itself. The optimizer then takes a step on zero gradients (with momentum or Adam the moments' decay moves the
        weights a little, with no NaN), and ``diverged`` reads the count once per switcher window, whose rollback
        restores the last good state."""

        def wrapped() -> Any:
            loss = closure()
            if self._zeroes_on_device():
                return loss
            # Manual optimization and gradient accumulation check the gradients too (what_is_checked):
            # _zeroes_on_device, which checks each micro-batch's loss before DDP's hook, needs automatic optimization.
            what = what_is_checked(self.lightning_module)
            value = checked_value(loss, lambda: grads_total(self._params), what)
            if value is None:
                return loss
            if value.device.type != "cpu":
                # On an accelerator, zeroed here on the device, as DDP's hook does for _zeroes_on_device: no host sync
                # per step (the optimizer then steps on zero gradients); optimizer_step counts the step for diverged.
                ok = torch.isfinite(value)
                for p in self._params:
                    if p.grad is not None:
                        p.grad.masked_fill_(~ok, 0.0)
                self._step_ok = ok if self._step_ok is None else self._step_ok & ok
            elif not math.isfinite(total := value.item()):
                self._held_back(total)
                for p in self._params:
                    p.grad = None
            return loss

        return wrapped

    def _on_nonfinite(self) -> Callable[[float], None] | None:
        return self._held_back

    def _held_back(self, loss: float, steps: int = 1) -> None:
        self._diverged = loss
        log.warning(
            "auto_sync: rank %d: non-finite loss %s in async mode (%d step(s)); update held back",
            self.global_rank, loss, steps,
        )  # fmt: skip

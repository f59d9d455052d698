"""At one rank there is nothing to exchange, so the DDP-based strategies (``hier_sync``, ``auto_sync``,
``ddp_measured``) leave the model unwrapped there, as Lightning's ``auto`` strategy does at ``devices=1``.

DDP at a world of one still copies every gradient into its buckets and back, all-reduces them over a group of one
and, with this package's measuring comm hooks, runs Python per bucket: about 0.3 ms of host time per step
(``scripts/host_overhead.py``), which on a GPU whose step the host already bounds is steps/s lost for nothing. The
gradients are the same without it: DDP divides them by a world size of 1 and sums them over one rank, both exact.
A compressing hook is the exception: at one rank it would quantize gradients it never sends, and unwrapped it does
not run at all, which is what a run with nothing to send should do.

What a one-rank trial run would lose is DDP's own check that every parameter gets a gradient: a model with unused
parameters trains at one rank and stops at two (DDP's "Expected to have finished reduction", which Lightning reports
as "parameters that were not used in producing the loss"). So the first backward of each fit at one rank looks for
them and warns with the fix.
"""

from __future__ import annotations

import logging

from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torch.nn import Module

log = logging.getLogger(__name__)


class UnwrappedAtOneRank:
    """Mixin (before the Lightning ``DDPStrategy`` base) for a strategy that wraps the model in DDP: its
    ``_setup_model`` returns the model as it is when :meth:`_unwrap_at_one_rank` says so."""

    _check_unused = False
    _unwrapped_name = ""

    def _unwrap_at_one_rank(self, name: str) -> bool:
        """Whether strategy ``name`` leaves the model unwrapped (one rank); says so in the log when it does."""
        if self.world_size != 1:  # type: ignore[attr-defined]
            return False
        log.info("%s: one rank, so the model is not wrapped in DDP (there are no gradients to exchange)", name)
        self._check_unused = not self._ddp_kwargs.get("find_unused_parameters", False)  # type: ignore[attr-defined]
        self._unwrapped_name = name
        return True

    def post_backward(self, closure_loss: Tensor) -> None:
        super().post_backward(closure_loss)  # type: ignore[misc]
        if self._check_unused:
            self._check_unused = False  # the first backward of the fit only: a host-side look, no GPU sync
            module: Module | None = self.lightning_module  # type: ignore[attr-defined]
            if module is not None:
                warn_unused(self._unwrapped_name, module)


def warn_unused(name: str, module: Module) -> list[str]:
    """Warn about the parameters that take gradients but got none (DDP's error at two ranks or more); returns them."""
    unused = [n for n, p in module.named_parameters() if p.requires_grad and p.grad is None]
    if unused:
        shown = unused[:5] + ([f"... ({len(unused)} in all)"] if len(unused) > 5 else [])
        rank_zero_warn(
            f"{name}: parameter(s) {shown} got no gradient in the first backward. At one rank that is harmless; with "
            "2 or more ranks DDP stops at the second step ('It looks like your LightningModule has parameters that "
            "were not used in producing the loss'). HINT: pass find_unused_parameters=True to the strategy, or set "
            "requires_grad=False on parameters you do not train"
        )
    return unused

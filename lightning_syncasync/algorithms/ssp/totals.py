"""A training step's finiteness in one value: the 0-d fp32 totals of a loss (``loss_total``) and of the gradients
(``grads_total``) whose finiteness stands for theirs, computed on their device so that checking them costs one host
read where and when the caller chooses (``SSPExchange.ship``'s exchange thread, the strategies' NaN checks)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["grads_total", "loss_total"]


def loss_total(loss: torch.Tensor) -> torch.Tensor:
    """A loss as the 0-d fp32 sum whose finiteness stands for the loss's (a NaN or an infinity in any term leaves it
    non-finite), on the loss's device: what ``SSPExchange.ship`` checks, and what a caller that zeroes a gradient
    before it ships it must check alike."""
    return (loss if loss.numel() == 1 else loss.sum()).detach().float().reshape(())


def grads_total(params: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The gradients of ``params`` as one 0-d fp32 value, the sum of their L1 norms, whose finiteness stands for
    theirs (as :func:`loss_total`'s), on their device; ``None`` when none has a gradient. The strategies check it in
    place of the loss under manual optimization, where Lightning's closure returns no loss (the step's backward ran in
    ``training_step``), and with it under gradient accumulation, where the closure's loss is the last micro-batch's
    only. A sharded parameter's (a DTensor's) is this rank's shard's."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return None
    local = [g.detach().to_local() if hasattr(g, "to_local") else g.detach() for g in grads]  # DTensor (not imported)
    try:
        # One fused launch per device and dtype instead of one per tensor (a GPU step under accumulation). Each norm
        # is accumulated and returned in fp32: an fp16 gradient's own-dtype norm overflows at 65504, and a large but
        # finite gradient must not read as a NaN step.
        norms = torch._foreach_norm(local, 1, dtype=torch.float32)
    except TypeError:  # a torch whose private _foreach_norm takes no dtype
        norms = [g.float().abs().sum() for g in local]
    return torch.stack(list(norms)).sum()

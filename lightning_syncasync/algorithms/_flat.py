"""In-place updates of a list of tensors from one flat tensor (the layout every algorithm here exchanges)."""

from __future__ import annotations

import torch


@torch.no_grad()
def add_flat_(tensors: list[torch.Tensor], flat: torch.Tensor) -> None:
    """``t += flat[slice of t]`` for each tensor, in order (cast to each tensor's dtype)."""
    offset = 0
    for t in tensors:
        n = t.numel()
        t.add_(flat[offset : offset + n].view_as(t).to(t.dtype))
        offset += n


@torch.no_grad()
def copy_flat_(tensors: list[torch.Tensor], flat: torch.Tensor) -> None:
    """``t[:] = flat[slice of t]`` for each tensor, in order (cast to each tensor's dtype)."""
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n

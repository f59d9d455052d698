"""Measure per-rank gradient norms before DDP averages them, and apply AdaScale's learning-rate gain.

Used by ``AdaptiveBatchSize(grow_batch=True)``. The squared norm of this rank's own gradient is summed in parameter
``post_accumulate_grad`` hooks, which run as each gradient is accumulated, before DDP's reducer copies the averaged
bucket back at the end of backward (with the default ``gradient_as_bucket_view=False``); the averaged gradient's norm
is read in ``on_before_optimizer_step``. The gain multiplies every parameter group's learning rate for the duration
of ``optimizer.step`` only (torch optimizer step pre/post hooks), so LR schedulers and checkpoints keep the base
rates.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.optim import Optimizer

from lightning_syncasync.algorithms.noise_scale import GradientNoiseScale


class NoiseScaleProbe:
    """Per-step pairs (local, averaged) of squared gradient norms, summed over a window; AdaScale gain on step."""

    def __init__(self, params: Iterable[torch.nn.Parameter], optimizers: Iterable[Optimizer]) -> None:
        self.gain = 1.0
        self._local: torch.Tensor | None = None
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params if p.requires_grad]
        self._saved: dict[int, list[float]] = {}
        for opt in optimizers:
            self._handles.append(opt.register_step_pre_hook(self._scale_lr))
            self._handles.append(opt.register_step_post_hook(self._restore_lr))
        self.reset_window()

    def reset_window(self) -> None:
        self.grad_sq_sum = 0.0
        self.trace_sum = 0.0
        self.count = 0

    def start_batch(self) -> None:
        self._local = None

    def _on_grad(self, p: torch.Tensor) -> None:
        if p.grad is None:
            return
        sq = p.grad.detach().float().pow(2).sum()
        self._local = sq if self._local is None else self._local + sq

    def after_reduce(self, params: Iterable[torch.nn.Parameter], weight: float, batch: int, global_batch: int) -> None:
        """Called once the gradients are averaged: add this step's pair to the window."""
        if self._local is None or weight <= 0:
            return
        grads = [p.grad.detach().float().pow(2).sum() for p in params if p.grad is not None]
        if not grads:
            return
        global_sq = float(torch.stack(grads).sum())
        # The loss hook scaled this rank's gradient by `weight`; the estimator wants the plain mean over its batch.
        local_sq = float(self._local) / (weight * weight)
        self._local = None
        est = GradientNoiseScale.pair_estimate(local_sq, batch, global_sq, global_batch)
        if est is not None:
            self.grad_sq_sum += est[0]
            self.trace_sum += est[1]
            self.count += 1

    def _scale_lr(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        if self.gain == 1.0:
            return
        self._saved[id(optimizer)] = [g["lr"] for g in optimizer.param_groups]
        for g in optimizer.param_groups:
            g["lr"] = g["lr"] * self.gain

    def _restore_lr(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        saved = self._saved.pop(id(optimizer), None)
        if saved is not None:
            for g, lr in zip(optimizer.param_groups, saved, strict=True):
                g["lr"] = lr

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

"""Measure per-rank gradient norms before DDP averages them, and apply AdaScale's learning-rate gain.

Used by ``AdaptiveBatchSize(grow_batch=True)``. The squared norm of this rank's own gradient is summed in parameter
``post_accumulate_grad`` hooks, which run as each gradient is accumulated, before DDP's reducer copies the averaged
bucket back at the end of backward (with the default ``gradient_as_bucket_view=False``); the averaged gradient's norm
is read in ``on_before_optimizer_step``. The gain multiplies every parameter group's learning rate for the duration
of ``optimizer.step`` only (torch optimizer step pre/post hooks), so LR schedulers and checkpoints keep the base
rates.

The norms stay on the device until the window is read (``grad_sq_sum``, ``trace_sum``, ``count``): reading them
every step would be a host sync per step on a GPU; the window reads them all at once.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.optim import Optimizer

from lightning_syncasync.algorithms.batching.noise_scale import GradientNoiseScale


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
        self._grad_sq_sum = 0.0
        self._trace_sum = 0.0
        self._count = 0
        # Per step of the window not read yet: (local squared norm, averaged squared norm) on the device, and the
        # step's weight, batch and global batch.
        self._pending: list[tuple[torch.Tensor, torch.Tensor, float, int, int]] = []

    @property
    def grad_sq_sum(self) -> float:
        """The window's sum of the squared-gradient-norm estimates."""
        self._read()
        return self._grad_sq_sum

    @property
    def trace_sum(self) -> float:
        """The window's sum of the gradient-noise-trace estimates."""
        self._read()
        return self._trace_sum

    @property
    def count(self) -> int:
        """The window's steps with an estimate."""
        self._read()
        return self._count

    def _read(self) -> None:
        """Bring the window's pending norms to the host, all at once, and add their estimates."""
        if not self._pending:
            return
        pairs = torch.stack([torch.stack([local, avg]) for local, avg, *_ in self._pending]).tolist()
        for (local_sq, global_sq), (_, _, weight, batch, global_batch) in zip(pairs, self._pending, strict=True):
            # The loss hook scaled this rank's gradient by `weight`; the estimator wants the plain mean over its batch.
            est = GradientNoiseScale.pair_estimate(local_sq / (weight * weight), batch, global_sq, global_batch)
            if est is not None:
                self._grad_sq_sum += est[0]
                self._trace_sum += est[1]
                self._count += 1
        self._pending = []

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
        global_sq = torch.stack(grads).sum()
        self._pending.append((self._local.to(global_sq.device), global_sq, weight, batch, global_batch))
        self._local = None

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

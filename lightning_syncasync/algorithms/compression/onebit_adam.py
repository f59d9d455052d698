"""1-bit Adam (Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training with Adam's Convergence Speed",
ICML 2021), since DeepSpeed 0.19.8 no longer ships ``OneBitAdam``.

Adam's variance is non-linear in the gradient, so it cannot be compressed with error feedback; but it becomes stable
early in training. 1-bit Adam therefore runs plain Adam (gradients averaged in full precision) for ``warmup_steps``,
then freezes the variance and, from then on, exchanges the *momentum* instead of the gradient: each rank updates
its momentum with its own local gradient and the momenta are averaged through a compressed all-reduce with error
feedback (1-bit ``sign`` by default, any method of ``algorithms/compression/compressor.py``), then the step is
``x -= lr * m / (sqrt(v_frozen) + eps)``. Every rank ends each step with the same averaged momentum and parameters.

Gradient communication must stop after warm-up for this to save anything: ``MeasuredDDPStrategy`` sees a
``OneBitAdam`` among the optimizers and registers a DDP hook that all-reduces gradients during warm-up and sends
nothing afterwards (see its docstring). Used with any other data-parallel setup (gradients already averaged), the
optimizer is still correct, the momentum exchange is then simply redundant.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from lightning_syncasync.algorithms.compression.compressor import Compressor


class OneBitAdam(torch.optim.Optimizer):
    """Adam whose post-warm-up communication is a compressed momentum all-reduce with error feedback.

    Args:
        params: parameters (or parameter groups) to optimise.
        lr, betas, eps, weight_decay: as ``torch.optim.Adam`` (decoupled weight decay, as AdamW).
        warmup_steps: steps of plain Adam before the variance is frozen (the paper uses 15-25% of training; at
            least a few hundred steps on real models).
        compression: compression of the momentum exchange (``sign`` is the paper's 1 bit).
        process_group: the group to average momenta over (``None``: the default group); it must not be used
            concurrently by anything else.

    Example::

        def configure_optimizers(self):
            return OneBitAdam(self.parameters(), lr=1e-3, warmup_steps=100)
        Trainer(strategy="ddp_measured" ...)  # gradients all-reduced only during warm-up
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        warmup_steps: int = 100,
        compression: str = "sign",
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        if lr <= 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        if eps <= 0:
            raise ValueError(f"eps must be > 0, got {eps}")
        if weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        if warmup_steps < 1:
            raise ValueError(f"warmup_steps must be >= 1, got {warmup_steps}; HINT: the variance needs a warm-up")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.warmup_steps = warmup_steps
        self.compressor = Compressor(compression)  # type: ignore[arg-type]
        self.process_group = process_group
        self.steps = 0
        self.bytes_last_step = 0

    @property
    def in_warmup(self) -> bool:
        """Whether the next step is a plain Adam step (gradients must arrive averaged)."""
        return self.steps < self.warmup_steps

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        warm = self.in_warmup
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size(self.process_group) > 1
        self.bytes_last_step = 0
        for gi, group in enumerate(self.param_groups):
            beta1, beta2 = group["betas"]
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for p in params:
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["exp_avg"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
                if warm:
                    state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
            if not warm and distributed:
                # The compression stage: average the local momenta, 1 bit per element plus scales, error feedback.
                flat = torch.cat([self.state[p]["exp_avg"].reshape(-1).float() for p in params])
                mean, nbytes = self.compressor.allreduce(flat, self.process_group, key=f"group{gi}")
                self.bytes_last_step += nbytes
                offset = 0
                for p in params:
                    n = p.numel()
                    self.state[p]["exp_avg"].copy_(mean[offset : offset + n].view_as(p))
                    offset += n
            # Bias corrections: the variance's stays at its value when frozen.
            t = self.steps + 1
            c1 = 1 - beta1**t
            c2 = 1 - beta2 ** min(t, self.warmup_steps)
            for p in params:
                state = self.state[p]
                if group["weight_decay"]:
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                denom = (state["exp_avg_sq"] / c2).sqrt_().add_(group["eps"])
                p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / c1)
        self.steps += 1
        return loss

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["onebit"] = {"steps": self.steps, "compressor": self.compressor.state_dict()}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        extra = state_dict.get("onebit")
        state_dict = {k: v for k, v in state_dict.items() if k != "onebit"}
        super().load_state_dict(state_dict)
        if extra is not None:
            self.steps = int(extra["steps"])
            self.compressor.load_state_dict(extra["compressor"])

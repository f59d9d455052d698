"""The step machinery the asynchronous strategies share (``async_ssp``, ``async_ssp_sharded``, ``auto_sync``'s async
mode, ``async_ssp_ft``'s divergence error): the NaN check that stops a replica's progress before it reaches the
others, the per-step SSP step and gate, and the server update every replica applies.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NoReturn

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.optim import Optimizer

from lightning_syncasync.algorithms.averaging.rounds import (
    NonFiniteRoundError,
    RoundExchange,
    RoundsStopped,
)
from lightning_syncasync.algorithms.ssp.compensation import StaleGradientCompensation
from lightning_syncasync.algorithms.ssp.exchange import ApplyFn, SSPExchange, grads_total, loss_total
from lightning_syncasync.strategies._optim import unwrap_optimizer


class DivergenceError(RuntimeError):
    """The loss became NaN/inf under asynchronous training."""


# What a step's finiteness check reads (what_is_checked), also named in its error.
LOSS = "loss"
MANUAL = "the gradients' L1 norm (manual optimization)"
ACCUMULATED = "the loss or the gradients' L1 norm (gradient accumulation)"


def what_is_checked(module: pl.LightningModule | None) -> str:
    """What the async modes check for a NaN before a step's gradient can leave the rank: the loss of Lightning's
    closure; under manual optimization, which returns none (the backward ran in ``training_step``), the gradients;
    under gradient accumulation the loss and the gradients, since the closure's loss is the last micro-batch's only
    while the gradients hold every micro-batch's."""
    if module is None:
        return LOSS
    if not module.automatic_optimization:
        return MANUAL
    trainer = module._trainer
    return ACCUMULATED if trainer is not None and trainer.accumulate_grad_batches > 1 else LOSS


def checked_value(loss: Any, grads: Callable[[], torch.Tensor | None], what: str) -> torch.Tensor | None:
    """The 0-d fp32 value whose finiteness stands for the step's (:func:`loss_total`), for :func:`what_is_checked`'s
    ``what``; ``grads`` gives the gradients' L1 norm, called only when needed. ``None``: nothing to check."""
    if what == MANUAL or not isinstance(loss, torch.Tensor):
        return grads()
    total = loss_total(loss.detach())
    if what == ACCUMULATED:
        summed = grads()
        if summed is not None:
            total = total + summed
    return total


def finite_closure(
    closure: Callable[[], Any],
    rank: int,
    rounds: RoundExchange | None,
    params: Sequence[torch.Tensor],
    what: str = LOSS,
) -> Callable[[], Any]:
    """``closure``, raising :class:`DivergenceError` on a non-finite loss before the optimizer uses it: the
    replica's next round would carry the NaN into every other replica. ``what`` (:func:`what_is_checked`): under
    manual optimization or gradient accumulation the gradients of ``params`` are checked too (:func:`grads_total`).

    On a GPU (any device but the CPU: accelerators run ahead of the host), reading the check back every step would
    be a host sync per step; there the losses are summed on the device over the round
    (``RoundExchange.note_loss``), and the round's end reads the sum once (raised through :func:`as_divergence`), still
    before its pseudo-gradient leaves the rank."""

    def wrapped() -> Any:
        loss = closure()
        value = checked_value(loss, lambda: grads_total(params), what)
        if value is None:
            return loss
        if value.device.type != "cpu" and rounds is not None:
            rounds.note_loss(value)
            return loss
        if not math.isfinite(value.item()):
            where = f"round {rounds.launched}" if rounds is not None else "a step"
            raise DivergenceError(
                f"rank {rank}: {what} is {value.item()} in {where} under async training; stopped before this "
                "replica's progress reached the others. HINT: lower the learning rate, or use SyncSwitcher to fall "
                "back to synchronous training"
            )
        return loss

    return wrapped


@contextmanager
def as_divergence(rank: int) -> Iterator[None]:
    """A round refused for a non-finite loss (on a GPU, at the round's end: ``finite_closure``) raised as
    :class:`DivergenceError`, around ``rounds.after_step()`` and ``rounds.cut()``; a SIGTERM that arrived while the
    rank waited for a round (:class:`RoundsStopped`) as Lightning's ``SIGTERMException``, the rounds in flight
    dropped."""
    try:
        yield
    except RoundsStopped as err:
        raise SIGTERMException() from err
    except NonFiniteRoundError as err:
        raise DivergenceError(
            f"rank {rank}: a loss or a gradient was not finite (nan or inf) in round {err.index} under async "
            "training; stopped "
            "before this replica's progress reached the others. HINT: lower the learning rate, or use SyncSwitcher "
            "to fall back to synchronous training"
        ) from err


def check_async_fit(optimizers: list[Optimizer], precision: Any, name: str) -> Optimizer:
    """What async training needs of the fit; returns its optimizer. One optimizer: a second one's steps would be
    counted as gradients of the first's. No fp16 ``GradScaler``: the gradients leave the rank still scaled."""
    if getattr(precision, "scaler", None) is not None:
        raise ValueError(
            f"{name} cannot train with fp16 loss scaling (precision='16-mixed'): gradients are shipped before the "
            "scaler would unscale them. HINT: use precision='bf16-mixed' or '32-true'"
        )
    if len(optimizers) != 1:
        raise ValueError(
            f"{name} trains with exactly one optimizer, this module configures {len(optimizers)}. HINT: return one "
            "optimizer (with several param groups if needed) from configure_optimizers, or use hier_sync/ddp"
        )
    return optimizers[0]


def server_update(optimizer: Optimizer, params: Sequence[torch.Tensor], module: pl.LightningModule) -> ApplyFn:
    """How a replica applies one server update of :class:`SSPExchange`: the mean gradient into ``p.grad``, the
    module's gradient clipping (DDP clips the mean gradient too), the update's learning rates, ``optimizer.step()``.
    The optimizer is the raw one: Lightning's wrapper would call back into the strategy."""
    opt = unwrap_optimizer(optimizer)

    @torch.no_grad()
    def apply(grad: torch.Tensor, lrs: list[float]) -> None:
        # A gradient already on the replica (earlier micro-batches under gradient accumulation, or manual
        # optimization's backward, both before the step's optimizer call) is set aside and put back: the update
        # steps the optimizer through p.grad. Dropping it lost those gradients (measured: 7 of 12 steps' with
        # accumulate_grad_batches=2 at 2 ranks).
        held = [p.grad for p in params]
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = grad[offset : offset + n].view_as(p).to(p.dtype)
            offset += n
        trainer = module._trainer
        if trainer is not None and module.automatic_optimization:
            module.configure_gradient_clipping(opt, trainer.gradient_clip_val, trainer.gradient_clip_algorithm)
        old = [group["lr"] for group in opt.param_groups]
        for group, lr in zip(opt.param_groups, lrs, strict=True):
            group["lr"] = lr
        try:
            opt.step()
        finally:
            for group, lr in zip(opt.param_groups, old, strict=True):
                group["lr"] = lr
            for p, g in zip(params, held, strict=True):
                p.grad = g

    return apply


def learning_rates(optimizer: Optimizer) -> list[float]:
    """The learning rate of each param group (shipped with each gradient)."""
    return [float(group["lr"]) for group in unwrap_optimizer(optimizer).param_groups]


def ssp_optimizer_step(
    ex: SSPExchange,
    compensator: StaleGradientCompensation,
    apply: ApplyFn,
    optimizer: Optimizer,
    rank: int,
    closure: Callable[[], Any],
    run_step: Callable[[Callable[[], Any]], Any],
    on_nonfinite: Callable[[float], None] | None = None,
    what: str = LOSS,
) -> Any:
    """One step under SSP (also ``auto_sync``'s async mode): the gate, the server updates that arrived, the closure
    (forward and backward on this replica), the compensation of the stale gradient, and the gradient shipped.

    Lightning's own optimizer step runs with every gradient taken away (a no-op for torch's optimizers, which skip
    parameters without one); the replica changes only through server updates (``apply``), which carry everyone's
    gradients, this rank's included. A non-finite loss raises :class:`DivergenceError` before the gradient leaves the
    rank; with ``on_nonfinite`` it is reported there instead and this step's gradient is dropped, so a policy can
    restore a good state without the NaN having reached any replica.

    ``what`` (:func:`what_is_checked`): the loss, or with it or in its place the gradient. On the CPU that is
    checked here, at once. On an accelerator reading it back would be a host sync per step, so
    the gradient is zeroed on the device when the loss is not finite, and the exchange's thread reads the loss when
    the gradient's round starts and drops it from the round (``SSPExchange.ship``); the error (or ``on_nonfinite``)
    comes at the next step or cut (:func:`report_nonfinite`), still before the NaN reached any replica.
    """
    ssp_gate(ex, compensator, apply, rank, on_nonfinite, what)  # passed already when training_step ran (the rule)
    params = ex.tensors
    read = ex.read_weights
    taken: dict[str, torch.Tensor] = {}
    bad: list[float] = []

    def wrapped() -> Any:
        loss = closure()
        flat = torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).float() for p in params]
        )
        # The gradients' L1 norm, as grads_total gives it (and the errors name it): one reduction over flat, as its sum
        # would be.
        total = checked_value(loss, lambda: torch.linalg.vector_norm(flat, 1), what)
        assert total is not None  # the gradient is always there to check
        if total.device.type == "cpu":
            if not math.isfinite(total.item()):
                if on_nonfinite is None:
                    _raise_nonfinite(rank, total.item(), ex.clock, what)
                bad.append(total.item())
        else:
            # Zeroed before the compensation, whose running statistics a NaN would spoil (SSPExchange.ship checks).
            taken["loss"] = total
            flat.masked_fill_(~torch.isfinite(total), 0.0)
        taken["grad"] = flat
        for p in params:
            p.grad = None  # the optimizer step Lightning runs next leaves the replica alone
        return loss

    out = run_step(wrapped)
    if "grad" not in taken:
        ex.ungate()  # the optimizer skipped the closure: nothing to ship, and the next step passes the gate again
        return out
    if bad:
        assert on_nonfinite is not None
        on_nonfinite(bad[0])
        ex.ship(None, learning_rates(optimizer))  # dropped: the clock moves on, nothing is sent
        return out
    # Server updates that formed during forward/backward: applied now, and the gradient compensated for them.
    if ex.apply_ready(apply):
        delta = ex.flat() - read if read is not None else None
        grad = compensator.apply(taken["grad"], delta, ex.updates_since_read)
    else:
        grad = compensator.apply(taken["grad"], None, 0)
    # Zeroed above when the loss is not finite, and the compensation keeps a zero gradient zero (every kind scales it).
    ex.ship(grad, learning_rates(optimizer), loss=taken.get("loss"), masked=True)
    return out


def ssp_gate(
    ex: SSPExchange,
    compensator: StaleGradientCompensation,
    apply: ApplyFn,
    rank: int,
    on_nonfinite: Callable[[float], None] | None = None,
    what: str = LOSS,
) -> None:
    """The start of a per-step SSP step, before its first forward: the gradients the exchange's thread dropped
    (:func:`report_nonfinite`), the SSP gate, the server updates formed so far, and for DC-ASGD a copy of the
    weights read (a full copy of the model per step). Once per step: a no-op until the step ships.

    The strategies call it from ``training_step``, so every micro-batch of a step under gradient accumulation, and
    manual optimization's backward inside ``training_step``, compute on the weights the gate let through, as the
    bound says; from the optimizer call instead, the earlier micro-batches would read weights one update short."""
    if ex.gated:
        return
    report_nonfinite(ex, rank, on_nonfinite, what)
    ex.begin_step(apply, keep_read=compensator.needs_delta)


def report_nonfinite(
    ex: SSPExchange, rank: int, on_nonfinite: Callable[[float], None] | None = None, what: str = LOSS
) -> None:
    """The gradients ``ex``'s thread dropped for a non-finite loss (on an accelerator: ``ssp_optimizer_step``):
    :class:`DivergenceError` naming ``what`` was checked, or each one to ``on_nonfinite``. Called at every step and
    after every cut."""
    for clock, value in ex.pop_nonfinite():
        if on_nonfinite is None:
            _raise_nonfinite(rank, value, clock, what)
        on_nonfinite(value)


def _raise_nonfinite(rank: int, value: float, clock: int, what: str = LOSS) -> NoReturn:
    raise DivergenceError(
        f"rank {rank}: {what} is {value} at clock {clock} under async training; stopped before the gradient reached "
        "the other replicas. HINT: lower the learning rate or the staleness, or use SyncSwitcher to fall back to "
        "synchronous training"
    )

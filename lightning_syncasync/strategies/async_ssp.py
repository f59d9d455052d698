"""``AsyncSSPStrategy`` (``async_ssp``): asynchronous data parallelism with SSP bounded staleness.

Each rank trains its own replica (no DDP gradient all-reduce); the updates travel in the background through
:class:`~lightning_syncasync.algorithms.ssp.SSPExchange` (see that module for the design, the invariants and the
papers), optionally compressed, and a stale gradient can be compensated
(:class:`~lightning_syncasync.algorithms.compensation.StaleGradientCompensation`) before the optimizer applies it.

What Lightning's collectives mean here, since ranks are at different steps during an epoch:

* ``self.log(..., sync_dist=True)`` inside ``training_step`` logs this rank's value: a collective there would put
  every rank back in lockstep. Epoch-level values (``on_epoch=True``), torchmetrics computed at epoch end,
  validation and ``barrier`` are collectives as usual: every rank reaches them after the same number of batches.
* Validation, checkpoints and the end of fit happen at a consistent cut: every update in flight is delivered and
  every replica is made bitwise equal (rank 0's broadcast), so validation sees, and ``save_checkpoint``,
  ``test`` and ``predict`` use, the merged model.
* A non-finite loss raises at once (async training would otherwise ship the NaN into every replica).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch.optim import Optimizer
from typing_extensions import override

from lightning_syncasync.algorithms._comm import destroy_groups
from lightning_syncasync.algorithms._flat import copy_flat_
from lightning_syncasync.algorithms.compensation import StaleGradientCompensation
from lightning_syncasync.algorithms.compression import Compressor
from lightning_syncasync.algorithms.ssp import SSPExchange
from lightning_syncasync.algorithms.stats import StatsRecorder
from lightning_syncasync.strategies._checks import check_async, check_common
from lightning_syncasync.strategies._state import CheckpointedAlgorithm
from lightning_syncasync.strategies._watch import WatchedStrategy

log = logging.getLogger(__name__)


class DivergenceError(RuntimeError):
    """The loss became NaN/inf under asynchronous training."""


class LocalReduceWhileAsync:
    """Strategy mixin: while an ``exchange`` runs, ``reduce`` inside ``training_step`` returns the rank's own value.
    Ranks are at different steps there, and a collective would put them back in lockstep (module docstring)."""

    exchange: SSPExchange | None
    _in_training_step: bool = False

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._in_training_step = True
        try:
            return super().training_step(*args, **kwargs)  # type: ignore[misc]
        finally:
            self._in_training_step = False

    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        if self._in_training_step and self.exchange is not None:
            return tensor
        return super().reduce(tensor, group=group, reduce_op=reduce_op)  # type: ignore[misc]


class AsyncSSPStrategy(WatchedStrategy, LocalReduceWhileAsync, CheckpointedAlgorithm, DDPStrategy):
    """Asynchronous training with Stale Synchronous Parallel bounded staleness, for any LightningModule.

    Args:
        staleness: the SSP bound ``s`` in steps (``0``: synchronous; ``None``: ASP, no bound). Default 1, measured
            on the transformer LM demo (4 ranks, AdamW lr 3e-3, 25 steps, no emulation): s=0 reached val_acc 0.293,
            s=1 0.277, s=4 stayed at the 0.22 plateau (with or without compensation), DDP 0.307.
        compensation: ``none``, ``staleness_lr``, ``dc_asgd`` or ``dc_asgd_adaptive`` (see
            ``algorithms/compensation.py``).
        lam: DC-ASGD's ``lambda``.
        compression: compression of the update exchange (``none``, ``fp16``, ``bf16``, ``int8``, ``sign``,
            ``powersgd``), with error feedback.
        compression_options: extra ``Compressor`` arguments.
        peer_timeout_s: a gate wait, cut or exchange round longer than this ends the run with an error naming the
            lost rank and its last clock.
        round_interval_s: the shortest a rank's exchange thread waits for a new local step before an idle round.
        exchange_every: local steps a rank accumulates before joining an exchange round (1: every step).
        **kwargs: what ``DDPStrategy`` takes (``start_method``, ``timeout``, ...); DDP itself is not used.

    Example::

        Trainer(strategy="async_ssp", accelerator="cpu", devices=4)
        Trainer(strategy=AsyncSSPStrategy(staleness=None, compensation="dc_asgd_adaptive"), devices=4)
    """

    strategy_name = "async_ssp"
    _ckpt_key = "async_ssp"

    def __init__(
        self,
        staleness: int | None = 1,
        compensation: Literal["none", "staleness_lr", "dc_asgd", "dc_asgd_adaptive"] = "dc_asgd_adaptive",
        lam: float = 1.0,
        compression: str = "none",
        compression_options: dict[str, Any] | None = None,
        peer_timeout_s: float = 60.0,
        round_interval_s: float = 0.005,
        exchange_every: int = 1,
        **kwargs: Any,
    ) -> None:
        check_async(staleness, compensation, lam)
        check_common("async_ssp does not all-reduce gradients", compression, compression_options, peer_timeout_s,
                     kwargs, type(self), wraps_ddp=False)  # fmt: skip
        if round_interval_s <= 0:
            raise ValueError(f"round_interval_s must be > 0, got {round_interval_s}; HINT: the default 0.005")
        if exchange_every < 1:
            raise ValueError(f"exchange_every must be >= 1, got {exchange_every}; HINT: 1 exchanges every step")
        super().__init__(**kwargs)
        self.staleness = staleness
        self.compensation = compensation
        self.lam = lam
        self.compression = compression
        self.compression_options = dict(compression_options or {})
        self.peer_timeout_s = peer_timeout_s
        self.round_interval_s = round_interval_s
        self.exchange_every = exchange_every
        self.sync_stats = StatsRecorder(mode="async")
        self.exchange: SSPExchange | None = None
        self._compensator: StaleGradientCompensation | None = None
        self._group: dist.ProcessGroup | None = None
        self._restored: dict[str, Any] | None = None
        self._in_training_step = False
        self._step_open = False

    @override
    def setup_distributed(self) -> None:
        super().setup_distributed()
        self._group = dist.new_group(timeout=timedelta(seconds=self.peer_timeout_s))

    @override
    def configure_ddp(self) -> None:
        # No DDP: gradients stay local. The replicas start from rank 0's weights (what DDP's constructor would do).
        assert self.model is not None
        with torch.no_grad():
            for t in [*self.model.parameters(), *self.model.buffers()]:
                dist.broadcast(t.data, src=0)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn != "fit" or self.lightning_module is None:
            return
        module = self.lightning_module
        self._params = [p for p in module.parameters()]
        tensors = self._params + [b for b in module.buffers() if b.is_floating_point()]
        self.exchange = SSPExchange(
            tensors,
            self._group,
            staleness=self.staleness,
            timeout_s=self.peer_timeout_s,
            compressor=Compressor(self.compression, seed=self.global_rank, **self.compression_options),  # type: ignore[arg-type]
            recorder=self.sync_stats,
            round_interval_s=self.round_interval_s,
            exchange_every=self.exchange_every,
        )
        self._compensator = StaleGradientCompensation(self.compensation, self.lam)  # type: ignore[arg-type]
        if self._restored is not None:
            self.exchange.load_state_dict(self._restored)
            self._restored = None
        self.exchange.start()

    # -- the training step -------------------------------------------------------------------------------------

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        ex = self.exchange
        if ex is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        assert self._compensator is not None
        return ssp_optimizer_step(
            ex, self._compensator, self._params, self.global_rank, closure,
            lambda wrapped: super(AsyncSSPStrategy, self).optimizer_step(optimizer, wrapped, model, **kwargs),
        )  # fmt: skip

    # -- consistent cuts -----------------------------------------------------------------------------------------

    @override
    def on_validation_start(self) -> None:
        if self.exchange is not None and self.lightning_module is not None and self.lightning_module.trainer.training:
            self.exchange.cut()  # validate the merged model
        super().on_validation_start()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self.exchange is not None and self.exchange._thread is not None:
            self.exchange.cut()  # all ranks save together: a consistent cut
        return super().lightning_module_state_dict()

    def _algorithm(self) -> Any | None:
        return self.exchange

    @override
    def on_train_end(self) -> None:
        # The model fit() leaves behind is the merged one; the exchange stops on every rank after the same round.
        if self.exchange is not None and self.exchange._thread is not None:
            self.exchange.cut(stop=True)
            _log_staleness(self.exchange)
        super().on_train_end()

    @override
    def teardown(self) -> None:
        if self.exchange is not None:
            self.exchange.close()
            self.exchange = None
        super().teardown()
        destroy_groups(self._group)
        self._group = None


def ssp_optimizer_step(
    ex: SSPExchange,
    compensator: StaleGradientCompensation,
    params: list[torch.Tensor],
    rank: int,
    closure: Callable[[], Any],
    run_step: Callable[[Callable[[], Any]], Any],
    on_nonfinite: Callable[[float], None] | None = None,
) -> Any:
    """One optimizer step under SSP (also ``auto_sync``'s async mode): the gate, what arrived, the closure, the
    compensation of the stale gradient, the step, and ``1/N`` of the update shipped.

    A non-finite loss raises :class:`DivergenceError` before the update leaves the rank; with ``on_nonfinite`` it is
    reported there instead and this step's update is dropped (the replica keeps what it had merged), so a policy can
    restore a good state without the NaN having reached any other replica.
    """
    ex.begin_step()  # the SSP gate, then what the others sent so far
    before: dict[str, torch.Tensor] = {}
    bad: list[float] = []

    def wrapped() -> Any:
        loss = closure()
        value = loss.detach() if isinstance(loss, torch.Tensor) else None
        if value is not None and not bool(torch.isfinite(value).all()):
            if on_nonfinite is None:
                raise DivergenceError(
                    f"rank {rank}: loss is {value.item()} at clock {ex.clock} under async training; stopped before "
                    "the update reached the other replicas. HINT: lower the learning rate or the staleness, or use "
                    "SyncSwitcher to fall back to synchronous training"
                )
            bad.append(float(value.float().mean()))
        delta, tau = ex.merge()  # updates that arrived during forward/backward
        compensator.apply(params, delta, tau)
        before["flat"] = ex.flat()
        return loss

    out = run_step(wrapped)
    if "flat" in before:  # the closure ran (an optimizer may skip it, e.g. LBFGS's first call)
        if bad:
            copy_flat_(ex.tensors, before["flat"])  # drop the update: the NaN must not reach the others
            assert on_nonfinite is not None
            on_nonfinite(bad[0])
        ex.finish_step(before["flat"])
    return out


def _log_staleness(ex: SSPExchange) -> None:
    gaps, versions = ex.stats.clock_gaps, ex.stats.version_staleness
    if gaps and versions:
        log.info(
            "async_ssp: %d rounds; clock gap mean %.2f max %d; version staleness mean %.2f max %d",
            ex.stats.rounds, sum(gaps) / len(gaps), max(gaps), sum(versions) / len(versions), max(versions),
        )  # fmt: skip

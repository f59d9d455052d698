"""``AsyncSSPStrategy`` (``async_ssp``): asynchronous data parallelism with bounded staleness (SSP).

Two modes (see the class docstring for the settings):

* **Rounds** (default, ``local_steps > 1``): each rank steps its own replica with its own optimizer on fresh
  gradients; its local progress travels every round through
  :class:`~lightning_syncasync.algorithms.averaging.RoundExchange` (design, invariants and papers there), optionally
  compressed, and comes back as the round's global step at most ``staleness`` rounds later. Rounds have a wall-clock
  length, so fast ranks take more local steps; with claimed batches (``batches="claim"``, chosen by default where the
  loop allows it) they also train on more of each epoch's batches instead of waiting at its end. ``auto_sync``'s
  async mode instead (``warmup_steps=None, batches="rebalance", options=AsyncSSPOptions(dynamic_local_steps=False)``):
  20 synchronous steps, rounds of a fixed step count, and an
  :class:`~lightning_syncasync.callbacks.AdaptiveBatchSize` the strategy adds.
* **Per step** (``local_steps=1``): gradients travel in the background through
  :class:`~lightning_syncasync.algorithms.ssp.SSPExchange`, optionally compressed, after a stale gradient is
  compensated (:class:`~lightning_syncasync.algorithms.ssp.StaleGradientCompensation`); every replica
  applies the same server updates (the mean of a quorum of gradients, fast ranks contributing more of them) with its
  own optimizer, so the replicas and their optimizer states stay equal. Gradient clipping applies to each server
  update; ``on_before_optimizer_step`` sees no gradients (they have been shipped); each param group's learning rate
  at the step a gradient was computed travels with it.

Both: one optimizer per module; no fp16 ``GradScaler`` (use ``bf16-mixed``).

What Lightning's collectives mean here, since ranks are at different steps during an epoch:

* ``self.log(..., sync_dist=True)`` inside ``training_step`` logs this rank's value: a collective there would put
  every rank back in lockstep. Epoch-level values (``on_epoch=True``), torchmetrics computed at epoch end,
  validation and ``barrier`` are collectives as usual; the time spent in them (and in the cuts) is recorded as
  ``sync_point_s``, since every rank waits there for the slowest.
* Validation, checkpoints and the end of fit happen at a consistent cut: every update in flight is delivered and
  every replica is made bitwise equal (rank 0's broadcast; in round mode its optimizer state too), so validation
  sees, and ``save_checkpoint``, ``test`` and ``predict`` use, the merged model.
* A non-finite loss raises at once (async training would otherwise carry the NaN into every replica).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch.optim import Optimizer
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_syncasync.algorithms._comm import all_reduce_, broadcast_, destroy_groups, exchange_backend
from lightning_syncasync.algorithms._flat import copy_flat_
from lightning_syncasync.algorithms.averaging.outer import OuterOptimizer, check_outer
from lightning_syncasync.algorithms.averaging.rounds import (
    RoundExchange,
    check_rounds,
)
from lightning_syncasync.algorithms.batching._loader import loader_kwargs, sampling_order
from lightning_syncasync.algorithms.compression.compressor import Compressor
from lightning_syncasync.algorithms.ssp.claim_sampler import ClaimingBatchSampler
from lightning_syncasync.algorithms.ssp.compensation import StaleGradientCompensation
from lightning_syncasync.algorithms.ssp.exchange import ApplyFn, SSPExchange
from lightning_syncasync.algorithms.stats import StatsRecorder
from lightning_syncasync.strategies._async_cuts import CutsAtLightningHooks, LocalReduceWhileAsync
from lightning_syncasync.strategies._async_step import (
    DivergenceError,
    as_divergence,
    check_async_fit,
    finite_closure,
    learning_rates,
    server_update,
    ssp_optimizer_step,
    what_is_checked,
)
from lightning_syncasync.strategies._checks import check_async, check_common
from lightning_syncasync.strategies._claiming import (
    DEFAULT_WARMUP_STEPS,
    Batches,
    _check_warmup,
    _claim_budget,
    _ClaimingLoader,
    batch_sharing,
    follow_global_progress,
)
from lightning_syncasync.strategies._merge import MergesBeforeUserHooks
from lightning_syncasync.strategies._optim import broadcast_optimizer_state
from lightning_syncasync.strategies._round_length import RoundLengthReport, round_length
from lightning_syncasync.strategies._sigterm import SigtermScope
from lightning_syncasync.strategies._state import CheckpointedAlgorithm, drop_added_callback_states
from lightning_syncasync.strategies._watch import WatchedStrategy
from lightning_syncasync.strategies.options import AsyncSSPOptions, adopt, resolve_options

__all__ = ["AsyncSSPStrategy", "DivergenceError"]

log = logging.getLogger(__name__)


class AsyncSSPStrategy(
    WatchedStrategy,
    LocalReduceWhileAsync,
    CutsAtLightningHooks,
    CheckpointedAlgorithm,
    MergesBeforeUserHooks,
    DDPStrategy,
):
    """Asynchronous training with bounded staleness (SSP), for any LightningModule.

    * **Rounds** (the default): async local SGD
      (:class:`~lightning_syncasync.algorithms.averaging.RoundExchange`). Every rank trains its own replica with its
      own optimizer; every round its progress (a pseudo-gradient) goes into a background exchange and the round's
      global step comes back at most ``staleness`` rounds later, so nobody waits for the slowest at a round's end.
      This is what learns with Adam-family optimizers: a stale gradient stops Adam (0.722 -> 0.242 on the convnet,
      ``scripts/delayed_gradients.py``), a stale round costs little.
    * **Steps** (``local_steps=1``): every gradient shipped in the background and applied by every replica
      (:class:`~lightning_syncasync.algorithms.ssp.SSPExchange`) after stale-gradient compensation; for SGD-style
      workloads.

    Args:
        staleness: the SSP bound, in rounds (``0``: synchronous rounds, i.e. local SGD / DiLoCo; ``1``: each round's
            exchange overlaps the next round's steps) or, with ``local_steps=1``, in steps (``None``: ASP, no bound).
        local_steps: local steps per round at the ranks' mean speed (``1``: per-step exchange). ``None`` (default):
            the shortest round whose exchange hides behind the next ``staleness`` rounds' compute, re-decided when
            the link or the step time drifts (:class:`~lightning_syncasync.algorithms.averaging.RoundLength`; shown
            in ``SyncMonitor``'s summary). On the 3.3 MB ``link_bound`` job it reached the target 6.06x [4.06-6.27]
            sooner than DDP at 100 Mbit/s (docs/benchmarks.md#self-tuned-round-length-issue-64). An integer pins
            the length; a pinned length the link cannot hide is warned about once, with the numbers.
        batches: how ranks of different speeds share the data. ``"claim"``: the ranks claim each epoch's batches
            from a shared queue (:class:`~lightning_syncasync.algorithms.ssp.ClaimingBatchSampler`), so a fast rank
            trains on more of them instead of waiting at the epoch's end; ``max_steps`` becomes a budget over all
            ranks (``max_steps x world`` batches, the samples DDP would see) and validation runs at epoch ends.
            ``"rebalance"``: an :class:`~lightning_syncasync.callbacks.AdaptiveBatchSize` sizes each rank's batch
            from its measured speed. ``"even"``: neither. ``"auto"`` (default): ``"claim"`` with rounds when the
            loop allows it (validation at epoch ends, no per-step checkpoints, no ``AdaptiveBatchSize`` of the
            user's), else ``"even"``; never at one rank. The summary's header says which was chosen and why.
        warmup_steps: rounds only: synchronous steps first (every rank's gradients averaged, as DDP), as in
            post-local SGD (Lin et al., 2020). ``None``: 20 steps (a tenth of a run of fewer than 200), none at one
            rank. Default 0: 20 warm-up steps with these rounds learned no more per sample on
            ``mid_run_straggler_long`` (1.18x DDP's samples; docs/strategies.md, async_ssp's settings).
        compression: of the exchange (pseudo-gradients or gradients): ``none``, ``fp16``, ``bf16``, ``int8``,
            ``int4``, ``int2``, ``sign``, ``powersgd``, with error feedback.
        options: the expert settings (:class:`~lightning_syncasync.strategies.options.AsyncSSPOptions`: the outer
            optimizer, wall-clock or fixed-step rounds, per-step compensation and pacing, timeouts), an instance or
            a dict; each also works as a keyword.
        **kwargs: what ``DDPStrategy`` takes (``start_method``, ``timeout``, ...); DDP itself is not used.

    Example::

        Trainer(strategy="async_ssp", accelerator="cpu", devices=4)
        Trainer(strategy=AsyncSSPStrategy(local_steps=16, compression="int8"), devices=4)
        Trainer(strategy=AsyncSSPStrategy(local_steps=1, staleness=None), devices=4)
        Trainer(strategy=AsyncSSPStrategy(options=AsyncSSPOptions(outer="delayed_nesterov")), devices=4)
    """

    strategy_name = "async_ssp"
    _ckpt_key = "async_ssp"

    def __init__(
        self,
        staleness: int | None = 1,
        local_steps: int | None = None,
        batches: Batches = "auto",
        warmup_steps: int | None = 0,
        compression: str = "none",
        options: AsyncSSPOptions | None = None,
        **kwargs: Any,
    ) -> None:
        opts = resolve_options(AsyncSSPOptions, options, kwargs, "async_ssp")
        claim_batches, adaptive_batch = batch_sharing(batches, kwargs, "async_ssp")
        check_async(staleness, opts.compensation, opts.lam)
        if warmup_steps is not None and (not isinstance(warmup_steps, int) or warmup_steps < 0):
            raise ValueError(f"warmup_steps must be an integer >= 0 or None, got {warmup_steps!r}; HINT: 0 (the "
                             "default) starts the rounds at the first step, None takes 20 steps (a tenth of a "
                             "shorter run)")  # fmt: skip
        rounds = local_steps is None or (isinstance(local_steps, int) and local_steps > 1)
        if warmup_steps and not rounds:
            raise ValueError(
                f"warmup_steps={warmup_steps} is a synchronous start before the rounds, and local_steps={local_steps} "
                "is per-step mode (no rounds). HINT: local_steps > 1, or warmup_steps=0"
            )
        # The staleness bound counts rounds (an integer) only in round mode; per-step mode also takes None (ASP).
        check_rounds(local_steps, staleness if rounds else 0, opts.round_s)
        if opts.round_s is not None and not opts.dynamic_local_steps:
            raise ValueError(
                f"round_s={opts.round_s} is a wall-clock round length, and dynamic_local_steps=False makes every round "
                "local_steps steps long. HINT: dynamic_local_steps=True (the default) with round_s, or round_s=None"
            )
        check_outer(opts.outer, opts.outer_lr, opts.outer_momentum, opts.outer_momentum_every)
        check_common("async_ssp does not all-reduce gradients", compression, opts.compression_options,
                     opts.peer_timeout_s, kwargs, type(self), wraps_ddp=False)  # fmt: skip
        if opts.round_interval_s <= 0:
            raise ValueError(f"round_interval_s must be > 0, got {opts.round_interval_s}; HINT: the default 0.005")
        if opts.exchange_every < 1:
            raise ValueError(f"exchange_every must be >= 1, got {opts.exchange_every}; HINT: 1 exchanges every step")
        super().__init__(**kwargs)
        adopt(self, opts)
        self.staleness = staleness
        self.local_steps = local_steps
        self.compression = compression
        self.claim_batches = claim_batches
        self.warmup_steps = warmup_steps
        self.adaptive_batch = adaptive_batch
        self._batches_note = ""  # what this fit's batch sharing is and why (summary_notes)
        self._warmup = 0  # warmup_steps as resolved for this fit (None: from the run's length)
        self._warm_group: dist.ProcessGroup | None = None
        self._claiming = False  # claim_batches as decided for this fit
        self.planned_steps: int | None = None  # with claim_batches: the user's max_steps, now a budget over ranks
        self._claim_budget: int | None = None
        self._claim_fits = 0
        self._claim_sampler: ClaimingBatchSampler | None = None
        self.sync_stats = StatsRecorder(mode="async")
        self.exchange: SSPExchange | None = None
        self.rounds: RoundExchange | None = None
        self._compensator: StaleGradientCompensation | None = None
        self._apply: ApplyFn | None = None
        self._optimizer: Optimizer | None = None
        self._params: list[torch.Tensor] = []
        self._sigterm = SigtermScope()
        self._group: dist.ProcessGroup | None = None
        self._restored: dict[str, Any] | None = None
        self._in_training_step = False
        self._step_open = False
        self._length_report: RoundLengthReport | None = None

    @override
    def consistent_settings(self) -> dict[str, Any]:
        # batches= as it was decided from it or from the old keywords (claim_batches/adaptive_batch), which must
        # agree across ranks too: a rank claiming batches while another rebalances would hang at the first epoch end.
        return {
            **super().consistent_settings(),
            "batches": f"claim={self.claim_batches}, rebalance={self.adaptive_batch}",
        }

    @property
    def round_mode(self) -> bool:
        """Whether training runs in rounds (``local_steps`` unset or > 1) rather than per-step gradient exchange."""
        return self.local_steps is None or self.local_steps > 1

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        if not self._adds_adaptive_batch() or self.lightning_module is None:
            return
        from lightning_syncasync.callbacks.adaptive_batch import AdaptiveBatchSize  # callbacks sit above strategies

        trainer = self.lightning_module.trainer
        if not any(isinstance(c, AdaptiveBatchSize) for c in trainer.callbacks):
            # required=False: a loader it cannot split (iterable dataset, custom batch sampler) trains with even
            # batches instead of failing on a callback the user did not add.
            trainer.callbacks.append(AdaptiveBatchSize(required=False))
            log.info("async_ssp: added AdaptiveBatchSize (adaptive_batch), so a slow rank's rounds take fewer samples")

    def _adds_adaptive_batch(self) -> bool:
        """``adaptive_batch`` for this fit: as set, or (``None``) on with rounds unless batches are claimed; never
        at one rank (no other rank to balance against)."""
        if self.world_size == 1:
            return False
        if self.adaptive_batch is not None:
            return self.adaptive_batch
        return self.round_mode and self.claim_batches is False

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only)
        if self.world_size == 1 and self.adaptive_batch is not False and self.lightning_module is not None:
            drop_added_callback_states(checkpoint, self.lightning_module.trainer.callbacks, ("AdaptiveBatchSize",),
                                       "async_ssp", log)  # fmt: skip
        return checkpoint

    @override
    def setup_distributed(self) -> None:
        super().setup_distributed()
        # The rounds' and the SSP exchange's group: their collectives run on a thread (exchange_backend).
        self._group = dist.new_group(timeout=timedelta(seconds=self.peer_timeout_s), backend=exchange_backend())
        if self.round_mode and self.warmup_steps != 0:
            # The warm-up's gradient average: on the training thread, apart from the rounds' thread and group.
            self._warm_group = dist.new_group(timeout=timedelta(seconds=self.peer_timeout_s))

    @override
    def configure_ddp(self) -> None:
        # No DDP: gradients stay local. The replicas start from rank 0's weights (what DDP's constructor would do).
        assert self.model is not None
        with torch.no_grad():
            for t in [*self.model.parameters(), *self.model.buffers()]:
                broadcast_(t.data, 0)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn != "fit" or self.lightning_module is None:
            return
        module = self.lightning_module
        self._params = [p for p in module.parameters() if p.requires_grad]
        optimizer = check_async_fit(self.optimizers, self.precision_plugin, "async_ssp")
        self._optimizer = optimizer
        self._sigterm.install(trainer)  # the rank alone: it trains apart
        self._warmup = self._resolve_warmup(trainer)  # before claim_batches turns max_steps into a budget
        if self._warmup:
            log.info("async_ssp: %d synchronous steps (gradients averaged over the %d ranks) before the rounds start",
                     self._warmup, self.world_size)  # fmt: skip
        self._claiming = self._decide_claiming(trainer)
        if self._claiming:
            self._claim_budget = _claim_budget(trainer, self.world_size)
            self.planned_steps = trainer.max_steps if trainer.max_steps > 0 else None
            trainer.fit_loop.epoch_loop.max_steps = -1  # the budget stops every rank at the same epoch end instead
            self._claim_fits += 1
            follow_global_progress(module, self.lr_scheduler_configs, self._global_steps)
        compressor = Compressor(self.compression, seed=self.global_rank, **self.compression_options)  # type: ignore[arg-type]
        buffers = [b for b in module.buffers() if b.is_floating_point()]
        if self.round_mode:
            assert self.staleness is not None  # checked at construction
            self.rounds = RoundExchange(
                self._params,
                self._group,
                length=round_length(self.local_steps, self.staleness, min_steps=2),
                staleness=self.staleness,
                round_s=self.round_s,
                dynamic=self.dynamic_local_steps,
                outer=OuterOptimizer(self.outer, self.outer_lr, self.outer_momentum, self.outer_momentum_every),
                compressor=compressor,
                recorder=self.sync_stats,
                scope="inter" if self.num_nodes > 1 else "intra",
                timeout_s=self.peer_timeout_s,
                buffers=buffers,
                should_stop=self._sigterm.requested,
            )
            if self._restored is not None:
                self.rounds.load_state_dict(self._restored)
                self._restored = None
            self.rounds.start()
            self._length_report = RoundLengthReport(self.rounds.length, "async_ssp")
            return
        self._apply = server_update(optimizer, self._params, module)
        self.exchange = SSPExchange(
            self._params,
            self._group,
            staleness=self.staleness,
            timeout_s=self.peer_timeout_s,
            compressor=compressor,
            recorder=self.sync_stats,
            round_interval_s=self.round_interval_s,
            exchange_every=self.exchange_every,
            buffers=buffers,
            num_lrs=len(learning_rates(optimizer)),
        )
        self._compensator = StaleGradientCompensation(self.compensation, self.lam)  # type: ignore[arg-type]
        if self._restored is not None:
            self.exchange.load_state_dict(self._restored)
            self._restored = None
        self.exchange.start()

    def _global_steps(self) -> int | None:
        """Under ``claim_batches``: the steps DDP would have taken by now (batches claimed over all ranks / world)."""
        sampler = self._claim_sampler
        return None if sampler is None else -(-sampler.position // self.world_size)

    def _resolve_warmup(self, trainer: pl.Trainer) -> int:
        """``warmup_steps`` for this fit: as set, or (``None``) ``DEFAULT_WARMUP_STEPS``, a tenth of a run with
        fewer than ten times as many steps (so a short run still trains in rounds), none at one rank."""
        if not self.round_mode:
            return 0
        if self.warmup_steps is not None:
            if self.warmup_steps:
                _check_warmup(trainer, self.warmup_steps)
            return self.warmup_steps
        if self.world_size == 1:
            return 0  # one replica: an average of one gradient is the gradient
        if trainer.max_steps > 0:
            return min(DEFAULT_WARMUP_STEPS, trainer.max_steps // 10)
        return DEFAULT_WARMUP_STEPS

    def _decide_claiming(self, trainer: pl.Trainer) -> bool:
        """Claimed batches for this fit: as set, or (``batches="auto"``) on with rounds when the loop allows it. The
        decision and its reason go to the summary's header (``_batches_note``): a user who reads ``max_steps`` as a
        budget over ranks must see when it is each rank's own."""
        from lightning_syncasync.callbacks.adaptive_batch import AdaptiveBatchSize  # callbacks sit above strategies

        has_abs = any(isinstance(c, AdaptiveBatchSize) for c in trainer.callbacks)
        if self.claim_batches and has_abs:
            raise ValueError(
                "async_ssp(batches='claim') with an AdaptiveBatchSize callback: both replace the training "
                "loader's sampler (a shared queue of batches against per-rank batch sizes). HINT: drop one of them"
            )
        claim, why = self._claiming_reason(trainer, has_abs)
        if self.world_size > 1:
            if claim:
                self._batches_note = "batches: claimed from a shared queue (a faster rank trains on more of them)"
            else:
                own = trainer.max_steps > 0
                steps = f"max_steps={trainer.max_steps} is each rank's own step count; " if own else ""
                self._batches_note = f"batches: {steps}not claimed: {why}"
            log.info("async_ssp: %s", self._batches_note)
        return claim

    def _claiming_reason(self, trainer: pl.Trainer, has_abs: bool) -> tuple[bool, str]:
        if self.claim_batches is not None:
            shared = "rebalanced by AdaptiveBatchSize" if has_abs else "each rank its own even share"
            return self.claim_batches, f"as set ({shared})"
        if not self.round_mode:
            return False, "per-step mode (local_steps=1) does not claim"
        if self.world_size == 1:
            return False, "one rank"  # no other rank to share with; a claim would cost a store round trip per batch
        if has_abs:
            return False, "AdaptiveBatchSize balances the batches instead"
        try:
            _claim_budget(trainer, self.world_size)
        except ValueError as reason:
            return False, str(reason).split(" HINT")[0].replace("async_ssp(batches='claim') ", "claiming ")
        return True, ""

    @override
    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)
        module = self.lightning_module
        training = module is not None and module._trainer is not None and module.trainer.training
        if self._claiming and training and isinstance(dataloader, DataLoader):
            dataloader = self._claiming_loader(dataloader)
        return dataloader

    def _claiming_loader(self, loader: DataLoader) -> DataLoader:
        if isinstance(loader, _ClaimingLoader):
            return loader
        if loader.batch_size is None:
            raise ValueError(
                "async_ssp(batches='claim') rebuilds the training loader from its batch_size, and this loader "
                "has a custom batch_sampler. HINT: pass batch_size= to the DataLoader, or batches='rebalance'"
            )
        shuffle, seed = sampling_order(loader.sampler, "async_ssp(batches='claim')")
        store = dist.PrefixStore(f"syncasync_claim/{self._claim_fits}", dist.distributed_c10d._get_default_store())
        sampler = ClaimingBatchSampler(
            len(loader.dataset),  # type: ignore[arg-type]
            loader.batch_size,
            self.global_rank,
            self.world_size,
            store,
            shuffle=shuffle,
            seed=seed,
            drop_last=loader.drop_last,
            budget=self._claim_budget,
            lockstep=self._warmup,
            # A straggler leaves an epoch's tail to the fast ranks, so they do not wait for its last batch at the cut.
            pace=lambda: self.rounds.step_times if self.rounds is not None else None,
        )
        self._claim_sampler = sampler
        trainer = self.lightning_module.trainer  # type: ignore[union-attr]
        return _ClaimingLoader(
            loader.dataset, batch_sampler=sampler, on_exhausted=lambda: setattr(trainer, "should_stop", True),
            **loader_kwargs(loader),
        )  # fmt: skip

    # -- the training step -------------------------------------------------------------------------------------

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        if self.rounds is not None:
            # A local step on fresh gradients of this replica, with its own optimizer; then the round's bookkeeping.
            what = what_is_checked(self.lightning_module)
            checked = finite_closure(closure, self.global_rank, self.rounds, self._params, what)
            if self._warming():
                # Every replica takes the same step from the same average: nothing for a round to carry.
                out = super().optimizer_step(optimizer, self._averaged(checked), model, **kwargs)
                self.rounds.rebase()
                return out
            out = super().optimizer_step(optimizer, checked, model, **kwargs)
            with as_divergence(self.global_rank):
                self.rounds.after_step()
            if self._length_report is not None:
                self._length_report.poll()
            return out
        ex = self.exchange
        if ex is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        assert self._compensator is not None and self._apply is not None
        return ssp_optimizer_step(
            ex, self._compensator, self._apply, optimizer, self.global_rank, closure,
            lambda wrapped: super(AsyncSSPStrategy, self).optimizer_step(optimizer, wrapped, model, **kwargs),
            what=what_is_checked(self.lightning_module),
        )  # fmt: skip

    def _warming(self) -> bool:
        """Whether this step is one of the synchronous warm-up's: every rank has taken the same number of steps
        until its end (lockstep), so ``global_step`` is the same on every rank here."""
        module = self.lightning_module
        return bool(self._warmup) and module is not None and module.trainer.global_step < self._warmup

    def _averaged(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        """``closure``, then its gradients averaged over every rank (a parameter without one counts as zeros, as in
        DDP, so every replica steps alike)."""

        def run() -> Any:
            out = closure()
            start = time.perf_counter()
            for p in self._params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            flat = torch.cat([p.grad.reshape(-1) for p in self._params])  # type: ignore[union-attr]
            all_reduce_(flat, self._warm_group)
            flat.div_(self.world_size)
            copy_flat_([p.grad for p in self._params], flat)  # type: ignore[misc]
            scope = "inter" if self.num_nodes > 1 else "intra"
            self.sync_stats.record_blocking(flat.numel() * flat.element_size(), scope, time.perf_counter() - start)
            return out

        return run

    # -- consistent cuts -----------------------------------------------------------------------------------------

    @override
    def _equal_optimizer_states(self) -> None:
        if self._optimizer is not None:
            broadcast_optimizer_state([self._optimizer], src=0)

    def _algorithm(self) -> Any | None:
        return self.rounds if self.rounds is not None else self.exchange

    @override
    def summary_notes(self) -> list[str]:
        """What SyncMonitor's summary header should say: with claimed batches ``max_steps`` is a budget over every
        rank, so the ranks' step counts differ and none of them reads ``max_steps``; without, why not; in round
        mode, the round length and where it came from."""
        notes = [self._length_report.note()] if self._length_report is not None else []
        if self._batches_note and not (self._claiming and self.planned_steps):
            return [*notes, self._batches_note]
        if not (self._claiming and self.planned_steps):
            return notes
        return notes + [
            f"max_steps={self.planned_steps} is a budget over all ranks here: {self.planned_steps * self.world_size} "
            f"batches ({self.planned_steps} x {self.world_size} ranks) claimed from a shared queue, so a faster rank "
            f"takes more steps (the steps column; each rank's global_step is its own; the budget ends at an epoch end)"
        ]

    def teardown(self) -> None:
        if self.exchange is not None:
            self.exchange.close()
            self.exchange = None
        if self.rounds is not None:
            self.rounds.close()
            self.rounds = None
        if self.lightning_module is not None:
            follow_global_progress(self.lightning_module, [], None)  # undone
        self._claim_sampler = None
        if self.planned_steps is not None and self.lightning_module is not None:
            self.lightning_module.trainer.fit_loop.epoch_loop.max_steps = self.planned_steps  # as the user set it
            self.planned_steps = None
        signalled = self._sigterm.requested()
        self._sigterm.undo()
        super().teardown()
        # After a SIGTERM the exchange thread may still sit in a dropped round's collective on the rounds' group,
        # which a peer that stopped a step earlier never joins: destroying the group would wait for it (the process
        # exits instead, and the group with it).
        destroy_groups(*((self._warm_group,) if signalled else (self._group, self._warm_group)))
        self._group = self._warm_group = None

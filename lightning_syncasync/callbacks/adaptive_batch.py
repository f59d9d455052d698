"""``AdaptiveBatchSize``: per-rank batch sizes from measured speed, with the global batch and the update unchanged.

In a synchronous job every step waits for the slowest rank. This callback keeps the global batch ``B`` fixed and
gives each rank a share proportional to its measured compute throughput, so all ranks finish their part of a step
at about the same time (:class:`~lightning_syncasync.algorithms.batching.BatchBalancer` has the arithmetic).

Three pieces make that safe for any LightningModule:

* **Data.** The training loader's sampler is replaced (at the point where Lightning injects its own
  ``DistributedSampler``: the strategy's ``process_dataloader``) by a
  :class:`~lightning_syncasync.algorithms.batching.VariableBatchSampler`: every global step takes the next ``B``
  indices of the epoch's permutation and rank ``i`` gets its slice of ``b_i``. Each sample is still seen exactly once
  per epoch, and every rank has the same number of steps.
* **Unbiased update.** DDP averages gradients uniformly over ranks. With unequal batches, rank ``i``'s loss gradient
  is scaled by ``N * b_i / B`` (a hook on the loss tensor, registered in ``on_before_backward``, so it works with
  automatic and manual optimisation, gradient accumulation and AMP scaling), which makes the averaged gradient the
  mean over the ``B`` samples: the single-process update on the same batch. This assumes the loss is a mean over the
  batch (torch's default ``reduction``); for a summed loss pass ``loss_reduction="sum"``.
* **One decision.** Every ``interval`` batches, each rank's compute throughput since the last decision (samples per
  second of compute, communication waits excluded, from the same ``StatsRecorder`` that ``SyncMonitor`` closes) is
  gathered; rank 0 decides (with hysteresis and bounds; when to move is
  :class:`~lightning_syncasync.algorithms.batching.rebalance.RebalancePolicy`) and broadcasts; all ranks schedule the
  new split from the same sampler step, past anything their loaders have prefetched. Under a strategy whose ranks are
  apart between its exchanges (``async_ssp``, ``hier_sync``, ``auto_sync`` in async or hier mode) the gather runs in
  the background and is read a window later, where every rank takes the same decision from the same numbers: no
  collective that every rank waits at.

With ``hier_sync`` each node keeps an equal share of ``B`` (node models are averaged uniformly, so only then is the
update unbiased); ranks are rebalanced inside their node. Decisions go to ``SyncMonitor``'s summary (``events``),
each rank's batch size is logged as ``syncasync/batch_size``, and the split is part of checkpoints, so a resumed run
continues with it.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_syncasync.algorithms.batching._loader import loader_kwargs, sampling_order
from lightning_syncasync.algorithms.batching.balancer import BatchBalancer
from lightning_syncasync.algorithms.batching.batch_sampler import VariableBatchSampler
from lightning_syncasync.algorithms.batching.noise_scale import GradientNoiseScale
from lightning_syncasync.algorithms.batching.rebalance import RebalancePolicy, broadcast_decision, grown_batch
from lightning_syncasync.algorithms.stats import StatsRecorder, StepStats
from lightning_syncasync.callbacks._batch_loader import (
    global_batch_of,
    initial_sizes,
    node_groups,
    patch_process_dataloader,
)
from lightning_syncasync.callbacks._noise_probe import NoiseScaleProbe
from lightning_syncasync.callbacks._stats_source import PendingRows, gather_rows, ranks_apart, stats_recorder
from lightning_syncasync.callbacks._step_log import is_logging_step, write_step_values
from lightning_syncasync.callbacks.monitor import SyncMonitor

log = logging.getLogger(__name__)

_REDUCTIONS = ("mean", "sum")


class AdaptiveBatchSize(Callback):
    """Per-rank batch sizes proportional to measured compute speed (see the module docstring).

    Args:
        interval: batches between two rebalancing decisions (all ranks decide together).
        global_batch: samples per step over all ranks; default the training loader's ``batch_size`` x ranks.
        min_batch: smallest per-rank batch.
        max_batch: largest per-rank batch (memory cap): one int for all ranks, a list with one per rank, or
            ``None`` for none.
        sizes: initial split (one size per rank, summing to the global batch); default an even split. With
            ``adapt=False`` this is a static split, for clusters whose speeds are known in advance.
        adapt: rebalance from measurements every ``interval`` batches.
        hysteresis: adopt a new split only if it predicts a step this much shorter (0.05 = 5%).
        smoothing: weight of the previous throughput estimate when a new window's measurement arrives (0 = use
            each window alone). Per-sample throughput hardly depends on the batch size, so estimates carry over
            across rebalances; smoothing keeps step-to-step noise from moving samples back and forth.
        warmup_steps: batches at the start of fit not measured (one-off start-up costs).
        persistence: windows in a row whose measurements must each call for moving samples the same way (the same
            ranks gaining, the same losing) before a split is adopted (>= 1). A rank's speed in a window is its
            median step (compute per sample), which a transient pause does not move; and a rank slow in one window
            only is not rebalanced. Under transient pauses (``jitter_slow_link``) the window means chased whichever
            rank paused last: 23-26 rebalances a run, splits such as [41, 39, 51, 29].
        loss_reduction: ``"mean"`` if the loss is averaged over the batch (torch's default), ``"sum"`` if summed.
        seed: permutation seed; default the seed of the sampler Lightning injected (0).
        grow_batch: (off by default) grow the global batch during training toward the measured gradient noise scale
            (McCandlish et al. 2018), at most doubling per decision, and multiply the learning rate by AdaScale's
            gain for the grown batch. Needs a flat all-reduce (``ddp``), no gradient accumulation, no fp16 loss
            scaling. Epochs keep their number of steps, so a grown batch makes an epoch span more than one pass
            over the data (each sample is seen once per pass); LR schedules are not stretched.
        max_global_batch: upper bound of the grown global batch (default 8x the initial one, at most the dataset).
        required: ``False``: a training loader this callback cannot split (an iterable dataset, a custom batch
            sampler) is left as it is, with a log line, and the run trains with even batches. Strategies that add
            the callback by default (``async_ssp``) set it, so that a loader the user chose is never an error of a
            callback the user did not add.

    Example::

        Trainer(strategy="ddp", devices=4, callbacks=[SyncMonitor(), AdaptiveBatchSize(interval=10)])
    """

    def __init__(
        self,
        interval: int = 10,
        global_batch: int | None = None,
        min_batch: int = 1,
        max_batch: int | list[int] | None = None,
        sizes: list[int] | None = None,
        adapt: bool = True,
        hysteresis: float = 0.05,
        smoothing: float = 0.5,
        warmup_steps: int = 3,
        persistence: int = 3,
        loss_reduction: str = "mean",
        seed: int | None = None,
        grow_batch: bool = False,
        max_global_batch: int | None = None,
        required: bool = True,
    ) -> None:
        super().__init__()
        if interval < 1:
            raise ValueError(
                f"interval must be >= 1 (batches between rebalancing decisions), got {interval}; HINT: 10 decides "
                "every 10 batches"
            )
        if global_batch is not None and global_batch < 1:
            raise ValueError(
                f"global_batch must be >= 1, got {global_batch}; HINT: None takes the loader's batch_size x ranks"
            )
        if min_batch < 1:
            raise ValueError(
                f"min_batch must be >= 1, got {min_batch}; HINT: 1 lets the slowest rank go down to one sample"
            )
        highs = [max_batch] if isinstance(max_batch, int) else list(max_batch or [])
        if highs and min(highs) < min_batch:
            raise ValueError(
                f"min_batch ({min_batch}) > max_batch ({min(highs)}): no split satisfies both; lower min_batch or "
                "raise max_batch"
            )
        if not 0.0 <= hysteresis < 1.0:
            raise ValueError(f"hysteresis must be in [0, 1), got {hysteresis}; HINT: 0.05 adopts a split 5% faster")
        if not 0.0 <= smoothing < 1.0:
            raise ValueError(
                f"smoothing must be in [0, 1) (weight of the previous estimate), got {smoothing}; HINT: 0.5, or 0 "
                "to use each window alone"
            )
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}; HINT: 0 measures from the first batch")
        if persistence < 1:
            raise ValueError(
                f"persistence must be >= 1 (windows in a row that call for the same move), got {persistence}; HINT: "
                "3 waits for three windows in a row, 1 adopts a split from one window"
            )
        if loss_reduction not in _REDUCTIONS:
            raise ValueError(
                f"loss_reduction must be one of {_REDUCTIONS}, got {loss_reduction!r}; HINT: 'mean' for a loss "
                "averaged over the batch (torch's default), 'sum' for a summed one"
            )
        if max_global_batch is not None and max_global_batch < 1:
            raise ValueError(
                f"max_global_batch must be >= 1, got {max_global_batch}; HINT: None allows 8x the initial global batch"
            )
        if sizes is not None and (not sizes or min(sizes) < 1):
            raise ValueError(
                f"sizes must give every rank a batch >= 1, got {sizes}; HINT: one size per rank summing to the global "
                "batch, or None for an even split"
            )
        self.interval = interval
        self.global_batch = global_batch
        self.min_batch = min_batch
        self.max_batch = list(max_batch) if isinstance(max_batch, (list, tuple)) else max_batch
        self.sizes = list(sizes) if sizes is not None else None
        self.adapt = adapt
        self.hysteresis = hysteresis
        self.smoothing = smoothing
        self.warmup_steps = warmup_steps
        self.persistence = persistence
        self.loss_reduction = loss_reduction
        self.seed = seed
        self.grow_batch = grow_batch
        self.max_global_batch = max_global_batch
        self.required = required
        self.noise = GradientNoiseScale()
        self.base_batch: int | None = None
        self._max_batch_total = 0
        self._probe: NoiseScaleProbe | None = None
        self._step_total = 0
        self.decisions: list[dict[str, Any]] = []
        self.sampler: VariableBatchSampler | None = None
        self.balancer: BatchBalancer | None = None
        self._restored: dict[str, Any] | None = None
        self._unpatch: Callable[[], None] | None = None
        self._recorder: StatsRecorder | None = None
        self._monitor: SyncMonitor | None = None
        self._batches = 0
        self._weight = 1.0
        self._batch_size = 0
        self._last_seen: StepStats | None = None
        self._samples = 0.0
        self._per_sample: list[float] = []  # this window's steps: compute seconds per sample of each
        self._policy = RebalancePolicy(smoothing, persistence)
        self._pending: PendingRows | None = None  # the window gathered in the background (asynchronous strategies)
        self._prefetch_bound = 2

    @property
    def current_sizes(self) -> list[int] | None:
        """The split in force for the batches being scheduled now (``None`` before fit)."""
        return self.sampler.sizes if self.sampler is not None else None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._monitor = next((c for c in trainer.callbacks if isinstance(c, SyncMonitor)), None)
        if self._monitor is None:
            # The throughput this callback balances on comes from the StatsRecorder whose steps SyncMonitor opens
            # and closes; without one, add a quiet one (no progress-bar field, no summary table). It does not
            # synchronise the GPU at each step (cuda_sync=False): this callback reads sums over `interval` steps,
            # whose wall time is right without it (the host cannot run more than its launch queue ahead), and a
            # sync per step would cost a small model's steps/s the host's lead over the GPU.
            self._monitor = SyncMonitor(progress_bar=False, print_summary=False, cuda_sync=False)
            trainer.callbacks.append(self._monitor)
            rank_zero_info("AdaptiveBatchSize: added a SyncMonitor to measure per-rank compute throughput")
        self._unpatch = patch_process_dataloader(trainer, lambda loader: self._replace_loader(trainer, loader))

    def _replace_loader(self, trainer: pl.Trainer, loader: DataLoader) -> DataLoader:
        if isinstance(loader.batch_sampler, VariableBatchSampler):
            return loader
        world = trainer.world_size
        try:
            global_batch = global_batch_of(loader, world, self.global_batch)
        except (TypeError, ValueError) as why:
            if self.required:
                raise
            rank_zero_info(f"AdaptiveBatchSize: the training loader is left as it is (even batches): {why}")
            return loader
        dataset = loader.dataset
        shuffle, seed = self._order_of(loader.sampler)
        if global_batch < world * self.min_batch:
            raise ValueError(
                f"global batch {global_batch} is smaller than {world} ranks x min_batch {self.min_batch}: some rank "
                "would get no sample. Raise the batch size (or global_batch) or use fewer ranks"
            )
        self.base_batch = global_batch
        self._max_batch_total = min(self.max_global_batch or 8 * global_batch, len(dataset))
        restored_batch = (self._restored or {}).get("global_batch")
        if self.grow_batch and isinstance(restored_batch, int) and global_batch < restored_batch <= len(dataset):
            global_batch = restored_batch  # a resumed run keeps the batch it had grown to
        groups = node_groups(trainer.strategy)
        self.balancer = BatchBalancer(
            global_batch, world, self.min_batch, self.max_batch, groups=groups, hysteresis=self.hysteresis
        )
        sizes = initial_sizes(self.balancer, self._restored, self.sizes)
        self.sampler = VariableBatchSampler(
            len(dataset),
            trainer.global_rank,
            sizes,
            shuffle=shuffle,
            seed=seed,
            drop_last=loader.drop_last,
            stream=self.grow_batch,  # a growing batch must not shorten the epochs Lightning has scheduled
        )
        if type(loader) is not DataLoader:
            rank_zero_warn(
                f"AdaptiveBatchSize rebuilds the training loader as a plain DataLoader; arguments specific to "
                f"{type(loader).__name__} are not carried over"
            )
        kwargs = {"batch_sampler": self.sampler, **loader_kwargs(loader)}
        # How far ahead of the step in training this rank's sampler can run: the loader's workers' prefetch, the
        # batch Lightning's fetcher holds back to spot the last one, and one in hand.
        workers = int(kwargs.get("num_workers") or 0)
        self._prefetch_bound = workers * int(kwargs.get("prefetch_factor") or 2) + 2
        rank_zero_info(
            f"AdaptiveBatchSize: global batch {global_batch} split {sizes} over {world} ranks"
            + (f" (per node {global_batch // len(groups)})" if groups else "")
        )
        return DataLoader(dataset, **kwargs)

    def _order_of(self, sampler: object) -> tuple[bool, int]:
        # The replaced sampler says whether the epoch is shuffled and with which seed.
        return sampling_order(sampler, "AdaptiveBatchSize", self.seed)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.grow_batch:
            self._check_grow_batch(trainer)
            self._probe = NoiseScaleProbe(pl_module.parameters(), trainer.optimizers)
            self._probe.gain = float((self._restored or {}).get("gain") or 1.0)
        self._recorder = stats_recorder(trainer)
        self._batches = 0
        self._last_seen = None
        self._samples = 0.0
        self._per_sample = []
        self._policy = RebalancePolicy(self.smoothing, self.persistence)
        self._pending = None

    def _check_grow_batch(self, trainer: pl.Trainer) -> None:
        # The noise-scale estimator pairs this rank's gradient with the average over *all* ranks of the same step:
        # not there under a strategy whose step statistics say it trains asynchronously (async_ssp and its sharded
        # form), nor one that averages across nodes on its own. Read from the strategy's public contract (its
        # `sync_stats` and `topology`), not from its class: callbacks do not import strategies.
        recorder = getattr(trainer.strategy, "sync_stats", None)
        asynchronous = isinstance(recorder, StatsRecorder) and recorder.mode == "async"
        if asynchronous or node_groups(trainer.strategy) is not None:
            raise ValueError(
                f"grow_batch needs a flat gradient all-reduce every step (ddp); {type(trainer.strategy).__name__} "
                "averages across nodes in the background. Set grow_batch=False or use strategy='ddp'"
            )
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(
                f"grow_batch measures the gradient of each step's batch; accumulate_grad_batches="
                f"{trainer.accumulate_grad_batches} mixes several. Grow the batch instead of accumulating, or set "
                "grow_batch=False"
            )
        if getattr(trainer.precision_plugin, "scaler", None) is not None:
            raise ValueError(
                "grow_batch reads gradient norms before fp16 loss scaling is undone; use precision='bf16-mixed' or "
                "'32', or set grow_batch=False"
            )

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.sampler is None:
            return
        if self.sampler.issued:
            b, total = self.sampler.issued.popleft()
        else:  # not a batch of ours (should not happen): leave the gradient as it is
            b, total = self.sampler.sizes[trainer.global_rank], self.sampler.global_batch
        self._batch_size = b
        self._step_total = total
        if self._probe is not None:
            self._probe.start_batch()
        n = trainer.world_size
        self._weight = n * b / total if self.loss_reduction == "mean" else n / total
        # The step SyncMonitor closed last is the previous batch: add it to the measurement window.
        last = self._recorder.last if self._recorder is not None else None
        if last is not None and last is not self._last_seen:
            self._last_seen = last
            if self._batches > self.warmup_steps:
                self._samples += last.samples
                if last.samples > 0:
                    self._per_sample.append(last.compute_s / last.samples)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if self.sampler is not None and self._weight != 1.0 and loss.requires_grad:
            weight = self._weight
            # Scaling the gradient that flows out of the loss scales every parameter gradient by the same factor
            # before DDP (or any strategy) averages them; the logged loss is left untouched.
            loss.register_hook(lambda grad: grad * weight)

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self._probe is not None:
            self._probe.after_reduce(pl_module.parameters(), self._weight, self._batch_size, self._step_total)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.sampler is None:
            return
        self._batches += 1
        # Straight to the loggers on Lightning's logging steps only: `self.log` costs host time every step
        # (callbacks/_step_log.py says how much).
        if is_logging_step(trainer):
            prefix = self._monitor.prefix if self._monitor is not None else "syncasync/"
            values = {f"{prefix}batch_size": float(self._batch_size)}
            if self._probe is not None:
                values[f"{prefix}global_batch"] = float(self._step_total)
                values[f"{prefix}adascale_gain"] = self._probe.gain
                if self.noise.noise_scale is not None:
                    values[f"{prefix}noise_scale"] = self.noise.noise_scale
            write_step_values(trainer, values)
        if self.adapt and self._batches % self.interval == 0 and trainer.world_size > 1:
            self._rebalance(trainer, pl_module)

    def _rebalance(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self.sampler is not None and self.balancer is not None
        probe = self._probe
        window = [probe.grad_sq_sum, probe.trace_sum, float(probe.count)] if probe is not None else [0.0, 0.0, 0.0]
        if probe is not None:
            probe.reset_window()
        # The window's samples, and their compute at its median step's pace: a rank's speed without its transient
        # pauses (r[0] / r[1] is samples per second of compute at that pace).
        median_s = statistics.median(self._per_sample) if self._per_sample else 0.0
        values = [self._samples, self._samples * median_s, float(self.sampler.produced), *window]
        self._samples = 0.0
        self._per_sample = []
        # Every gather launched is read, in launch order, whatever the strategy does now.
        pending, self._pending = self._pending, None
        earlier = pending.rows() if pending is not None else None
        if probe is None and ranks_apart(trainer):
            self._rebalance_async(trainer, values, earlier)
            return
        rows = gather_rows(trainer, values)
        measured = [r[0] / r[1] if r[1] > 0 else 0.0 for r in rows]
        throughput = self._policy.smoothed(measured)
        current = self.sampler.sizes
        decision: list[int] | None = None
        grown = False
        if trainer.is_global_zero:
            if probe is not None:
                pairs = sum(r[5] for r in rows)
                if pairs > 0:
                    self.noise.update(sum(r[3] for r in rows) / pairs, sum(r[4] for r in rows) / pairs)
                new_batch = grown_batch(self.noise, self.balancer, self._max_batch_total)
                if new_batch is not None and all(t > 0 for t in throughput):
                    self.balancer = self._balancer_for(new_batch)
                    decision, grown = self.balancer.propose(throughput), True
            if decision is None:
                decision = self._policy.decide(self.balancer, current, measured, throughput)
        # One decision for everyone: floating-point differences between ranks can never split the job.
        decision, grown, gain = broadcast_decision(
            decision, grown, self._gain(), self.noise, trainer.world_size, pl_module.device, trainer.is_global_zero
        )
        if probe is not None:
            probe.gain = gain
        if decision is None:
            return
        if grown and not trainer.is_global_zero:
            self.balancer = self._balancer_for(sum(decision))
        # Past every rank's prefetched batches, so all ranks switch at the same global step.
        self._schedule(trainer, current, decision, throughput, int(max(r[2] for r in rows)), grown, gain)

    def _rebalance_async(self, trainer: pl.Trainer, values: list[float], earlier: list[list[float]] | None) -> None:
        """A rebalancing window under a strategy that trains asynchronously: no collective any rank waits at.

        This window's numbers are gathered in the background (``PendingRows``: a gather every rank waited at was the
        only thing holding async ranks together) and the previous window's are read now. Every rank decides from
        those same rows by the same pure arithmetic (``BatchBalancer.decide``, float64 in Python), so no broadcast
        of rank 0's decision is needed; the noise-scale probe, which needs one, keeps the blocking path. The new
        split starts past every rank's horizon, sent with its row: its sampler's position a window later plus
        everything its loader can have prefetched by then.
        """
        assert self.sampler is not None and self.balancer is not None
        horizon = float(self.sampler.produced + self.interval + self._prefetch_bound)
        self._pending = PendingRows(trainer, [*values, horizon])
        if earlier is None:
            return  # the first window without a gather to wait at: decide at the next one
        measured = [r[0] / r[1] if r[1] > 0 else 0.0 for r in earlier]
        throughput = self._policy.smoothed(measured)
        current = self.sampler.sizes
        decision = self._policy.decide(self.balancer, current, measured, throughput)
        if decision is not None:
            self._schedule(trainer, current, decision, throughput, int(max(r[-1] for r in earlier)), False)

    def _schedule(
        self,
        trainer: pl.Trainer,
        current: list[int],
        decision: list[int],
        throughput: list[float],
        from_step: int,
        grown: bool,
        gain: float = 1.0,
    ) -> None:
        assert self.sampler is not None
        start = self.sampler.set_sizes(decision, from_step=from_step, resize=grown)
        event = {
            "batch": self._batches,
            "from_sampler_step": start,
            "sizes": decision,
            "previous": current,
            "throughput": [round(t, 2) for t in throughput],
            # Samples per second of the new split over the current one (a grown batch also moves more per step).
            "predicted_speedup": round(
                BatchBalancer.step_time(current, throughput)
                / BatchBalancer.step_time(decision, throughput)
                * sum(decision)
                / sum(current),
                4,
            ),
        }
        if grown:
            event.update(global_batch=sum(decision), noise_scale=self.noise.noise_scale, adascale_gain=gain)
        kind = "grow_batch" if grown else "rebalance"
        self.decisions.append({"kind": kind, "step": trainer.global_step, **event})
        if self._monitor is not None:
            self._monitor.record_event(kind, trainer.global_step, **event)
        log.info("rank %d: rebalanced %s -> %s (throughput %s)", trainer.global_rank, current, decision, throughput)

    def _balancer_for(self, global_batch: int) -> BatchBalancer:
        """The current balancer's ranks, bounds and groups, for a new global batch."""
        assert self.balancer is not None
        old = self.balancer
        return BatchBalancer(global_batch, old.world_size, self.min_batch, self.max_batch, old.groups, self.hysteresis)

    def _gain(self) -> float:
        if self.balancer is None or self.base_batch is None or not self.grow_batch:
            return 1.0
        return self.noise.gain(self.base_batch, self.balancer.global_batch)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The last window gathered in the background: read, so that no rank leaves a collective behind on the
        # default group (every rank launched it at the same batch). It comes too late for a decision.
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.rows()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._pending = None  # a failing run must not wait for a rank that may be gone

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._probe is not None:
            self._probe.remove()
            self._probe = None
        if self._unpatch is not None:
            self._unpatch()
            self._unpatch = None

    @override
    def state_dict(self) -> dict[str, Any]:
        sizes = self.sampler.sizes if self.sampler is not None else (self._restored or {}).get("sizes")
        global_batch = self.sampler.global_batch if self.sampler is not None else None
        return {
            "sizes": sizes,
            "global_batch": global_batch,
            "decisions": self.decisions[-100:],
            "noise": self.noise.state_dict(),
            "gain": self._probe.gain if self._probe is not None else 1.0,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = dict(state_dict)
        self.decisions = list(state_dict.get("decisions", []))
        if state_dict.get("noise"):
            self.noise.load_state_dict(state_dict["noise"])

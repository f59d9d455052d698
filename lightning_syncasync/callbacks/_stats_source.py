"""Find (or attach) the :class:`StatsRecorder` of the strategy a ``Trainer`` runs.

Our strategies own their recorder and expose it as ``strategy.sync_stats``. For strategies we do not own (Lightning's
``ddp``/``ddp_spawn``) a recorder is attached once per strategy object by registering a measuring DDP comm hook on
the wrapped model; every callback asking for the same trainer gets the same recorder, so the monitor, the switcher
and the batch-size policy all read one record.
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_warn
from torch.nn.parallel import DistributedDataParallel

from lightning_syncasync.algorithms._comm import start_all_gather_flat, wire_device
from lightning_syncasync.algorithms.comm_hooks import MeasuredAllReduce
from lightning_syncasync.algorithms.fsdp_comm import measure_fsdp_collectives
from lightning_syncasync.algorithms.stats import Scope, StatsRecorder

log = logging.getLogger(__name__)

_ATTACHED: weakref.WeakKeyDictionary[object, StatsRecorder] = weakref.WeakKeyDictionary()


def stats_recorder(trainer: pl.Trainer) -> StatsRecorder:
    """The recorder for ``trainer.strategy``. Call after the strategy's ``setup`` (e.g. in ``on_fit_start``)."""
    strategy = trainer.strategy
    own = getattr(strategy, "sync_stats", None)
    if isinstance(own, StatsRecorder):
        _time_reduce(trainer, own)
        _time_checkpoint(trainer, own)
        return own
    if strategy in _ATTACHED:
        return _ATTACHED[strategy]
    recorder = StatsRecorder(mode="sync" if trainer.world_size > 1 else "local")
    _ATTACHED[strategy] = recorder
    model = strategy.model
    if isinstance(strategy, DDPStrategy) and isinstance(model, DistributedDataParallel):
        try:
            MeasuredAllReduce(recorder, scope=scope_of(trainer), process_group=model.process_group).register(model)
        except RuntimeError as err:
            # DDP accepts one comm hook per module; on CUDA Lightning may already have registered the user's.
            rank_zero_warn(
                f"SyncMonitor could not measure DDP communication ({err}); bytes and wait time will read 0. "
                "HINT: a `ddp_comm_hook` passed to DDPStrategy is already registered on this model."
            )
    elif model is not None and measure_fsdp_collectives(model, recorder, scope=scope_of(trainer)) > 0:
        pass  # FSDP2 (Lightning's ModelParallelStrategy): its all-gathers and reduce-scatters, through torch's API
    elif trainer.world_size > 1:
        rank_zero_warn(
            f"SyncMonitor does not know how to measure communication of {type(strategy).__name__}; "
            "bytes and wait time will read 0. Strategies expose measurements through a `sync_stats` StatsRecorder."
        )
    _time_reduce(trainer, recorder)
    _time_checkpoint(trainer, recorder)
    log.debug("attached StatsRecorder to %s", type(strategy).__name__)
    return recorder


def scope_of(trainer: pl.Trainer) -> Scope:
    # A flat collective over every rank crosses node boundaries as soon as there is more than one node.
    return "inter" if trainer.num_nodes > 1 else "intra"


_TIMED: weakref.WeakSet[object] = weakref.WeakSet()


def _time_reduce(trainer: pl.Trainer, recorder: StatsRecorder) -> None:
    """Count time blocked in ``strategy.reduce`` during training steps as wait time.

    ``self.log(..., sync_dist=True)`` inside ``training_step`` all-reduces through ``strategy.reduce``: a hidden
    synchronisation point where fast ranks wait for slow ones. Left unmeasured, that wait reads as compute, and a
    per-rank speed (what ``AdaptiveBatchSize`` balances on) looks the same on every rank.
    """
    strategy = trainer.strategy
    if strategy in _TIMED or trainer.world_size <= 1:
        return
    _TIMED.add(strategy)
    original = strategy.reduce

    def reduce(*args: Any, **kwargs: Any) -> Any:
        if not trainer.training:
            return original(*args, **kwargs)
        value = args[0] if args else kwargs.get("tensor")
        with recorder.timed(value.device if isinstance(value, torch.Tensor) else None):
            return original(*args, **kwargs)

    strategy.reduce = reduce  # type: ignore[method-assign]


_SAVES_TIMED: weakref.WeakSet[object] = weakref.WeakSet()


def _time_checkpoint(trainer: pl.Trainer, recorder: StatsRecorder) -> None:
    """Keep checkpoint saves out of the steps' time (``StatsRecorder.record_checkpoint``).

    ``ModelCheckpoint`` saves after the monitor's end of a step or of validation, so a save's time would otherwise
    read as the next step's compute. A compressed strategy's save gathers every rank's error-feedback residuals
    (``MeasuredDDPStrategy.save_checkpoint``), a model's worth of fp32 per rank: at 4 nodes x 1 on 100 Mbit/s that
    was 1.6 s of every int8 step when validating (and saving twice) every 5 steps, which made int8 look slower than
    uncompressed DDP. The save's cost is real, but it belongs to how often a run saves, as validation's does.
    """
    strategy = trainer.strategy
    if strategy in _SAVES_TIMED:
        return
    _SAVES_TIMED.add(strategy)
    original = strategy.save_checkpoint

    def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            recorder.record_checkpoint(start, time.perf_counter())

    strategy.save_checkpoint = save_checkpoint  # type: ignore[method-assign]


def gather_rows(trainer: pl.Trainer, values: list[float]) -> list[list[float]]:
    """Every rank's ``values`` (the same length everywhere), in rank order, on every rank: a :class:`PendingRows`
    read at once.

    Straight through ``torch.distributed`` on the default group (the group Lightning's ``strategy.all_gather`` uses):
    Lightning's version goes through ``torch.distributed.nn.functional.all_gather``, which warns about its own
    deprecation on every call, and three callbacks gathering every window flooded the log with it. float64, so
    counters of samples and bytes stay exact.
    """
    return PendingRows(trainer, values).rows()


class PendingRows:
    """A callback's gather launched now and read later: :func:`gather_rows` without the wait at the launch.

    Under a strategy that trains asynchronously (its ``StatsRecorder`` in mode ``async``: ``async_ssp``,
    ``auto_sync`` in async mode) nothing else makes the ranks meet, so a blocking gather every window is a barrier
    that holds every rank to the slowest one's pauses: with SyncSwitcher's and AdaptiveBatchSize's gathers every 10
    steps, ``auto_sync`` in async mode on ``jitter_long`` spent 36.7% of its step time waiting against
    ``async_ssp``'s 7.5% (docs/benchmarks.md). Launched at one window and read at the next, the gather waits only
    for a rank more than a window behind. Every rank must launch the same gathers in the same order (the default
    group's collectives run in launch order), and read each one (:meth:`rows`) before the run ends.
    """

    def __init__(self, trainer: pl.Trainer, values: list[float]) -> None:
        self._trainer = trainer
        self._local = torch.tensor(values, dtype=torch.float64, device="cpu")
        self._rows: list[list[float]] | None = None
        self._work: Any = None
        if trainer.world_size <= 1 or not dist.is_available() or not dist.is_initialized():
            self._rows = [self._local.tolist()]
            return
        # On the wire's device from the start (NCCL gathers CUDA tensors only): the result is copied back at the read.
        device = wire_device(self._local, None)
        self._sent = self._local.to(device)
        self._out = torch.empty(dist.get_world_size() * self._local.numel(), dtype=self._local.dtype, device=device)
        self._work = start_all_gather_flat(self._out, self._sent, group=None)

    def rows(self) -> list[list[float]]:
        """Every rank's values, in rank order; waits for the ranks that have not launched this gather yet."""
        if self._rows is None:
            start = time.perf_counter()
            self._work.wait()
            rows = self._out.cpu().reshape(-1, self._local.numel()).tolist()
            # The time this rank waited here for the others is communication, not compute: left in compute it read
            # as the rank's own work, and StragglerEmulator, which scales its pauses by that figure, paused a rank
            # longer after every wait at a callback's gather. Under jitter with async rounds that fed on itself
            # until a pause outlasted the peers' 60 s timeout (auto_sync with allow_async on jitter_long: py-spy
            # found three ranks in SyncSwitcher's gather and the fourth in a StragglerEmulator pause).
            # AdaptiveBatchSize reads the same compute figure.
            recorder = _existing_recorder(self._trainer)
            if recorder is not None:
                recorder.record_wait(time.perf_counter() - start)
            self._rows, self._work = rows, None
        return self._rows


def ranks_apart(trainer: pl.Trainer) -> bool:
    """Whether the strategy's own steps leave ranks apart across the world between its exchanges (its recorder's mode
    is ``async``: every rank on its own; or ``hier``: each node on its own between the nodes' averaging rounds), read
    now: an ``auto_sync`` strategy changes its mode during the fit. A callback's blocking gather there is a barrier
    across the link the strategy does not have: in ``hier`` mode under pauses, ``auto_sync``'s two window gathers
    held it at 0.96x [0.71-1.06] ``hier_sync``'s samples/s (``jitter_slow_link``, 5 seeds)."""
    recorder = _existing_recorder(trainer)
    return recorder is not None and recorder.mode in ("async", "hier")


def _existing_recorder(trainer: pl.Trainer) -> StatsRecorder | None:
    """The strategy's recorder, or the one ``stats_recorder`` attached to it, without attaching one."""
    own = getattr(trainer.strategy, "sync_stats", None)
    return own if isinstance(own, StatsRecorder) else _ATTACHED.get(trainer.strategy)

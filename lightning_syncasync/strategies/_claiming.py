"""``async_ssp``'s claimed batches (``batches="claim"``): the loader that ends the run when the shared budget is used
up, the learning-rate schedules that follow global progress, and the checks of what counts per-rank batches.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.utilities.types import LRSchedulerConfig
from torch.utils.data import DataLoader

Batches = Literal["auto", "claim", "rebalance", "even"]
# batches= as the two settings it replaced: (claim_batches, adaptive_batch), None meaning "decide at setup".
_BATCHES: dict[str, tuple[bool | None, bool | None]] = {
    "auto": (None, None),
    "claim": (True, None),
    "rebalance": (False, True),
    "even": (False, False),
}


def batch_sharing(batches: str, kwargs: dict[str, Any], owner: str) -> tuple[bool | None, bool | None]:
    """``batches=`` as ``(claim_batches, adaptive_batch)``. The two old settings were one decision (both replace the
    training loader's sampler, so only three of their four pairs made sense); given as keywords (taken out of
    ``kwargs``) they still work, alone."""
    if batches not in _BATCHES:
        raise ValueError(f"{owner}(batches={batches!r}): unknown; HINT: one of {list(_BATCHES)}")
    legacy = {k: kwargs.pop(k) for k in ("claim_batches", "adaptive_batch") if k in kwargs}
    if not legacy:
        return _BATCHES[batches]
    if batches != "auto":
        raise ValueError(
            f"{owner}(batches={batches!r}) with {legacy}: batches= replaced claim_batches and adaptive_batch; HINT: "
            "batches= alone ('claim', 'rebalance', 'even' or 'auto')"
        )
    claim, adaptive = legacy.get("claim_batches"), legacy.get("adaptive_batch")
    if adaptive and claim is not False:
        raise ValueError(
            f"adaptive_batch=True and claim_batches={claim}: both replace the training loader's sampler (per-rank "
            "batch sizes against a shared queue of batches). HINT: batches='rebalance' to rebalance batches, or "
            "batches='claim' to claim them"
        )
    return claim, adaptive


class _ClaimingLoader(DataLoader):
    """The training loader under ``claim_batches``: when the budget is used up, the epoch that just ended is the
    last (``trainer.should_stop``, set when the iterator ends, i.e. before the epoch's last batch has run, so that
    batch still runs and Lightning validates after it on every rank)."""

    def __init__(self, *args: Any, on_exhausted: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._on_exhausted = on_exhausted

    def __iter__(self) -> Any:
        yield from super().__iter__()
        if self.batch_sampler.exhausted:  # type: ignore[union-attr]
            self._on_exhausted()


def follow_global_progress(
    module: pl.LightningModule, configs: list[LRSchedulerConfig], steps: Callable[[], int | None] | None
) -> None:
    """Make the module's step-interval learning-rate schedulers follow global progress (``steps()``, the steps DDP
    would have taken by now) rather than this rank's own steps; ``steps=None`` undoes it.

    Why: under ``claim_batches`` a fast rank takes more steps than DDP's per-rank budget and a slow one fewer. A
    schedule stepped per local step would run a fast rank to the end of its cosine (learning rate near 0) long before
    the run ends, and leave the slow rank in its warm-up. Each call of Lightning's ``lr_scheduler_step`` instead steps
    the scheduler as many times as the global step count has moved since (0, 1 or several), so every rank follows
    one schedule in time. Schedulers without ``last_epoch`` (not torch's) are stepped as before.
    """
    if "lr_scheduler_step" in vars(module):
        del module.lr_scheduler_step  # the module's own (or Lightning's default) method again
    stepped = {id(c.scheduler) for c in configs if c.interval == "step"}
    if steps is None or not stepped:
        return
    original = module.lr_scheduler_step

    def lr_scheduler_step(scheduler: Any, metric: Any = None) -> None:
        target, done = steps(), getattr(scheduler, "last_epoch", None)
        if id(scheduler) not in stepped or target is None or not isinstance(done, int):
            original(scheduler, metric)
            return
        for _ in range(target - done):
            original(scheduler, metric)

    module.lr_scheduler_step = lr_scheduler_step  # type: ignore[method-assign]


DEFAULT_WARMUP_STEPS = 20
"""``warmup_steps=None``'s synchronous start (``_resolve_warmup``): what ``auto_sync`` does before its first
decision, and what ``async_ssp_auto_like`` measured with (docs/benchmarks.md)."""


def _check_warmup(trainer: pl.Trainer, warmup_steps: int) -> None:
    """A warm-up must end before the budget: in lockstep, a budget cut inside it could leave one rank a batch
    short at an average."""
    if 0 < trainer.max_steps <= warmup_steps:
        raise ValueError(
            f"async_ssp(warmup_steps={warmup_steps}) is longer than the run (max_steps={trainer.max_steps}): the "
            "rounds would never start. HINT: a warm-up of a few percent of max_steps, or warmup_steps=0"
        )


def _claim_budget(trainer: pl.Trainer, world: int) -> int | None:
    """Batches over all ranks for ``claim_batches``; refuses what counts per-rank batches."""
    if isinstance(trainer.val_check_interval, int):
        raise ValueError(
            f"async_ssp(batches='claim') validates at epoch ends: ranks train different numbers of batches, so "
            f"trainer.val_check_interval={trainer.val_check_interval} (every so many batches of each rank) would "
            "validate at different moments on each rank. HINT: use check_val_every_n_epoch, or batches='rebalance'"
        )
    for cb in trainer.checkpoint_callbacks:
        if getattr(cb, "_every_n_train_steps", 0) or getattr(cb, "_train_time_interval", None):
            raise ValueError(
                "async_ssp(batches='claim'): ModelCheckpoint(every_n_train_steps/train_time_interval) counts "
                "each rank's own steps or clock, which differ across ranks here, so the ranks would save at "
                "different moments. HINT: checkpoint every_n_epochs, or batches='rebalance'"
            )
    return trainer.max_steps * world if trainer.max_steps > 0 else None

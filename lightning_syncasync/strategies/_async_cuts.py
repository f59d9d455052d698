"""How Lightning's collectives behave while ranks train apart (``async_ssp``, ``async_ssp_sharded``, ``auto_sync``):
``reduce`` inside ``training_step`` stays local, every other collective waits at a consistent cut first, and
validation, checkpoints and the end of fit see the merged model (``AsyncSSPStrategy``'s module docstring says why).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from lightning_syncasync.algorithms.averaging.rounds import (
    RoundExchange,
)
from lightning_syncasync.algorithms.ssp.compensation import StaleGradientCompensation
from lightning_syncasync.algorithms.ssp.exchange import ApplyFn, SSPExchange
from lightning_syncasync.algorithms.stats import StatsRecorder
from lightning_syncasync.strategies._async_step import as_divergence, report_nonfinite, ssp_gate, what_is_checked

log = logging.getLogger(__name__)


class LocalReduceWhileAsync:
    """Strategy mixin: while an ``exchange`` runs, ``reduce`` inside ``training_step`` returns the rank's own value.
    Ranks are at different steps there, and a collective would put them back in lockstep (module docstring)."""

    exchange: SSPExchange | None
    rounds: RoundExchange | None = None
    sync_stats: StatsRecorder
    _compensator: StaleGradientCompensation | None = None
    _apply: ApplyFn | None = None
    _in_training_step: bool = False

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._in_training_step = True
        try:
            ex, compensator, apply = self.exchange, self._compensator, self._apply
            if ex is not None and compensator is not None and apply is not None and not ex.gated:
                # Per-step SSP: the gate before the step's first forward (ssp_gate), once per step.
                what = what_is_checked(self.lightning_module)  # type: ignore[attr-defined]
                ssp_gate(ex, compensator, apply, self.global_rank, self._on_nonfinite(), what)  # type: ignore[attr-defined]
            return super().training_step(*args, **kwargs)  # type: ignore[misc]
        finally:
            self._in_training_step = False

    def _on_nonfinite(self) -> Callable[[float], None] | None:
        """What a non-finite loss in per-step SSP does: ``None`` raises :class:`DivergenceError`."""
        return None

    def _async_active(self) -> bool:
        return self.exchange is not None or self.rounds is not None

    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        if self._in_training_step and self._async_active():
            return tensor
        with self._sync_point():
            return super().reduce(tensor, group=group, reduce_op=reduce_op)  # type: ignore[misc]

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        with self._sync_point():
            super().barrier(*args, **kwargs)  # type: ignore[misc]

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        with self._sync_point():
            return super().broadcast(obj, src)  # type: ignore[misc]

    def all_gather(self, tensor: Any, group: Any | None = None, sync_grads: bool = False) -> Any:
        with self._sync_point():
            return super().all_gather(tensor, group=group, sync_grads=sync_grads)  # type: ignore[misc]

    @contextmanager
    def _sync_point(self) -> Iterator[None]:
        """Time a collective of Lightning's outside the training step while training is asynchronous: every rank
        waits there for the slowest (epoch ends, metric reductions, validation), so it is recorded apart.

        With rounds, a consistent cut comes first. A rank waiting at the staleness bound needs its peers to end their
        rounds, and a peer inside one of Lightning's collectives never would: a deadlock, found when ranks that
        claim batches took different numbers of steps and the epoch ended without validation (the epoch-end metric
        reduction; before the fix rank 0 timed out at round 3 after 60 s). Every rank reaches the same first
        collective, so that is a consistent point; the cuts after it are clean and cost one metadata all-reduce."""
        if not self._async_active():
            yield
            return
        start = time.perf_counter()
        try:
            self._cut_rounds()
            yield
        finally:
            self.sync_stats.record_sync_point(time.perf_counter() - start)

    def _cut_rounds(self, stop: bool = False) -> None:
        """A consistent cut of the rounds (if they run), then the optimizer states made one (when anything changed)."""
        rounds = self.rounds
        if rounds is None or rounds._thread is None:
            return
        with as_divergence(self.global_rank):  # type: ignore[attr-defined]
            changed = rounds.cut(stop=stop)
        if changed:
            self._equal_optimizer_states()

    def _equal_optimizer_states(self) -> None:
        """After a cut that changed the replicas: every rank's optimizer state made rank 0's (the strategy's way)."""
        raise NotImplementedError


class CutsAtLightningHooks:
    """Mixin (before ``MergesBeforeUserHooks`` and the Lightning base) for a strategy whose ranks train apart through
    ``self.rounds`` or ``self.exchange``: validation, ``lightning_module_state_dict`` (checkpoints) and the end of fit
    happen at a consistent cut (``async_ssp`` and ``async_ssp_sharded``; ``auto_sync`` switches modes and has its
    own)."""

    rounds: RoundExchange | None
    exchange: SSPExchange | None
    sync_stats: StatsRecorder
    _apply: ApplyFn | None = None

    def _cut(self, stop: bool = False) -> None:
        """Every update in flight delivered, the replicas (and in round mode the optimizer states) made rank 0's."""
        start = time.perf_counter()
        active = self._async_active()  # type: ignore[attr-defined]
        self._cut_now(stop)
        if active:
            self.sync_stats.record_sync_point(time.perf_counter() - start)

    def _cut_now(self, stop: bool) -> None:
        if self.rounds is not None and self.rounds._thread is not None:
            self._cut_rounds(stop)  # type: ignore[attr-defined]
            if stop:
                _log_rounds(self.rounds)
        elif self.exchange is not None and self.exchange._thread is not None:
            self.exchange.cut(self._apply, stop=stop)  # type: ignore[arg-type]
            what = what_is_checked(self.lightning_module)  # type: ignore[attr-defined]
            report_nonfinite(self.exchange, self.global_rank, None, what)  # type: ignore[attr-defined]
            if stop:
                _log_staleness(self.exchange)

    def on_validation_start(self) -> None:
        # Not `trainer.training`: Lightning leaves the training stage before this hook, so that test never held and
        # validation inside fit saw a replica without the updates still in flight.
        self._cut()  # validate the merged model
        super().on_validation_start()  # type: ignore[misc]

    def lightning_module_state_dict(self) -> dict[str, Any]:
        self._cut()  # all ranks save together: a consistent cut
        return super().lightning_module_state_dict()  # type: ignore[misc,no-any-return]

    def _merge_replicas(self) -> None:
        # The model fit() leaves behind (and on_train_end hooks see) is the merged one; the exchange stops on every
        # rank after the same round.
        self._cut(stop=True)


def _log_staleness(ex: SSPExchange) -> None:
    gaps, versions = ex.stats.clock_gaps, ex.stats.version_staleness
    if gaps and versions:
        log.info(
            "async_ssp: %d rounds; clock gap mean %.2f max %d; version staleness mean %.2f max %d",
            ex.stats.rounds, sum(gaps) / len(gaps), max(gaps), sum(versions) / len(versions), max(versions),
        )  # fmt: skip


def _log_rounds(rounds: RoundExchange) -> None:
    st = rounds.stats
    if st.local_steps:
        log.info(
            "async_ssp: %d rounds delivered; local steps per round mean %.1f (min %d, max %d); lag mean %.2f max %d; "
            "%.2f s waited on the staleness bound; %d rounds ended with no step to catch up after a pause; %s",
            st.rounds, sum(st.local_steps) / len(st.local_steps), min(st.local_steps), max(st.local_steps),
            sum(st.lags) / max(len(st.lags), 1), max(st.lags, default=0), st.wait_s, st.catch_up,
            rounds.length.describe(),
        )  # fmt: skip

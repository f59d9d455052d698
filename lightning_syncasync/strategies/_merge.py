"""The final merge of a strategy's replicas, done before any user hook sees the final model (issue 23).

Lightning 2.6's ``FitLoop.on_run_end`` (``lightning/pytorch/loops/fit_loop.py``) calls ``on_train_end`` on the
callbacks, then on the LightningModule, and only then on the strategy. A strategy whose nodes or ranks keep replicas
of their own and merged them in its own ``on_train_end`` left every user hook there (saving, exporting or checking the
final model) with this rank's replica. The last step is known only once it has run (``max_steps``, ``max_epochs``,
``should_stop`` from early stopping or a batch budget), and no strategy hook runs between it and the callbacks'
``on_train_end``; so the strategy puts a private callback first in ``trainer.callbacks`` whose ``on_train_end``
merges.
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch import Callback
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override


class MergesBeforeUserHooks:
    """Mixin (before the Lightning base) for a strategy that keeps per-node or per-rank replicas.

    Its :meth:`_merge_replicas` (a collective: every rank calls it together) runs once at the end of ``fit``, before
    any callback's or the LightningModule's ``on_train_end``. The strategy's own ``on_train_end`` runs it too, as a
    safety net that is a no-op by then: a second round would cost a cross-node exchange, and with an outer optimizer
    (``outer="nesterov"``) its momentum would move the merged model again.
    """

    _replicas_merged: bool = False
    _merge_hook: tuple[pl.Trainer, Callback] | None = None

    def _merge_replicas(self) -> None:
        """Make every rank hold the one final model (the strategy's consistent cut)."""
        raise NotImplementedError

    def _merge_once(self) -> None:
        if self._replicas_merged:
            return
        self._merge_replicas()
        self._replicas_merged = True

    # No @override on the three hooks below: the mixin has no base of its own; they chain, through super(), to the
    # strategy's Lightning base that follows it in the MRO.

    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)  # type: ignore[misc]
        self._replicas_merged = False
        callbacks = _callbacks(trainer)
        # One left behind by a fit that never reached teardown would otherwise run beside the new one.
        callbacks[:] = [c for c in callbacks if not isinstance(c, _MergeReplicasFirst)]
        if trainer.state.fn == TrainerFn.FITTING:
            # strategy.setup runs in the worker process (spawn never pickles the callback), after the callbacks'
            # setup and after Lightning's _reorder_callbacks (at the start of each fit): position 0 stays first.
            hook = _MergeReplicasFirst()
            callbacks.insert(0, hook)
            self._merge_hook = (trainer, hook)

    def on_train_end(self) -> None:
        self._merge_once()
        super().on_train_end()  # type: ignore[misc]

    def teardown(self) -> None:
        # Out of the list again, so that a Trainer reused for another fit does not run two.
        if self._merge_hook is not None:
            trainer, hook = self._merge_hook
            self._merge_hook = None
            callbacks = _callbacks(trainer)
            if hook in callbacks:
                callbacks.remove(hook)
        super().teardown()  # type: ignore[misc]


class _MergeReplicasFirst(Callback):
    """Calls the strategy's final merge from the first callback's ``on_train_end``. It has no state, so it puts
    nothing in checkpoints (Lightning saves only non-empty callback states) and resuming never looks for it."""

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if isinstance(trainer.strategy, MergesBeforeUserHooks):
            trainer.strategy._merge_once()


def _callbacks(trainer: pl.Trainer) -> list[Callback]:
    return trainer.callbacks  # type: ignore[attr-defined,no-any-return]  # set by Lightning's callback connector

"""The final merge of a strategy's replicas, done before any user hook sees the final model (issue 23).

Lightning 2.6's ``FitLoop.on_run_end`` (``lightning/pytorch/loops/fit_loop.py``) calls ``on_train_end`` on the
callbacks, then on the LightningModule, and only then on the strategy. A strategy whose nodes or ranks keep replicas
of their own and merged them in its own ``on_train_end`` left every user hook there (saving, exporting or checking the
final model) with this rank's replica. The last step is known only once it has run (``max_steps``, ``max_epochs``,
``should_stop`` from early stopping or a batch budget), and no strategy hook runs between it and the callbacks'
``on_train_end``; so the strategy wraps that one call: for the fit, the fit loop's ``on_run_end`` merges first, then
runs Lightning's.

A wrapper rather than a callback of the strategy's own at the head of ``trainer.callbacks`` (the first design):
Lightning calls every hook of every callback at every step, about six per step (``_call_callback_hooks``, each in a
profiler context), and that dispatch was most of the work the DDP-based strategies added to a one-rank step (108
of their 133 added function calls per step, ``scripts/host_overhead.py --calls``). The loop's ``on_run_end`` runs
once per fit.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn

from lightning_syncasync.algorithms._flat import broadcast_flat_


class MergesBeforeUserHooks:
    """Mixin (before the Lightning base) for a strategy that keeps per-node or per-rank replicas.

    Its :meth:`_merge_replicas` (a collective: every rank calls it together) runs once at the end of ``fit``, before
    any callback's or the LightningModule's ``on_train_end``. The strategy's own ``on_train_end`` runs it too, as a
    safety net that is a no-op by then: a second round would cost a cross-node exchange, and with an outer optimizer
    (``outer="nesterov"``) its momentum would move the merged model again.
    """

    _replicas_merged: bool = False
    _merge_loop: Any = None  # the fit loop wrapped for this fit

    def _merge_replicas(self) -> None:
        """Make every rank hold the one final model (the strategy's consistent cut)."""
        raise NotImplementedError

    def _merge_once(self) -> None:
        if self._replicas_merged:
            return
        self._merge_replicas()
        self._buffers_as_rank0()
        self._replicas_merged = True

    def _buffers_as_rank0(self) -> None:
        """After the merge, every integer buffer of the module is rank 0's (DDP's rule, which it applies at every
        forward). The merge averages the float buffers; an integer one (BatchNorm's ``num_batches_tracked``, which
        counts this rank's own steps) stayed each rank's (issue 65). Read again here, broadcast once, at the end of
        fit. Float buffers are left to the merge: broadcasting them too made the runs on the emulated accelerator
        differ from the CPU runs of the same seeds (tests/gpu, distance 0.014-0.028 against 0.005), not understood
        yet."""
        module = self.lightning_module  # type: ignore[attr-defined]
        if module is None or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
            return
        # Sharded buffers (DTensor) are the sharding's to keep consistent.
        counters = [b for b in module.buffers() if type(b) is torch.Tensor and not b.is_floating_point()]
        if counters:
            broadcast_flat_(counters, 0)

    # No @override on the three hooks below: the mixin has no base of its own; they chain, through super(), to the
    # strategy's Lightning base that follows it in the MRO.

    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)  # type: ignore[misc]
        self._replicas_merged = False
        loop = trainer.fit_loop
        _unwrap(loop)  # one left behind by a fit that never reached teardown would merge through a stale strategy
        if trainer.state.fn == TrainerFn.FITTING:
            # strategy.setup runs in the worker process (spawn never pickles the loop's wrapper), before the fit loop.
            run_end = loop.on_run_end

            def merged_first() -> None:
                self._merge_once()
                run_end()

            merged_first._syncasync_merge = True  # type: ignore[attr-defined]  # what _unwrap looks for
            merged_first.__wrapped__ = run_end  # type: ignore[attr-defined]  # functools' name for what it wraps
            loop.on_run_end = merged_first  # type: ignore[method-assign]  # this instance only; teardown undoes it
            self._merge_loop = loop

    def on_train_end(self) -> None:
        self._merge_once()
        super().on_train_end()  # type: ignore[misc]

    def teardown(self) -> None:
        # Unwrapped again, so that a Trainer reused with another strategy runs no merge of this one.
        if self._merge_loop is not None:
            _unwrap(self._merge_loop)
            self._merge_loop = None
        super().teardown()  # type: ignore[misc]


def _unwrap(loop: Any) -> None:
    """Take a merge wrapper off ``loop`` (the loop's own ``on_run_end`` shows again)."""
    if getattr(loop.__dict__.get("on_run_end"), "_syncasync_merge", False):
        del loop.on_run_end

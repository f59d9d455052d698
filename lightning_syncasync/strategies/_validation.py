"""Validation of the merged model, and the other Lightning hooks of a :class:`DelayedAverager`, for strategies whose
nodes train apart between averagings."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_syncasync.algorithms.averaging.delayed import DelayedAverager
from lightning_syncasync.strategies._optim import unwrap_optimizer


class ValidatesNodeMean:
    """Mixin for a strategy with a :class:`DelayedAverager`: validation inside ``fit`` sees the mean of the node
    replicas (the model a checkpoint or the end of ``fit`` holds), lent by ``averager.swap_in_mean`` in the
    strategy's ``on_validation_start``; here the node's replica is put back, so validating never changes the
    training trajectory."""

    averager: DelayedAverager | None

    def on_validation_end(self) -> None:
        if self.averager is not None:
            self.averager.swap_back()
        super().on_validation_end()  # type: ignore[misc]


class AveragesNodes(ValidatesNodeMean):
    """Mixin (before ``MergesBeforeUserHooks`` and the Lightning base) mapping Lightning's hooks onto a strategy's
    :class:`DelayedAverager`: ``hier_sync`` over node replicas, ``hier_sync_sharded`` over each rank's shards. The
    strategy builds ``self.averager`` in its ``setup`` and keeps ``self._eval_cross_group``, a cross-node group that
    only validation uses (compressed rounds use the averager's own group from a thread at any time)."""

    _eval_cross_group: Any
    _replicas_merged: bool
    optimizers: list[Any]
    lightning_module: Any

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        out = super().optimizer_step(optimizer, closure, model, **kwargs)  # type: ignore[misc]
        # One averaging step per training step: with several optimizers, after the last one has stepped.
        if self.averager is not None and (not self.optimizers or optimizer is unwrap_optimizer(self.optimizers[-1])):
            self.averager.after_step()
            report = getattr(self, "_length_report", None)
            if report is not None:
                report.poll()  # the period's decisions and warning, as they are made
        return out

    def on_validation_start(self) -> None:
        # Validation inside fit evaluates the mean of the node replicas (the model a checkpoint or the end of fit
        # would hold), not each node's own replica; it is swapped back afterwards, so validating never changes
        # the training trajectory. (Lightning has left the training stage here: hence state.fn, not `training`.)
        module = self.lightning_module
        if self.averager is not None and module is not None and module.trainer.state.fn == "fit":
            self.averager.swap_in_mean(self._eval_cross_group)
        super().on_validation_start()  # type: ignore[misc]

    def _merge_replicas(self) -> None:
        # The model fit() leaves behind (and that on_train_end hooks, test/predict and save see) is the merged one,
        # not a node's replica: a consistent cut, since draining alone leaves each node's progress since the last
        # launch unmerged.
        if self.averager is not None:
            self.averager.synchronize()

    def lightning_module_state_dict(self) -> dict[str, Any]:
        # Checkpoints hold a consistent cut: every node the same model, no residual held back (all ranks save
        # together, so this collective is safe here).
        if self.averager is not None and not self._replicas_merged:  # merged at the end of fit: nothing moved since
            # Also when saved from a callback during validation (ModelCheckpoint's on_validation_end runs before
            # ours): synchronize() drains, which first puts back the node replica lent to validation.
            self.averager.synchronize()
        return super().lightning_module_state_dict()  # type: ignore[misc,no-any-return]

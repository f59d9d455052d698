"""Validation of the merged model for strategies whose nodes train apart between averagings."""

from __future__ import annotations

from lightning_syncasync.algorithms.averaging import DelayedAverager


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

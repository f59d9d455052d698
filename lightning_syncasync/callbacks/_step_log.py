"""How this package's callbacks log their per-step values: straight to the loggers, on Lightning's logging steps.

Lightning's own monitors (``LearningRateMonitor``, ``DeviceStatsMonitor``, ``ThroughputMonitor``) do the same, and for
host time per step. A value given to ``LightningModule.log`` costs about 0.25 ms per call in Lightning 2.6 (its
result collection is moved to the value's device on every call), and once logged, each name stays in Lightning's
result collection, which Lightning walks at the end of every step of the fit, logged there or not. Writing
``SyncMonitor``'s 9 values this way took its step from 1.16x to 1.07x of plain Lightning's on the 16 -> 4 model of
``scripts/host_overhead.py`` (``docs/results/host_overhead/one_rank.json`` and ``direct_logs.json``): host time a
small model's GPU step cannot spare (``docs/gpu.md``).

What this gives up: the values are not in ``trainer.callback_metrics``, so ``ModelCheckpoint``/``EarlyStopping``
cannot monitor them (they are throughput figures, not quality ones). With loggers they are in
``trainer.logged_metrics``, and the loggers write them at the steps Lightning writes its own step values (a
``CSVLogger`` file has them in rows of their own at that step); with ``logger=False`` they go nowhere, as before.
"""

from __future__ import annotations

import lightning.pytorch as pl


def is_logging_step(trainer: pl.Trainer) -> bool:
    """Whether Lightning writes its own step values at this batch: a logging step (``log_every_n_steps``) or
    ``fast_dev_run``, and not a micro-batch that only accumulates gradients (the rule of Lightning 2.6's
    ``_LoggerConnector.update_train_step_metrics``, so each value is written once per optimizer step)."""
    module = trainer.lightning_module
    if trainer.fit_loop._should_accumulate() and (module is None or module.automatic_optimization):
        return False
    return bool(trainer._logger_connector.should_update_logs or trainer.fast_dev_run)


def write_step_values(trainer: pl.Trainer, values: dict[str, float]) -> None:
    """Write ``values`` to the trainer's loggers at the step number Lightning's own step logs use. Call it on a step
    where :func:`is_logging_step` (the callers build their values only then)."""
    trainer._logger_connector.log_metrics(values)  # type: ignore[arg-type]

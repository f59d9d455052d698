"""How this package's callbacks log their per-step values: straight to the loggers, on Lightning's logging steps.

Lightning's own monitors (``LearningRateMonitor``, ``DeviceStatsMonitor``, ``ThroughputMonitor``) do the same, and for
host time per step. A value given to ``LightningModule.log`` costs about 0.25 ms per call in Lightning 2.6 (its
result collection is moved to the value's device on every call), and once logged, each name stays in Lightning's
result collection, which Lightning walks at the end of every step of the fit, logged there or not. Writing
``SyncMonitor``'s 9 values this way took its step from 1.16x to 1.07x of plain Lightning's on the 16 -> 4 model of
``scripts/host_overhead.py`` (``docs/results/host_overhead/one_rank.json`` and ``direct_logs.json``): host time a
small model's GPU step cannot spare (``docs/gpu.md``).

What this gives up: the values are not in ``trainer.callback_metrics``, so ``ModelCheckpoint``/``EarlyStopping``
cannot monitor them (they are throughput figures, not quality ones). They are in ``trainer.logged_metrics``, and the
loggers write them at the same steps as before.
"""

from __future__ import annotations

import lightning.pytorch as pl


def log_on_logging_steps(trainer: pl.Trainer, values: dict[str, float]) -> bool:
    """Write ``values`` to the trainer's loggers if this step is one of Lightning's logging steps
    (``log_every_n_steps``), at the step number Lightning's own step logs use; returns whether it did."""
    connector = trainer._logger_connector
    if not connector.should_update_logs:
        return False
    connector.log_metrics(values)  # type: ignore[arg-type]
    return True

"""The calibration of :class:`~lightning_syncasync.algorithms.costmodel.ScalingModel` against ``syncasync-bench``
records (``_Calibration``): its free parameters (``DEFAULT_PARAMS``), fitted by coordinate descent on log grids to the
measured samples/s, and the model's error per scenario, strategy and workload."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

# Free parameters fitted by calibrate(), their defaults (no overhead, nothing hidden) and the grids searched.
DEFAULT_PARAMS: dict[str, float] = {
    "overlap": 0.0,
    "collective_overhead_s": 0.0,
    "comm_cpu_s_per_byte": 0.0,
    "codec_s_per_byte": 0.0,
    "unlimited_bytes_per_s": 1e9,
}
_GRIDS: dict[str, list[float]] = {
    "overlap": [i / 10 for i in range(10)],
    "collective_overhead_s": [0.0, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1],
    "comm_cpu_s_per_byte": [0.0, 1e-10, 3e-10, 1e-9, 3e-9, 1e-8, 3e-8, 1e-7],
    "codec_s_per_byte": [0.0, 1e-10, 3e-10, 1e-9, 3e-9, 1e-8, 3e-8, 1e-7],
    "unlimited_bytes_per_s": [10 ** (7 + i / 4) for i in range(13)],  # 10 MB/s .. 10 GB/s
}


class _Calibration:
    """Fitting and its error, for :class:`~lightning_syncasync.algorithms.costmodel.ScalingModel` (whose
    :meth:`from_record` makes the model of one record)."""

    if TYPE_CHECKING:

        @classmethod
        def from_record(cls, record: Mapping[str, Any], params: Mapping[str, float] | None = None) -> Any: ...

    @classmethod
    def _predict_record(cls, record: Mapping[str, Any], params: Mapping[str, float]) -> float:
        model = cls.from_record(record, params)
        return model.predict(record["model_strategy"], int(record["nodes"]), **record.get("settings", {})).samples_per_s

    @classmethod
    def _loss(cls, records: Sequence[Mapping[str, Any]], params: Mapping[str, float]) -> float:
        errs = [math.log(cls._predict_record(r, params) / float(r["samples_per_s"])) ** 2 for r in records]
        return sum(errs) / len(errs)

    @classmethod
    def calibrate(cls, records: Sequence[Mapping[str, Any]], rounds: int = 3) -> dict[str, float]:
        """Fit the free parameters (``DEFAULT_PARAMS``) to benchmark records: coordinate descent on log grids,
        minimising the mean squared log error of the predicted samples/s.

        Each record is a dict with ``scenario``, ``strategy`` (its label), ``model_strategy`` and ``settings`` (what
        :meth:`predict` takes), ``samples_per_s`` (measured), ``ideal_per_rank_samples_per_s`` (each rank alone,
        same stragglers), ``batch_size``, ``grad_bytes``, ``nodes``, ``procs_per_node``, ``link_mbit`` (``None`` =
        no limit: its bandwidth is ``unlimited_bytes_per_s``, fitted) and ``jitter`` (``[p, f]`` or ``None``).
        ``syncasync-advise --calibrate`` builds them from ``syncasync-bench`` results.
        """
        records = list(records)
        if not records:
            raise ValueError("calibrate() got no records; HINT: pass syncasync-bench results of supported strategies")
        best = dict(DEFAULT_PARAMS)
        best_loss = cls._loss(records, best)
        for _ in range(rounds):
            improved = False
            for name, grid in _GRIDS.items():
                for value in grid:
                    trial = {**best, name: value}
                    loss = cls._loss(records, trial)
                    if loss < best_loss - 1e-12:
                        best, best_loss, improved = trial, loss, True
            if not improved:
                break
        return best

    @classmethod
    def prediction_error(
        cls, records: Sequence[Mapping[str, Any]], params: Mapping[str, float] | None = None
    ) -> list[dict[str, Any]]:
        """Per (scenario, strategy, workload): median measured and predicted samples/s over repeats, and the
        relative error ``(predicted - measured) / measured``. The workload (gradient size, batch) is part of the key:
        records of one scenario name measured on different workloads are not repeats."""
        p = {**DEFAULT_PARAMS, **(params or {})}
        by_key: dict[tuple[str, str, str], list[tuple[float, float]]] = {}
        for r in records:
            workload = f"{float(r['grad_bytes']) / 1e6:.2f} MB, batch {int(r['batch_size'])}"
            key = (str(r["scenario"]), str(r["strategy"]), workload)
            by_key.setdefault(key, []).append((float(r["samples_per_s"]), cls._predict_record(r, p)))
        out = []
        for (scenario, strategy, workload), pairs in by_key.items():
            measured = statistics.median(m for m, _ in pairs)
            predicted = statistics.median(q for _, q in pairs)
            out.append(
                {
                    "scenario": scenario,
                    "strategy": strategy,
                    "workload": workload,
                    "runs": len(pairs),
                    "measured_samples_per_s": measured,
                    "predicted_samples_per_s": predicted,
                    "rel_error": (predicted - measured) / measured,
                }
            )
        return out

"""Torch-only algorithms: topology, statistics, communication. Nothing in this package imports Lightning."""

from lightning_syncasync.algorithms.comm_hooks import MeasuredAllReduce
from lightning_syncasync.algorithms.stats import StatsRecorder, StepStats
from lightning_syncasync.algorithms.topology import Topology

__all__ = ["MeasuredAllReduce", "StatsRecorder", "StepStats", "Topology"]

"""Lightning callbacks: live synchronisation metrics, adaptive per-rank batch sizes, sync/async switching,
straggler emulation."""

from lightning_syncasync.callbacks.adaptive_batch import AdaptiveBatchSize
from lightning_syncasync.callbacks.monitor import SyncMonitor
from lightning_syncasync.callbacks.straggler import StragglerEmulator
from lightning_syncasync.callbacks.switcher import SyncSwitcher

__all__ = ["AdaptiveBatchSize", "StragglerEmulator", "SyncMonitor", "SyncSwitcher"]

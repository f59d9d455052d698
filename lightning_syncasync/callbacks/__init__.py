"""Lightning callbacks: live synchronisation metrics (and, as they land, adaptive batch sizes and mode switching)."""

from lightning_syncasync.callbacks.monitor import SyncMonitor
from lightning_syncasync.callbacks.straggler import StragglerEmulator

__all__ = ["StragglerEmulator", "SyncMonitor"]

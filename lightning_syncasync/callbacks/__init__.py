"""Lightning callbacks: live synchronisation metrics (and, as they land, adaptive batch sizes and mode switching)."""

from lightning_syncasync.callbacks.monitor import SyncMonitor

__all__ = ["SyncMonitor"]

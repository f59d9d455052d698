"""Lightning callbacks: live synchronisation metrics, adaptive per-rank batch sizes, sync/async switching,
straggler emulation, fault injection and lost-peer detection."""

from lightning_syncasync.callbacks.adaptive_batch import AdaptiveBatchSize
from lightning_syncasync.callbacks.faults import FaultInjector
from lightning_syncasync.callbacks.monitor import SyncMonitor
from lightning_syncasync.callbacks.straggler import StragglerEmulator
from lightning_syncasync.callbacks.switcher import SyncSwitcher
from lightning_syncasync.callbacks.watchdog import PeerWatchdog

__all__ = ["AdaptiveBatchSize", "FaultInjector", "PeerWatchdog", "StragglerEmulator", "SyncMonitor", "SyncSwitcher"]

"""Lightning plugins: checkpoint I/O that survives crashes and refuses unreadable checkpoints clearly."""

from lightning_syncasync.plugins.checkpoint_io import AtomicCheckpointIO, CheckpointLoadError

__all__ = ["AtomicCheckpointIO", "CheckpointLoadError"]

"""lightning_syncasync: distributed training strategies for PyTorch Lightning where plain DDP is slow.

Importing the package registers its strategy names in Lightning's ``StrategyRegistry`` (idempotently); that is the
only import-time side effect.
"""

from __future__ import annotations

from lightning_syncasync.strategies._registry import register_strategies

__version__ = "0.1.0"

register_strategies()

__all__ = ["__version__", "register_strategies"]

"""Lightning adapters: strategies mapping Lightning's hooks onto ``lightning_syncasync.algorithms``."""

from lightning_syncasync.strategies._registry import STRATEGIES, StrategyEntry, register_strategies

__all__ = ["STRATEGIES", "StrategyEntry", "register_strategies"]

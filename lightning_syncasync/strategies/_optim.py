"""The torch optimizer behind Lightning's ``LightningOptimizer`` wrapper (the strategies step or inspect the raw one:
the wrapper's ``step`` would call back into the strategy)."""

from __future__ import annotations

from typing import Any


def unwrap_optimizer(optimizer: Any) -> Any:
    return getattr(optimizer, "_optimizer", optimizer)

"""``syncasync-bench``: scenarios, the side-by-side runner and the report.

The names below are imported when first used (PEP 562), so that ``python -m lightning_syncasync.bench.gpu`` does not
import the runner's Hydra/OmegaConf machinery: the GPU check runs where only torch and Lightning are installed.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "BenchRunner": "lightning_syncasync.bench.runner",
    "Contender": "lightning_syncasync.bench.runner",
    "resolve_contenders": "lightning_syncasync.bench.runner",
    "SCENARIOS": "lightning_syncasync.bench.scenarios",
    "Scenario": "lightning_syncasync.bench.scenarios",
}

__all__ = ["SCENARIOS", "BenchRunner", "Contender", "Scenario", "resolve_contenders"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""Registration of this package's strategy names in Lightning's ``StrategyRegistry``.

Lightning 2.6 has no entry point for third-party strategies, so the names must be registered when
``lightning_syncasync`` is imported, before ``Trainer(strategy="hier_sync")`` is built. Registration is the only
import-time side effect of the package and it is idempotent: importing twice, or re-registering after a user
already did, leaves one entry per name.

Names follow Lightning's ``ddp``/``ddp_spawn`` convention: the ``_spawn`` alias differs only in
``start_method="spawn"`` and is what Hydra multirun and the tests use.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from lightning.pytorch.strategies import StrategyRegistry


@dataclass(frozen=True)
class StrategyEntry:
    """One registered name: the strategy class (as an import path), a description, and the init params that make
    this alias differ from its siblings (``start_method="spawn"`` for the ``_spawn`` variants)."""

    name: str
    class_path: str
    description: str
    init_params: dict[str, Any] = field(default_factory=dict)


def _with_spawn(name: str, class_path: str, description: str) -> list[StrategyEntry]:
    return [
        StrategyEntry(name, class_path, description),
        StrategyEntry(f"{name}_spawn", class_path, f"{description} (spawn start method)", {"start_method": "spawn"}),
    ]


STRATEGIES: list[StrategyEntry] = [
    *_with_spawn(
        "hier_sync",
        "lightning_syncasync.strategies.hier_sync.HierSyncStrategy",
        "full sync inside a node, bounded-delay averaging across nodes",
    ),
    *_with_spawn(
        "async_ssp",
        "lightning_syncasync.strategies.async_ssp.AsyncSSPStrategy",
        "asynchronous training with Stale Synchronous Parallel bounded staleness",
    ),
    *_with_spawn(
        "auto_sync",
        "lightning_syncasync.strategies.auto_sync.AutoSyncStrategy",
        "sync, hierarchical or asynchronous, switched from live metrics by SyncSwitcher",
    ),
    *_with_spawn(
        "deepspeed_cpu",
        "lightning_syncasync.strategies.deepspeed_cpu.DeepSpeedCPUStrategy",
        "Lightning's DeepSpeed strategy (ZeRO 0-3), also on CPU processes with gloo",
    ),
]


def _resolve(class_path: str) -> type:
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def register_strategies(registry: Any = StrategyRegistry, entries: Iterable[StrategyEntry] | None = None) -> list[str]:
    """Register ``entries`` (default: every strategy of this package) in ``registry``.

    A name already registered with the same class and init params is left alone (idempotent). A name registered by
    somebody else with a different class is an error, because silently replacing it would change what an existing
    ``Trainer(strategy=name)`` call does.

    Returns:
        The names that are registered after the call, in table order.
    """
    names = []
    for entry in STRATEGIES if entries is None else entries:
        cls = _resolve(entry.class_path)
        if entry.name in registry:
            existing = registry[entry.name]
            if existing["strategy"] is cls and existing["init_params"] == entry.init_params:
                names.append(entry.name)
                continue
            raise ValueError(
                f"strategy name {entry.name!r} is already registered to {existing['strategy']!r}; lightning_syncasync "
                f"wants it for {cls!r}. HINT: register your strategy under another name."
            )
        registry.register(entry.name, cls, description=entry.description, **entry.init_params)
        names.append(entry.name)
    return names

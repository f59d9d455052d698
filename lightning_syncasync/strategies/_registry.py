"""Registration of this package's strategy names in Lightning's ``StrategyRegistry``.

Lightning 2.6 has no entry point for third-party strategies, so the names must be registered when
``lightning_syncasync`` is imported, before ``Trainer(strategy="hier_sync")`` is built. Registration is the only
import-time side effect of the package and it is idempotent: importing twice, or re-registering after a user
already did, leaves one entry per name.

Names follow Lightning's ``ddp``/``ddp_spawn`` convention: the ``_spawn`` alias differs only in
``start_method="spawn"`` and is what Hydra multirun and the tests use.
"""

from __future__ import annotations

import difflib
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


def _with_spawn(
    name: str, class_path: str, description: str, init_params: dict[str, Any] | None = None
) -> list[StrategyEntry]:
    params = dict(init_params or {})
    return [
        StrategyEntry(name, class_path, description, params),
        StrategyEntry(
            f"{name}_spawn", class_path, f"{description} (spawn start method)", {**params, "start_method": "spawn"}
        ),
    ]


STRATEGIES: list[StrategyEntry] = [
    *_with_spawn(
        "hier_sync",
        "lightning_syncasync.strategies.hier_sync.HierSyncStrategy",
        "full sync inside a node, bounded-delay averaging across nodes",
    ),
    # hier_sync on one machine: its ranks split into 2 virtual nodes, so a single box exercises the hierarchy.
    *_with_spawn(
        "hier_sync_virtual",
        "lightning_syncasync.strategies.hier_sync.HierSyncStrategy",
        "hier_sync with each machine's ranks split into 2 virtual nodes (try the hierarchy on one machine)",
        {"virtual_nodes": 2},
    ),
    *_with_spawn(
        "hier_sync_sharded",
        "lightning_syncasync.strategies.hier_sync_sharded.ShardedHierSyncStrategy",
        "hier_sync for models that do not fit one device: FSDP2 shards inside each node, averaging across nodes",
    ),
    *_with_spawn(
        "async_ssp",
        "lightning_syncasync.strategies.async_ssp.AsyncSSPStrategy",
        "asynchronous training with Stale Synchronous Parallel bounded staleness",
    ),
    *_with_spawn(
        "async_ssp_sharded",
        "lightning_syncasync.strategies.async_ssp_sharded.ShardedAsyncSSPStrategy",
        "async_ssp's rounds for models that do not fit one device: FSDP2 shards inside each node, rounds across nodes",
    ),
    # Nodes that leave and join (torchft; pip install -e ".[ft]"): one job per node, joined through a
    # Lighthouse. One class; the async name sets wall-clock rounds and async_ssp's round length.
    *_with_spawn(
        "hier_sync_ft",
        "lightning_syncasync.strategies.fault_tolerant.FaultTolerantStrategy",
        "hier_sync across nodes that may leave and join a running job (torchft replica groups, one job per node)",
    ),
    *_with_spawn(
        "async_ssp_ft",
        "lightning_syncasync.strategies.fault_tolerant.FaultTolerantStrategy",
        "async_ssp's wall-clock rounds across nodes that may leave and join a running job (torchft replica groups)",
        {"dynamic_local_steps": True, "local_steps": 8},
    ),
    *_with_spawn(
        "auto_sync",
        "lightning_syncasync.strategies.auto_sync.AutoSyncStrategy",
        "sync, hierarchical or asynchronous, switched from live metrics by SyncSwitcher",
    ),
    *_with_spawn(
        "ddp_measured",
        "lightning_syncasync.strategies.measured_ddp.MeasuredDDPStrategy",
        "Lightning's DDP, measured, with compressed gradients (compression=) or post-local/hierarchical SGD",
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


def pack_strategy_names() -> list[str]:
    """This package's registered names, in table order."""
    return [entry.name for entry in STRATEGIES]


def is_fault_tolerant(strategy: Any) -> bool:
    """Whether ``strategy`` is ``FaultTolerantStrategy`` (one job per node, joined through a torchft Lighthouse):
    a registered name (``hier_sync_ft``, ``async_ssp_ft_spawn``), a class path, a config with ``_target_`` (Hydra) or
    ``class_path`` (the Lightning CLI), or a strategy object. The one test every front end asks (``ft=N``,
    ``--ft N``, the benchmark's launch)."""
    if isinstance(strategy, str):
        return strategy.endswith(("_ft", "_ft_spawn", "FaultTolerantStrategy"))
    if type(strategy).__name__ == "FaultTolerantStrategy":
        return True
    path = getattr(strategy, "class_path", None)
    if path is None and callable(getattr(strategy, "get", None)):
        path = strategy.get("class_path") or strategy.get("_target_")
    return str(path or "").endswith("FaultTolerantStrategy")


def check_strategy_name(name: str, setting: str = "strategy", registry: Any = StrategyRegistry) -> str:
    """Return ``name`` if ``Trainer(strategy=name)`` will find it; otherwise raise a ``ValueError`` that names the
    setting, suggests the closest registered names ("did you mean hier_sync?") and lists this package's names.

    Lightning's own message for an unknown name lists every registered name without a suggestion, and when
    ``import lightning_syncasync`` was forgotten it lacks this package's names altogether; the CLI and the Hydra app
    check the name with this before the Trainer is built. Registers this package's names first (idempotent), so a
    name of ours is always found.

    Example::

        check_strategy_name("hier_synk")  # ValueError: ... did you mean 'hier_sync'? ...
    """
    if not isinstance(name, str) or name == "auto":
        return name
    register_strategies(registry)
    if name in registry:
        return name
    ours = pack_strategy_names()
    known = list(dict.fromkeys([*ours, *registry.available_strategies()]))
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    suggestion = f"did you mean {close[0]!r}? " if close else ""
    # Lightning's own names without the dozen *_find_unused_parameters_* spellings, which would bury the rest.
    lightning = sorted(n for n in known if n not in ours and "find_unused_parameters" not in n)
    raise ValueError(
        f"{setting}={name!r} is not a registered strategy name; HINT: {suggestion}lightning_syncasync's names: "
        f"{', '.join(ours)}; Lightning's own: {', '.join(lightning)} (and *_find_unused_parameters_* variants)"
    )

"""Lightning adapters: strategies mapping Lightning's hooks onto ``lightning_syncasync.algorithms``.

Every strategy class of the package is importable from here; the registered names (``Trainer(strategy="hier_sync")``)
are listed in ``STRATEGIES``, and :func:`check_strategy_name` says "did you mean ...?" for a misspelt one.
"""

from lightning_syncasync.strategies._registry import (
    STRATEGIES,
    StrategyEntry,
    check_strategy_name,
    is_fault_tolerant,
    pack_strategy_names,
    register_strategies,
)
from lightning_syncasync.strategies.async_ssp import AsyncSSPStrategy
from lightning_syncasync.strategies.async_ssp_sharded import ShardedAsyncSSPStrategy
from lightning_syncasync.strategies.auto_sync import AutoSyncStrategy
from lightning_syncasync.strategies.deepspeed_cpu import DeepSpeedCPUStrategy
from lightning_syncasync.strategies.fault_tolerant import FaultTolerantStrategy
from lightning_syncasync.strategies.hier_sync import HierSyncStrategy
from lightning_syncasync.strategies.hier_sync_sharded import ShardedHierSyncStrategy
from lightning_syncasync.strategies.measured_ddp import MeasuredDDPStrategy

__all__ = [
    "STRATEGIES",
    "AsyncSSPStrategy",
    "AutoSyncStrategy",
    "DeepSpeedCPUStrategy",
    "FaultTolerantStrategy",
    "HierSyncStrategy",
    "MeasuredDDPStrategy",
    "ShardedAsyncSSPStrategy",
    "ShardedHierSyncStrategy",
    "StrategyEntry",
    "check_strategy_name",
    "is_fault_tolerant",
    "pack_strategy_names",
    "register_strategies",
]

"""A recommendation as the command lines a user runs: ``syncasync-train`` overrides and ``syncasync-cli fit``
arguments for a strategy and its settings on the measured cluster's shape."""

from __future__ import annotations

from typing import Any

from lightning_syncasync.advise.measurements import Measurements


def format_settings(settings: dict[str, Any]) -> str:
    return "".join(f"{k}={v} " for k, v in settings.items())


def _shape(m: Measurements) -> list[str]:
    return [f"trainer.num_nodes={m.nodes}", f"trainer.devices={m.procs_per_node}"]


def hydra_line(strategy: str, settings: dict[str, Any], m: Measurements) -> str:
    """The ``syncasync-train`` overrides (names from ``conf/strategy`` and ``conf/callbacks``)."""
    parts = ["syncasync-train", *m.overrides]
    if strategy == "ddp_adaptive_batch":
        parts += ["strategy=ddp", "+callbacks@callbacks.adaptive_batch=adaptive_batch"]
    elif strategy in ("ddp_int8", "ddp_powersgd"):
        parts += ["strategy=ddp_measured", f"strategy.compression={strategy.removeprefix('ddp_')}"]
    elif strategy == "hsdp":
        parts += ["strategy=hier_sync_sharded", "strategy.hsdp=true"]
    elif strategy.startswith("hier_sync"):
        base = "hier_sync_sharded" if strategy.startswith("hier_sync_sharded") else "hier_sync"
        parts += [f"strategy={base}", *(f"strategy.{k}={v}" for k, v in settings.items())]
        if strategy.endswith("_int8"):
            parts.append("strategy.compression=int8")
    elif strategy in ("async_ssp", "auto_sync"):
        parts += [f"strategy={strategy}", *(f"strategy.{k}={v}" for k, v in settings.items())]
    else:
        parts.append(f"strategy={strategy}")
    return " ".join(parts + _shape(m))


_CLASS = {
    "hier_sync": "lightning_syncasync.strategies.hier_sync.HierSyncStrategy",
    "async_ssp": "lightning_syncasync.strategies.async_ssp.AsyncSSPStrategy",
    "ddp_measured": "lightning_syncasync.strategies.measured_ddp.MeasuredDDPStrategy",
    "auto_sync": "lightning_syncasync.strategies.auto_sync.AutoSyncStrategy",
    "hier_sync_sharded": "lightning_syncasync.strategies.hier_sync_sharded.ShardedHierSyncStrategy",
    "fsdp": "lightning.pytorch.strategies.ModelParallelStrategy",
}


def cli_line(strategy: str, settings: dict[str, Any], m: Measurements) -> str:
    """The ``syncasync-cli fit`` arguments (class paths where init args are set, as jsonargparse needs)."""
    parts = ["syncasync-cli", "fit"]
    if strategy == "ddp_adaptive_batch":
        parts += ["--trainer.strategy=ddp", "--trainer.callbacks+=AdaptiveBatchSize"]
    elif strategy in ("ddp_int8", "ddp_powersgd"):
        parts += [
            f"--trainer.strategy={_CLASS['ddp_measured']}",
            f"--trainer.strategy.init_args.compression={strategy.removeprefix('ddp_')}",
        ]
    elif strategy == "fsdp":
        # FSDP2 over every rank: Lightning's ModelParallelStrategy with all ranks data-parallel.
        parts += [
            f"--trainer.strategy={_CLASS['fsdp']}",
            f"--trainer.strategy.init_args.data_parallel_size={m.world_size}",
            "--trainer.strategy.init_args.tensor_parallel_size=1",
        ]
    elif strategy == "hsdp":
        parts += [f"--trainer.strategy={_CLASS['hier_sync_sharded']}", "--trainer.strategy.init_args.hsdp=true"]
    elif strategy.startswith("hier_sync") or strategy in ("async_ssp", "auto_sync"):
        base = "hier_sync" if strategy.startswith("hier_sync") else strategy
        if strategy.startswith("hier_sync_sharded"):
            base = "hier_sync_sharded"
        parts.append(f"--trainer.strategy={_CLASS[base]}")
        parts += [f"--trainer.strategy.init_args.{k}={v}" for k, v in settings.items()]
        if strategy.endswith("_int8"):
            parts.append("--trainer.strategy.init_args.compression=int8")
    else:
        parts.append(f"--trainer.strategy={strategy}")
    return " ".join(parts + [f"--trainer.num_nodes={m.nodes}", f"--trainer.devices={m.procs_per_node}"])

"""FSDP2 sharding of the demo models, for the strategies that give a LightningModule a device mesh."""

from __future__ import annotations

from collections.abc import Iterable

from lightning.pytorch import LightningModule
from torch import nn


def shard_if_meshed(module: LightningModule, units: Iterable[nn.Module]) -> None:
    """Shard ``module`` with FSDP2 over ``device_mesh["data_parallel"]`` when its strategy gave it a mesh: over the
    node's ranks under ``hier_sync_sharded``, over every rank under Lightning's ``ModelParallelStrategy``. Each of
    ``units`` becomes its own FSDP unit (gathered for its forward and freed after); the rest goes with the root.
    Without a mesh (the replicated strategies) nothing happens, so one module runs under every strategy."""
    mesh = getattr(module, "_device_mesh", None)
    if mesh is None:
        return
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if isinstance(module, FSDPModule):
        return  # sharded by an earlier fit/validate of this module
    # hier_sync_sharded(hsdp=True) asks for FSDP2's HSDP, a 2-D (replicate, shard) mesh; everything else for one dim.
    dims = getattr(module.trainer.strategy, "shard_dims", ("data_parallel",))
    shard_mesh = mesh[dims if len(dims) > 1 else dims[0]]
    for unit in units:
        fully_shard(unit, mesh=shard_mesh)
    fully_shard(module, mesh=shard_mesh)

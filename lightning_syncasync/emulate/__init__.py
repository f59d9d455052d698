"""``syncasync-emulate``: a multi-node cluster on one machine (network namespaces, rate-limited links, CPU shares)."""

from lightning_syncasync.emulate.cgroups import CpuShares
from lightning_syncasync.emulate.cluster import EmulatedCluster
from lightning_syncasync.emulate.network import EmulatedNetwork, EmulationUnavailable

__all__ = ["CpuShares", "EmulatedCluster", "EmulatedNetwork", "EmulationUnavailable"]

"""Torch-only algorithms: the math and the communication. Nothing in this package imports Lightning.

Grouped by concern, as torch's ``distributed/algorithms`` is (``ddp_comm_hooks/``, ``model_averaging/``):

* ``compression/``: the ``Compressor`` every strategy's collectives share, its codecs, the compressing DDP comm hook
  and 1-bit Adam;
* ``averaging/``: averages of replicas launched in the background and applied late (``hier_sync``'s delayed
  averaging, ``async_ssp``'s rounds) and the outer optimizer both use;
* ``ssp/``: per-step bounded staleness (the SSP exchange, stale-gradient compensation, claimed batches);
* ``batching/``: per-rank batch sizes (the balancer, its sampler, the gradient noise scale).

What every concern uses stays at the top: ``topology`` (which ranks form a node), ``stats`` (the per-step record),
``costmodel``, ``watchdog``, ``switch_policy``, ``comm_hooks`` and ``fsdp_comm`` (measured collectives), ``streams``
(side streams, device waits) and the private ``_comm`` (every collective, put on the wire's device) and ``_flat``.
"""

from lightning_syncasync.algorithms.comm_hooks import MeasuredAllReduce
from lightning_syncasync.algorithms.stats import StatsRecorder, StepStats
from lightning_syncasync.algorithms.topology import Topology

__all__ = ["MeasuredAllReduce", "StatsRecorder", "StepStats", "Topology"]

"""Per-step asynchronous training with bounded staleness: the SSP exchange of updates (``SSPExchange``), stale-gradient
compensation (``StaleGradientCompensation``) and the batches the ranks claim from a shared epoch
(``ClaimingBatchSampler``).

``from lightning_syncasync.algorithms.ssp import SSPExchange`` keeps working from when this was one module.
"""

from lightning_syncasync.algorithms.ssp.claim_sampler import ClaimingBatchSampler
from lightning_syncasync.algorithms.ssp.compensation import StaleGradientCompensation
from lightning_syncasync.algorithms.ssp.exchange import ApplyFn, SSPExchange, SSPStats

__all__ = ["ApplyFn", "ClaimingBatchSampler", "SSPExchange", "SSPStats", "StaleGradientCompensation"]

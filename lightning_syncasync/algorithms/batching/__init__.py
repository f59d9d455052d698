"""Per-rank batch sizes: the split of a global batch by measured speed (``BatchBalancer``), the sampler that serves
it (``VariableBatchSampler``), and the gradient noise scale that says how large a batch still pays
(``GradientNoiseScale``).

``from lightning_syncasync.algorithms.batching import BatchBalancer`` keeps working from when this was one module.
"""

from lightning_syncasync.algorithms.batching.balancer import BatchBalancer
from lightning_syncasync.algorithms.batching.batch_sampler import VariableBatchSampler
from lightning_syncasync.algorithms.batching.noise_scale import GradientNoiseScale

__all__ = ["BatchBalancer", "GradientNoiseScale", "VariableBatchSampler"]

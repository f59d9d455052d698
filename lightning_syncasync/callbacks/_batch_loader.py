"""How :class:`~lightning_syncasync.callbacks.adaptive_batch.AdaptiveBatchSize` takes the training loader over.

Lightning hands every dataloader to the strategy's ``process_dataloader`` (:func:`patch_process_dataloader` routes
the training one through the callback); the callback then reads the global batch the loader implies
(:func:`global_batch_of`), the nodes whose share of it is fixed (:func:`node_groups`) and the split to start from
(:func:`initial_sizes`), and rebuilds the loader around a ``VariableBatchSampler``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader, IterableDataset

from lightning_syncasync.algorithms.batching.balancer import BatchBalancer
from lightning_syncasync.algorithms.topology import Topology


def patch_process_dataloader(trainer: pl.Trainer, replace: Callable[[DataLoader], DataLoader]) -> Callable[[], None]:
    """Hand the training loader to ``replace`` wherever the strategy processes it; return the undo."""
    # Lightning hands every dataloader to `strategy.process_dataloader` right after injecting its
    # DistributedSampler and before measuring the loader's length and starting the fetcher: the one point where
    # the training loader can be replaced for any strategy, including on `reload_dataloaders_every_n_epochs`.
    strategy = trainer.strategy
    original = strategy.process_dataloader

    def process_dataloader(dataloader: object) -> object:
        dataloader = original(dataloader)
        if trainer.training and isinstance(dataloader, DataLoader):
            dataloader = replace(dataloader)
        return dataloader

    strategy.process_dataloader = process_dataloader  # type: ignore[method-assign]

    def unpatch() -> None:
        if strategy.__dict__.get("process_dataloader") is process_dataloader:
            del strategy.process_dataloader

    return unpatch


def global_batch_of(loader: DataLoader, world: int, global_batch: int | None) -> int:
    """The samples per step over all ranks (``global_batch`` when given), or why this loader's batches cannot be
    split by index."""
    dataset = loader.dataset
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        raise TypeError(
            f"AdaptiveBatchSize needs a map-style dataset with __len__ to split each global batch by index; "
            f"{type(dataset).__name__} is iterable. Use a map-style dataset, or drop AdaptiveBatchSize (an "
            "iterable dataset decides batch composition itself)"
        )
    if global_batch is not None:
        return global_batch
    if loader.batch_size is not None:
        return loader.batch_size * world
    raise ValueError(
        "the training DataLoader has a custom batch_sampler, so its batch size is unknown; pass "
        "AdaptiveBatchSize(global_batch=...) with the samples per step over all ranks"
    )


def initial_sizes(balancer: BatchBalancer, restored: dict[str, Any] | None, given: list[int] | None) -> list[int]:
    """The split to start from: the checkpoint's (``restored``) if it fits this run, else the ``given`` one, else an
    even split."""
    if restored is not None:
        sizes = restored.get("sizes")
        if restored.get("global_batch") == balancer.global_batch and sizes and len(sizes) == balancer.world_size:
            return balancer.check(sizes)
        rank_zero_warn(
            f"AdaptiveBatchSize: the checkpoint's split {sizes} (global batch {restored.get('global_batch')}) "
            f"does not fit this run ({balancer.world_size} ranks, global batch {balancer.global_batch}); "
            "starting from an even split"
        )
    if given is not None:
        return balancer.check(given)
    return balancer.even_split()


def node_groups(strategy: object) -> list[list[int]] | None:
    """The ranks of each node when the strategy averages across nodes on its own (``hier_sync``), else ``None``."""
    topology = getattr(strategy, "topology", None)
    return topology.all_nodes() if isinstance(topology, Topology) and topology.num_nodes > 1 else None

"""Rebuilding a training ``DataLoader`` around another batch sampler, keeping everything else the user set."""

from __future__ import annotations

from typing import Any

from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, SequentialSampler


def loader_kwargs(loader: DataLoader) -> dict[str, Any]:
    """The arguments of ``loader`` a rebuilt loader keeps (all but the dataset and how batches are formed)."""
    kwargs: dict[str, Any] = {
        "num_workers": loader.num_workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": loader.pin_memory,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "generator": loader.generator,
        "persistent_workers": loader.persistent_workers,
        "pin_memory_device": loader.pin_memory_device,
    }
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    return kwargs


def sampling_order(sampler: object, who: str, seed: int | None = None) -> tuple[bool, int]:
    """``(shuffle, seed)`` of the sampler Lightning put in the loader, which a replacement must reproduce."""
    if isinstance(sampler, DistributedSampler) and type(sampler) is DistributedSampler:
        return sampler.shuffle, sampler.seed if seed is None else seed
    if isinstance(sampler, RandomSampler):
        return True, 0 if seed is None else seed
    if isinstance(sampler, SequentialSampler):
        return False, 0 if seed is None else seed
    raise ValueError(
        f"{who} replaces the training sampler and cannot reproduce a {type(sampler).__name__} (a custom sampler, "
        "which Lightning wraps); use shuffle=True/False in the DataLoader instead of a custom sampler"
    )

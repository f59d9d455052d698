"""``VariableBatchSampler``: every rank takes its own-sized slice of the same global batch.

Lightning's ``DistributedSampler`` injection gives each rank a fixed 1/N of the epoch and a fixed batch size. With
unequal per-rank batches that breaks: ranks would run out of data at different steps. Here all ranks draw the same
epoch permutation (seeded by ``seed`` and the epoch, like ``DistributedSampler``) and, for each global step, the next
``B`` indices of it are cut into consecutive slices of sizes ``b_0..b_{N-1}``; rank ``i`` yields slice ``i``. Every
sample is seen exactly once per epoch (the last step is smaller when ``B`` does not divide the dataset, unless
``drop_last``), and every rank has the same number of steps per epoch.

Splits change while the data loader runs ahead of training (worker prefetching, Lightning's own one-batch lookahead),
so a new split is scheduled from a *sampler step* (a count of batches handed out, across epochs) that no rank has
produced yet; all ranks use the same schedule, so at every step the slices still tile the global batch exactly.

The sampler also remembers, for every batch it handed out and training has not consumed yet, ``(b_i, B_step)``:
what the gradient of that batch must be weighted by (``b_i / B_step``) for the synchronous update to equal the
single-process update on the same ``B_step`` samples.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import Sampler


class VariableBatchSampler(Sampler[list[int]]):
    """Batch sampler that gives rank ``rank`` its slice of each global batch (see the module docstring).

    Args:
        dataset_len: number of samples in the dataset.
        rank: this rank.
        sizes: initial per-rank batch sizes (their sum is the global batch, kept fixed).
        shuffle: draw a new permutation each epoch (seeded by ``seed + epoch``) instead of the dataset order.
        seed: permutation seed; must be the same on every rank.
        drop_last: drop the last, smaller global batch of an epoch instead of splitting it.
        stream: for a global batch that may grow (``set_sizes(..., resize=True)``): every epoch has the number of
            steps announced at construction (Lightning fixes an epoch's length, and schedules validation on it,
            when the loader is set up), and indices come from a stream of passes over the data, each a fresh
            permutation; every sample is seen once per *pass*, and with a grown batch an epoch spans more than one.

    Example::

        sampler = VariableBatchSampler(len(dataset), rank=dist.get_rank(), sizes=[3, 5, 8, 16])
        loader = DataLoader(dataset, batch_sampler=sampler)
    """

    def __init__(
        self,
        dataset_len: int,
        rank: int,
        sizes: Sequence[int],
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        stream: bool = False,
    ) -> None:
        sizes = [int(s) for s in sizes]
        if not sizes or min(sizes) < 1:
            raise ValueError(f"sizes must be >= 1 for every rank, got {sizes}")
        if not 0 <= rank < len(sizes):
            raise ValueError(f"rank {rank} is not in 0..{len(sizes) - 1} (one size per rank: {sizes})")
        if dataset_len < 1:
            raise ValueError(f"dataset_len must be >= 1, got {dataset_len}")
        if drop_last and dataset_len < sum(sizes):
            raise ValueError(
                f"drop_last with a global batch of {sum(sizes)} > {dataset_len} samples leaves no step; lower the "
                "batch size or set drop_last=False"
            )
        self.dataset_len = dataset_len
        self.rank = rank
        self.world_size = len(sizes)
        self.global_batch = sum(sizes)
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.stream = stream
        self._steps_per_epoch = self._steps(sum(sizes))
        self._pass = 0  # stream mode: passes over the data started so far, and the position in the current one
        self._order: list[int] = []
        self._pos = 0
        self.epoch = 0
        self.produced = 0  # batches handed out since creation, across epochs: the clock of the schedule
        self._schedule: list[tuple[int, list[int]]] = [(0, sizes)]
        # (b_i, B_step) of batches handed out and not yet consumed, oldest first (see the module docstring).
        self.issued: deque[tuple[int, int]] = deque()

    @property
    def sizes(self) -> list[int]:
        """The split of the most recently scheduled change (what new batches use once it takes effect)."""
        return list(self._schedule[-1][1])

    def sizes_at(self, step: int) -> list[int]:
        """The split in force at sampler step ``step``."""
        current = self._schedule[0][1]
        for start, sizes in self._schedule:
            if start > step:
                break
            current = sizes
        return list(current)

    def set_sizes(self, sizes: Sequence[int], from_step: int | None = None, resize: bool = False) -> int:
        """Use ``sizes`` from sampler step ``from_step`` on (default: the next batch); return that step.

        All ranks must schedule the same change at the same step; it must not be one this sampler already produced.
        The sizes must sum to the current global batch unless ``resize`` (an explicit change of the global batch,
        e.g. growing it by the gradient noise scale); epochs then have fewer, larger steps.
        """
        sizes = [int(s) for s in sizes]
        total = sum(sizes) if resize else self.global_batch
        if len(sizes) != self.world_size or sum(sizes) != total or min(sizes) < 1:
            raise ValueError(
                f"a new split must have {self.world_size} sizes >= 1 summing to the global batch "
                f"{self.global_batch}, got {sizes}"
            )
        if self.drop_last and total > self.dataset_len:
            raise ValueError(f"drop_last with a global batch of {total} > {self.dataset_len} samples leaves no step")
        start = self.produced if from_step is None else int(from_step)
        if start < self.produced:
            raise ValueError(f"step {start} was already produced (next is {self.produced}); schedule a later one")
        self._schedule = [(s, z) for s, z in self._schedule if s < start] + [(start, sizes)]
        self.global_batch = total
        # Drop entries nobody can use any more (all but the last one at or before the next step).
        while len(self._schedule) > 1 and self._schedule[1][0] <= self.produced:
            self._schedule.pop(0)
        return start

    def set_epoch(self, epoch: int) -> None:
        """Called by Lightning at each epoch start: a new permutation (same on every rank)."""
        self.epoch = epoch

    @property
    def sampler(self) -> VariableBatchSampler:
        # Lightning's epoch hook calls ``loader.batch_sampler.sampler.set_epoch(epoch)``, not the batch sampler's:
        # without this every epoch reused epoch 0's permutation.
        return self

    def _steps(self, global_batch: int) -> int:
        if self.drop_last:
            return self.dataset_len // global_batch
        return math.ceil(self.dataset_len / global_batch)

    def __len__(self) -> int:
        return self._steps_per_epoch if self.stream else self._steps(self.global_batch)

    def _permutation(self, key: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.dataset_len))
        g = torch.Generator()
        g.manual_seed(self.seed + key)
        return torch.randperm(self.dataset_len, generator=g, device="cpu").tolist()

    def __iter__(self) -> Iterator[list[int]]:
        # A new pass: batches prefetched by an abandoned iterator will never reach training.
        self.issued.clear()
        if self.stream:
            yield from self._iter_stream()
            return
        order = self._permutation(self.epoch)
        pos = 0
        while pos < self.dataset_len:
            sizes = self.sizes_at(self.produced)
            step_batch = sum(sizes)  # the global batch in force for this step (it only changes on request)
            if self.drop_last and self.dataset_len - pos < step_batch:
                break
            chunk = order[pos : pos + step_batch]
            pos += step_batch
            if len(chunk) < step_batch:
                sizes = _shrink(sizes, len(chunk))
                if len(chunk) < self.world_size:
                    # Fewer samples left than ranks: every rank still needs one, so wrap around to the start of the
                    # permutation (as DistributedSampler pads); those few samples are seen twice this epoch.
                    chunk = chunk + order[: self.world_size - len(chunk)]
            start = sum(sizes[: self.rank])
            mine = chunk[start : start + sizes[self.rank]]
            self.produced += 1
            self.issued.append((len(mine), sum(sizes)))
            yield mine

    def _iter_stream(self) -> Iterator[list[int]]:
        for _ in range(self._steps_per_epoch):
            sizes = self.sizes_at(self.produced)
            chunk: list[int] = []
            while len(chunk) < sum(sizes):
                if self._pos >= len(self._order):
                    self._order, self._pos = self._permutation(self._pass), 0
                    self._pass += 1
                take = self._order[self._pos : self._pos + sum(sizes) - len(chunk)]
                self._pos += len(take)
                chunk += take
            start = sum(sizes[: self.rank])
            self.produced += 1
            self.issued.append((sizes[self.rank], sum(sizes)))
            yield chunk[start : start + sizes[self.rank]]


def _shrink(sizes: list[int], total: int) -> list[int]:
    """Split a last, smaller global batch of ``total`` samples in the proportions of ``sizes`` (each rank >= 1)."""
    n = len(sizes)
    if total <= n:
        return [1] * n
    full = sum(sizes)
    target = [s * total / full for s in sizes]
    out = [max(1, math.floor(t)) for t in target]
    order = sorted(range(n), key=lambda i: target[i] - out[i], reverse=True)
    k = 0
    while sum(out) < total:
        out[order[k % n]] += 1
        k += 1
    while sum(out) > total:
        i = max((i for i in range(n) if out[i] > 1), key=lambda i: out[i] - target[i])
        out[i] -= 1
    return out

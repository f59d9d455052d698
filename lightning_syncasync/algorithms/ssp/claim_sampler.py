"""``ClaimingBatchSampler``: the ranks claim the batches of a shared epoch from a counter in the torch store, so a
faster rank trains on more of them (the work sharing of asynchronous training, as workers of a parameter server pull
data at their own pace).

Why: with Lightning's ``DistributedSampler`` every rank has the same number of batches per epoch, so under a
persistently slower rank the fast ranks finish their share early and wait for it at every epoch end (validation, a
consistent cut): asynchronous training could then never beat the slow rank's pace. Here all ranks draw the same
epoch permutation (seeded by ``seed`` and the epoch, like ``DistributedSampler``), cut it into batches, and:

* batch ``r`` of every epoch is reserved for rank ``r``, so every rank trains at least one batch in every epoch
  (Lightning runs epoch ends and their validation on every rank; a rank with an empty epoch would skip them);
* the other batches go to whoever asks first: ``store.add(key, 1)`` is atomic, so each is claimed exactly once.

Every sample is trained once per epoch, by one rank. ``budget`` (batches over all ranks, e.g. ``max_steps x world``,
the samples DDP would see) ends training: the claims stop at the budget, every rank finishes the epoch it is in,
and :attr:`exhausted` says so, identically on every rank (it depends only on the epoch and the shared counter). The
reserved batches of the last epoch may overshoot the budget by at most ``world - 1`` batches.

With ``pace`` (each rank's seconds per batch, e.g. from the asynchronous exchange's round metadata), a straggler
stops claiming near an epoch's end when the others would drain the queue before it finished one more batch: the
epoch then ends when the fast ranks are done, instead of their waiting for the straggler's last batch at the epoch
end (a consistent cut when validation follows). At most ``world - 1`` ranks may hand over an epoch's tail (a second
store counter decides), so one rank always drains the queue and no batch is left untrained.

With a ``budget`` (training continues past this epoch), a rank whose epoch queue is empty while another rank is
still in the epoch (a paused rank finishing its batch) does not idle at the epoch end: it trains batches of the
*next* epoch's queue (``borrow``) until every rank has arrived, then ends the epoch. The next epoch's counter already
holds those claims, so each sample is still trained once per epoch; the epoch end (and its consistent cut) then
costs about the last arrival's own batch instead of every rank waiting for it. A straggler (``tail_ratio``) does not
borrow: its batch would keep the others waiting.

:attr:`position` is the claim number of the batch this rank last drew, counted over all ranks and epochs: the
training's global progress in batches (what a learning-rate schedule should follow when ranks step at different
rates).

With ``lockstep`` (a synchronous warm-up of that many steps per rank, ranks averaging gradients every step), the
first ``lockstep`` batches of every rank are dealt in turn instead (rank ``r`` trains batches ``r, r + world, ...`` of
each epoch, as ``DistributedSampler`` does): every rank then takes the same number of steps until the warm-up's last,
so no rank's collective ever waits for a peer that ran out of batches. An epoch wholly inside the warm-up drops its
last ``batches % world`` batches (``DistributedSampler(drop_last=True)``); the claims (and the hand-over and borrowing)
start after the warm-up, at the next undealt batch of the epoch it ends in. The reserved batch above is the case of
one dealt batch.

The sampler has no ``__len__``: an epoch's length on a rank is only known at its end, so Lightning treats the loader
as of unknown length and validates at epoch ends.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import Sampler


class ClaimingBatchSampler(Sampler[list[int]]):
    """Batch sampler whose batches are claimed by the ranks from a shared counter (see the module docstring).

    Args:
        dataset_len: number of samples in the dataset.
        batch_size: samples per batch (per rank and step).
        rank, world: this rank and the number of ranks sharing the epoch.
        store: a ``torch.distributed`` store every rank reaches (e.g. a ``PrefixStore`` over the default one).
        shuffle: a new permutation each epoch (seeded by ``seed + epoch``) instead of the dataset order.
        seed: permutation seed; the same on every rank.
        drop_last: drop the last, smaller batch of an epoch.
        budget: batches over all ranks after which training ends (``None``: no limit, epochs run until Lightning's
            ``max_epochs``).
        pace: returns every rank's current seconds per batch (``None`` or zeros while unmeasured); enables the
            hand-over of an epoch's tail by a rank slower than ``tail_ratio`` x the fastest other rank.
        tail_ratio: how much slower than the fastest other rank a rank must be before it may hand over (> 1, so
            ranks of equal speed never do: they would only trade who waits).
        borrow: train batches of the next epoch while another rank is still in this one (needs ``budget``).
        lockstep: batches of every rank dealt in turn before any is claimed (a synchronous warm-up's steps, >= 0).

    Example::

        sampler = ClaimingBatchSampler(len(ds), 128, dist.get_rank(), dist.get_world_size(), store, budget=480)
        loader = DataLoader(ds, batch_sampler=sampler)
    """

    def __init__(
        self,
        dataset_len: int,
        batch_size: int,
        rank: int,
        world: int,
        store: Any,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        budget: int | None = None,
        pace: Callable[[], Sequence[float] | None] | None = None,
        tail_ratio: float = 1.25,
        borrow: bool = True,
        lockstep: int = 0,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}; HINT: the DataLoader's batch_size per rank")
        if not 0 <= rank < world:
            raise ValueError(f"rank must be in [0, world={world}), got {rank}")
        if budget is not None and budget < 1:
            raise ValueError(
                f"budget must be >= 1 batch or None, got {budget}; HINT: max_steps x world, or None for no limit"
            )
        if not tail_ratio > 1.0:
            raise ValueError(
                f"tail_ratio must be > 1, got {tail_ratio}; HINT: 1.25 lets only a rank 25% slower than the fastest "
                "hand over an epoch's tail"
            )
        if not isinstance(lockstep, int) or lockstep < 0:
            raise ValueError(f"lockstep must be an integer >= 0, got {lockstep!r}; HINT: 0 claims every batch but one")
        self.dataset_len = dataset_len
        self.batch_size = batch_size
        self.rank = rank
        self.world = world
        self.store = store
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.budget = budget
        self.pace = pace
        self.tail_ratio = tail_ratio
        self.borrow = borrow
        self.lockstep = lockstep
        full, rest = divmod(dataset_len, batch_size)
        self.batches_per_epoch = full + (1 if rest and not drop_last else 0)
        if self.batches_per_epoch < world:
            raise ValueError(
                f"an epoch has {self.batches_per_epoch} batches of {batch_size} for {world} ranks: every rank needs "
                "at least one batch per epoch. HINT: lower the batch size or use fewer ranks"
            )
        self.epoch = 0
        self.exhausted = False
        self.claimed = 0  # batches this rank trained on (over all epochs)
        self.position = 0  # claim number (over all ranks and epochs) of the batch this rank last drew, plus one
        self.handed_over = 0  # epochs whose tail this rank left to faster ranks
        self.borrowed = 0  # batches of a next epoch this rank trained while waiting for the others at an epoch end

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    @property
    def sampler(self) -> ClaimingBatchSampler:
        # Lightning's epoch hook calls ``loader.batch_sampler.sampler.set_epoch(epoch)``, not the batch sampler's.
        return self

    def _batches(self, epoch: int | None = None) -> list[list[int]]:
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + (self.epoch if epoch is None else epoch))
            order = torch.randperm(self.dataset_len, generator=g, device="cpu").tolist()
        else:
            order = list(range(self.dataset_len))
        return [order[i * self.batch_size : (i + 1) * self.batch_size] for i in range(self.batches_per_epoch)]

    def dealt(self, epoch: int) -> int:
        """Batches of each rank dealt in turn in ``epoch`` (at least the reserved one; module docstring)."""
        per_rank = self.batches_per_epoch // self.world  # an epoch wholly in the warm-up: every rank's share
        return max(1, min(per_rank, self.lockstep - epoch * per_rank))

    def _in_lockstep_after(self, epoch: int) -> bool:
        """Whether the warm-up goes on past ``epoch``: it then has no claims and the next epoch no borrowing."""
        return self.lockstep > (epoch + 1) * (self.batches_per_epoch // self.world)

    def __iter__(self) -> Iterator[list[int]]:
        batches = self._batches()
        per_epoch = self.batches_per_epoch
        start = self.epoch * per_epoch  # batches every earlier epoch used up (each ran until its queue was empty)
        key = f"claim/e{self.epoch}"
        # The budget counts claims in order, so a batch is trained iff its claim number is below it.
        dealt = self.dealt(self.epoch)
        for i in range(dealt):  # the first is reserved: every rank trains at least once per epoch
            index = self.rank + i * self.world
            if i and self.budget is not None and start + index >= self.budget:
                break
            self.claimed += 1
            self.position = start + index + 1
            yield batches[index]
        if self._in_lockstep_after(self.epoch):
            self.exhausted = self.budget is not None and start + per_epoch >= self.budget
            return  # the warm-up goes on in the next epoch, dealt as well; this epoch's remainder is dropped
        while not self._hand_over(key, start):
            index = self.world * dealt + int(self.store.add(key, 1)) - 1
            if index >= per_epoch or (self.budget is not None and start + index >= self.budget):
                break
            self.claimed += 1
            self.position = start + index + 1
            yield batches[index]
        # Every rank ends this epoch; whether training is over depends only on the epoch and the budget (the claims
        # stop at the budget, so the epoch it falls in is the last), never on where this rank stopped claiming.
        self.exhausted = self.budget is not None and start + per_epoch >= self.budget
        yield from self._borrow(start + per_epoch)

    def _borrow(self, next_start: int) -> Iterator[list[int]]:
        """Batches of the next epoch's queue while another rank has not reached this epoch's end (module docstring)."""
        arrived_key = f"arrived/e{self.epoch}"
        arrived = int(self.store.add(arrived_key, 1))
        if not self.borrow or self.budget is None or self._straggler() is not None:
            return
        key, batches, dealt = f"claim/e{self.epoch + 1}", None, self.dealt(self.epoch + 1)
        while arrived < self.world:
            index = self.world * dealt + int(self.store.add(key, 1)) - 1
            if index >= self.batches_per_epoch or next_start + index >= self.budget:
                return  # the next epoch is used up (or the budget): nothing left to borrow
            batches = batches or self._batches(self.epoch + 1)
            self.claimed += 1
            self.borrowed += 1
            self.position = next_start + index + 1
            yield batches[index]
            arrived = int(self.store.add(arrived_key, 0))

    def _straggler(self) -> tuple[float, list[float]] | None:
        """``(this rank's seconds per batch, the others')`` when this rank is ``tail_ratio`` slower than the fastest
        other rank, else ``None`` (also while unmeasured)."""
        times = self.pace() if self.pace is not None else None
        if times is None or len(times) != self.world:
            return None
        mine = float(times[self.rank])
        others = [float(t) for r, t in enumerate(times) if r != self.rank and t > 0]
        if mine <= 0 or not others or mine < self.tail_ratio * min(others):
            return None
        return mine, others

    def _hand_over(self, key: str, start: int) -> bool:
        """Whether this rank stops claiming and leaves the rest of the epoch to the others: it is a straggler
        (``tail_ratio``) and the others would drain what is left before it finished one more batch."""
        slow = self._straggler()
        if slow is None:
            return False
        mine, others = slow
        end = self.batches_per_epoch if self.budget is None else min(self.batches_per_epoch, self.budget - start)
        # Unclaimed batches (add 0 reads the counter; the first world x dealt were dealt).
        left = end - self.world * self.dealt(self.epoch) - int(self.store.add(key, 0))
        if left <= 0 or mine <= left / sum(1.0 / t for t in others):
            return False  # nothing left to hand over, or this rank's next batch ends before the others drain the rest
        # At most world - 1 ranks hand over an epoch's tail: the last to ask is refused and drains the queue.
        if int(self.store.add(f"handover/e{self.epoch}", 1)) >= self.world:
            return False
        self.handed_over += 1
        return True

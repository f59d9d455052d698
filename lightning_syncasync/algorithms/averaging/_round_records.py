"""One round of :class:`~lightning_syncasync.algorithms.averaging.rounds.RoundExchange`, as data: the layout of its
metadata (per rank, then two counts over ranks), the round in flight (``_Round``), and what the rounds did
(``RoundStats``)."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

# Metadata per rank in a round: local steps, samples, mean step time (s), end time (wall clock, s since the
# exchange's time origin), and the duration of the rank's last completed exchange of pseudo-gradients (s, on the
# exchange thread, after the metadata all-reduce lined the ranks up: the link's time, not a wait for a late peer).
# After them two counts over ranks: the ranks that flag a cut, and the clean ones (nothing changed on them since the
# last cut).
_FIELDS = 5


@dataclass
class _Round:
    index: int
    delta: torch.Tensor  # this rank's pseudo-gradient (its exact local progress over the round)
    future: Future[tuple[torch.Tensor, torch.Tensor, int]]  # (G, metadata, bytes sent)
    launched_at: float


@dataclass
class RoundStats:
    """What the rounds did (also fed to the ``StatsRecorder``)."""

    rounds: int = 0  # rounds delivered and applied
    local_steps: list[int] = field(default_factory=list)  # this rank's local steps in each round it ended
    lags: list[int] = field(default_factory=list)  # rounds launched since a round, when it was applied
    wait_s: float = 0.0  # time the training loop blocked on the staleness bound
    round_s: list[float] = field(default_factory=list)  # the decided round length, per dynamic round
    exchange_s: list[float] = field(default_factory=list)  # the slowest rank's exchange time, per delivered round
    catch_up: int = 0  # rounds ended with no step by a rank that was behind the others (it was paused)


def _count(meta: torch.Tensor, world: int, which: int) -> int:
    """One of a round's counts over ranks: ``0`` the ranks that flag a cut, ``1`` the clean ones."""
    return int(round(float(meta[world * _FIELDS + which])))

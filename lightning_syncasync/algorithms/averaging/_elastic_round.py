"""One round of :class:`~lightning_syncasync.algorithms.averaging.elastic.ElasticRounds`, as data: the layout of its
header (summed over the replica groups), the round in flight (``_Flight``), and what the rounds did
(``ElasticStats``)."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

# The header of a round, summed over the groups: contributing groups, present groups, the model's size, its
# fingerprint, summed step times (s) and the number of groups that measured one, samples, groups ending their fit.
_HEADER = 9
_STOPPING = 7
_COMPRESSED = 8  # groups that ask for a compressed body (every group present must, or the round is exact)


@dataclass
class ElasticStats:
    """What the rounds did (per rank)."""

    committed: int = 0  # rounds committed and applied here
    failed: int = 0  # rounds not committed (their progress carried into the next)
    participants: list[int] = field(default_factory=list)  # groups present in each committed round
    committed_at: list[float] = field(default_factory=list)  # wall clock (time.time()) of each commit
    heals: int = 0  # times this group took a live peer's state
    healed_at: float | None = None  # wall clock of the last heal
    joined_at: float | None = None  # wall clock when join() began (a joiner's wait for the others' round starts)
    samples_committed: int = 0  # this group's samples in committed rounds (this rank's view)
    samples_discarded: int = 0  # this group's samples dropped by a heal (its progress replaced by the quorum's)
    wait_s: float = 0.0  # the training loop's time blocked on rounds (its parts: wait_exchange_s + the main thread's)
    # Where a round's time goes, summed over the rounds (s). On the exchange thread with staleness=1, overlapped with
    # the next round's steps: torchft's quorum, the header's and the body's all-reduces, torchft's vote
    # (should_commit: a call to the node's manager server and a barrier over the node's ranks). On the training loop:
    # waiting for a round's exchange to end (what of the above the steps did not hide), the node's heal check (at
    # torchft step 0 only), and applying the round (the outer step, the node's all-gather, the copy into the model).
    quorum_s: float = 0.0
    header_s: float = 0.0
    body_s: float = 0.0
    vote_s: float = 0.0
    wait_exchange_s: float = 0.0
    heal_check_s: float = 0.0
    apply_s: float = 0.0
    # (torchft step after the commit, groups present, groups contributing, this group's samples) per committed round
    history: list[tuple[int, int, int, int]] = field(default_factory=list)
    # (the torchft step the round commits as if it commits, this group's samples) per round launched
    launches: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class _Flight:
    delta: torch.Tensor  # this rank's shard of the group's pseudo-gradient
    samples: int
    payload: torch.Tensor  # header + body, summed over the groups once the future is done
    future: Future[tuple[bool, bool]]  # (the header agreed and the body was exchanged, torchft's vote)
    launched_at: float
    first: bool = False  # launched at torchft step 0, where the ranks of a group may disagree about healing
    owed: torch.Tensor | None = None  # delta plus this group's compression residual: what it sends this round
    kept: torch.Tensor | None = None  # a compressed round's new residual (taken if the round commits)
    vote_error: BaseException | None = None  # should_commit raised (the main thread re-raises it)
    phases: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)  # quorum, header, body, vote (s)


def _agrees(header: torch.Tensor, numel: int, fingerprint: int) -> bool:
    """Whether every group present sent the same model size and fingerprint (sums over the groups)."""
    present = float(header[1])
    return present > 0 and float(header[2]) == present * numel and float(header[3]) == present * fingerprint

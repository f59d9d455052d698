"""What a round-level strategy says about its round length: the decision at setup and at each change (logged on
rank 0), the one warning of a pinned length that is link-bound or of a link too slow for any length, and the line in
``SyncMonitor``'s summary. The decision itself is :class:`~lightning_syncasync.algorithms.averaging.RoundLength`'s."""

from __future__ import annotations

from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_syncasync.algorithms.averaging.round_length import RoundLength


def round_length(local_steps: int | None, overlap: float, min_steps: int) -> RoundLength:
    """The policy for a strategy's setting: ``None`` decided from the link, an integer pinned. ``overlap`` is the
    staleness bound; synchronous rounds (0) count as 1, as ``RoundExchange`` counts them: the round's own compute is
    what its exchange is weighed against."""
    return RoundLength(fixed=local_steps, overlap=max(overlap, 1.0), min_steps=min(min_steps, local_steps or min_steps))


class RoundLengthReport:
    """Reports one :class:`RoundLength`'s decisions as they are made; call :meth:`poll` after each step (cheap)."""

    def __init__(self, length: RoundLength, who: str) -> None:
        self.length, self.who = length, who
        self._seen = 0
        rank_zero_info(f"{who}: {length.describe()}")

    def poll(self) -> None:
        decisions = self.length.decisions
        if len(decisions) > self._seen:
            for d in decisions[self._seen :]:
                rank_zero_info(f"{self.who}: round length now {d.describe()}")
            self._seen = len(decisions)
        if self.length.warning is not None:
            warning = self.length.take_warning()
            rank_zero_warn(f"{self.who}: {warning}")

    def note(self) -> str:
        """The summary's line."""
        changes = len(self.length.decisions)
        return f"{self.who} round length: {self.length.describe()}; {changes} decision(s) from measurements"

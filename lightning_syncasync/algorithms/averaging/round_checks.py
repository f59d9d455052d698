"""The checks of :class:`~lightning_syncasync.algorithms.averaging.rounds.RoundExchange`: its settings
(``check_rounds``, which the strategies call at construction), and the two ways a round ends early: a non-finite loss
(``NonFiniteRoundError``, before the round's pseudo-gradient leaves the rank) and a stop requested while the loop
waits for a round (``RoundsStopped``)."""

from __future__ import annotations

__all__ = ["NonFiniteRoundError", "RoundsStopped", "check_rounds"]


def check_rounds(local_steps: int | None, staleness: int | None, round_s: float | None) -> None:
    """Validate round settings (the strategy checks them at construction, before any process starts).
    ``local_steps=None`` is a length decided from the measured link (:class:`RoundLength`)."""
    if local_steps is not None and (
        not isinstance(local_steps, int) or isinstance(local_steps, bool) or local_steps < 1
    ):
        raise ValueError(
            f"local_steps must be an integer >= 1 or None, got {local_steps!r}; HINT: None (the default) decides the "
            "round length from the measured step and exchange times, 1 exchanges a gradient every step (per-step async)"
        )
    if staleness is None or not isinstance(staleness, int) or staleness < 0:
        raise ValueError(
            f"staleness must be an integer >= 0 with local_steps > 1 (rounds in flight), got {staleness!r}; HINT: 0 "
            "is synchronous rounds, 1 overlaps each round's exchange with the next round's steps"
        )
    if round_s is not None and not round_s > 0:
        raise ValueError(
            f"round_s must be > 0 seconds or None (local_steps x the measured step time), got {round_s!r}; "
            "HINT: leave it None"
        )


class RoundsStopped(Exception):  # noqa: N818 - a request, not an error
    """A stop was requested (``should_stop``) while the loop waited for round ``index``: the rounds in flight are
    dropped; the caller ends the fit (a SIGTERM)."""

    def __init__(self, index: int) -> None:
        super().__init__(f"stop requested while waiting for round {index}; the rounds in flight are dropped")
        self.index = index


class NonFiniteRoundError(FloatingPointError):
    """A local step of round ``index`` had a non-finite loss (:meth:`RoundExchange.note_loss`); the round was not
    launched, so its pseudo-gradient never reached another rank."""

    def __init__(self, index: int) -> None:
        super().__init__(f"a loss of round {index} was not finite")
        self.index = index

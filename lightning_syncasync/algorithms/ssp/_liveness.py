"""Liveness of the other ranks for :class:`~lightning_syncasync.algorithms.ssp.exchange.SSPExchange` (``_Liveness``):
a heartbeat per rank through the torch store, and the :class:`~lightning_syncasync.algorithms.watchdog.PeerLostError`
that names the rank to blame, with its last known clock, when a wait outlasts ``timeout_s`` or a round fails."""

from __future__ import annotations

import threading
import time
from typing import Any

from lightning_syncasync.algorithms.watchdog import PeerLostError

_HEARTBEAT_S = 1.0


class _Liveness:
    """The liveness part of :class:`~lightning_syncasync.algorithms.ssp.exchange.SSPExchange` (which sets the
    attributes below in its constructor and runs :meth:`_heartbeat` on a thread of its own)."""

    timeout_s: float
    global_rank: int
    global_ranks: list[int]
    known_clocks: list[int]
    _store: Any
    _stop: bool
    _hb_stop: threading.Event
    _error: BaseException | None

    def _heartbeat(self) -> None:
        beat = 0
        while not self._stop and not self._hb_stop.is_set():
            beat += 1
            try:
                self._store.set(f"hb{self.global_rank}", str(beat))
            except Exception:  # noqa: BLE001 - the store's host died; the checks below name it
                return
            self._hb_stop.wait(_HEARTBEAT_S)

    def _silent_ranks(self) -> list[int]:
        """Ranks whose heartbeat did not advance over three heartbeat periods (rank 0 hosts the store)."""

        def beats() -> dict[int, bytes | None]:
            # check() first: get() on a key never set would block for the store's whole timeout.
            return {r: self._store.get(f"hb{r}") if self._store.check([f"hb{r}"]) else None for r in self.global_ranks}

        try:
            first = beats()
            time.sleep(3 * _HEARTBEAT_S)
            second = beats()
        except Exception:  # noqa: BLE001 - the store is hosted by rank 0's process
            return [self.global_ranks[0]]
        return [r for r in self.global_ranks if r != self.global_rank and first[r] == second[r]]

    def _suspects(self) -> str:
        """The ranks to blame, with their last known clocks: those whose heartbeat stopped (dead or frozen), else
        the slowest (its process is alive but stuck in its own code)."""
        clocks = {self.global_ranks[i]: c for i, c in enumerate(self.known_clocks)}
        silent = self._silent_ranks()
        if silent:
            return ", ".join(f"rank {r} (last clock {clocks.get(r)}, heartbeat stopped)" for r in silent)
        others = [r for r in clocks if r != self.global_rank]
        if not others:
            return "none"
        slowest = min(others, key=lambda r: clocks[r])
        return f"rank {slowest} (last clock {clocks[slowest]}, the slowest; heartbeat alive, so stuck, not dead)"

    def _lost(self, what: str) -> None:
        raise PeerLostError(
            f"rank {self.global_rank}: {what} longer than timeout_s={self.timeout_s:g}; lost peer: "
            f"{self._suspects()}. HINT: check that rank's log; resume from the last checkpoint"
        )

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise PeerLostError(
                f"rank {self.global_rank}: an exchange round failed ({err}); lost peer: {self._suspects()}"
            ) from err

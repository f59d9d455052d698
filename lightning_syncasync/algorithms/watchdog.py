"""Liveness of the ranks of a job: heartbeats through the rendezvous store, naming the rank that went silent.

Why this exists: a collective with a dead or frozen peer does not say who is gone. gloo reports a closed socket by
address, or nothing at all until the process group's timeout (Lightning's default: 30 minutes), and on gloo even
``ProcessGroup.abort`` does not release an operation that is already waiting (measured with torch 2.13: the waiting
all-reduce returned only when the peer process exited). A worker that was SIGKILLed, SIGSTOPped or cut off by the
network looks the same from the outside: it stops making progress. So every rank runs a heartbeat, and a rank whose
heartbeat stops for ``timeout_s`` is declared lost, by name, on every rank.

Design (torchft and torchelastic use the same idea, a store-based heartbeat beside the data path):

* Each rank increments ``<prefix>/hb/<rank>`` in the job's store every ``interval_s`` (``store.add``: one round
  trip, never blocks on a missing key) and reads the counters of up to ``watch`` other ranks (its ring successors),
  so the store load per rank is constant whatever the world size; every rank is watched by ``watch`` others.
* A watched counter that does not move for ``timeout_s`` makes the watcher publish ``<prefix>/lost`` (the first
  verdict wins: ``compare_set`` from empty) and every rank reads that key each round, so all ranks name the same
  lost rank, including ranks that do not watch it directly. A rank that ends normally publishes
  ``<prefix>/done/<rank>``, so a rank that finished first is never blamed.
* A store that stops answering for ``timeout_s`` (the host of the store died, or the link to it is cut) is itself a
  verdict: the store is hosted by rank 0 under Lightning's own launchers (the agent under torchrun).
* Store calls run on the heartbeat thread; the verdict is taken on a second thread, so a store call stuck behind a
  cut link (TCP retransmits, no error) cannot stop the judge.
* On a verdict, :attr:`lost` is set and ``on_lost(message)`` is called once, from the judge thread. What to do is
  the caller's choice; the Lightning callback ends the process after a grace period, since no collective can finish.

Key prefix: the restart count of torchelastic (``TORCHELASTIC_RESTART_COUNT``) is part of it, so a restarted job
never reads the heartbeats or verdicts of the attempt before.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

log = logging.getLogger(__name__)


class PeerLostError(RuntimeError):
    """A peer died, hung or became unreachable; the message names it."""


def check_settings(timeout_s: float, interval_s: float | None) -> float:
    """Validate the heartbeat settings (shared by :class:`Heartbeat` and the Lightning callback, which checks them at
    construction, before any process starts); returns the interval to use."""
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}; HINT: 30 ends a hung job within 35 s")
    if interval_s is not None and not 0 < interval_s < timeout_s:
        raise ValueError(f"interval_s must be in (0, timeout_s={timeout_s}), got {interval_s}; HINT: leave it unset")
    return min(1.0, timeout_s / 10) if interval_s is None else interval_s


@dataclass
class _Seen:
    value: int
    since: float  # monotonic time the value was first seen


class Heartbeat:
    """Store heartbeats of one rank, and the judge that names a silent rank.

    Args:
        store: the job's store (``torch.distributed`` ``Store``; Lightning's default process group store).
        rank: this rank.
        world_size: number of ranks.
        timeout_s: silence after which a rank (or the store) is declared lost.
        interval_s: heartbeat period (default ``min(1, timeout_s / 10)``).
        watch: how many other ranks this rank reads each round (its ring successors; default all, up to 8).
        on_lost: called once with the verdict's message, from the judge thread.
        prefix: key prefix (default ``syncasync/wd/<restart count>``).
        store_host: how to name the store's host in a verdict (default: rank 0, which hosts it under Lightning's
            own launchers).
    """

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        timeout_s: float = 60.0,
        interval_s: float | None = None,
        watch: int = 8,
        on_lost: Callable[[str], None] | None = None,
        prefix: str | None = None,
        store_host: str = "rank 0 (it hosts the rendezvous store)",
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        interval_s = check_settings(timeout_s, interval_s)
        if watch < 1:
            raise ValueError(f"watch must be >= 1, got {watch}; HINT: 8 keeps the store load small")
        self.store = store
        self.rank, self.world_size = rank, world_size
        self.timeout_s, self.interval_s = timeout_s, interval_s
        self.on_lost = on_lost
        self.prefix = prefix or f"syncasync/wd/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        self.store_host = store_host
        n = min(watch, world_size - 1)
        self.watched = [(rank + i) % world_size for i in range(1, n + 1)]
        self.lost: str | None = None
        self._seen: dict[int, _Seen] = {}
        self._done: set[int] = set()
        self._last_ok = time.monotonic()
        self._verdict: str | None = None  # published by some rank, read by the beat thread
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def _key(self, *parts: object) -> str:
        return "/".join([self.prefix, *map(str, parts)])

    def start(self) -> Heartbeat:
        if self._threads:
            return self
        self._stop.clear()
        self._last_ok = time.monotonic()
        self._beat_once()  # a first beat before anyone can judge this rank
        for target, name in ((self._beat_loop, "beat"), (self._judge_loop, "judge")):
            t = threading.Thread(target=target, name=f"syncasync-watchdog-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self, finished: bool = True) -> None:
        """Stop both threads; ``finished`` publishes that this rank ended normally (it is then never blamed)."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout=2 * self.interval_s + 1)
        self._threads = []
        if finished and self.lost is None:
            try:
                self.store.set(self._key("done", self.rank), "1")
            except Exception:  # noqa: BLE001 - a store gone at the end changes nothing
                pass

    # ----------------------------------------------------------------------------------------------- heartbeat side
    def _beat_once(self) -> None:
        self.store.add(self._key("hb", self.rank), 1)
        values = {r: int(self.store.add(self._key("hb", r), 0)) for r in self.watched}
        done = {r for r in self.watched if r not in self._done and self.store.check([self._key("done", r)])}
        verdict = None
        if self.store.check([self._key("lost")]):
            verdict = self.store.get(self._key("lost")).decode()
        now = time.monotonic()
        with self._lock:
            for r, v in values.items():
                seen = self._seen.get(r)
                if seen is None or seen.value != v:
                    self._seen[r] = _Seen(v, now)
            self._done |= done
            self._verdict = verdict
            self._last_ok = now

    def _beat_loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._beat_once()
            except Exception as err:  # noqa: BLE001 - the judge decides when silence becomes a verdict
                log.debug("heartbeat round failed: %s", err)

    # --------------------------------------------------------------------------------------------------- judge side
    def silent(self, at_least_s: float) -> list[tuple[int, float]]:
        """Watched ranks (not finished) whose heartbeat has not moved for ``at_least_s`` seconds, longest first.

        Silence counts only while the store answers (up to the last successful round): when the store itself goes
        quiet, every counter stops at once, and the store's host is the one to blame, not the peers."""
        with self._lock:
            out = [(r, self._last_ok - s.since) for r, s in self._seen.items() if r not in self._done]
        return sorted([x for x in out if x[1] >= at_least_s], key=lambda x: -x[1])

    def verdict(self, silence_s: float | None = None) -> str | None:
        """The published verdict, or this rank's own one after ``silence_s`` (default ``timeout_s``) of silence of
        a watched rank or of the store, or ``None`` while everyone is alive."""
        silence_s = self.timeout_s if silence_s is None else silence_s
        with self._lock:
            published, last_ok = self._verdict, self._last_ok
        if published is not None:
            return published
        quiet = time.monotonic() - last_ok
        if quiet > silence_s:
            return self.store_lost(quiet)
        silent = self.silent(silence_s)
        if silent:
            r, s = silent[0]
            return f"rank {r} is lost: no heartbeat for {s:.1f}s (killed, frozen or cut off; seen by rank {self.rank})"
        return None

    def blame(self, wait_s: float | None = None) -> str | None:
        """Who to name after a collective failed: the verdict if any, else the rank silent longest once it has
        been silent for three heartbeats (a killed rank stops at once), waiting up to ``wait_s`` for one;
        ``None`` if every watched rank is still alive by then."""
        deadline = time.monotonic() + (self.timeout_s if wait_s is None else wait_s)
        while True:
            v = self.verdict(3 * self.interval_s)
            if v is not None:
                return v
            if time.monotonic() >= deadline:
                return None
            time.sleep(self.interval_s / 2)

    def publish(self, message: str) -> str | None:
        """Publish ``message`` unless another rank published first, and return the verdict that stands; ``None``
        when the store refused the call or did not answer within two heartbeats (a cut link: TCP retransmits, no
        error). Never blocks longer."""
        result: list[str | None] = [None]

        def call() -> None:
            try:
                got = self.store.compare_set(self._key("lost"), "", message)
                result[0] = got.decode() if isinstance(got, bytes) else str(got)
            except Exception as err:  # noqa: BLE001 - the store may be what is lost
                log.debug("publishing the verdict failed: %s", err)

        t = threading.Thread(target=call, name="syncasync-watchdog-publish", daemon=True)
        t.start()
        t.join(timeout=2 * self.interval_s)
        return result[0]

    def store_lost(self, quiet_s: float | None = None) -> str:
        """The verdict when the store itself cannot be reached (for ``quiet_s`` seconds, when known)."""
        since = "" if quiet_s is None else f" for {quiet_s:.1f}s"
        return (
            f"{self.store_host} is lost: the rendezvous store has not answered rank {self.rank}{since} (process gone, "
            "host down or link cut)"
        )

    def _judge_loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            v = self.verdict()
            if v is None:
                continue
            # A store gone by now does not make this rank's own verdict about a peer wrong: keep it.
            self.lost = (self.publish(v) or v) if v != self._verdict else v
            log.error("syncasync watchdog (rank %d): %s", self.rank, self.lost)
            if self.on_lost is not None:
                self.on_lost(self.lost)
            return

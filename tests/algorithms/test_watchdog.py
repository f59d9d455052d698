"""Heartbeat (the watchdog's algorithm) on a real in-process store, no Lightning: who is named, and when."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from lightning_syncasync.algorithms.watchdog import Heartbeat


class _FailingStore(dist.Store):
    """A store whose host went away: every call fails at once (what a client sees after a connection reset)."""

    def add(self, key, value):
        raise RuntimeError("Connection reset by peer")

    def check(self, keys):
        raise RuntimeError("Connection reset by peer")


def _beats(store, world=3, timeout_s=0.6, lost=None):
    return [Heartbeat(store, r, world, timeout_s=timeout_s, interval_s=0.05, on_lost=lost) for r in range(world)]


@pytest.mark.timeout(30)
def test_a_silent_rank_is_named_on_every_rank_and_a_finished_one_never():
    store = dist.HashStore()
    said: list[str] = []
    hbs = _beats(store, lost=said.append)
    for hb in hbs:
        hb.start()
    time.sleep(0.3)
    assert all(hb.verdict() is None for hb in hbs)  # everyone beats
    hbs[2].stop(finished=True)  # rank 2 ends normally: never blamed
    time.sleep(1.0)
    assert all(hb.lost is None for hb in hbs[:2])
    hbs[1]._stop.set()  # rank 1 freezes (as under SIGSTOP): no "done", no more beats
    for t in hbs[1]._threads:
        t.join()
    deadline = time.monotonic() + 5
    while hbs[0].lost is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert hbs[0].lost is not None and hbs[0].lost.startswith("rank 1 is lost: no heartbeat for")
    assert said and said[0] == hbs[0].lost  # on_lost called once, with the verdict
    # The verdict is published: a rank that does not watch rank 1 reads it too.
    late = Heartbeat(store, 2, 3, timeout_s=0.6, interval_s=0.05, watch=1)  # watches rank 0 only
    late._beat_once()
    assert late.verdict() == hbs[0].lost
    hbs[0].stop()


@pytest.mark.timeout(30)
def test_blame_after_a_failed_collective_waits_for_evidence_then_returns_none():
    store = dist.HashStore()
    hbs = _beats(store, timeout_s=5.0)
    for hb in hbs:
        hb.start()
    time.sleep(0.3)
    started = time.monotonic()
    assert hbs[0].blame(wait_s=0.5) is None  # everyone alive: this rank is where the failure started
    assert time.monotonic() - started >= 0.5
    hbs[2]._stop.set()  # rank 2 killed: its counter stops at once
    blamed = hbs[0].blame(wait_s=3.0)
    assert blamed is not None and blamed.startswith("rank 2 is lost"), blamed  # well before timeout_s=5
    for hb in hbs:
        hb.stop(finished=False)


@pytest.mark.timeout(30)
def test_a_store_that_stops_answering_names_its_host():
    hb = Heartbeat(dist.HashStore(), 1, 2, timeout_s=0.5, interval_s=0.05)
    hb._beat_once()
    hb.store = _FailingStore()
    time.sleep(0.7)
    verdict = hb.verdict()
    assert verdict is not None and verdict.startswith("rank 0 (it hosts the rendezvous store) is lost")
    assert hb.publish("rank 1 failed: x") is None  # refused: the caller decides (its own verdict, or the store)
    assert hb.store_lost().startswith("rank 0 (it hosts the rendezvous store) is lost")


def test_bad_arguments():
    with pytest.raises(ValueError, match="timeout_s must be > 0.*HINT"):
        Heartbeat(dist.HashStore(), 0, 2, timeout_s=0)
    with pytest.raises(ValueError, match="interval_s must be in"):
        Heartbeat(dist.HashStore(), 0, 2, timeout_s=1, interval_s=2)
    with pytest.raises(ValueError, match="need 0 <= rank < world_size"):
        Heartbeat(dist.HashStore(), 2, 2)

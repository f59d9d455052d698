"""The CPU side of the side stream and of event timing: on the CPU every stream method is a no-op and jobs run as
they are; the recorder's arithmetic on timing events (which only CUDA makes: ``tests/gpu`` runs them there) is
checked with stand-ins that report fixed times."""

from __future__ import annotations

import pytest
import torch

from lightning_syncasync.algorithms._comm import CommThread
from lightning_syncasync.algorithms.stats import StatsRecorder, timing_event
from lightning_syncasync.algorithms.streams import SIDE_STREAM_ENV, SideStream


def test_on_the_cpu_a_side_stream_runs_the_job_as_it_is():
    side = SideStream(torch.device("cpu"))
    assert not side.cuda and side.stream is None
    assert side.handoff() is None and side.consumer() is None
    assert side.run(None, lambda: 41 + 1) == 42
    with side.context() as stream:
        assert stream is None
    side.follow(None)
    side.flush()
    side.lend(torch.ones(2), None)
    assert timing_event(torch.device("cpu")) is None


def test_a_comm_thread_on_the_cpu_runs_jobs_in_order_and_hands_back_errors():
    thread = CommThread("test-cpu")
    try:
        futures = [thread.submit(lambda i=i: i * i) for i in range(5)]
        assert [f.result(timeout=10) for f in futures] == [0, 1, 4, 9, 16]
        failing = thread.submit(lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            failing.result(timeout=10)
    finally:
        thread.close()


def test_the_environment_turns_side_streams_off(monkeypatch):
    assert SideStream(None).enabled
    monkeypatch.setenv(SIDE_STREAM_ENV, "0")
    assert not SideStream(None).enabled
    assert not SideStream(None, enabled=True).enabled


def test_a_bad_enabled_value_is_refused():
    with pytest.raises(ValueError, match="enabled must be a bool"):
        SideStream(None, enabled="yes")  # type: ignore[arg-type]


class _Event:
    """A stand-in for a CUDA timing event: a fixed time on the GPU's clock (seconds)."""

    def __init__(self, at: float) -> None:
        self.at = at
        self.synchronized = False

    def synchronize(self) -> None:
        self.synchronized = True

    def elapsed_time(self, end: _Event) -> float:
        return (end.at - self.at) * 1000.0  # milliseconds, as torch.cuda.Event


def test_stream_waits_and_overlap_tails_timed_by_events_count_as_wait():
    rec = StatsRecorder()
    rec.begin_step(at=0.0)
    waits = [(_Event(1.0), _Event(1.25)), (_Event(2.0), _Event(2.5))]
    for start, end in waits:
        rec.record_stream_wait(start, end)
    rec.record_launch(1000, "inter", event=_Event(3.0))
    rec.record_completion(event=_Event(3.125))
    stats = rec.end_step(step=0, samples=1)
    # 0.25 + 0.5 of stream waits and 0.125 of the last collective outlasting its launch; capped by the step's wall
    # time (host clock, started at 0: seconds since).
    assert stats.wait_s == pytest.approx(min(0.875, stats.wall_s))
    assert stats.bytes_inter == 1000
    assert all(end.synchronized for _, end in waits)
    # The next step starts clean.
    rec.begin_step()
    assert rec.end_step(step=1, samples=1).wait_s < 0.01

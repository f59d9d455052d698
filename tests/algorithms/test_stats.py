from __future__ import annotations

import threading
import time

import pytest

from lightning_syncasync.algorithms.stats import StatsRecorder


def test_blocking_collectives_add_bytes_and_wait():
    rec = StatsRecorder()
    rec.begin_step()
    rec.record_blocking(nbytes=1000, scope="inter", seconds=0.0)
    rec.record_blocking(nbytes=24, scope="intra", seconds=0.0)
    time.sleep(0.02)
    rec.record_wait(0.005)
    s = rec.end_step(step=3, samples=32)
    assert (s.step, s.bytes_inter, s.bytes_intra, s.bytes_total, s.samples) == (3, 1000, 24, 1024, 32)
    assert s.wait_s == pytest.approx(0.005)
    assert s.wall_s >= 0.02
    assert s.compute_s == pytest.approx(s.wall_s - 0.005)
    assert s.samples_per_s == pytest.approx(32 / s.wall_s)
    assert rec.last is s
    assert rec.total_bytes == {"intra": 24, "inter": 1000}


def test_a_timed_collective_on_the_cpu_is_timed_by_the_host_clock():
    # On the CPU (gloo) the host blocks for a collective: the host clock around it is the step's wait. (On CUDA the
    # same block is timed by events on the current stream: tests/gpu/test_cuda_timing.py.)
    import torch

    rec = StatsRecorder()
    rec.begin_step()
    with rec.timed(torch.device("cpu"), 64, "inter"):
        time.sleep(0.02)
    with rec.timed(None):  # no tensor to place it (a gate): a wait that moves no bytes
        time.sleep(0.01)
    s = rec.end_step(step=0, samples=1)
    assert (s.bytes_inter, s.bytes_intra) == (64, 0)
    assert 0.03 <= s.wait_s <= s.wall_s


def test_overlapped_wait_is_the_tail_after_the_last_launch():
    rec = StatsRecorder()
    rec.begin_step()
    t0 = time.perf_counter()
    rec.record_launch(100, "intra", at=t0)
    rec.record_launch(100, "intra", at=t0 + 0.010)  # last bucket: backward's compute ends here
    rec.record_completion(at=t0 + 0.012)
    rec.record_completion(at=t0 + 0.025)
    time.sleep(0.03)
    s = rec.end_step(step=0, samples=1)
    assert s.bytes_intra == 200
    assert s.wait_s == pytest.approx(0.015, abs=1e-9)


def test_wait_never_exceeds_the_step():
    rec = StatsRecorder()
    rec.begin_step()
    rec.record_wait(10.0)
    s = rec.end_step(step=0, samples=1)
    assert s.wait_s == pytest.approx(s.wall_s)
    assert s.compute_s == 0.0


def test_records_between_steps_count_in_the_next_step_and_steps_reset():
    rec = StatsRecorder()
    rec.record_blocking(8, "inter", 0.0)  # e.g. a collective issued during setup
    rec.begin_step()
    assert rec.end_step(0, 1).bytes_inter == 8
    rec.begin_step()
    s = rec.end_step(1, 1)
    assert s.bytes_inter == 0 and s.wait_s == 0.0


def test_staleness_and_mode():
    rec = StatsRecorder(mode="async")
    rec.begin_step()
    for v in (0, 2, 4):
        rec.record_staleness(v)
    s = rec.end_step(0, 1)
    assert (s.staleness_mean, s.staleness_max, s.mode) == (2.0, 4.0, "async")


def test_thread_safe_completions():
    rec = StatsRecorder()
    rec.begin_step()

    def launch_many():
        for _ in range(1000):
            rec.record_launch(4, "intra")
            rec.record_completion()

    threads = [threading.Thread(target=launch_many) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert rec.end_step(0, 1).bytes_intra == 4 * 4 * 1000


def test_history_is_bounded():
    rec = StatsRecorder(history=3)
    for i in range(5):
        rec.begin_step()
        rec.end_step(i, 1)
    assert [s.step for s in rec.history] == [2, 3, 4]


def test_checkpoint_saves_are_left_out_of_the_step_they_fall_in():
    rec = StatsRecorder()
    rec.begin_step()
    rec.end_step(0, 1)
    t0 = time.perf_counter()
    time.sleep(0.05)  # a save between steps: before the next step begins, after the previous one ended
    rec.record_checkpoint(t0, time.perf_counter())
    rec.begin_step(at=t0)  # the monitor starts a step at the previous step's end
    time.sleep(0.02)
    s = rec.end_step(1, 8)
    assert 0.015 <= s.wall_s < 0.045  # the 20 ms of the step, not the 50 ms save
    assert rec.checkpoint_s == pytest.approx(0.05, abs=0.02)
    # Only the part of a save inside the step's window comes out: one that ended before the step began costs nothing.
    t1 = time.perf_counter()
    rec.record_checkpoint(t1 - 1.0, t1 - 0.5)
    rec.begin_step(at=t1)
    time.sleep(0.02)
    assert rec.end_step(2, 8).wall_s >= 0.015
    assert rec.checkpoint_s == pytest.approx(0.55, abs=0.02)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda r: r.record_blocking(-1, "intra", 0.0), "nbytes"),
        (lambda r: r.record_launch(1, "between", None), "scope"),
        (lambda r: r.record_staleness(-1), "staleness"),
        (lambda r: r.record_checkpoint(2.0, 1.0), "cannot end"),
    ],
)
def test_bad_records_are_rejected(call, match):
    with pytest.raises(ValueError, match=match):
        call(StatsRecorder())


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="history"):
        StatsRecorder(history=0)
    with pytest.raises(ValueError, match="mode"):
        StatsRecorder(mode="")


def test_pickles_for_spawn():
    import pickle

    rec = StatsRecorder(mode="hier")
    rec.begin_step()
    rec.record_blocking(4, "inter", 0.0)
    rec.end_step(0, 1)
    clone = pickle.loads(pickle.dumps(rec))
    assert clone.mode == "hier" and clone.last == rec.last
    clone.begin_step()
    clone.record_launch(8, "intra")
    assert clone.end_step(1, 1).bytes_intra == 8


class _Event:
    """Stands in for a CUDA timing event (no GPU here; tests/gpu times real ones): ``at`` ms on the GPU's clock,
    ``reached`` once the GPU has passed it, and a count of the host syncs asked of it."""

    def __init__(self, at: float, reached: bool = True, before: _Event | None = None) -> None:
        self.at, self.reached, self.syncs, self.before = at, reached, 0, before

    def query(self) -> bool:
        return self.reached

    def synchronize(self) -> None:
        self.syncs += 1
        self.reached = True
        if self.before is not None:  # an event earlier on the stream is passed before this one
            self.before.reached = True

    def elapsed_time(self, end: _Event) -> float:
        assert self.reached and end.reached, "cudaEventElapsedTime fails on an event not reached yet"
        return end.at - self.at


def _pair(start_ms: float, end_ms: float, reached: bool = True) -> tuple[_Event, _Event]:
    start = _Event(start_ms, reached)
    return start, _Event(end_ms, reached, before=start)


def _step(rec: StatsRecorder, waits: list[tuple[_Event, _Event]], block: bool) -> float:
    rec.begin_step(at=time.perf_counter() - 1.0)  # a 1 s step: the waits below are never clamped
    for start, end in waits:
        rec.record_stream_wait(start, end)
    return rec.end_step(step=0, samples=1, block=block).wait_s


def test_an_unblocked_step_never_waits_for_the_gpu_and_counts_late_waits_in_a_later_step():
    rec = StatsRecorder()
    late_start, late_end = _pair(0.0, 30.0, reached=False)
    # Step 1: a 10 ms wait the GPU has passed, and a 30 ms one it has not reached: only the first counts now.
    assert _step(rec, [_pair(0.0, 10.0), (late_start, late_end)], block=False) == pytest.approx(0.010)
    # Step 2: still not reached: carried again; nothing of step 2's own.
    assert _step(rec, [], block=False) == 0.0
    late_start.reached = late_end.reached = True
    # Step 3: reached: the carried 30 ms lands here, with step 3's own 5 ms; once, not again in step 4.
    assert _step(rec, [_pair(0.0, 5.0)], block=False) == pytest.approx(0.035)
    assert _step(rec, [], block=False) == 0.0
    assert late_end.syncs == 0  # never a host sync without block


def test_a_blocking_step_waits_for_its_events_and_for_those_carried():
    rec = StatsRecorder()
    late = _pair(0.0, 20.0, reached=False)
    assert _step(rec, [late], block=False) == 0.0
    own = _pair(0.0, 7.0, reached=False)
    assert _step(rec, [own], block=True) == pytest.approx(0.027)  # both resolved, the late one once
    assert own[1].syncs == 1 and late[1].syncs == 1
    assert _step(rec, [], block=True) == 0.0


def test_an_overlapped_tail_on_cuda_events_not_reached_is_carried_too():
    rec = StatsRecorder()
    launch, done = _pair(100.0, 112.0, reached=False)
    rec.begin_step(at=time.perf_counter() - 1.0)
    rec.record_launch(64, "intra", event=launch)
    rec.record_completion(event=done)
    assert rec.end_step(step=0, samples=1, block=False).wait_s == 0.0
    launch.reached = done.reached = True
    assert _step(rec, [], block=False) == pytest.approx(0.012)


def test_late_events_of_an_earlier_fit_can_be_dropped():
    rec = StatsRecorder()
    assert _step(rec, [_pair(0.0, 50.0, reached=False)], block=False) == 0.0
    rec.drop_late_events()  # a new fit starts (SyncMonitor.on_train_start)
    assert _step(rec, [], block=True) == 0.0  # the old wait is neither waited for nor counted

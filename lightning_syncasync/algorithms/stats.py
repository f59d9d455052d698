"""The per-step statistics record every strategy feeds and every callback reads.

This is the contract between the communication layer and the callbacks (see ARCHITECTURE.md): a strategy (or a
DDP comm hook for strategies we do not own) writes what its collectives cost into a :class:`StatsRecorder`;
``SyncMonitor`` closes the step and logs the resulting :class:`StepStats`; later policies (``SyncSwitcher``,
``AdaptiveBatchSize``) read the same records. Nothing here imports Lightning.

Two kinds of communication are recorded, because they cost a step differently:

* *blocking* collectives (the caller waits for them): their whole duration is wait time;
* *overlapped* collectives (launched during backward, e.g. DDP buckets, completed on a background thread): only the
  part that outlasts the computation is wait time. We estimate it as ``max(completion) - max(launch)`` over the
  step: the last bucket is launched when the last gradient is ready, i.e. when backward's compute is done, so
  anything after that is time the step spent blocked on the network.

Bytes are the sizes of the tensors handed to collectives (what the caller asked to move), split by whether the
collective's group spans more than one node. They are measured from the tensors, never estimated.

On CUDA a collective returns before its kernels run, so host clocks around it measure the launch. There, what waits
on a stream (NCCL's asynchronous work, DDP's buckets) is timed by CUDA events recorded on the streams
(:meth:`StatsRecorder.record_stream_wait`, ``event=`` of :meth:`~StatsRecorder.record_launch` and
:meth:`~StatsRecorder.record_completion`), resolved when the step closes; a collective the caller runs to completion
goes through :meth:`StatsRecorder.timed`, which times it by events on CUDA (an NCCL call with ``async_op=False``
returns at its launch) and by the host clock elsewhere. Waits where the host itself blocks (a
background exchange's result: the pack's communication threads finish their stream before they deliver,
``algorithms/streams.py``) stay on host clocks, which are right for them.

Resolving an event the GPU has not reached yet means waiting for it: a host sync at every step, which a caller that
lets the host run ahead of the GPU must not pay. ``end_step(block=False)`` resolves only the events already
reached (``Event.query``) and carries the others to the first later step at whose end they are: each step's wait is
then what the GPU finished waiting by its end, and sums over a window are exact but for its edges.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Scope = Literal["intra", "inter"]
_SCOPES = ("intra", "inter")


@dataclass(frozen=True)
class StepStats:
    """What one optimizer step cost on one rank.

    Attributes:
        step: index of the step (the caller's counter, usually ``trainer.global_step`` before the step).
        wall_s: wall-clock seconds from the start to the end of the step.
        compute_s: ``wall_s - wait_s``: time not spent blocked on communication.
        wait_s: time blocked on communication (blocking collectives plus the non-overlapped tail of overlapped ones).
        bytes_intra: bytes passed to collectives whose group stays inside one node.
        bytes_inter: bytes passed to collectives whose group spans nodes.
        samples: samples processed in the step on this rank.
        staleness_mean: mean staleness of the updates applied in the step (0 for synchronous training).
        staleness_max: max staleness of the updates applied in the step.
        clock_gap: the SSP clock gap this step started with (own clock minus the slowest peer's; 0 when synchronous).
        mode: the sync mode the step ran in (``"sync"``, ``"hier"``, ``"async"``, ``"local"``).
        participants: the nodes in the last committed round of a fault-tolerant strategy (0 where membership is
            fixed).
    """

    step: int
    wall_s: float
    compute_s: float
    wait_s: float
    bytes_intra: int
    bytes_inter: int
    samples: int
    staleness_mean: float = 0.0
    staleness_max: float = 0.0
    clock_gap: float = 0.0
    mode: str = "sync"
    participants: int = 0

    @property
    def bytes_total(self) -> int:
        return self.bytes_intra + self.bytes_inter

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.wall_s if self.wall_s > 0 else 0.0

    def as_dict(self) -> dict[str, float | int | str]:
        return asdict(self)


@dataclass
class _Open:
    """Accumulators of the step in progress."""

    start: float
    bytes: dict[str, int] = field(default_factory=lambda: {"intra": 0, "inter": 0})
    blocking_s: float = 0.0
    last_launch: float | None = None
    last_completion: float | None = None
    # CUDA: the events of the last overlapped launch and completion, and (start, end) events around stream waits.
    launch_event: Any = None
    completion_event: Any = None
    stream_waits: list[tuple[Any, Any]] = field(default_factory=list)
    staleness: list[float] = field(default_factory=list)
    clock_gap: float = 0.0
    # (start, end) of checkpoint saves since the previous step closed: not part of any step's time.
    paused: list[tuple[float, float]] = field(default_factory=list)


class StatsRecorder:
    """Thread-safe accumulator of per-step communication statistics.

    Collectives may complete on a background thread (gloo/NCCL work, DDP comm-hook futures), so every method takes
    a lock. Records made while no step is open (e.g. during validation or setup) are counted in the next step.

    Args:
        history: how many closed :class:`StepStats` to keep for policies that look at a window.
        mode: the initial sync mode reported with each step.

    Example::

        rec = StatsRecorder()
        rec.begin_step()
        rec.record_blocking(nbytes=4096, scope="inter", seconds=0.01)
        stats = rec.end_step(step=0, samples=32)
        assert stats.bytes_inter == 4096
    """

    def __init__(self, history: int = 1000, mode: str = "sync") -> None:
        if history < 1:
            raise ValueError(f"history must be >= 1, got {history}; keep at least the last step")
        if not mode:
            raise ValueError("mode must be a non-empty string such as 'sync'")
        self._lock = threading.Lock()
        self._open = _Open(start=time.perf_counter())
        self._in_step = False
        # end_step(block=False): event pairs of earlier steps the GPU had not reached when their step closed.
        self._carried: list[tuple[Any, Any]] = []
        self.mode = mode
        self.last_participants = 0  # the last value record_participants saw (kept across steps)
        self.history: deque[StepStats] = deque(maxlen=history)
        self.total_bytes = {"intra": 0, "inter": 0}
        # Whole-run histograms {value: count} of version staleness and clock gaps (integers for the async modes).
        self.histograms: dict[str, dict[int, int]] = {"staleness": {}, "clock_gap": {}}
        # Whole-run seconds spent at sync points of asynchronous training (consistent cuts, Lightning's collectives
        # outside the training step: epoch ends, metric reductions, validation), where every rank waits for the
        # slowest. Already inside the steps' wall time; kept apart to show what they cost.
        self.sync_point_s = 0.0
        # Whole-run seconds spent saving checkpoints. Like validation, a save happens between steps and how often it
        # happens is a choice of the run, so it is kept out of the steps' wall time (and their samples/s).
        self.checkpoint_s = 0.0

    def __getstate__(self) -> dict:
        # Strategies are pickled to spawned processes; a lock cannot travel, a fresh one is made on arrival.
        state = self.__dict__.copy()
        del state["_lock"]
        state["_carried"] = []  # CUDA events (none before a fit starts) do not travel
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def drop_late_events(self) -> None:
        """Forget the CUDA events earlier steps carried (``end_step(block=False)``): at the start of a fit, waits of
        the last one's final steps are not the new one's."""
        with self._lock:
            self._carried = []

    @property
    def last(self) -> StepStats | None:
        """The most recent closed step, or ``None`` before the first."""
        return self.history[-1] if self.history else None

    def begin_step(self, at: float | None = None) -> None:
        """Start timing a step (at ``at``, a ``time.perf_counter()`` stamp, default now).

        Records made since the previous step stay attached to this one. Callers that want a step to include the
        loop's work between steps (fetching the batch) pass the previous step's end as ``at``.
        """
        with self._lock:
            self._open.start = time.perf_counter() if at is None else at
            self._in_step = True

    def record_blocking(self, nbytes: int, scope: Scope, seconds: float) -> None:
        """Record a collective the caller waited ``seconds`` for."""
        _check(nbytes, scope)
        with self._lock:
            self._open.bytes[scope] += nbytes
            self._open.blocking_s += max(0.0, seconds)

    def record_wait(self, seconds: float) -> None:
        """Record time blocked on communication that moved no new bytes (a gate, a barrier, waiting on a handle)."""
        with self._lock:
            self._open.blocking_s += max(0.0, seconds)

    @contextmanager
    def timed(self, device: Any, nbytes: int = 0, scope: Scope | None = None) -> Iterator[None]:
        """Record a collective the calling thread runs to completion on ``device`` (``async_op=False``, or a wait on
        its handle) inside the block: its bytes under ``scope`` (``None``: a wait that moves no new bytes), and how
        long the step waited for it. On the CPU (gloo) the host blocks until it is done, so a host clock times it. On
        CUDA an NCCL collective only makes the current stream wait and the host returns at its launch, where a host
        clock would read microseconds: events on that stream time the stall instead (:meth:`record_stream_wait`)."""
        before = timing_event(device)
        start = time.perf_counter()
        yield
        seconds = time.perf_counter() - start
        if before is not None:
            self.record_stream_wait(before, timing_event(device))
            seconds = 0.0
        if scope is None:
            self.record_wait(seconds)
        else:
            self.record_blocking(nbytes, scope, seconds)

    def record_sync_point(self, seconds: float) -> None:
        """Record time spent at a sync point of asynchronous training (see ``sync_point_s``)."""
        with self._lock:
            self.sync_point_s += max(0.0, seconds)

    def record_checkpoint(self, start: float, end: float) -> None:
        """Record a checkpoint save that ran from ``start`` to ``end`` (``time.perf_counter()`` stamps). Its time is
        left out of the step it falls in (a save between steps falls in the next one, which starts at the previous
        step's end) and added to :attr:`checkpoint_s`."""
        if end < start:
            raise ValueError(f"a checkpoint save cannot end ({end}) before it starts ({start})")
        with self._lock:
            self.checkpoint_s += end - start
            self._open.paused.append((start, end))

    def record_launch(self, nbytes: int, scope: Scope, at: float | None = None, event: Any = None) -> None:
        """Record the launch of an overlapped collective (its completion is recorded by :meth:`record_completion`).
        On CUDA, ``event`` (a timing ``torch.cuda.Event`` recorded on the launching stream just before it) times it
        on the GPU instead of the host clock (module docstring)."""
        _check(nbytes, scope)
        at = time.perf_counter() if at is None else at
        with self._lock:
            self._open.bytes[scope] += nbytes
            if event is not None:
                self._open.launch_event = event  # launches come in order: the last one recorded is the last
            elif self._open.last_launch is None or at > self._open.last_launch:
                self._open.last_launch = at

    def record_completion(self, at: float | None = None, event: Any = None) -> None:
        """Record the completion of an overlapped collective (may be called from a communication thread); on CUDA
        ``event`` is a timing event recorded on a stream that waited for it."""
        at = time.perf_counter() if at is None else at
        with self._lock:
            if event is not None:
                self._open.completion_event = event  # buckets complete in launch order on one stream
            elif self._open.last_completion is None or at > self._open.last_completion:
                self._open.last_completion = at

    def record_stream_wait(self, start: Any, end: Any) -> None:
        """Record a wait of a CUDA stream (``stream.wait_event``, NCCL's ``work.wait()``) between two timing events
        recorded on that stream just before and after it: the time the stream stalled there."""
        with self._lock:
            self._open.stream_waits.append((start, end))

    def record_staleness(self, value: float) -> None:
        """Record the staleness (in steps or versions) of one applied update."""
        if value < 0:
            raise ValueError(f"staleness must be >= 0, got {value}")
        with self._lock:
            self._open.staleness.append(float(value))
            hist = self.histograms["staleness"]
            hist[round(value)] = hist.get(round(value), 0) + 1

    def record_participants(self, value: int) -> None:
        """Record the nodes that took part in the last committed round (fault-tolerant strategies)."""
        if value < 0:
            raise ValueError(f"participants must be >= 0, got {value}")
        with self._lock:
            self.last_participants = int(value)

    def record_clock_gap(self, value: float) -> None:
        """Record the SSP clock gap the current step started with."""
        if value < 0:
            raise ValueError(f"clock gap must be >= 0, got {value}")
        with self._lock:
            self._open.clock_gap = max(self._open.clock_gap, float(value))
            hist = self.histograms["clock_gap"]
            hist[round(value)] = hist.get(round(value), 0) + 1

    def end_step(self, step: int, samples: int, block: bool = True) -> StepStats:
        """Close the step opened by :meth:`begin_step` and return its record. ``block=False``: CUDA events the GPU
        has not reached yet are not waited for, but counted in a later step (module docstring)."""
        now = time.perf_counter()
        with self._lock:
            cur = self._open
            # Only the part of a save inside this step's window is taken out (begin_step may set the start later).
            paused = sum(max(0.0, min(end, now) - max(start, cur.start)) for start, end in cur.paused)
            wall = max(now - cur.start - paused, 0.0) if self._in_step else 0.0
            overlap_tail = 0.0
            if cur.last_launch is not None and cur.last_completion is not None:
                overlap_tail = max(0.0, cur.last_completion - cur.last_launch)
            pending = list(cur.stream_waits)
            if cur.launch_event is not None and cur.completion_event is not None:
                if block or _reached(cur.launch_event, cur.completion_event):
                    overlap_tail = max(overlap_tail, _elapsed_s(cur.launch_event, cur.completion_event, block))
                else:
                    pending.append((cur.launch_event, cur.completion_event))
            # This step's stream waits, and the pairs earlier steps carried (each counted once, where resolved).
            pending += self._carried
            reached = [block or _reached(*pair) for pair in pending]  # asked once: the answer may change
            self._carried = [pair for pair, ok in zip(pending, reached, strict=True) if not ok]
            stream_wait = sum(_elapsed_s(a, b, block) for (a, b), ok in zip(pending, reached, strict=True) if ok)
            # Wait can never exceed the step itself (a completion stamped late by a busy thread must not make
            # compute time negative).
            waited = cur.blocking_s + overlap_tail + stream_wait
            wait = min(waited, wall) if wall > 0 else waited
            stal = cur.staleness
            stats = StepStats(
                step=step,
                wall_s=wall,
                compute_s=max(wall - wait, 0.0),
                wait_s=wait,
                bytes_intra=cur.bytes["intra"],
                bytes_inter=cur.bytes["inter"],
                samples=samples,
                staleness_mean=sum(stal) / len(stal) if stal else 0.0,
                staleness_max=max(stal) if stal else 0.0,
                clock_gap=cur.clock_gap,
                mode=self.mode,
                participants=self.last_participants,
            )
            for scope in _SCOPES:
                self.total_bytes[scope] += cur.bytes[scope]
            self._open = _Open(start=now)
            self._in_step = False
            self.history.append(stats)
        return stats


def timing_event(device: Any) -> Any:
    """A timing event recorded now on ``device``'s current CUDA stream; ``None`` off CUDA (use host clocks)."""
    if getattr(device, "type", None) != "cuda":
        return None
    import torch

    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))
    return event


def _reached(start: Any, end: Any) -> bool:
    """Whether the GPU has passed both events (``Event.query``: no host sync)."""
    return bool(end.query() and start.query())


def _elapsed_s(start: Any, end: Any, block: bool = True) -> float:
    """Seconds between two CUDA timing events; ``block`` waits for ``end`` first (a no-op when the device was
    synchronised; without it the caller has checked :func:`_reached`, and waiting would be a host sync per call)."""
    if block:
        end.synchronize()
    return max(0.0, start.elapsed_time(end) / 1000.0)


def _check(nbytes: int, scope: str) -> None:
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if scope not in _SCOPES:
        raise ValueError(f"scope must be one of {_SCOPES}, got {scope!r}")

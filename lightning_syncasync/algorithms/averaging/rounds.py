"""Round-level asynchronous training (async local SGD): every rank a learner, rounds of pseudo-gradients in the
background, bounded staleness counted in rounds.

Why rounds: with Adam-family optimizers a gradient one optimizer step old already stops learning (per-step async,
``algorithms/ssp/exchange.py``: 0.722 -> 0.242 on the convnet). Moving the staleness from inner steps to outer rounds
keeps every inner step on a fresh gradient of the rank's own replica, with its own optimizer state; only the exchange of
whole rounds is late (Liu et al., 2024, "Asynchronous Local-SGD Training for Language Modeling"; DiLoCo, Douillard
et al., 2023; overlapped outer communication as in Streaming DiLoCo, Douillard et al., 2025).

A round, on every rank:

1. Local steps on the replica ``theta`` (the caller's optimizer), counted by :meth:`RoundExchange.after_step`.
2. At the round's end the rank's pseudo-gradient is its local progress since its previous round ended,
   ``delta = base - theta``; then ``base = theta``. It goes into a background exchange (one all-reduce of a small
   metadata vector, then one all-reduce of the pseudo-gradients, compressed through the shared
   :class:`~lightning_syncasync.algorithms.compression.Compressor` with error feedback), and the rank goes on with
   the next round's local steps at once.
3. The round's global pseudo-gradient is ``G = sum_i delta_i / world``, the same on every rank. With SGD the global
   model moves by ``-lr / world`` times the sum of every gradient any rank computed: DDP's mean per sample. A rank
   that took more steps (a fast one) holds more samples in its ``delta`` and moves the global model further, in
   proportion to its samples, so the update stays unbiased (no per-rank weights to get wrong).
4. When the round is *delivered* (its exchange done), every rank runs the same outer step on ``G``
   (:class:`~lightning_syncasync.algorithms.averaging.OuterOptimizer`: average, Nesterov, delayed Nesterov) and
   replaces its own contribution by the global step: ``theta += delta_i - step``, ``base += delta_i - step``. The
   local progress made since the round ended is kept, and counted in the next round only (it is not in any
   ``delta`` yet): nothing is lost or counted twice, however many rounds are in flight (tested with a toy model
   whose updates sum exactly).

Bounded staleness (SSP over rounds): a rank starts round ``r`` only once round ``r - 1 - staleness`` is delivered.
``staleness=0`` is synchronous local SGD (DiLoCo); ``staleness=1`` (default) overlaps each round's exchange with the
next round's local steps, so a replica misses at most one round of the others' progress. Delivered rounds are
applied at the next step boundary, not only when the bound forces it.

Dynamic local steps (``dynamic=True``): rounds have a wall-clock length, ``T = local_steps x`` the ranks' mean step
time, measured (each rank's moving average travels in the round metadata, so every rank derives the same ``T``),
and re-decided every round. A rank ends a round at the first step boundary past its deadline, so a fast rank takes
more local steps and a slow one fewer, and they reach the round's exchange together: a persistent straggler no
longer paces the others, it contributes fewer samples. A transient pause shorter than ``staleness`` rounds only
delays the delivery of that rank's round, which nobody needs until ``staleness`` rounds later. A rank that is past
the next deadline already and behind the others (it ended the last delivered round over half a round after their
median: it was paused) ends that round with no new step, so the ranks stay on the same round grid; a rank that is
late with everyone (they all waited for a slow link) gets the next round's full length from now instead: ending
rounds with no step there sent a whole exchange of nothing each time, back to back (issue 64's storm). The length
itself, ``local_steps``, is :class:`RoundLength`'s: fixed, or decided from the step and exchange times every rank
reports in the round metadata. Deadlines are ``median end time of round q + (r - q) T`` with ``q`` the last round
delivered when round ``r`` starts (at least ``r - 1 - staleness``), on the wall clock, so rounds do not drift. The first
``staleness + 1`` rounds, before any measurement is delivered, are ``local_steps`` steps long on every rank.
``dynamic=False`` keeps every round ``local_steps`` steps long and applies round ``r`` exactly at the end of round
``r + staleness``: a deterministic trajectory (exact resume, tests).

A consistent cut (validation, checkpoints, the end of fit; every rank calls :meth:`RoundExchange.cut` at the same
point of its loop) ends the current round with a cut flag, then keeps joining rounds (with no new steps) until one
round carries every rank's flag; that round is exact (fp32, with every error-feedback residual flushed into it).
After it is applied every replica is the global model; rank 0's parameters and buffers are broadcast so they are
bitwise equal, and the next rounds start from a fresh time origin. A cut where every rank is still clean (no step
and no round applied since the last cut: validation's metric reductions right after it) costs the metadata
all-reduce and nothing else (it is not even counted as a round), so strategies can cut before every collective of
theirs. (It has to be a round: a rank waiting at the bound needs the others' next round launched, and a check of its
own before the round would block them first.)

Sharded learners (``node_group``): when a learner is a node whose ranks each hold a shard of its model (FSDP2),
``group`` is the cross-node group of this rank's shard (the same local rank on every node), and each rank runs the
rounds of its shard: the same pseudo-gradient arithmetic, shard by shard. The ranks of a node must end every round at
the same step (the node takes its steps together); so each round-end decision is agreed over ``node_group`` (one
all-reduce MAX of a flag per step: a round ends when any rank of the node says so), and the number of such calls
depends only on agreed values, so no rank of a node calls one more than the others.

Buffers (BatchNorm statistics) are not exchanged between cuts (each rank keeps its own, as in ``SSPExchange``).
A round that does not complete within ``timeout_s`` raises
:class:`~lightning_syncasync.algorithms.watchdog.PeerLostError` naming the peers.

One learner (``group`` of one rank: a one-device trial run): every round, the bound and the outer step run as on a
cluster, but a round's exchange is done on the calling thread with no collective (an all-reduce over one rank is the
identity), exact (compression is for bytes that are never sent here).
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch
import torch.distributed as dist

from lightning_syncasync.algorithms._comm import CommThread, all_reduce_
from lightning_syncasync.algorithms._flat import add_flat_, broadcast_flat_
from lightning_syncasync.algorithms.averaging._round_records import _FIELDS, RoundStats, _count, _Round
from lightning_syncasync.algorithms.averaging.outer import OuterOptimizer
from lightning_syncasync.algorithms.averaging.round_checks import NonFiniteRoundError, RoundsStopped, check_rounds
from lightning_syncasync.algorithms.averaging.round_length import RoundLength
from lightning_syncasync.algorithms.compression.compressor import Compressor
from lightning_syncasync.algorithms.stats import Scope, StatsRecorder
from lightning_syncasync.algorithms.watchdog import PeerLostError

# check_rounds, NonFiniteRoundError and RoundsStopped were defined here: still importable from here.
__all__ = ["NonFiniteRoundError", "RoundExchange", "RoundStats", "RoundsStopped", "check_rounds"]


class RoundExchange:
    """Rounds of pseudo-gradients in the background, an outer optimizer, bounded staleness in rounds.

    Args:
        params: the replica's parameters, in a fixed order, identical on every rank at start.
        group: a process group over every rank, used by nothing else (the rounds run on a thread of their own).
        local_steps: steps per round (``dynamic``: at the ranks' mean speed); ignored when ``length`` is given.
        length: the policy that decides the steps per round from the measured step and exchange times
            (:class:`~lightning_syncasync.algorithms.averaging.round_length.RoundLength`); ``None``: ``local_steps``,
            fixed. Every rank feeds it the same delivered metadata, so every rank decides the same length.
        staleness: rounds a rank may run ahead of the last round delivered (``0``: synchronous rounds).
        round_s: a fixed round length in seconds instead of ``local_steps x`` the measured mean step time.
        dynamic: rounds of wall-clock length, so each rank's local steps follow its speed (module docstring).
        outer: the outer optimizer (default: plain averaging).
        compressor: compression of the pseudo-gradients (error feedback; ``None``: fp32).
        recorder: where bytes, wait time and staleness go.
        scope: how the recorder files the bytes (``"inter"`` when the group spans several nodes).
        timeout_s: how long the training loop waits for a round before :class:`PeerLostError`.
        buffers: tensors made rank 0's at every cut (BatchNorm statistics).
        node_group: the ranks that hold the other shards of this rank's model (module docstring); ``None``: every
            rank is a learner of its own and ``group`` spans every rank.
        side_stream: on CUDA, run the exchange on a stream of its own (``algorithms/streams.py``); ``False`` gives
            the same results without the overlap.
        should_stop: polled while the loop waits for a round (a SIGTERM's flag): when it says so the wait ends with
            :class:`RoundsStopped`, and the rounds in flight are dropped (the process is about to exit; the last
            consistent cut, and any checkpoint taken there, is what survives).

    Example::

        ex = RoundExchange(list(model.parameters()), dist.new_group(), local_steps=8, staleness=1)
        ex.start()
        for batch in data:
            loss = model(batch).sum(); loss.backward(); opt.step(); opt.zero_grad()
            ex.after_step(samples=len(batch))
        ex.cut(stop=True)   # every round delivered, replicas bitwise equal, thread stopped
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        group: dist.ProcessGroup | None,
        local_steps: int = 8,
        staleness: int = 1,
        round_s: float | None = None,
        dynamic: bool = True,
        outer: OuterOptimizer | None = None,
        compressor: Compressor | None = None,
        recorder: StatsRecorder | None = None,
        scope: Scope = "intra",
        timeout_s: float = 60.0,
        buffers: Sequence[torch.Tensor] = (),
        node_group: dist.ProcessGroup | None = None,
        side_stream: bool = True,
        length: RoundLength | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> None:
        check_rounds(local_steps if length is None else length.steps, staleness, round_s)
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if not params:
            raise ValueError("params is empty: nothing to exchange")
        learners = dist.get_world_size(group) * (dist.get_world_size(node_group) if node_group is not None else 1)
        if learners != dist.get_world_size():
            raise ValueError(
                "group must span every rank, or with node_group one rank of every node (group size x node_group size "
                f"= world size), got {learners} ranks for a world of {dist.get_world_size()}"
            )
        self.node_group = node_group
        self.side_stream = side_stream
        self.should_stop = should_stop
        self.tensors = list(params)
        self.buffers = list(buffers)
        self.group = group
        self.length = length if length is not None else RoundLength(fixed=local_steps, overlap=max(staleness, 1))
        self.staleness, self.round_s, self.dynamic = staleness, round_s, dynamic
        self.outer = outer if outer is not None else OuterOptimizer("average")
        self.compressor = compressor if compressor is not None and compressor.method != "none" else None
        if self.compressor is not None:
            self.compressor.check_backend(group)  # before any round: a missing collective fails here, named
        self.recorder, self.scope, self.timeout_s = recorder, scope, timeout_s
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.global_ranks = dist.get_process_group_ranks(group) if group is not None else list(range(self.world))
        self.numel = sum(t.numel() for t in params)
        self.stats = RoundStats()
        self.step_times: list[float] | None = None  # every rank's mean seconds per step, from the last round delivered
        self.launched = 0  # rounds this rank has ended (and launched)
        self.delivered = 0  # rounds applied to this replica
        self._base = self.flat()
        self._flight: deque[_Round] = deque()
        self._steps = 0  # local steps in the current round
        self._samples = 0
        self._step_ema: float | None = None  # this rank's mean step time (the loop's time between two steps)
        self._last_step_at: float | None = None
        self._origin = 0.0  # the wall-clock time origin of the metadata (agreed at start and at every cut)
        self._ends: dict[int, float] = {}  # median end time per delivered round (for the deadlines)
        self._lengths: dict[int, float] = {}  # the round length each delivered round's metadata decides
        self._deadline: float | None = None  # the current round's end (wall clock), None: a fixed-step round
        self._exchange_s = 0.0  # this rank's last exchange's duration (set on the exchange thread)
        self._behind = False  # this rank ended the last delivered round over half a round after the others' median
        self._thread: CommThread | None = None
        self._clean = True  # nothing changed on this rank since the last cut (the replicas start equal)
        self._losses: torch.Tensor | None = None  # note_loss's sum over the current round, on the device
        self.peers = [r for r in self.global_ranks if r != dist.get_rank()]
        # One learner: a round's exchange runs on the calling thread, with no collective and no wake-up of the
        # exchange thread: that wake-up (the thread's turn at the GIL) was about 0.09 ms of the 0.25 ms per step
        # async_ssp added at one rank (scripts/host_overhead.py, docs/gpu.md). The rounds, the bound and the outer
        # step run as on a cluster.
        self._inline = self.world == 1

    # -- lifecycle ---------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the exchange thread and agree on a time origin (a collective: every rank calls it)."""
        self._thread = CommThread("syncasync-rounds", self.tensors[0].device, self.side_stream)
        self._new_origin()

    def close(self) -> None:
        """Stop the exchange thread (rounds still in flight are dropped: :meth:`cut` first keeps them)."""
        if self._thread is not None:
            self._thread.close()
            self._thread = None

    # -- the training loop's side ------------------------------------------------------------------------------

    def flat(self) -> torch.Tensor:
        return torch.cat([t.detach().reshape(-1).float() for t in self.tensors])

    @property
    def local_steps(self) -> int:
        """Steps per round now (the policy's current length; ``dynamic``: at the ranks' mean speed)."""
        return self.length.steps

    @property
    def in_flight(self) -> int:
        return len(self._flight)

    def after_step(self, samples: int = 1) -> None:
        """Call after every local optimizer step: applies the rounds delivered so far, and ends the round (launching
        its exchange, then waiting on the staleness bound) when it is over."""
        self._clean = False
        now = time.perf_counter()
        if self._last_step_at is not None:
            dt = now - self._last_step_at
            self._step_ema = dt if self._step_ema is None else 0.8 * self._step_ema + 0.2 * dt
        self._steps += 1
        self._samples += samples
        if self.dynamic:
            self._apply_done()
        if self._agree(self._round_over()):
            self._end_round(cut=False)
            # A rank past the next deadline already (it was paused) ends that round too, with no new step, so it
            # stays on the others' round grid instead of running one round behind for good. Only a rank that is
            # behind the others does (``_end_round`` re-anchors the deadline of one that is late with everyone,
            # after waiting for the link): rounds with no step, launched back to back behind a slow link, were
            # issue 64's storm.
            while self._agree(self._deadline is not None and time.time() >= self._deadline):
                self.stats.catch_up += 1
                self._end_round(cut=False)
        self._last_step_at = time.perf_counter()  # the time blocked above is not step time

    def rebase(self) -> None:
        """The replicas moved together outside the rounds (a synchronous warm-up step, gradients averaged over every
        rank): the current round starts again from here, with nothing of that step in its pseudo-gradient. Every rank
        calls it at the same step; no collective."""
        self._base = self.flat()
        self._steps = self._samples = 0
        self._step_ema = self._last_step_at = None  # a step that waited for every rank is not this rank's pace

    def note_loss(self, loss: torch.Tensor) -> None:
        """Add a local step's loss (detached, on the device) to the current round's sum, which is checked for a NaN
        or an infinity when the round ends, before its pseudo-gradient leaves the rank (:class:`NonFiniteRoundError`):
        one host sync per round instead of one per step, which on a GPU would stop the host from queueing ahead.

        A sum, because a NaN or an infinity in any term leaves it non-finite (``inf - inf`` is NaN), and it costs one
        device operation per step (none in a round's first); ``torch.isfinite`` at every step would cost five. The
        sum is kept in fp32 (a 16-bit loss is cast: fp16 overflows at 65504), so only finite losses summing past
        3.4e38 would be refused as well: a diverged run."""
        loss = loss if loss.numel() == 1 else loss.sum()
        if loss.dtype in (torch.float16, torch.bfloat16):
            loss = loss.float()
        self._losses = loss if self._losses is None else self._losses + loss

    def cut(self, stop: bool = False) -> bool:
        """A consistent cut (every rank at the same point of its loop): every round delivered and applied, the last
        one exact, the replicas bitwise equal. ``stop=True`` ends the exchange thread after it. Returns whether
        anything changed (``False``: every rank was clean, the replicas were equal already)."""
        start = time.perf_counter()
        if self._thread is None:
            raise RuntimeError("cut() before start()")
        while True:
            self._end_round(cut=True, gate=False)
            while self._flight:
                meta = self._apply(self._flight.popleft())
            if _count(meta, self.world, 0) == self.world:
                break  # every rank flagged this round: it was exact and it is applied everywhere
        if _count(meta, self.world, 1) == self.world:
            if stop:
                self.close()
            return False  # every rank was clean: the replicas were equal, nothing moved
        # Rounding differs a little across replicas (each adds its own delta back); rank 0's is everyone's (with
        # shards: node 0's shard, over this shard's group; buffers are whole on every rank, so over every rank).
        if self.node_group is None:
            broadcast_flat_([t.data for t in [*self.tensors, *self.buffers]], self.global_ranks[0])  # default group
        else:
            broadcast_flat_([t.data for t in self.tensors], self.global_ranks[0], self.group)
            if self.buffers:
                broadcast_flat_([t.data for t in self.buffers], 0)
        self._base = self.flat()
        self._ends.clear()
        self._lengths.clear()
        self._deadline = None
        self._behind = False
        self._last_step_at = None
        if stop:
            self.close()
        elif self.node_group is not None:
            self._new_origin()  # every rank of every shard group on one clock, so a node's ranks agree on deadlines
        else:
            # The new origin is the latest end time of the cut round, which every rank holds (the same metadata):
            # the same value as an all-reduce MAX of the clocks, without another collective.
            per_rank = meta[: self.world * _FIELDS].view(self.world, _FIELDS)
            self._origin += float(per_rank[:, 3].max())
            self._last_step_at = None
        self._clean = True
        if self.recorder is not None:
            self.recorder.record_wait(time.perf_counter() - start)
        return True

    def state_dict(self) -> dict[str, Any]:
        """After a cut: the round counters, the outer optimizer's state and the compressor's."""
        if self._flight:
            raise RuntimeError("cut() the rounds before state_dict(): rounds are still in flight")
        state: dict[str, Any] = {
            "launched": self.launched,
            "delivered": self.delivered,
            "outer": self.outer.state_dict(),
        }
        if self.compressor is not None:
            state["compression"] = self.compressor.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore after the weights were loaded (they are a consistent cut: the global model)."""
        self.launched = self.delivered = int(state["delivered"])
        self.outer.load_state_dict(state["outer"])
        comp = state.get("compression")
        if self.compressor is not None and comp is not None:
            self.compressor.load_state_dict(comp)
        elif self.compressor is not None or comp is not None:
            raise ValueError(
                "the checkpoint was saved with a different round compression than this run's "
                f"({'none' if self.compressor is None else self.compressor.method}); HINT: resume with the same setting"
            )
        self._base = self.flat()

    # -- internals ---------------------------------------------------------------------------------------------

    def _new_origin(self) -> None:
        # The latest wall clock of all ranks: every rank's metadata times are then small, non-negative offsets.
        now = torch.tensor([time.time()], dtype=torch.float64, device="cpu")
        all_reduce_(now, self.group if self.node_group is None else None, dist.ReduceOp.MAX)
        self._origin = float(now)
        self._last_step_at = None

    def _agree(self, flag: bool) -> bool:
        """A round-end decision, the same on every rank of the node (``node_group``): true if any rank's is."""
        if self.node_group is None:
            return flag
        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device="cpu")
        all_reduce_(t, self.node_group, dist.ReduceOp.MAX)
        return bool(t.item())

    def _round_over(self) -> bool:
        if self._deadline is None:
            return self._steps >= self.local_steps
        return time.time() >= self._deadline

    def _end_round(self, cut: bool, gate: bool = True) -> None:
        """End this rank's current round: its pseudo-gradient into a background exchange; then the bound."""
        if self._losses is not None:
            total, self._losses = self._losses.item(), None
            if not math.isfinite(total):
                raise NonFiniteRoundError(self.launched)
        theta = self.flat()
        delta = self._base - theta
        self._base = theta
        # Host metadata (the loop reads it): it travels on the wire's device and comes back to the CPU.
        meta = torch.zeros(self.world * _FIELDS + 2, dtype=torch.float64, device="cpu")
        mine = meta[self.rank * _FIELDS : (self.rank + 1) * _FIELDS]
        mine[0], mine[1] = self._steps, self._samples
        mine[2] = self._step_ema if self._step_ema is not None else 0.0
        mine[3] = time.time() - self._origin
        mine[4] = self._exchange_s
        meta[-2] = 1.0 if cut else 0.0
        meta[-1] = 1.0 if cut and self._clean else 0.0
        self.stats.local_steps.append(self._steps)
        self._steps = self._samples = 0
        index = self.launched
        self.launched += 1
        assert self._thread is not None
        if self._inline:
            future: Future[tuple[torch.Tensor, torch.Tensor, int]] = Future()
            future.set_result(self._exchange(delta, meta))
        else:
            future = self._thread.submit(lambda: self._exchange(delta, meta))
        self._flight.append(_Round(index, delta, future, time.perf_counter()))
        if not gate:
            return
        # The bound: round r + 1 (the next) starts only once round r - staleness is delivered.
        start = time.perf_counter()
        while len(self._flight) > self.staleness:
            self._apply(self._flight.popleft())
        if self.dynamic:
            self._apply_done()
        waited = time.perf_counter() - start
        self.stats.wait_s += waited
        if self.recorder is not None and waited > 1e-4:
            self.recorder.record_wait(waited)
        self._deadline = self._next_deadline() if self.dynamic else None
        if self._deadline is not None and self._deadline <= time.time() and not self._behind:
            # Past the next deadline, and not behind the others (the last delivered round ended on every rank at
            # about the same time): the grid fell behind the wall clock for everyone, waiting for the link. The
            # next round gets its full length from now instead of ending at once with no step.
            self._deadline = time.time() + self._lengths[max(self._lengths)]

    def _next_deadline(self) -> float | None:
        """The end of the round about to start (wall clock), from the last round delivered; ``None`` (a round of
        ``local_steps`` steps) until the first measurement is delivered."""
        if not self._ends:
            return None
        q = max(self._ends)  # at least round launched - 1 - staleness (the bound delivered it)
        return self._origin + self._ends[q] + (self.launched - 1 - q) * self._lengths[q] + self._lengths[q]

    def _apply_done(self) -> None:
        while self._flight and self._flight[0].future.done():
            self._apply(self._flight.popleft())

    def _apply(self, rnd: _Round) -> torch.Tensor:
        """Deliver one round to this replica: the outer step replaces this rank's own contribution."""
        try:
            # The group's own timeout fails the collective first; this bound is the backstop. Waited in slices when
            # a stop can be requested meanwhile (a link-bound round can take long).
            deadline = time.perf_counter() + self.timeout_s + 30.0
            while True:
                try:
                    left = deadline - time.perf_counter()
                    slice_s = min(0.2, max(left, 0.0)) if self.should_stop is not None else max(left, 0.0)
                    grad, meta, nbytes = rnd.future.result(timeout=slice_s)
                    break
                except FutureTimeout:
                    if self.should_stop is not None and self.should_stop():
                        raise RoundsStopped(rnd.index) from None
                    if time.perf_counter() >= deadline:
                        raise
        except (FutureTimeout, RuntimeError) as err:
            waited = time.perf_counter() - rnd.launched_at
            who = f"rank {self.peers[0]}" if len(self.peers) == 1 else f"one of ranks {self.peers}"
            raise PeerLostError(
                f"rank {dist.get_rank()}: round {rnd.index} of the pseudo-gradient exchange failed after "
                f"{waited:.1f}s: lost peer {who}. Cause: {err}. HINT: the bound is timeout_s={self.timeout_s:g}; "
                "check that rank's log, then resume from the last checkpoint"
            ) from err
        per_rank = meta[: self.world * _FIELDS].view(self.world, _FIELDS)
        if _count(meta, self.world, 1) == self.world:
            # A cut where no rank had changed: not a round (counters and statistics stay as they were).
            self.launched -= 1
            self.stats.local_steps.pop()
            return meta
        self._clean = False  # the round carried someone's progress: the replicas may differ now
        if int(per_rank[:, 0].sum()) > 0:
            step = self.outer.step(grad)
        else:
            # No rank took a step (a cut right after a round ended, or everyone paused): not an outer step, or
            # every validation would add a momentum step. What it carries (residuals flushed at a cut) goes as is.
            step = grad
        correction = rnd.delta.sub_(step)  # delta_i - step: this rank's own progress out, the global step in
        add_flat_(self.tensors, correction)
        self._base += correction
        self.delivered += 1
        self.stats.rounds += 1
        lag = self.launched - 1 - rnd.index
        self.stats.lags.append(lag)
        if self.recorder is not None:
            self.recorder.record_staleness(lag)
            self.recorder.record_blocking(nbytes, self.scope, 0.0)
        self.step_times = per_rank[:, 2].tolist()
        ends = per_rank[:, 3].tolist()
        self._ends[rnd.index] = statistics.median(ends)
        times = [t for t in per_rank[:, 2].tolist() if t > 0]
        step_s = sum(times) / len(times) if times else None  # the ranks' mean step time
        exchange_s = float(per_rank[:, 4].max())  # the slowest rank's: a round is delivered when its exchange is
        if self.round_s is not None or step_s is not None:
            late = ends[self.rank] - self._ends[rnd.index]
            # Late against the pace rounds really end at: the round's compute, or the exchange when the link is
            # slower (the bound then paces every rank). A rank a few scheduler ticks late behind a link-bound
            # exchange is not behind: a catch-up round there costs a whole exchange and carries no step.
            length = self.round_s if self.round_s is not None else self.local_steps * step_s
            self._behind = late > 0.5 * max(length, exchange_s)
        if step_s is not None and exchange_s > 0:
            self.stats.exchange_s.append(exchange_s)
            # The same metadata on every rank, the same decision: the length changes at this round everywhere.
            self.length.update(step_s, exchange_s)
        if self.round_s is not None:
            self._lengths[rnd.index] = self.round_s
        elif step_s is not None:
            self._lengths[rnd.index] = self.local_steps * step_s
            self.stats.round_s.append(self._lengths[rnd.index])
        else:
            self._ends.pop(rnd.index)  # no speed measured yet: the next rounds stay step-counted
        for old in [k for k in self._ends if k < rnd.index]:
            self._ends.pop(old)
            self._lengths.pop(old, None)
        return meta

    def _exchange(self, delta: torch.Tensor, meta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """On the exchange thread: the metadata, then the pseudo-gradients (exact when every rank flagged a cut).
        Inline for one learner: no collective (over one rank it is the identity) and exact (nothing is sent)."""
        inline = self._inline
        nbytes = 0
        if not inline:
            all_reduce_(meta, self.group)
            nbytes += meta.numel() * meta.element_size()
        everyone_cut = _count(meta, self.world, 0) == self.world
        if everyone_cut and _count(meta, self.world, 1) == self.world:
            return torch.zeros_like(delta), meta, nbytes  # every rank clean (cut()): nothing to exchange
        start = time.perf_counter()
        if self.compressor is None or everyone_cut or inline:
            total = delta.clone()
            if self.compressor is not None:
                # Everything compression held back (own and server residuals) joins the exact round.
                residual = self.compressor.pop_residual("round", total.numel(), self.group)
                if residual is not None:
                    total += residual.to(total.device)  # restored from a checkpoint: maybe on the CPU
            if inline:
                return total, meta, nbytes
            all_reduce_(total, self.group)
            nbytes += total.numel() * total.element_size()
            self._exchange_s = time.perf_counter() - start
            return total / self.world, meta, nbytes
        mean, sent = self.compressor.allreduce(delta, self.group, key="round")
        self._exchange_s = time.perf_counter() - start
        return mean, meta, nbytes + sent

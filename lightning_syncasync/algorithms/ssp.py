"""Asynchronous data parallelism with Stale Synchronous Parallel bounded staleness (Ho et al., "More Effective
Distributed ML via a Stale Synchronous Parallel Parameter Server", NIPS 2013).

Design: decentralised background exchange of update deltas, clocks carried alongside. Every rank trains its own
replica. After each local step the rank applies ``1/N`` of its optimizer's update to its replica and puts the same
``1/N`` in an *outbox*. A daemon thread runs exchange rounds back to back on a process group of its own: one
all-reduce (sum) of ``[outbox | clock vector | cut flags]``; what the others sent (sum minus own) lands in an
*inbox* that the training loop merges into the replica at step boundaries only (never while backward reads the
weights). Why not a parameter server: a server (or a server shard per rank) needs point-to-point traffic that a
straggler's server shard would serialise, and torch's collectives on gloo/NCCL are the one communication layer this
project trusts; rounds of all-reduce keep every byte on that layer, spread evenly over all ranks, and let any
:class:`~lightning_syncasync.algorithms.compression.Compressor` plug in. A round does not wait for slow *compute*:
each rank's thread joins a round as soon as it has a new step, or when half its own step time (at least
``round_interval_s``) has passed without one, so a straggler only contributes fewer (never late) updates and idle
rounds cost at most about two exchanges per step (measured: joining every 5 ms regardless cost the 0.375-core ranks
of the ``straggler`` benchmark more CPU than their compute).

Invariants:

* Every update reaches every replica exactly once: own updates locally when made, others' when their round lands.
  With synchronous-speed workers, ``1/N`` of each of ``N`` updates per step is DDP's mean update.
* SSP gate: a rank at clock ``c`` (completed steps) starts its next step only when every other rank's known clock
  is ``>= c - staleness``. Known clocks lag the true ones, so the gate is conservative and the clock gap can never
  exceed ``staleness``. ``staleness=0`` is synchronous; ``None`` is ASP (no gate).
* Two staleness figures per update: the clock gap at its start (SSP's) and the version staleness, the number of
  other ranks' updates merged into the replica between reading the weights and the round that delivers this
  update to the others (DC-ASGD's ``tau``).
* A consistent cut (validation, checkpoints, the end of fit) flushes every outbox in one final round that every
  rank has flagged, merges it, and broadcasts rank 0's replica so all replicas are bitwise equal.
* Liveness: a torch store heartbeat per rank; a gate wait, a cut or a failed round that outlasts ``timeout_s``
  raises :class:`~lightning_syncasync.algorithms.averaging.PeerLostError` naming the rank whose heartbeat stopped
  and its last known clock.

Staleness in steps is only bounded with a finite ``staleness``; with a persistently slower rank a finite bound means
the fast ranks use up their slack and then wait (SSP absorbs transient slowness, not persistent heterogeneity).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from lightning_syncasync.algorithms._flat import add_flat_, copy_flat_
from lightning_syncasync.algorithms.averaging import PeerLostError
from lightning_syncasync.algorithms.compression import Compressor
from lightning_syncasync.algorithms.stats import StatsRecorder

log = logging.getLogger(__name__)

_HEARTBEAT_S = 1.0


@dataclass
class SSPStats:
    """Recorded staleness figures (also fed to the ``StatsRecorder``)."""

    clock_gaps: list[int] = field(default_factory=list)
    version_staleness: list[int] = field(default_factory=list)
    rounds: int = 0


class SSPExchange:
    """Background exchange of update deltas with an SSP gate, consistent cuts and a liveness timeout.

    Args:
        tensors: the replica's parameters (and float buffers), in a fixed order, identical at start on every rank.
        group: a process group used by nothing else (the exchange thread issues its collectives on it).
        staleness: the SSP bound ``s`` (``0``: synchronous; ``None``: ASP, no gate).
        timeout_s: how long a gate wait, a cut or a round may take before the run fails naming the lost rank.
        compressor: compression of the deltas (error feedback; ``None``: fp32).
        recorder: where bytes, wait time and staleness go.
        round_interval_s: the shortest a rank's thread waits for a new local step before joining a round anyway (it
            waits half its own mean step time when that is longer).
        store: the store for heartbeats (``None``: torch's default store).
        exchange_every: local steps a rank accumulates before joining a round (the others' updates and the clocks
            still arrive with every round). Fewer rounds cost less CPU and bandwidth; the staleness grows with it.

    Example::

        ex = SSPExchange(list(model.parameters()), dist.new_group(), staleness=4)
        ex.start()
        for batch in data:
            ex.begin_step()                       # gate, then merge what arrived
            loss = model(batch).sum(); loss.backward()
            ex.merge()                            # what arrived during backward (compensate grads with it)
            before = ex.flat(); opt.step()
            ex.finish_step(before)                # 1/N of the update stays, the same 1/N is shipped
        ex.cut(stop=True)                          # every update delivered, replicas equal, threads stopped
    """

    def __init__(
        self,
        tensors: list[torch.Tensor],
        group: dist.ProcessGroup | None,
        staleness: int | None = 1,
        timeout_s: float = 60.0,
        compressor: Compressor | None = None,
        recorder: StatsRecorder | None = None,
        round_interval_s: float = 0.005,
        store: Any = None,
        exchange_every: int = 1,
    ) -> None:
        if staleness is not None and staleness < 0:
            raise ValueError(f"staleness must be >= 0 or None (ASP), got {staleness}; HINT: 0 is synchronous")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if round_interval_s <= 0:
            raise ValueError(f"round_interval_s must be > 0, got {round_interval_s}")
        if not tensors:
            raise ValueError("tensors is empty: nothing to exchange")
        if exchange_every < 1:
            raise ValueError(f"exchange_every must be >= 1, got {exchange_every}")
        self.exchange_every = exchange_every
        self.tensors = tensors
        self.group = group
        self.staleness = staleness
        self.timeout_s = timeout_s
        self.compressor = compressor if compressor is not None and compressor.method != "none" else None
        self.recorder = recorder
        self.round_interval_s = round_interval_s
        self._step_ema: float | None = None  # this rank's mean step time (for the idle-round interval)
        self._last_finish: float | None = None
        if dist.get_world_size(group) != dist.get_world_size():
            raise ValueError("group must span every rank (cuts broadcast over the default group)")
        self.rank = dist.get_rank(group)
        self.global_rank = dist.get_rank()
        self.world = dist.get_world_size(group)
        self.global_ranks = dist.get_process_group_ranks(group) if group is not None else list(range(self.world))
        self.numel = sum(t.numel() for t in tensors)
        self.clock = 0
        self.known_clocks = [0] * self.world
        self.stats = SSPStats()
        self._outbox = torch.zeros(self.numel)
        # Per local step waiting for its round: how many other ranks' updates the replica held when it was read.
        self._outbox_steps: list[int] = []
        self._inbox = torch.zeros(self.numel)
        self._inbox_updates = 0
        self._merged = 0  # other ranks' updates merged into this replica so far
        self._arrived = 0  # ... and received by the thread (merged or waiting in the inbox)
        self._cond = threading.Condition()
        self._cut_requested = False
        self._cut_round_done = False
        self._stop_after_cut = False
        self._stop = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._store = store
        self._hb: threading.Thread | None = None
        self._hb_stop = threading.Event()

    # -- lifecycle ---------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the exchange and heartbeat threads (all ranks)."""
        if self._store is None:
            self._store = dist.PrefixStore("syncasync_ssp", dist.distributed_c10d._get_default_store())
        self._stop = False
        self._hb_stop.clear()
        self._thread = threading.Thread(target=self._loop, name="syncasync-ssp", daemon=True)
        self._thread.start()
        self._hb = threading.Thread(target=self._heartbeat, name="syncasync-ssp-heartbeat", daemon=True)
        self._hb.start()

    def close(self) -> None:
        """Stop the threads. ``cut(stop=True)`` first keeps every update and stops every rank's thread after the same
        round; closing without it (after a failure) may leave a peer's collective waiting for its timeout."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=self.timeout_s)
            self._thread = None
        # The heartbeat too: left running, a store call of it could be cut by the interpreter's exit (an abort).
        self._hb_stop.set()
        if self._hb is not None:
            self._hb.join(timeout=3 * _HEARTBEAT_S)
            self._hb = None

    # -- the training loop's side ------------------------------------------------------------------------------

    def flat(self) -> torch.Tensor:
        return torch.cat([t.detach().reshape(-1).float() for t in self.tensors])

    def begin_step(self) -> None:
        """Wait at the SSP gate, then merge what has arrived. Records the clock gap of the step about to run."""
        start = time.perf_counter()
        with self._cond:
            while True:
                self._raise_if_failed()
                others = [c for i, c in enumerate(self.known_clocks) if i != self.rank]
                slowest = min(others) if others else self.clock
                if self.staleness is None or slowest >= self.clock - self.staleness:
                    break
                if time.perf_counter() - start > self.timeout_s:
                    self._lost(f"the SSP gate (clock {self.clock}, staleness {self.staleness}) waited")
                self._cond.wait(timeout=0.05)
            gap = max(self.clock - slowest, 0)
        waited = time.perf_counter() - start
        if self.recorder is not None and waited > 1e-4:
            self.recorder.record_wait(waited)
        self.merge()
        self._read = self._merged
        self.stats.clock_gaps.append(gap)
        if self.recorder is not None:
            self.recorder.record_clock_gap(gap)

    def merge(self) -> tuple[torch.Tensor | None, int]:
        """Apply every delta the other ranks' rounds delivered; returns ``(delta, updates)`` (``None`` if none)."""
        with self._cond:
            self._raise_if_failed()
            if not self._inbox_updates and not bool(self._inbox.any()):
                return None, 0
            delta, self._inbox = self._inbox, torch.zeros(self.numel)
            updates, self._inbox_updates = self._inbox_updates, 0
            self._merged += updates
        add_flat_(self.tensors, delta)
        return delta, updates

    def finish_step(self, before: torch.Tensor) -> None:
        """After the optimizer step: keep ``1/N`` of the update made since ``before`` and ship the same ``1/N``."""
        now = time.perf_counter()
        if self._last_finish is not None:
            dt = now - self._last_finish
            self._step_ema = dt if self._step_ema is None else 0.8 * self._step_ema + 0.2 * dt
        self._last_finish = now
        share = (self.flat() - before) / self.world
        copy_flat_(self.tensors, before + share)
        with self._cond:
            self._outbox += share
            self._outbox_steps.append(self._read)
            self.clock += 1
            self._cond.notify_all()

    def cut(self, stop: bool = False) -> None:
        """A consistent cut (every rank calls it at the same step): flush all updates, merge, agree bitwise.
        ``stop=True`` (every rank alike, e.g. at the end of fit) ends the exchange after the cut's round."""
        start = time.perf_counter()
        with self._cond:
            self._stop_after_cut = stop
            self._cut_requested = True
            self._cut_round_done = False
            self._cond.notify_all()
            while not self._cut_round_done:
                self._raise_if_failed()
                if time.perf_counter() - start > self.timeout_s:
                    self._lost("a consistent cut waited")
                self._cond.wait(timeout=0.05)
        self.merge()
        with torch.no_grad():
            for t in self.tensors:
                # The default group: the exchange thread may already run the next round on its own group.
                dist.broadcast(t.data, src=self.global_ranks[0])
        with self._cond:
            self._cut_requested = False
            self._cond.notify_all()
        if stop:
            self.close()
        if self.recorder is not None:
            self.recorder.record_wait(time.perf_counter() - start)

    def state_dict(self) -> dict[str, Any]:
        """At a cut: the clock (identical on every rank after a cut at the same step) and the compressor state."""
        state: dict[str, Any] = {"clock": self.clock, "rounds": self.stats.rounds}
        if self.compressor is not None:
            state["compression"] = self.compressor.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.clock = int(state["clock"])
        self.known_clocks = [self.clock] * self.world
        if self.compressor is not None and "compression" in state:
            self.compressor.load_state_dict(state["compression"])

    # -- the exchange thread -------------------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    # Join when `exchange_every` local steps are waiting, at a cut, or when idle long enough.
                    idle = max(self.round_interval_s, (self.exchange_every - 0.5) * (self._step_ema or 0.0))
                    deadline = time.perf_counter() + idle
                    while not self._stop and len(self._outbox_steps) < self.exchange_every and not self._cut_requested:
                        left = deadline - time.perf_counter()
                        if left <= 0:
                            break
                        self._cond.wait(timeout=left)
                    if self._stop:
                        return
                    if self._cut_round_done and self._stop_after_cut:
                        return  # every rank asked for this: no round after the cut's
                    if self._cut_round_done and self._cut_requested:
                        # The cut's round is done: wait for the training loop to release it.
                        self._cond.wait(timeout=0.05)
                        continue
                    send, self._outbox = self._outbox, torch.zeros(self.numel)
                    shipped, self._outbox_steps = self._outbox_steps, []
                    clock, flag = self.clock, 1.0 if self._cut_requested else 0.0
                self._round(send, shipped, clock, flag)
        except BaseException as err:  # noqa: BLE001 - handed to the training loop, which raises it
            with self._cond:
                self._error = err
                self._cond.notify_all()

    def _round(self, send: torch.Tensor, shipped: list[int], clock: int, flag: float) -> None:
        meta = torch.zeros(self.world + 1, dtype=torch.float64)
        meta[self.rank] = clock
        meta[-1] = flag
        if self.compressor is None:
            # One all-reduce: the deltas and, in the same fp32 buffer, the clocks and flags (exact below 2**24).
            buf = torch.cat([send, meta.float()])
            dist.all_reduce(buf, group=self.group)
            nbytes = buf.numel() * buf.element_size()
            others = buf[: self.numel] - send
            meta = buf[self.numel :].double()
        else:
            # Clocks and flags first: whether this is the cut's round must be agreed before the payload's format.
            dist.all_reduce(meta, group=self.group)
            nbytes = meta.numel() * meta.element_size()
            if int(round(float(meta[-1]))) == self.world:
                # The cut's round is exact and carries the error-feedback residual: nothing stays held back.
                residual = self.compressor.residuals.pop("delta", None)
                sent = send + residual if residual is not None else send
                total = sent.double()
                dist.all_reduce(total, group=self.group)
                nbytes += total.numel() * total.element_size()
                others = (total - sent.double()).float()  # this rank's own updates are all in its replica already
            else:
                old = self.compressor.residuals.get("delta")
                compensated = send + old if old is not None else send
                mean, sent_bytes = self.compressor.allreduce(send, self.group, key="delta")
                nbytes += sent_bytes
                # The others received this rank's decoded contribution (the rest waits in the residual).
                own = compensated - self.compressor.residuals["delta"]
                others = mean * self.world - own
        clocks = [int(c) for c in meta[: self.world].tolist()]
        everyone_flagged = int(round(float(meta[-1]))) == self.world
        with self._cond:
            pairs = enumerate(zip(clocks, self.known_clocks, strict=True))
            new_updates = sum(max(c - k, 0) for i, (c, k) in pairs if i != self.rank)
            self._inbox += others
            self._inbox_updates += new_updates
            self._arrived += new_updates
            self.known_clocks = clocks
            self.stats.rounds += 1
            for s in shipped:
                self.stats.version_staleness.append(self._arrived - s)
                if self.recorder is not None:
                    self.recorder.record_staleness(self._arrived - s)
            if everyone_flagged:
                self._cut_round_done = True
            self._cond.notify_all()
        if self.recorder is not None:
            self.recorder.record_blocking(nbytes, "intra", 0.0)

    # -- liveness ----------------------------------------------------------------------------------------------

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

"""Asynchronous data parallelism with Stale Synchronous Parallel bounded staleness (Ho et al., "More Effective
Distributed ML via a Stale Synchronous Parallel Parameter Server", NIPS 2013).

Design: a replicated parameter server fed by background all-reduce rounds of *gradients*, clocks carried alongside.
Every rank is a worker and, at the same time, a full replica of the server. A worker computes a gradient on its
replica as it is (never waiting for the others, except at the SSP gate) and puts it in an *outbox*. A daemon
thread runs exchange rounds back to back on a process group of its own: one all-reduce (sum) of
``[outbox | clock vector | cut flags | gradient count | learning rates]``. Every rank receives the same sums, in the
same order, and folds them into an *accumulator*; as soon as it holds ``quorum`` gradients (default: one per rank,
the number DDP averages) it becomes one server update: the mean of its ``k`` gradients, applied by the rank's own
optimizer at ``k / world`` times the learning rate (a round can bring more gradients than the quorum). The
training loop applies server updates at step boundaries only (never while backward reads the weights). Every rank
applies the same updates in the same order to the same starting weights with the same optimizer, so the replicas
and the optimizer states stay equal without ever being sent.

Why this design (measured, not assumed): the first design shipped each rank's *optimizer update* (``1/N`` of it,
decentralised averaging of update deltas). With Adam, the mean of ``N`` updates computed from ``N`` noisy
per-rank gradients is much smaller and noisier than one update from their mean: on the ``straggler`` benchmark
(convnet, Adam) it never reached the validation target (0.60 against DDP's 0.93 at the end of the budget). Shipping
gradients and running the optimizer on their mean learns per sample like DDP: with everyone at the same speed and
``staleness=0`` it *is* DDP (every step reads the weights after every gradient of the step before). Stragglers only
change who contributes: a fast rank puts more gradients into each server update, a slow one fewer, and nobody waits
for anybody (Pipe-SGD, Li et al., NeurIPS 2018, does the same with a fixed one-step delay and synchronous
workers). Why not a classical parameter server: a server (or a server shard per rank) needs point-to-point traffic
that a straggler's shard would serialise, and torch's collectives on gloo/NCCL are the one communication layer this
project trusts; rounds of all-reduce keep every byte on that layer, spread evenly over all ranks, and let any
:class:`~lightning_syncasync.algorithms.compression.Compressor` plug in. A round does not wait for slow *compute*:
each rank's thread joins a round as soon as it has a new step, or when half its own step time (at least
``round_interval_s``) has passed without one, so a straggler only contributes fewer (never late) gradients and idle
rounds cost at most about two exchanges per step.

Invariants:

* Every gradient reaches every replica exactly once, weighted ``1/world`` (DDP's mean). With SGD the sum of all
  applied updates equals ``-lr/world`` times the sum of all computed gradients, whoever computed them; with Adam an
  update of ``k`` gradients moves ``k / world`` as far as one of DDP's (the rate's scale), so the steps per sample
  stay DDP's.
* SSP gate: a rank at clock ``c`` (completed steps) starts its next step only when every rank's *delivered* clock
  (its own included) is ``>= c - staleness``. Delivered clocks lag the true ones, so the gate is conservative and
  the clock gap never exceeds ``staleness``. ``staleness=0`` is synchronous (DDP's trajectory); ``None`` is ASP (no
  gate, only the liveness timeout).
* Two staleness figures per gradient: the clock gap at its start (SSP's) and the version staleness, the number of
  server updates between the weights it was computed on and the update it is applied in (DC-ASGD's ``tau``).
* A consistent cut (validation, checkpoints, the end of fit) flushes every outbox in one final round that every
  rank has flagged, applies everything (the remainder below the quorum too), then broadcasts rank 0's parameters
  and buffers, so all replicas are bitwise equal even if a platform's arithmetic were not deterministic. Buffers
  (BatchNorm statistics) are not gradients: each rank keeps its own between cuts and rank 0's are everyone's at a
  cut (DDP's rule, where rank 0's buffers are broadcast).
* Liveness: a torch store heartbeat per rank; a gate wait, a cut or a failed round that outlasts ``timeout_s``
  raises :class:`~lightning_syncasync.algorithms.watchdog.PeerLostError` naming the rank whose heartbeat stopped
  and its last known clock.

Staleness in steps is only bounded with a finite ``staleness``; with a persistently slower rank a finite bound means
the fast ranks use up their slack and then wait (SSP absorbs transient slowness, not persistent heterogeneity).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from lightning_syncasync.algorithms._comm import all_reduce_, broadcast_
from lightning_syncasync.algorithms.compression.compressor import Compressor
from lightning_syncasync.algorithms.ssp._liveness import _HEARTBEAT_S, _Liveness
from lightning_syncasync.algorithms.ssp.totals import grads_total, loss_total
from lightning_syncasync.algorithms.stats import StatsRecorder
from lightning_syncasync.algorithms.streams import SideStream

log = logging.getLogger(__name__)

# loss_total and grads_total were defined here: still importable from here.
__all__ = ["ApplyFn", "SSPExchange", "SSPStats", "grads_total", "loss_total"]

# Applies one server update: (gradient over the server's parameters, flat; learning rate per param group).
ApplyFn = Callable[[torch.Tensor, list[float]], None]


@dataclass
class SSPStats:
    """Recorded staleness figures (also fed to the ``StatsRecorder``)."""

    clock_gaps: list[int] = field(default_factory=list)
    version_staleness: list[int] = field(default_factory=list)
    rounds: int = 0
    gradients: list[int] = field(default_factory=list)  # gradients in each server update


class SSPExchange(_Liveness):
    """Background exchange of gradients with an SSP gate, server updates on every replica, consistent cuts and a
    liveness timeout.

    Args:
        params: the replica's parameters, in a fixed order, identical at start on every rank.
        group: a process group used by nothing else (the exchange thread issues its collectives on it).
        staleness: the SSP bound ``s`` (``0``: synchronous; ``None``: ASP, no gate).
        timeout_s: how long a gate wait, a cut or a round may take before the run fails naming the lost rank.
        compressor: compression of the gradients (error feedback; ``None``: fp32).
        recorder: where bytes, wait time and staleness go.
        round_interval_s: the shortest a rank's thread waits for a new local step before joining a round anyway (it
            waits half its own mean step time when that is longer).
        store: the store for heartbeats (``None``: torch's default store).
        exchange_every: local steps a rank accumulates before joining a round (the server updates and the clocks
            still arrive with every round). Fewer rounds cost less CPU and bandwidth; the staleness grows with it.
        buffers: tensors made rank 0's at every cut (BatchNorm statistics), not exchanged otherwise.
        quorum: gradients per server update (default: the world size, DDP's global batch).
        num_lrs: learning rates shipped with each gradient (one per param group); a server update uses the mean of
            its gradients' rates, so every replica applies it alike even when the ranks' schedules are at different
            steps.
        side_stream: on CUDA, run the exchange thread on a stream of its own (``algorithms/streams.py``); ``False``
            gives the same results without the overlap.

    Example::

        ex = SSPExchange(list(model.parameters()), dist.new_group(), staleness=4)
        ex.start()
        apply = lambda grad, lrs: ...             # set p.grad from ``grad``, the lrs, ``opt.step()``
        for batch in data:
            ex.begin_step(apply)                  # gate, then the server updates that arrived
            loss = model(batch).sum(); loss.backward()
            ex.ship(torch.cat([p.grad.flatten() for p in model.parameters()]), [lr])
        ex.cut(apply, stop=True)                   # every gradient applied, replicas equal, threads stopped
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        group: dist.ProcessGroup | None,
        staleness: int | None = 1,
        timeout_s: float = 60.0,
        compressor: Compressor | None = None,
        recorder: StatsRecorder | None = None,
        round_interval_s: float = 0.005,
        store: Any = None,
        exchange_every: int = 1,
        buffers: Sequence[torch.Tensor] = (),
        quorum: int | None = None,
        num_lrs: int = 1,
        side_stream: bool = True,
    ) -> None:
        if staleness is not None and staleness < 0:
            raise ValueError(f"staleness must be >= 0 or None (ASP), got {staleness}; HINT: 0 is synchronous")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if round_interval_s <= 0:
            raise ValueError(f"round_interval_s must be > 0, got {round_interval_s}")
        if not params:
            raise ValueError("params is empty: nothing to exchange")
        if exchange_every < 1:
            raise ValueError(f"exchange_every must be >= 1, got {exchange_every}")
        if quorum is not None and quorum < 1:
            raise ValueError(f"quorum must be >= 1 or None (the world size), got {quorum}")
        if num_lrs < 1:
            raise ValueError(f"num_lrs must be >= 1 (one per param group), got {num_lrs}")
        if dist.get_world_size(group) != dist.get_world_size():
            raise ValueError("group must span every rank (cuts broadcast over the default group)")
        self.exchange_every = exchange_every
        self.tensors = list(params)
        self.buffers = list(buffers)
        self.group = group
        self.staleness = staleness
        self.timeout_s = timeout_s
        self.compressor = compressor if compressor is not None and compressor.method != "none" else None
        if self.compressor is not None:
            self.compressor.check_backend(group)  # before any round: a missing collective fails here, named
        self.recorder = recorder
        self.round_interval_s = round_interval_s
        self.num_lrs = num_lrs
        self._step_ema: float | None = None  # this rank's mean step time (for the idle-round interval)
        self._last_finish: float | None = None
        self.rank = dist.get_rank(group)
        self.global_rank = dist.get_rank()
        self.world = dist.get_world_size(group)
        self.quorum = quorum if quorum is not None else self.world
        self.global_ranks = dist.get_process_group_ranks(group) if group is not None else list(range(self.world))
        self.numel = sum(t.numel() for t in params)
        self.clock = 0
        self.known_clocks = [0] * self.world  # delivered clocks (this rank's own included)
        self.applied = 0  # server updates applied to this replica
        self.stats = SSPStats()
        # Gradients stay on the model's device; the host figures (learning rates, clocks) on the CPU.
        self.device = params[0].device
        self._side = SideStream(self.device, side_stream)
        self._consumer: Any = None  # the training loop's CUDA stream, taken at start()
        self._outbox = torch.zeros(self.numel, device=self.device)
        self._outbox_lrs = torch.zeros(num_lrs, dtype=torch.float64, device="cpu")
        # Per gradient waiting for its round: the server updates the replica held when it was computed.
        self._outbox_reads: list[int] = []
        # Per gradient shipped with its loss (ship's ``loss``): its place in the outbox, its clock, its learning
        # rates and the loss's fp32 sum on the device, for the exchange thread to check (:meth:`pop_nonfinite`).
        self._outbox_checks: list[tuple[int, int, list[float], torch.Tensor]] = []
        self._nonfinite: list[tuple[int, float]] = []
        self._read = 0
        # Between a step's gate (begin_step) and its ship: the gate runs before the step's first forward, which under
        # gradient accumulation or manual optimization comes before the optimizer call that ships.
        self._gated = False
        self.read_weights: torch.Tensor | None = None  # begin_step(keep_read=True): the weights the step reads
        # Gradients received but short of the quorum, and the server updates formed but not applied yet.
        self._acc = torch.zeros(self.numel, device=self.device)
        self._acc_lrs = torch.zeros(num_lrs, dtype=torch.float64, device="cpu")
        self._acc_count = 0
        self._last_lrs: list[float] | None = None
        self._ready: list[tuple[torch.Tensor, list[float], int]] = []
        self._formed = 0  # server updates formed so far (applied or waiting in ``_ready``)
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
        self._consumer = self._side.consumer()
        self._thread = threading.Thread(target=self._loop, name="syncasync-ssp", daemon=True)
        self._thread.start()
        self._hb = threading.Thread(target=self._heartbeat, name="syncasync-ssp-heartbeat", daemon=True)
        self._hb.start()

    def close(self) -> None:
        """Stop the threads. ``cut(stop=True)`` first keeps every gradient and stops every rank's thread after the
        same round; closing without it (after a failure) may leave a peer's collective waiting for its timeout."""
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

    @property
    def gated(self) -> bool:
        """This step has passed its gate (:meth:`begin_step`) and not shipped yet (:meth:`ship`)."""
        return self._gated

    def ungate(self) -> None:
        """Forget a gate passed without a ship to follow (an optimizer that skipped its closure): the next step
        passes the gate again, on its own weights."""
        self._gated = False
        self.read_weights = None

    def begin_step(self, apply: ApplyFn, keep_read: bool = False) -> None:
        """Wait at the SSP gate, then apply the server updates that arrived. Records the clock gap of the step about
        to run and remembers which server update its gradient will be computed on; ``keep_read`` also keeps a copy
        of the weights themselves (``read_weights``, for a delay compensation's ``w_now - w_read``). Call it before
        the step's first forward."""
        start = time.perf_counter()
        with self._cond:
            while True:
                self._raise_if_failed()
                others = [c for i, c in enumerate(self.known_clocks) if i != self.rank]
                slowest = min(others) if others else self.clock
                # Own delivered clock too: at staleness 0 a step must see the server update holding its own last
                # gradient, else two lockstep steps would read the same weights.
                delivered = min(self.known_clocks)
                if self.staleness is None or delivered >= self.clock - self.staleness:
                    break
                if time.perf_counter() - start > self.timeout_s:
                    self._lost(f"the SSP gate (clock {self.clock}, staleness {self.staleness}) waited")
                self._cond.wait(timeout=0.05)
            gap = max(self.clock - slowest, 0)
        waited = time.perf_counter() - start
        if self.recorder is not None and waited > 1e-4:
            self.recorder.record_wait(waited)
        self.apply_ready(apply)
        self._read = self.applied
        self.read_weights = self.flat() if keep_read else None
        self._gated = True
        self.stats.clock_gaps.append(gap)
        if self.recorder is not None:
            self.recorder.record_clock_gap(gap)

    def apply_ready(self, apply: ApplyFn) -> int:
        """Apply, in order, every server update formed so far; returns how many."""
        with self._cond:
            self._raise_if_failed()
            ready, self._ready = self._ready, []
        for grad, lrs, count in ready:
            apply(grad, lrs)
            self.applied += 1
            self.stats.gradients.append(count)
        return len(ready)

    @property
    def updates_since_read(self) -> int:
        """Server updates applied since this step's gradient started (the ``tau`` of its compensation)."""
        return self.applied - self._read

    def ship(
        self,
        grad: torch.Tensor | None,
        lrs: Sequence[float],
        loss: torch.Tensor | None = None,
        masked: bool = False,
    ) -> None:
        """After backward: hand this step's gradient (flat, fp32, over ``params``) to the exchange, with the
        learning rate of each param group. ``None`` ships nothing (a dropped step) but still advances the clock.

        ``loss`` (detached, on the gradient's device): the exchange checks it instead of the loop, for an accelerator,
        where reading it back at every step would make the host wait for the device. A non-finite loss zeroes the
        gradient on the device at once, and the exchange thread, which reads the loss when its round starts (its own
        stream has waited for the loop's by then: the thread waits, the loop does not), drops that gradient from the
        round as ``ship(None)`` would and reports it through :meth:`pop_nonfinite`. The check is of the loss's fp32
        sum, as ``RoundExchange.note_loss``'s. ``masked``: the caller has zeroed ``grad`` already when that sum is not
        finite (``ssp_optimizer_step`` does, before its compensation), which saves a pass over the gradient."""
        now = time.perf_counter()
        if self._last_finish is not None:
            dt = now - self._last_finish
            self._step_ema = dt if self._step_ema is None else 0.8 * self._step_ema + 0.2 * dt
        self._last_finish = now
        if len(lrs) != self.num_lrs:
            raise ValueError(f"ship() got {len(lrs)} learning rates, the exchange was built for num_lrs={self.num_lrs}")
        total = None
        if grad is not None and loss is not None:
            total = loss_total(loss)
            if not masked:
                grad = grad.masked_fill(~torch.isfinite(total), 0.0)  # on the device: no host sync
        with self._cond:
            if grad is not None:
                if total is not None:
                    self._outbox_checks.append((len(self._outbox_reads), self.clock, list(lrs), total))
                self._outbox += grad
                self._outbox_lrs += torch.tensor(list(lrs), dtype=torch.float64, device="cpu")
                self._outbox_reads.append(self._read)
            self.clock += 1
            self._gated = False
            self.read_weights = None
            self._cond.notify_all()

    def pop_nonfinite(self) -> list[tuple[int, float]]:
        """The gradients dropped for a non-finite ``loss`` (:meth:`ship`) since the last call: (clock, loss sum)."""
        with self._cond:
            found, self._nonfinite = self._nonfinite, []
        return found

    def cut(self, apply: ApplyFn, stop: bool = False) -> None:
        """A consistent cut (every rank calls it at the same step): flush all gradients, apply everything, agree
        bitwise. ``stop=True`` (every rank alike, e.g. at the end of fit) ends the exchange after the cut's round."""
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
        self.apply_ready(apply)
        with torch.no_grad():
            for t in [*self.tensors, *self.buffers]:
                # The default group: the exchange thread may already run the next round on its own group.
                broadcast_(t.data, self.global_ranks[0])
        with self._cond:
            self._cut_requested = False
            self._cond.notify_all()
        if stop:
            self.close()
        if self.recorder is not None:
            self.recorder.record_wait(time.perf_counter() - start)

    def state_dict(self) -> dict[str, Any]:
        """At a cut: the clock and the server updates applied (identical on every rank after a cut at the same
        step) and the compressor state."""
        state: dict[str, Any] = {"clock": self.clock, "rounds": self.stats.rounds, "applied": self.applied}
        if self.compressor is not None:
            state["compression"] = self.compressor.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.clock = int(state["clock"])
        self.known_clocks = [self.clock] * self.world
        self.applied = self._formed = self._read = int(state.get("applied", 0))
        self.ungate()  # a restored clock starts a step afresh
        if self.compressor is not None and "compression" in state:
            self.compressor.load_state_dict(state["compression"])

    # -- the exchange thread -------------------------------------------------------------------------------------

    def _loop(self) -> None:
        with self._side.context():
            self._rounds()

    def _rounds(self) -> None:
        # On CUDA this runs on the side stream (algorithms/streams.py): it waits for the loop's stream before it
        # reads what the loop wrote (the outbox), and finishes its own work before it hands anything over.
        try:
            while True:
                with self._cond:
                    # Join when `exchange_every` local steps are waiting, at a cut, or when idle long enough.
                    idle = max(self.round_interval_s, (self.exchange_every - 0.5) * (self._step_ema or 0.0))
                    deadline = time.perf_counter() + idle
                    while not self._stop and self._pending() < self.exchange_every and not self._cut_requested:
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
                    self._side.follow(self._consumer)  # the loop's writes into the outbox first
                    send, self._outbox = self._outbox, torch.zeros(self.numel, device=self.device)
                    self._side.flush()  # the new outbox is zero before the loop adds to it
                    self._side.lend(self._outbox, self._consumer)
                    fresh_lrs = torch.zeros(self.num_lrs, dtype=torch.float64, device="cpu")
                    lrs, self._outbox_lrs = self._outbox_lrs, fresh_lrs
                    shipped, self._outbox_reads = self._outbox_reads, []
                    checks, self._outbox_checks = self._outbox_checks, []
                    clock, flag = self.clock, 1.0 if self._cut_requested else 0.0
                if checks:
                    shipped = self._drop_nonfinite(checks, shipped, lrs)
                self._round(send, lrs, shipped, clock, flag)
        except BaseException as err:  # noqa: BLE001 - handed to the training loop, which raises it
            with self._cond:
                self._error = err
                self._cond.notify_all()

    def _drop_nonfinite(
        self, checks: list[tuple[int, int, list[float], torch.Tensor]], shipped: list[int], lrs: torch.Tensor
    ) -> list[int]:
        """Read the losses shipped with this round's gradients (a wait of this thread for the loop's stream, which its
        own follows by now); the non-finite ones' gradients (zeroed by ``ship``) leave the count, their learning
        rates the sum (in place), and are reported. Returns the reads of the gradients that stay."""
        values = torch.stack([total for *_, total in checks]).cpu().tolist()
        bad = [(check, value) for check, value in zip(checks, values, strict=True) if not math.isfinite(value)]
        if not bad:
            return shipped
        for (_, _, rates, _), _ in bad:
            lrs -= torch.tensor(rates, dtype=torch.float64, device="cpu")
        dropped = {index for (index, *_), _ in bad}
        with self._cond:
            self._nonfinite.extend((clock, value) for (_, clock, _, _), value in bad)
        return [read for i, read in enumerate(shipped) if i not in dropped]

    def _pending(self) -> int:
        """Local steps since the last round (a dropped step counts: its clock must still travel)."""
        return self.clock - self.known_clocks[self.rank]

    def _round(self, send: torch.Tensor, lrs: torch.Tensor, shipped: list[int], clock: int, flag: float) -> None:
        # meta: clock per rank, cut flags, gradient count, learning-rate sums. Exact in fp32 below 2**24 (counts);
        # the rates are summed in the same order on every rank, so every rank reads the same mean.
        meta = torch.zeros(self.world + 2 + self.num_lrs, dtype=torch.float64, device="cpu")
        meta[self.rank] = clock
        meta[self.world] = flag
        meta[self.world + 1] = len(shipped)  # one read per gradient in the outbox
        meta[self.world + 2 :] = lrs
        if self.compressor is None:
            # One all-reduce: the gradients and, in the same fp32 buffer, the metadata.
            buf = torch.cat([send, meta.float().to(send.device)])
            all_reduce_(buf, self.group)
            nbytes = buf.numel() * buf.element_size()
            total = buf[: self.numel]
            meta = buf[self.numel :].double().cpu()
        else:
            # Metadata first: whether this is the cut's round must be agreed before the payload's format.
            all_reduce_(meta, self.group)
            nbytes = meta.numel() * meta.element_size()
            if int(round(float(meta[self.world]))) == self.world:
                # The cut's round is exact and carries the error-feedback residual: nothing stays held back.
                residual = self.compressor.pop_residual("grad", send.numel(), self.group)
                exact = (send + residual.to(send.device) if residual is not None else send).double()
                all_reduce_(exact, self.group)
                nbytes += exact.numel() * exact.element_size()
                total = exact.float()
            else:
                mean, sent_bytes = self.compressor.allreduce(send, self.group, key="grad")
                nbytes += sent_bytes
                total = mean * self.world  # the same decoded sum on every rank; the error waits in the residual
        clocks = [int(c) for c in meta[: self.world].tolist()]
        everyone_flagged = int(round(float(meta[self.world]))) == self.world
        arrived = int(round(float(meta[self.world + 1])))
        with self._cond:
            landing = self._formed  # the server update this round's gradients join
            self._acc += total
            self._acc_count += arrived
            self._acc_lrs += meta[self.world + 2 :]
            if self._acc_count >= self.quorum or (everyone_flagged and (self._acc_count or bool(self._acc.any()))):
                self._form()
            self.known_clocks = clocks
            self.stats.rounds += 1
            for s in shipped:
                self.stats.version_staleness.append(landing - s)
                if self.recorder is not None:
                    self.recorder.record_staleness(landing - s)
            if everyone_flagged:
                self._cut_round_done = True
            self._side.lend([grad for grad, _, _ in self._ready], self._consumer)
            self._side.flush()  # what this round formed is complete before the loop may read it
            self._cond.notify_all()
        if self.recorder is not None:
            self.recorder.record_blocking(nbytes, "intra", 0.0)

    def _form(self) -> None:
        """Turn the accumulator into one server update (under the lock): the mean of its ``k`` gradients at ``k /
        world`` times their mean learning rate. A round can overshoot the quorum (it brings several gradients at
        once), and Adam's step does not grow with the gradient's size: without the scale, an update of 6 gradients
        would move the weights as far as one of 4, and the run would take fewer steps than DDP for the same samples
        (measured on a toy quadratic: updates of 4-9 gradients under ASP). With SGD the update is ``lr * sum /
        world`` either way, DDP's mean; with ``k = world`` (lockstep) it is DDP's update exactly."""
        if self._acc_count:
            scale = self._acc_count / self.world
            self._last_lrs = (self._acc_lrs / self._acc_count).tolist()
            grad, lrs = self._acc / self._acc_count, [lr * scale for lr in self._last_lrs]
        else:
            # A cut's round may bring only an error-feedback residual: the sum's share, at the last rates seen.
            grad, lrs = self._acc / self.world, self._last_lrs if self._last_lrs is not None else [0.0] * self.num_lrs
        self._ready.append((grad, lrs, self._acc_count))
        self._formed += 1
        # The first accumulator was allocated by the training thread (its stream's memory pool) and read above on
        # the side stream: freed without this, its memory could go to the training thread's next allocation while
        # those reads are still queued. The later ones are allocated here, on the side stream, and need nothing.
        self._side.lend(self._acc, self._side.consumer())
        self._acc = torch.zeros(self.numel, device=self.device)
        self._acc_lrs = torch.zeros(self.num_lrs, dtype=torch.float64, device="cpu")
        self._acc_count = 0

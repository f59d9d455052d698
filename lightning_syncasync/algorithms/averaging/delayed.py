"""Bounded-delay averaging of node models across nodes, sharded over the ranks of each node.

Hierarchical synchronisation (the design brief's "intra-node full sync, inter-node quasi-sync allowing 1-2
iterations of delay"): ranks of one node keep identical replicas by all-reducing gradients every step (DDP on the
node's group); every ``inter_period`` steps the node replicas are averaged across nodes. That average is launched
asynchronously and applied ``max_delay`` steps later as an additive correction ``avg(snapshot) - snapshot``, so the
local progress made while it was in flight is kept (as in overlapped local SGD: Wang et al., "Overlap Local-SGD",
ICASSP 2020). Optionally the average goes through an outer Nesterov-momentum step (DiLoCo: Douillard et al., 2023):
the pseudo-gradient ``anchor - avg`` is taken against the last global model (the *anchor*, identical on every node),
so every node computes the same new global model, ``anchor - outer_lr * nesterov(pseudo-gradient)``; each node then
adds the difference between that model and its own snapshot, which keeps its local progress since the launch.

Traffic is spread over all local ranks instead of one leader per node: since the replicas of a node are identical,
local rank ``i`` takes shard ``i`` of the flattened model and all-reduces it with local rank ``i`` of every other
node (the "all-reduce across" of reduce-scatter / all-reduce / all-gather, where the reduce-scatter inside the node is
free because the node already agrees); the corrections are then all-gathered inside the node.

With ``inter_period=1``, ``max_delay=0`` and plain averaging, a step of SGD followed by the average equals flat
data-parallel SGD over all ranks (the mean of the node updates is the update of the mean gradient).

Compression of the inter-node hop (a :class:`~lightning_syncasync.algorithms.compression.Compressor`) is applied to
the shard's distance from the last global model (``snapshot - anchor``, small and centred on zero, what DiLoCo-style
methods compress), never to the weights themselves, with error feedback. Compressed exchanges are blocking
collectives, so they run on a daemon thread of their own (the cross-node group is used by nothing else).

A lost peer cannot hang the run: the cross-node group has a timeout (``timeout_s``), and a failed or timed-out round
raises :class:`PeerLostError` naming the ranks on the other end.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_syncasync.algorithms._comm import CommThread, all_gather_flat, all_reduce_, wire_device
from lightning_syncasync.algorithms._flat import add_flat_, copy_flat_
from lightning_syncasync.algorithms.averaging.outer import Outer, OuterOptimizer, check_outer
from lightning_syncasync.algorithms.averaging.round_length import RoundLength
from lightning_syncasync.algorithms.compression.compressor import Compressor
from lightning_syncasync.algorithms.stats import StatsRecorder, timing_event
from lightning_syncasync.algorithms.watchdog import PeerLostError

__all__ = ["DelayedAverager", "PeerLostError", "check_settings"]


def check_settings(
    inter_period: int | None,
    max_delay: int | None,
    outer: str,
    outer_lr: float,
    outer_momentum: float,
    warmup_steps: int = 0,
) -> None:
    """Validate the averaging settings (shared by :class:`DelayedAverager` and the strategies built on it, which
    check them at construction, before any process starts)."""
    if not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(
            f"warmup_steps must be an integer >= 0, got {warmup_steps!r}; HINT: 0 starts hierarchical averaging at once"
        )
    if inter_period is not None and (
        not isinstance(inter_period, int) or isinstance(inter_period, bool) or inter_period < 1
    ):
        raise ValueError(
            f"inter_period must be an integer >= 1 or None, got {inter_period!r}; HINT: None (the default) decides "
            "it from the measured step and exchange times, 1 averages across nodes every step"
        )
    if max_delay is not None and (not isinstance(max_delay, int) or isinstance(max_delay, bool) or max_delay < 0):
        raise ValueError(
            f"max_delay must be an integer >= 0 or None, got {max_delay!r}; HINT: None (the default) takes the "
            "shortest delay that hides the measured exchange, 0 is synchronous, 1 allows one step of lag"
        )
    check_outer(outer, outer_lr, outer_momentum)


@dataclass
class _Round:
    step: int
    snapshot: torch.Tensor  # this rank's shard of the node model at launch
    base: torch.Tensor  # the anchor at launch: compressed rounds exchange snapshot - base
    buffer: torch.Tensor | None  # uncompressed: the all-reduced (summed) shard, valid once `work` is done
    work: dist.Work | Future[torch.Tensor]  # compressed: a future of the mean of (snapshot - base)
    launched_at: float
    due: int = 0  # the step at which it is applied (launch step + the delay decided then)
    meta: torch.Tensor | None = None  # [step_s, exchange_s] summed over nodes (appended to the uncompressed buffer)
    done_at: float | None = None  # uncompressed: when its collective completed (the work future's callback)


class DelayedAverager:
    """Average a node-identical model across nodes, ``max_delay`` steps after launching the average.

    Args:
        tensors: the model's parameters (and float buffers) in a fixed order; identical on the ranks of a node.
        cross_group: the group of this local rank's peers on the other nodes (one rank per node).
        node_group: the ranks of this node.
        local_rank, node_size, num_nodes: this rank's place in the topology.
        inter_period: steps between two launches (>= 1); ignored when ``length`` is given.
        max_delay: steps between a launch and the application of its result (>= 0; 0 = synchronous). ``None``:
            the shortest delay that hides the measured exchange (with the policy's margin), at most a period;
            one step until the first measurement.
        length: the policy that decides the period from the measured step and exchange times
            (:class:`~lightning_syncasync.algorithms.averaging.round_length.RoundLength`); every rank decides from
            the same numbers (carried by the rounds themselves) at the same step, so the nodes stay in step.
        outer: ``"average"`` (apply the average), ``"nesterov"`` (outer SGD with Nesterov momentum on the
            pseudo-gradient, DiLoCo) or ``"delayed_nesterov"`` (:mod:`~lightning_syncasync.algorithms.averaging.outer`).
        outer_lr, outer_momentum: the outer optimizer's settings (``outer="nesterov"``).
        recorder: where bytes and wait time go.
        compressor: compression of the cross-node exchange (``None``: plain fp32 all-reduce).
        timeout_s: how long a round may wait for its peers before :class:`PeerLostError`; bounds the cross-node
            group's collectives too when the group was created with ``timeout=timedelta(seconds=timeout_s)``.
        warmup_steps: steps during which the caller keeps every node identical by itself (gradients averaged over
            all ranks, as ``HierSyncStrategy`` does): no round is launched, and the anchor is re-taken when the
            warm-up ends. Rounds then come every ``inter_period`` steps after it.
        side_stream: on CUDA, run the compressed rounds on a stream of their own (``algorithms/streams.py``);
            ``False`` gives the same results without the overlap.

    Example::

        avg = DelayedAverager(list(model.parameters()), cross, node, local_rank, 2, 2, inter_period=1, max_delay=1)
        for step in range(n):
            train_step()
            avg.after_step()
        avg.drain()
    """

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        cross_group: dist.ProcessGroup | None,
        node_group: dist.ProcessGroup | None,
        local_rank: int,
        node_size: int,
        num_nodes: int,
        inter_period: int = 1,
        max_delay: int = 1,
        outer: Outer = "average",
        outer_lr: float = 1.0,
        outer_momentum: float = 0.9,
        recorder: StatsRecorder | None = None,
        compressor: Compressor | None = None,
        timeout_s: float = 300.0,
        warmup_steps: int = 0,
        side_stream: bool = True,
        length: RoundLength | None = None,
    ) -> None:
        check_settings(inter_period, max_delay, outer, outer_lr, outer_momentum, warmup_steps)
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if not 0 <= local_rank < node_size:
            raise ValueError(f"local_rank must be in [0, {node_size}), got {local_rank}")
        if not tensors:
            raise ValueError("tensors is empty: nothing to average")
        self.tensors = list(tensors)
        self.cross_group, self.node_group = cross_group, node_group
        self.local_rank, self.node_size, self.num_nodes = local_rank, node_size, num_nodes
        self.length = length if length is not None else RoundLength(fixed=inter_period)
        self.fixed_delay = max_delay
        self.max_delay = max_delay if max_delay is not None else min(1, self.length.steps)
        self._next_launch = warmup_steps + self.length.steps
        self._last_launch = warmup_steps
        self._step_ema: float | None = None  # this rank's compute time per step (waits on rounds not counted)
        self._last_step_at: float | None = None
        self._waited = 0.0  # time blocked on rounds since the last step
        self._exchange_s = 0.0  # the last completed round's exchange time, on this rank
        self.outer, self.outer_lr, self.outer_momentum = outer, outer_lr, outer_momentum
        self.recorder = recorder
        self.compressor = compressor if compressor is not None and compressor.method != "none" else None
        if self.compressor is not None and cross_group is not None:
            self.compressor.check_backend(cross_group)  # before any round: a missing collective fails here, named
        self.timeout_s = timeout_s
        self.warmup_steps = warmup_steps
        self.side_stream = side_stream
        self._thread: CommThread | None = None
        self.peers: list[int] = []
        if cross_group is not None and num_nodes > 1:
            me = dist.get_rank()
            self.peers = [r for r in dist.get_process_group_ranks(cross_group) if r != me]
        numel = sum(t.numel() for t in tensors)
        self.shard_numel = -(-numel // node_size)  # ceil: the last shard is padded
        self.numel = numel
        self.step = 0
        self.pending: deque[_Round] = deque()
        # The outer optimizer, on this rank's shard (the same pseudo-gradient on every node: the same state).
        self.outer_opt = OuterOptimizer(outer, outer_lr, outer_momentum)
        # The last global model, this rank's shard (the same on every node). The replicas must start identical on
        # every node (the strategy broadcasts them before building the averager).
        self.anchor = self._shard()
        self.rounds_applied = 0
        self._held: torch.Tensor | None = None  # the node replica (flat) while swap_in_mean() lends out the mean

    # -- public ----------------------------------------------------------------------------------------------

    @property
    def inter_period(self) -> int:
        """Steps between two launches now (the policy's current length)."""
        return self.length.steps

    def after_step(self) -> None:
        """Call once per optimizer step, after it: apply the rounds that are due, then maybe launch one."""
        now = time.perf_counter()
        if self._last_step_at is not None:
            dt = max(now - self._last_step_at - self._waited, 1e-6)
            self._step_ema = dt if self._step_ema is None else 0.8 * self._step_ema + 0.2 * dt
        self._waited = 0.0
        self.step += 1
        if self.step <= self.warmup_steps:
            if self.step == self.warmup_steps:
                self.anchor = self._shard()  # the nodes agree after a synchronous warm-up: the new global model
                self._next_launch = self.step + self.length.steps
                self._last_launch = self.step
            self._last_step_at = time.perf_counter()
            return
        while self.pending and self.step >= self.pending[0].due:
            self._apply(self.pending.popleft())
        if self.num_nodes > 1 and self.step >= self._next_launch:
            self._next_launch = self.step + self.length.steps
            self._last_launch = self.step
            self._launch()
            if self.max_delay == 0:
                self._apply(self.pending.popleft())
        self._last_step_at = time.perf_counter()

    @property
    def in_warmup(self) -> bool:
        """Whether the step now being computed is a warm-up step (gradients must be averaged over all ranks)."""
        return self.step < self.warmup_steps

    def drain(self) -> None:
        """Wait for and apply every round in flight (before a mode switch or teardown), after putting back a
        replica lent to evaluation: the rounds' corrections belong to the replica, not to the mean."""
        self.swap_back()
        while self.pending:
            self._apply(self.pending.popleft())

    def close(self) -> None:
        """Drain and stop the communication thread."""
        try:
            self.drain()
        finally:
            if self._thread is not None:
                self._thread.close()
                self._thread = None

    def synchronize(self) -> None:
        """A consistent cut: drain, then one more round applied at once, after which every node holds the same
        model (the new global model). Checkpoints are taken here, so a resumed run starts from exactly the model
        and outer state the uninterrupted run continues from."""
        self.drain()
        if self.num_nodes > 1:
            self._launch(exact=True)
            self._apply(self.pending.popleft(), replace=True)

    def swap_in_mean(self, cross_group: dist.ProcessGroup | None) -> None:
        """Lend the tensors the exact mean of the node replicas, for evaluation; :meth:`swap_back` restores the
        replica bitwise, so evaluating never changes the training trajectory.

        The mean of the replicas is the model training stands for: with ``outer="average"`` the corrections still
        in flight sum to zero over the nodes (each is the global average minus that node's snapshot), so it is
        also the model the next consistent cut would produce (with compression, up to what compression drops;
        with ``outer="nesterov"`` without the pending outer steps). ``cross_group`` must be a cross-node group
        that nothing else uses at the same time (the compressed rounds run on a thread of their own), and every
        rank calls this together. Not recorded as training traffic.
        """
        if self._held is not None:
            raise RuntimeError("swap_in_mean() called twice without swap_back()")
        self._held = self._flat()[: self.numel]  # a fresh tensor (torch.cat): the replica as it is now
        if self.num_nodes == 1:
            return
        shard = self._shard()
        all_reduce_(shard, cross_group)
        shard /= self.num_nodes
        copy_flat_(self.tensors, self._gather(shard, record=False)[: self.numel])

    def swap_back(self) -> None:
        """Put the node replica back after :meth:`swap_in_mean` (a no-op when nothing was swapped)."""
        if self._held is None:
            return
        copy_flat_(self.tensors, self._held)
        self._held = None

    def state_dict(self) -> dict[str, object]:
        """What a resumed run needs after :meth:`synchronize`: the step counter and the whole outer momentum (the
        shards of the node's ranks, gathered: a collective on the node group, so every rank must call it)."""
        if self.pending:
            raise RuntimeError("synchronize() the averager before state_dict(): rounds are still in flight")
        opt = self.outer_opt
        momentum, pending = (
            None if t is None else self._gather(t, record=False)[: self.numel].clone()
            for t in (opt.buffer, opt.pending)
        )
        state: dict[str, object] = {"step": self.step, "momentum": momentum, "rounds_applied": self.rounds_applied}
        if self.outer == "delayed_nesterov":
            state.update(outer_pending=pending, outer_count=opt.count)
        if self.compressor is not None:
            # After synchronize() the residuals are empty and the PowerSGD factors are the same on every node.
            state["compression"] = self.compressor.state_dict()
        return state

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore after the model's weights were loaded (the anchor is taken from them)."""
        self.step = int(state["step"])  # type: ignore[call-overload]
        self.rounds_applied = int(state.get("rounds_applied", 0))  # type: ignore[call-overload]
        self.outer_opt.load_state_dict(
            {
                "buffer": self._my_shard(state.get("momentum")),  # type: ignore[arg-type]
                "pending": self._my_shard(state.get("outer_pending")),  # type: ignore[arg-type]
                "count": state.get("outer_count", 0),
            }
        )
        comp = state.get("compression")
        if self.compressor is not None and comp is not None:
            self.compressor.load_state_dict(comp)  # type: ignore[arg-type]
        elif self.compressor is not None or comp is not None:
            raise ValueError(
                "the checkpoint was saved with a different inter-node compression than this run's "
                f"({'none' if self.compressor is None else self.compressor.method}); HINT: resume with the same setting"
            )
        self.anchor = self._shard()  # the restored weights are a consistent cut: the global model
        # Launches at warm-up + k x period, as in the run that saved it (a fixed period resumes exactly).
        period, done = self.length.steps, max(self.step - self.warmup_steps, 0)
        self._last_launch = self.warmup_steps + done // period * period
        self._next_launch = self._last_launch + period

    @property
    def momentum(self) -> torch.Tensor | None:
        """The outer momentum of this rank's shard (``None`` before the first Nesterov round)."""
        return self.outer_opt.buffer

    # -- internals -------------------------------------------------------------------------------------------

    def _my_shard(self, full: torch.Tensor | None) -> torch.Tensor | None:
        if full is None:
            return None
        full = torch.nn.functional.pad(full, (0, self.shard_numel * self.node_size - full.numel()))
        lo = self.local_rank * self.shard_numel
        return full[lo : lo + self.shard_numel].clone()

    def _flat(self) -> torch.Tensor:
        flat = torch.cat([t.detach().reshape(-1) for t in self.tensors])
        pad = self.shard_numel * self.node_size - flat.numel()
        return torch.nn.functional.pad(flat, (0, pad)) if pad else flat

    def _shard(self) -> torch.Tensor:
        lo = self.local_rank * self.shard_numel
        return self._flat()[lo : lo + self.shard_numel].clone()

    def _meta(self) -> torch.Tensor:
        """What this rank measured, for the policy: [seconds per compute step, the last round's exchange time]."""
        return torch.tensor([self._step_ema or 0.0, self._exchange_s], dtype=torch.float32, device="cpu")

    def _launch(self, exact: bool = False) -> None:
        snapshot = self._shard()
        now = time.perf_counter()
        due = self.step + self.max_delay
        if self.compressor is None or exact:
            # On the wire's device from the start (a CPU copy under gloo with a model on a GPU): the collective is
            # asynchronous, so it cannot stage through a copy the way the blocking ones do. The policy's two
            # numbers ride at its end (summed over nodes like the shard: no collective of their own).
            wire = wire_device(snapshot, self.cross_group)
            buffer = torch.cat([snapshot, self._meta().to(snapshot)]).to(wire)
            if self.compressor is not None:
                # Everything compression held back (this rank's residual and, in the two-phase layout, the server
                # residual of the part it owns): an exact round flushes it, so a checkpoint holds nothing back.
                residual = self.compressor.pop_residual("shard", snapshot.numel(), self.cross_group)
                if residual is not None:
                    buffer[:-2] += residual.to(buffer.device)
            work: Any = dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=self.cross_group, async_op=True)
            if self.recorder is not None:
                self.recorder.record_blocking(buffer.numel() * buffer.element_size(), "inter", 0.0)
            rnd = _Round(self.step, snapshot, self.anchor, buffer, work, now, due)
            try:
                # The exchange's own end, for the policy: a callback when the collective completes (a poll at step
                # boundaries would round every exchange up to a step, and ask for rounds twice as long on a fast link).
                work.get_future().add_done_callback(lambda _: setattr(rnd, "done_at", time.perf_counter()))
            except (RuntimeError, AttributeError):  # a backend without futures: timed to the wait in _wait instead
                pass
            self.pending.append(rnd)
            return
        if self._thread is None:
            self._thread = CommThread("syncasync-inter-node", snapshot.device, self.side_stream)
        compressor, group, recorder, delta = self.compressor, self.cross_group, self.recorder, snapshot - self.anchor
        meta = self._meta()

        def exchange() -> tuple[torch.Tensor, torch.Tensor, float]:
            all_reduce_(meta, group)  # the policy's numbers, summed over nodes (a few bytes)
            start = time.perf_counter()
            mean, nbytes = compressor.allreduce(delta, group, key="shard")
            if recorder is not None:
                recorder.record_blocking(nbytes + meta.numel() * 4, "inter", 0.0)  # measured from the payload
            return mean, meta, time.perf_counter() - start

        work = self._thread.submit(exchange)
        self.pending.append(_Round(self.step, snapshot, self.anchor, None, work, now, due))

    def _wait(self, rnd: _Round) -> torch.Tensor:
        """The average of the snapshots of ``rnd`` across nodes; a failure or timeout becomes PeerLostError."""
        try:
            if isinstance(rnd.work, Future):
                # The group's own timeout fails the collective first; this bound is the backstop.
                mean, meta, seconds = rnd.work.result(timeout=self.timeout_s + 30.0)
                rnd.meta, self._exchange_s = meta, seconds
                return rnd.base + mean
            assert rnd.buffer is not None
            # Under NCCL this makes the current stream wait (the host goes on): timed on the stream, by events.
            before = timing_event(rnd.buffer.device)
            rnd.work.wait()
            if before is not None and self.recorder is not None:
                self.recorder.record_stream_wait(before, timing_event(rnd.buffer.device))
            # Completed at done_at (its future's callback), or, on a backend without futures, now at the latest.
            self._exchange_s = (rnd.done_at or time.perf_counter()) - rnd.launched_at
            rnd.meta = rnd.buffer[-2:].to("cpu", torch.float32)
            return rnd.buffer[:-2].to(rnd.base.device) / self.num_nodes
        except Exception as err:  # noqa: BLE001 - gloo raises RuntimeError, futures TimeoutError
            waited = time.perf_counter() - rnd.launched_at
            who = f"rank {self.peers[0]}" if len(self.peers) == 1 else f"one of ranks {self.peers}"
            raise PeerLostError(
                f"rank {dist.get_rank()}: the inter-node average launched at step {rnd.step} failed after "
                f"{waited:.1f}s: lost peer {who} (this rank's cross-node group). Cause: {err}. HINT: the bound is "
                f"timeout_s={self.timeout_s:g}; check that rank's log, then resume from the last checkpoint"
            ) from err

    def _apply(self, rnd: _Round, replace: bool = False) -> None:
        """Apply a delivered round. ``replace``: nothing was learned since its launch (a cut), so the tensors become
        the new global model itself, bitwise the same on every node (adding ``new_global - snapshot`` to each node's
        own snapshot rounds differently on each)."""
        start = time.perf_counter()
        average = self._wait(rnd)
        waited = time.perf_counter() - start
        self._waited += waited
        if self.recorder is not None:
            self.recorder.record_wait(waited)
        if not replace:
            self._decide(rnd)
        if self.outer == "average":
            new_global = average  # bitwise the mean of the snapshots
        else:
            new_global = self.anchor - self.outer_opt.step(self.anchor - average)  # the same on every node
        self.anchor = new_global
        if replace:
            copy_flat_(self.tensors, self._gather(new_global)[: self.numel])
        else:
            # Move from the snapshot to the new global model, keeping what was learned locally since the launch.
            delta = new_global - rnd.snapshot
            add_flat_(self.tensors, self._gather(delta)[: self.numel])
        self.rounds_applied += 1

    def _decide(self, rnd: _Round) -> None:
        """The period and the delay from the round's numbers, the same on every rank: each local rank holds its
        cross-node group's sums, and a gather inside the node gives every rank of every node all of them."""
        if rnd.meta is None:
            return
        meta = rnd.meta / self.num_nodes  # [mean step_s over nodes, mean exchange_s over nodes]
        if self.node_size > 1:
            every = torch.empty(self.node_size * 2, dtype=torch.float32, device="cpu")
            with self.recorder.timed(every.device, every.numel() * 4, "intra") if self.recorder else nullcontext():
                all_gather_flat(every, meta.contiguous(), self.node_group)
            meta = every.view(self.node_size, 2)
        else:
            meta = meta.view(1, 2)
        step_s, exchange_s = float(meta[:, 0].mean()), float(meta[:, 1].max())
        if step_s <= 0 or exchange_s <= 0:
            return  # a rank had nothing measured yet: every rank sees the same zero and skips alike
        self.length.update(step_s, exchange_s)
        if self.fixed_delay is None:
            # The shortest delay that hides the exchange, with the policy's margin; at most a period (then the
            # round is applied as the next one launches: one round of staleness, as async_ssp's default).
            hide = math.ceil(self.length.margin * exchange_s / step_s - 1e-9)
            self.max_delay = max(1, min(hide, self.length.steps))
        self._next_launch = self._last_launch + self.length.steps  # the same step on every rank (may be now)

    def _gather(self, delta: torch.Tensor, record: bool = True) -> torch.Tensor:
        if self.node_size == 1:
            return delta
        out = torch.empty(self.shard_numel * self.node_size, dtype=delta.dtype, device=delta.device)
        recorder = self.recorder if record else None
        nbytes = out.numel() * out.element_size()
        with recorder.timed(out.device, nbytes, "intra") if recorder is not None else nullcontext():
            all_gather_flat(out, delta.contiguous(), self.node_group)
        return out

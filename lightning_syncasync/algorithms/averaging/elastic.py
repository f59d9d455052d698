"""Round-level averaging across replica groups that may leave and join: torchft's quorum decides who takes part.

Each node is a torchft replica group (its own job, synchronous DDP inside it); the groups exchange pseudo-gradients
every round over torchft's managed process group, which a Lighthouse reconfigures whenever membership changes
(torchft: ``Manager``, ``ProcessGroupGloo``/``ProcessGroupNCCL``; https://github.com/pytorch/torchft). Local rank
``i`` of every group exchanges shard ``i`` of the flattened model (torchft configures each local rank's process group
over the same local rank of every group, as ``hier_sync_sharded`` lays the shards out), and the node all-gathers the
shards of the result over its own group.

A round, on every rank of every group present:

1. ``torchft.Manager.start_quorum()``: the Lighthouse's current membership. A group behind the quorum's step (a new
   or restarted node) receives a live peer's state here, through torchft's checkpoint transport (the *heal*).
2. A header all-reduce (contributing groups, the model's size and fingerprint, step times), then the body: the sum of
   the groups' pseudo-gradients ``delta_g`` (this rank's shard; ``delta_g = base - theta + carry``: the progress
   since the last snapshot, plus whatever an uncommitted round left behind).
3. ``Manager.should_commit()``: every rank of the group votes; a failed collective (a peer died mid-round), too few
   replicas or an error anywhere in the group makes it ``False``. It runs where the exchange runs (the exchange
   thread with ``staleness=1``): its call to the group's manager server and its barrier over the group's ranks stay
   off the training loop.
4. Committed: the round's global pseudo-gradient is ``G = sum_g delta_g / P``, ``P`` the groups that contributed
   samples to it (a joiner healing this round contributes none and does not dilute the mean; a group that left is not
   counted). Every group runs the same outer step (:class:`~lightning_syncasync.algorithms.averaging.OuterOptimizer`)
   on the same ``G``, so the global model (the *anchor*) stays the same on every group, and each group replaces its
   own contribution by the global step. Not committed: nothing is applied, and ``delta_g`` (with its samples) is
   *carried* into the next round's pseudo-gradient. So every local step of a survivor enters exactly one committed
   round: none is lost, none is applied twice (tested with a toy model whose updates sum exactly).

Why the mean over contributing groups and not a mean weighted by samples: ``delta_g`` is already the sum of the
group's steps, so a group that trained on more samples (a carried round, a faster node) moves the global model
further in proportion to them; weighting by samples again would count them twice.

``staleness=0``: synchronous rounds (local SGD / DiLoCo): the round is exchanged and applied at its end, and every
group then holds the anchor bitwise. ``staleness=1``: round ``r``'s quorum and exchange run on a thread while round
``r + 1``'s local steps run; it is committed and applied at the end of round ``r + 1`` as a correction that keeps the
local progress made meanwhile (as ``RoundExchange`` does).

A consistent cut (validation, checkpoints, the end of fit) drains the round in flight and then runs rounds with no
new step until one commits: every group present then holds the anchor bitwise.

Heal state (what a joiner receives): this rank's shard of the anchor, the outer optimizer's state, the round clock
(committed rounds, samples), the round length, and whatever the caller adds (``extra_state``: the inner optimizer,
the LR schedulers, the loop's step and epoch), with the model's parameter names and shapes, which the joiner checks
against its own before loading anything. Compression residuals are not sent: they are a group's own held-back
progress, and a copy would make the peer's count twice.

Compression (``int8``, ``int4``): the body as codes an all-reduce can sum (:func:`compress_summable`), the only
collective torchft manages; per-group error feedback, exact rounds at every cut.

The advertised address (:func:`advertised_host`): where the other groups reach this one's store, manager, checkpoint
server and gloo sockets; never the launcher's loopback ``MASTER_ADDR`` unless the Lighthouse is on loopback too.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist

from lightning_syncasync.algorithms._comm import CommThread, all_gather_flat, all_reduce_
from lightning_syncasync.algorithms.averaging._elastic_apply import (
    ModelMismatchError,
    _Applies,
    _fingerprint,
    model_signature,
)
from lightning_syncasync.algorithms.averaging._elastic_round import (
    _COMPRESSED,
    _HEADER,
    _STOPPING,
    ElasticStats,
    _agrees,
    _Flight,
)
from lightning_syncasync.algorithms.averaging.ft_manager import (
    FT_HINT,
    LIGHTHOUSE_ENV,
    QuorumManager,
    make_manager,
    require_torchft,
)
from lightning_syncasync.algorithms.averaging.outer import OuterOptimizer
from lightning_syncasync.algorithms.averaging.round_checks import NonFiniteRoundError
from lightning_syncasync.algorithms.compression.summable import LEVELS, SUMMABLE, compress_summable
from lightning_syncasync.algorithms.stats import StatsRecorder

log = logging.getLogger(__name__)

# ElasticStats, FT_HINT, LIGHTHOUSE_ENV, make_manager and require_torchft were defined here: still importable from here.
__all__ = [
    "FT_HINT",
    "LIGHTHOUSE_ENV",
    "ElasticRounds",
    "ElasticStats",
    "ModelMismatchError",
    "QuorumError",
    "QuorumManager",
    "check_elastic",
    "make_manager",
    "require_torchft",
]

_HEAL_KEY = "syncasync_elastic"


class QuorumError(RuntimeError):
    """No quorum of replica groups formed in time (the Lighthouse unreachable, too few nodes alive)."""


def check_elastic(local_steps: int, staleness: int, min_replicas: int, max_replicas: int | None) -> None:
    """Validate the settings (strategies check them at construction, before any process starts)."""
    if not isinstance(local_steps, int) or local_steps < 1:
        raise ValueError(f"local_steps must be an integer >= 1, got {local_steps!r}; HINT: 4 averages every 4 steps")
    if staleness not in (0, 1):
        raise ValueError(
            f"staleness must be 0 or 1 for fault-tolerant rounds, got {staleness!r}; HINT: 0 is synchronous rounds, "
            "1 overlaps each round's exchange with the next round's steps"
        )
    if not isinstance(min_replicas, int) or min_replicas < 1:
        raise ValueError(f"min_replicas must be an integer >= 1, got {min_replicas!r}; HINT: 1 trains on alone")
    if max_replicas is not None and (not isinstance(max_replicas, int) or max_replicas < 1):
        raise ValueError(f"max_replicas must be an integer >= 1 or None, got {max_replicas!r}")
    if max_replicas is not None and min_replicas > max_replicas:
        raise ValueError(
            f"min_replicas={min_replicas} is larger than max_replicas={max_replicas}, the nodes that can exist: no "
            f"round could ever commit. HINT: min_replicas <= {max_replicas} (1 lets a lone survivor train on)"
        )


class ElasticRounds(_Applies):
    """Rounds of pseudo-gradients across torchft replica groups; membership may change at every round.

    Args:
        tensors: the model's parameters (and float buffers), identical on the ranks of a group, in a fixed order.
        manager: this rank's ``torchft.Manager`` (its process group spans this local rank of every group).
        names: the parameter names (for the joiner's check and its error message).
        node_group: the group's own ranks (``None``: a group of one rank).
        local_rank, node_size: this rank's place in its group.
        local_steps: steps per round (``round_s``/``dynamic``: at the groups' mean speed).
        staleness: ``0`` synchronous rounds, ``1`` each round's exchange overlapped with the next round's steps.
        outer: the outer optimizer (default: plain averaging).
        dynamic: rounds of wall-clock length ``local_steps x`` the groups' mean step time (measured, exchanged in the
            header), so a slow group takes fewer local steps and reaches the quorum with the others. Each round's
            length becomes a step count when it starts (that time over the group's own step time), agreed inside
            the group once per round.
        recorder: where bytes and wait time go.
        extra_state: ``(save, load)``: more state a joiner needs (the inner optimizer, schedulers, the loop's step).
        on_heal: called on the main thread after this group took a live peer's state and the round was applied, with
            the number of local steps the peers took between sending the state and committing the round (``0`` with
            ``staleness=0``): what the caller adds to the step counter it restored through ``extra_state``.
        cut_timeout_s: how long a consistent cut may keep retrying rounds that do not commit.
        compression: ``"none"``, ``"int8"`` or ``"int4"``: the body of a round as summable codes
            (:func:`compress_summable`: one all-reduce of the chunks' scales, one of the packed codes, both torchft's
            managed all-reduce, so a peer lost mid-round makes the vote say no as for the fp32 body). Error feedback
            per group: what a group's codes dropped is its own residual, sent with its next round; it is not part of
            the heal state (a joiner starts with none, a group that dies takes its own with it). Consistent cuts are
            exact rounds that flush the residuals, and a round is exact whenever one group present asks for one.
        chunk_size: elements per scale of the summable codecs.
        counters: integer buffers (BatchNorm's ``num_batches_tracked``): not averaged as the model is, but made the
            same on every group at each consistent cut (the rounded mean of the groups' counts), and taken from the
            live peer by a joiner.

    Example::

        rounds = ElasticRounds(list(model.parameters()), manager, names=[n for n, _ in model.named_parameters()])
        rounds.join()                      # heals from a live group if the job is already running
        for batch in data:
            train_step(batch)
            rounds.after_step(samples=len(batch))
        rounds.cut(stop=True)
    """

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        manager: QuorumManager,
        names: Sequence[str] | None = None,
        node_group: dist.ProcessGroup | None = None,
        local_rank: int = 0,
        node_size: int = 1,
        local_steps: int = 4,
        staleness: int = 0,
        outer: OuterOptimizer | None = None,
        dynamic: bool = False,
        recorder: StatsRecorder | None = None,
        extra_state: tuple[Callable[[], Any], Callable[[Any], None]] | None = None,
        on_heal: Callable[[int], None] | None = None,
        cut_timeout_s: float = 300.0,
        counters: Sequence[torch.Tensor] = (),
        compression: str = "none",
        chunk_size: int = 256,
    ) -> None:
        check_elastic(local_steps, staleness, 1, None)
        if not tensors:
            raise ValueError("tensors is empty: nothing to average")
        if not 0 <= local_rank < node_size:
            raise ValueError(f"local_rank must be in [0, {node_size}), got {local_rank}")
        self.tensors = list(tensors)
        self.manager = manager
        self.names = list(names) if names is not None else [f"tensor{i}" for i in range(len(self.tensors))]
        self.signature = model_signature(self.names, self.tensors)
        self.fingerprint = _fingerprint(self.signature)
        self.node_group, self.local_rank, self.node_size = node_group, local_rank, node_size
        self.local_steps, self.staleness, self.dynamic = local_steps, staleness, dynamic
        self.outer = outer if outer is not None else OuterOptimizer("average")
        self.recorder = recorder
        self.extra_state = extra_state
        self.on_heal = on_heal
        self.cut_timeout_s = cut_timeout_s
        self.numel = sum(t.numel() for t in self.tensors)
        self.shard_numel = -(-self.numel // node_size)
        self.counters = list(counters)
        self.counters_numel = sum(t.numel() for t in self.counters)
        if compression != "none" and compression not in LEVELS:
            raise ValueError(
                f"compression={compression!r} cannot run across torchft's replica groups; HINT: one of 'none', "
                f"{', '.join(repr(c) for c in SUMMABLE)} (codes an all-reduce can sum: the only collective torchft "
                "manages)"
            )
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self.compression, self.chunk_size = compression, chunk_size
        self._residual: torch.Tensor | None = None  # what this group's codes dropped, owed to the next round
        self.stats = ElasticStats()
        self.anchor = self._shard()  # the global model (this rank's shard); the same on every group
        self._base = self.anchor.clone()  # this rank's shard at the last snapshot
        self._carry: torch.Tensor | None = None  # progress of uncommitted rounds, sent again with the next one
        self._carry_samples = 0
        self._steps = self._samples = 0
        self._flight: _Flight | None = None
        self._thread: CommThread | None = None if staleness == 0 else CommThread("syncasync-elastic")
        self._healed: dict[str, Any] | None = None  # a peer's state, loaded by torchft inside should_commit
        self._step_ema: float | None = None
        self._last_step_at: float | None = None
        self._round_target = local_steps  # steps of the current round (_plan_round)
        self._at_cut = False  # no step since the last consistent cut
        self._round_s: float | None = None  # dynamic: the agreed round length
        self._gated = False  # a round is being exchanged on the main thread (committed with no step in between)
        self._last_header = torch.zeros(_HEADER, dtype=torch.float64, device="cpu")  # the last round's, summed
        self.last_participants = 0
        manager.register_state_dict_fn(_HEAL_KEY, self._load_heal, self._heal_state)

    # -- public ------------------------------------------------------------------------------------------------

    def join(self) -> None:
        """Take part in one round with no progress: a fresh job's groups start from one model (torchft heals every
        group at step 0 from the first one), and a group joining a running job heals from a live peer here. Every
        group of a new job calls it; a running job's groups see it as one of their rounds."""
        self.stats.joined_at = time.time()
        self._commit_round(self._launch(gate=True))  # nothing owed yet: it need not make the others' round exact
        if self.staleness == 1:
            # The groups already running launched their next round as they committed this one: launch it too (with
            # nothing in it), so this group's rounds end with theirs.
            self._flight = self._launch(gate=False)

    def before_step(self) -> None:
        """Call before each optimizer step: a heal being sent (torchft's thread reads the state) waits for the step."""
        self.manager.disallow_state_dict_read()

    def after_step(self, samples: int = 1) -> None:
        """Call after each optimizer step: ends the round when it is over (and, with ``staleness=1``, commits the
        previous one first)."""
        self.manager.allow_state_dict_read()
        now = time.perf_counter()
        if self._last_step_at is not None:
            dt = now - self._last_step_at
            self._step_ema = dt if self._step_ema is None else 0.8 * self._step_ema + 0.2 * dt
        self._steps += 1
        self._samples += samples
        self._at_cut = False
        if self._steps >= self._round_target:
            self._end_round()
        self._last_step_at = time.perf_counter()

    def cut(self, stop: bool = False, leave: bool = False, flush: bool = True) -> None:
        """A consistent cut: the round in flight committed or carried, then rounds with no new step until one
        commits; every group present then holds the anchor bitwise.

        ``stop`` (the end of this group's fit): the group goes on taking part in the others' rounds, with nothing,
        until a round commits in which every group present is stopping too, then ends the exchange thread. So every
        group present at the end holds the same final model, also where the groups end their fit at different times
        (rounds of wall-clock length, ``dynamic``: a faster group runs out of data first; issue 65 found
        ``async_ssp_ft``'s nodes ending with different models); a group that stops waits for the others' last
        round. ``leave`` (a preempted group): ``stop`` without that wait, after its own last round committed.

        ``flush``: send this group's compression residual in an exact round, so that nothing is held back (the end
        of fit, a checkpoint). Without it (a validation) the residual stays owed and the cut's round may be
        compressed: every group holds the same model either way. A group with nothing owed asks for no exact round,
        so a group waiting for the others' end of fit does not make their rounds exact."""
        start = time.perf_counter()
        deadline = start + self.cut_timeout_s
        stop = stop or leave
        if self._at_cut and not stop and not (flush and self._residual is not None):
            return  # no step since the last cut (a checkpoint right after a validation): already there
        if self._flight is not None:
            self._commit_round(self._flight)
            self._flight = None
        while True:
            exact = (flush or stop) and self._residual is not None
            if self._commit_round(self._launch(gate=True, stopping=stop, exact=exact), replace=True):
                header = self._last_header
                if not stop or leave or int(round(float(header[_STOPPING]))) >= int(round(float(header[1]))):
                    break
                deadline = time.perf_counter() + self.cut_timeout_s  # the others train on: rounds keep committing
            elif time.perf_counter() > deadline:
                raise TimeoutError(
                    f"a consistent cut found no committed round in {self.cut_timeout_s:g}s (cut_timeout_s); HINT: "
                    "check that the Lighthouse runs and that min_replicas groups are alive"
                )
        self._steps = self._samples = 0
        self._plan_round()
        self._last_step_at = None
        self._at_cut = True
        if stop:
            self.close()
        self.stats.wait_s += time.perf_counter() - start

    def close(self) -> None:
        if self._thread is not None:
            self._thread.close()
            self._thread = None

    def state_dict(self) -> dict[str, Any]:
        """After a cut: what a resumed run needs (the anchor is the model's weights, saved by the caller)."""
        if self._flight is not None:
            raise RuntimeError("cut() the rounds before state_dict(): a round is in flight")
        return {
            "outer": self.outer.state_dict(),
            "round_s": self._round_s,
            "committed": self.stats.committed,
            "samples_committed": self.stats.samples_committed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore after the weights were loaded (a checkpoint is a cut: they are the anchor)."""
        self.outer.load_state_dict(state["outer"])
        self._round_s = state.get("round_s")
        self.stats.committed = int(state.get("committed", 0))
        self.stats.samples_committed = int(state.get("samples_committed", 0))
        self.anchor = self._shard()
        self._base = self.anchor.clone()
        self._carry, self._carry_samples = None, 0

    @property
    def in_flight(self) -> bool:
        return self._flight is not None

    # -- rounds ------------------------------------------------------------------------------------------------

    def _plan_round(self) -> None:
        """The steps of the round that starts now, the same on every rank of the group. Fixed rounds: ``local_steps``
        (DDP steps the ranks together). ``dynamic``: the agreed round length over this group's own step time, so a
        slow group takes fewer steps and reaches the quorum with the others; the ranks' step times differ in the last
        digits, so the group takes the largest of its ranks' counts, agreed once per round (it was one all-reduce per
        step, a round-end decision by the wall clock: issue 65)."""
        target = self.local_steps
        if self.dynamic and self._round_s is not None and self._step_ema:
            target = max(1, round(self._round_s / self._step_ema))
            if self.node_group is not None and self.node_size > 1:
                t = torch.tensor([target], dtype=torch.int64, device="cpu")
                all_reduce_(t, self.node_group, dist.ReduceOp.MAX)
                target = int(t.item())
        self._round_target = target

    def _end_round(self) -> None:
        start = time.perf_counter()
        if self._flight is not None:  # staleness 1: the previous round first
            self._commit_round(self._flight)
            self._flight = None
        rnd = self._launch(gate=self.staleness == 0)
        if self.staleness == 0:
            self._commit_round(rnd)
        else:
            self._flight = rnd
        self._steps = self._samples = 0
        self._plan_round()
        waited = time.perf_counter() - start
        self.stats.wait_s += waited
        if self.recorder is not None:
            self.recorder.record_wait(waited)

    def _launch(self, gate: bool, stopping: bool = False, exact: bool = False) -> _Flight:
        """Snapshot this rank's progress and start the round's quorum and exchange (on the thread unless ``gate``)."""
        theta = self._shard()
        delta = self._base - theta
        if not bool(torch.isfinite(delta).all()):
            # Before anything leaves the node: a NaN or an infinity in the global model would reach every node. The
            # ranks of a node hold the same replica (DDP), so they all stop here, and the other nodes go on.
            raise NonFiniteRoundError(self.stats.committed)
        self._base = theta
        samples = self._samples
        if self._carry is not None:
            delta += self._carry
            samples += self._carry_samples
            self._carry, self._carry_samples = None, 0
        # On the CPU: the exchange goes over torchft's gloo process group (make_manager).
        payload = torch.zeros(_HEADER + self.shard_numel + self.counters_numel, dtype=torch.float32, device="cpu")
        header = torch.zeros(_HEADER, dtype=torch.float64, device="cpu")
        # A group contributes when it has progress to send: new samples, or a residual its codes still owe.
        header[0] = 1.0 if samples > 0 or self._residual is not None else 0.0
        header[1] = 1.0
        header[2] = float(self.numel)
        header[3] = float(self.fingerprint)
        if self._step_ema is not None:
            header[4], header[5] = self._step_ema, 1.0
        header[6] = float(samples)
        header[_STOPPING] = 1.0 if stopping else 0.0
        header[_COMPRESSED] = 1.0 if self.compression != "none" and not exact else 0.0
        owed = delta if self._residual is None else delta + self._residual
        payload[_HEADER : _HEADER + self.shard_numel] = owed
        if self.counters:
            # fp32 counts are exact below 2**24 / groups (steps of a BatchNorm layer).
            payload[_HEADER + self.shard_numel :] = torch.cat(
                [c.detach().reshape(-1).cpu().float() for c in self.counters]
            )
        step = self.manager.current_step()
        self.stats.launches.append((step + 1, samples))
        rnd = _Flight(delta, samples, payload, Future(), time.perf_counter(), first=step == 0, owed=owed)
        if gate or self._thread is None:
            self._gated = True  # a peer healing from this round sees it committed at once, with no step between
            try:
                self._exchange(rnd, header)
            finally:
                self._gated = False
        else:
            self._thread.submit(lambda: self._exchange(rnd, header))
        return rnd

    def _exchange(self, rnd: _Flight, header: torch.Tensor) -> None:
        """The quorum, the header and the body, then torchft's vote (on the exchange thread with ``staleness=1``, so
        the vote's call to the manager server and its barrier over the group's ranks are off the training loop too).
        Failures of the collectives are torchft's to report: ``should_commit`` then says no on every rank of the
        group."""
        try:
            t0 = time.perf_counter()
            self.manager.start_quorum()
            t1 = time.perf_counter()
            self.manager.allreduce(header, reduce_op=dist.ReduceOp.SUM).wait()
            t2 = time.perf_counter()
            agree = _agrees(header, self.numel, self.fingerprint)
            present = int(round(float(header[1])))
            if agree and self.compression != "none" and int(round(float(header[_COMPRESSED]))) == present:
                assert rnd.owed is not None
                total, own, nbytes = compress_summable(
                    rnd.owed, LEVELS[self.compression], self.chunk_size, present,
                    lambda t, op: self.manager.allreduce(t, reduce_op=op).wait(),
                )  # fmt: skip
                rnd.payload[_HEADER : _HEADER + self.shard_numel] = total
                rnd.kept = rnd.owed - own
                if self.recorder is not None:
                    self.recorder.record_blocking(nbytes, "inter", 0.0)
            elif agree:
                body = rnd.payload[_HEADER:]
                self.manager.allreduce(body, reduce_op=dist.ReduceOp.SUM).wait()
                if self.recorder is not None:
                    self.recorder.record_blocking(body.numel() * body.element_size(), "inter", 0.0)
            rnd.payload[:_HEADER] = header.to(rnd.payload.dtype)
            t3 = time.perf_counter()
        except BaseException as err:  # noqa: BLE001 - the main thread decides
            rnd.future.set_exception(err)
            return
        try:
            committed = self.manager.should_commit()
        except BaseException as err:  # noqa: BLE001 - re-raised on the main thread, after the round is carried
            rnd.vote_error, committed = err, False
        rnd.phases = (t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3)
        rnd.future.set_result((agree, committed))

    def _commit_round(self, rnd: _Flight, replace: bool = False) -> bool:
        """Wait for a round, vote, and apply it (committed) or carry it (not). Returns whether it committed."""
        waiting = time.perf_counter()
        try:
            agreed, committed = rnd.future.result()
        except ModelMismatchError:
            raise  # this group is the one that cannot join: its own message says why
        except Exception as err:
            self._carry_back(rnd)
            raise QuorumError(
                f"no quorum of replica groups for round {self.manager.current_step()}: {err}. HINT: check that the "
                "Lighthouse (TORCHFT_LIGHTHOUSE) is reachable and that at least min_replicas nodes are running; the "
                "wait is bounded by quorum_timeout_s"
            ) from err
        done = time.perf_counter()
        st = self.stats
        st.wait_exchange_s += done - waiting
        st.quorum_s, st.header_s, st.body_s, st.vote_s = (
            a + b for a, b in zip((st.quorum_s, st.header_s, st.body_s, st.vote_s), rnd.phases, strict=True)
        )
        if rnd.vote_error is not None:
            self._carry_back(rnd)
            raise rnd.vote_error
        header = rnd.payload[:_HEADER].double()
        self._last_header = header
        healed, self._healed = self._healed, None
        if rnd.first and self.node_group is not None and self.node_size > 1:
            # torchft decides the heal per local rank, and at step 0 (every group new, init_sync) it takes each
            # local rank's shard from a different group: some ranks of a group heal, the others are the source of
            # their shard. The group heals as a whole: a source rank's own state stands for the healed one. Past
            # step 0 a group behind the quorum heals on every rank, and one that is not on none: no check then.
            flag = torch.tensor([0 if healed is None else 1], dtype=torch.int32, device="cpu")
            all_reduce_(flag, self.node_group, dist.ReduceOp.MAX)
            if int(flag.item()) and healed is None:
                healed = self._heal_state()
        st.heal_check_s += time.perf_counter() - done
        if healed is not None:
            self._finish_heal(healed, rnd, header, committed and agreed)
            return committed and agreed
        if not agreed and committed:
            # Every rank saw the same header: a group whose model differs is present. The healing side names the
            # parameter; here the round carries nothing.
            present = int(round(float(header[1])))
            raise ModelMismatchError(
                f"the {present} replica groups of this round do not train the same model (sizes or parameter names "
                f"differ: this node has {self.numel} elements). HINT: start every node with the same model and "
                "optimizer; a node that joins later says which parameter differs"
            )
        if not committed or not agreed:
            self._carry_back(rnd)
            self.stats.failed += 1
            log.info(
                "elastic round not committed (step %d): its progress goes into the next", self.manager.current_step()
            )
            return False
        self._apply(rnd, header, replace)
        self._residual = rnd.kept  # an exact round sent (and so flushed) the residual: None
        return True

    # -- shards ----------------------------------------------------------------------------------------------

    def _flat(self) -> torch.Tensor:
        return torch.cat([t.detach().reshape(-1).float().cpu() for t in self.tensors])

    def _shard(self) -> torch.Tensor:
        flat = self._flat()
        pad = self.shard_numel * self.node_size - self.numel
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        return flat[self.local_rank * self.shard_numel : (self.local_rank + 1) * self.shard_numel].clone()

    def _gather(self, shard: torch.Tensor) -> torch.Tensor:
        if self.node_size == 1:
            return shard
        out = torch.empty(self.shard_numel * self.node_size, dtype=shard.dtype, device="cpu")
        all_gather_flat(out, shard.contiguous(), self.node_group)
        return out

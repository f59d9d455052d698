"""How a round of :class:`~lightning_syncasync.algorithms.averaging.elastic.ElasticRounds` lands on this replica
group's model (``_Applies``): committed (the outer step on the global pseudo-gradient, in place of the group's own
contribution), not committed (carried into the next round), or with a heal: the state a joining group receives from a
live peer through torchft's checkpoint transport, checked against the joiner's own model (:class:`ModelMismatchError`
names the first parameter that differs), taken on, and then the round applied to it as to everyone."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from lightning_syncasync.algorithms._comm import broadcast_object
from lightning_syncasync.algorithms._flat import add_flat_, copy_flat_
from lightning_syncasync.algorithms.averaging._elastic_round import _HEADER, ElasticStats, _Flight
from lightning_syncasync.algorithms.averaging.ft_manager import QuorumManager
from lightning_syncasync.algorithms.averaging.outer import OuterOptimizer


class ModelMismatchError(ValueError):
    """A joiner's model (or optimizer) is not the quorum's: the message names the first parameter that differs."""


def model_signature(names: Sequence[str], tensors: Sequence[torch.Tensor]) -> list[tuple[str, tuple[int, ...]]]:
    """The parameter names and shapes a joiner compares with the quorum's."""
    return [(n, tuple(t.shape)) for n, t in zip(names, tensors, strict=True)]


def _fingerprint(signature: list[tuple[str, tuple[int, ...]]]) -> int:
    # 20 bits: summed over up to thousands of groups in fp64 it stays exact.
    return int(hashlib.sha1(repr(signature).encode()).hexdigest()[:5], 16)


def first_difference(ours: list[tuple[str, tuple[int, ...]]], theirs: list[tuple[str, tuple[int, ...]]]) -> str | None:
    """A sentence naming the first parameter where two signatures differ, or ``None`` when they agree."""
    for i, (a, b) in enumerate(zip(ours, theirs, strict=False)):  # a length difference is reported below
        if a != b:
            return f"parameter {i}: this node has {a[0]!r} of shape {a[1]}, the quorum has {b[0]!r} of shape {b[1]}"
    if len(ours) != len(theirs):
        longer, which = (ours, "this node") if len(ours) > len(theirs) else (theirs, "the quorum")
        extra = longer[min(len(ours), len(theirs))]
        return f"{which} has {len(longer)} parameters, the first extra one {extra[0]!r} of shape {extra[1]}"
    return None


class _Applies:
    """Rounds and heals applied, for :class:`~lightning_syncasync.algorithms.averaging.elastic.ElasticRounds` (which
    sets every attribute below in its constructor)."""

    tensors: list[torch.Tensor]
    counters: list[torch.Tensor]
    manager: QuorumManager
    signature: list[tuple[str, tuple[int, ...]]]
    node_group: dist.ProcessGroup | None
    node_size: int
    numel: int
    shard_numel: int
    local_steps: int
    staleness: int
    dynamic: bool
    outer: OuterOptimizer
    extra_state: tuple[Callable[[], Any], Callable[[Any], None]] | None
    on_heal: Callable[[int], None] | None
    stats: ElasticStats
    anchor: torch.Tensor
    last_participants: int
    _base: torch.Tensor
    _carry: torch.Tensor | None
    _carry_samples: int
    _residual: torch.Tensor | None
    _round_s: float | None
    _healed: dict[str, Any] | None
    _gated: bool
    _steps: int

    if TYPE_CHECKING:

        def _gather(self, shard: torch.Tensor) -> torch.Tensor: ...

    def _carry_back(self, rnd: _Flight) -> None:
        self._carry = rnd.delta if self._carry is None else self._carry + rnd.delta
        self._carry_samples += rnd.samples

    def _apply(self, rnd: _Flight, header: torch.Tensor, replace: bool) -> None:
        start = time.perf_counter()
        contributors = int(round(float(header[0])))
        present = int(round(float(header[1])))
        if header[5] > 0:
            mean_step = float(header[4] / header[5])
            if self.dynamic:
                self._round_s = self.local_steps * mean_step
        if contributors > 0:
            grad = rnd.payload[_HEADER : _HEADER + self.shard_numel] / contributors
            step = self.outer.step(grad)
        else:
            step = torch.zeros_like(rnd.delta)
        self.anchor = self.anchor - step
        if replace or self.staleness == 0:
            # Nothing was learned since the snapshot (a cut, or a synchronous round): the tensors become the anchor,
            # bitwise the same on every group.
            copy_flat_(self.tensors, self._gather(self.anchor)[: self.numel])
            self._base = self.anchor.clone()
            if replace and self.counters and present > 0:
                counts = rnd.payload[_HEADER + self.shard_numel :].double() / present
                copy_flat_(self.counters, counts.round().to(torch.int64))
        else:
            correction = rnd.delta - step  # this group's own progress out, the global step in
            add_flat_(self.tensors, self._gather(correction)[: self.numel])
            self._base += correction
        self.last_participants = present
        self.stats.committed += 1
        self.stats.participants.append(present)
        self.stats.committed_at.append(time.time())
        self.stats.samples_committed += rnd.samples
        self.stats.history.append((self.manager.current_step(), present, contributors, rnd.samples))
        self.stats.apply_s += time.perf_counter() - start

    def _finish_heal(self, healed: dict[str, Any], rnd: _Flight, header: torch.Tensor, committed: bool) -> None:
        """This group took a live peer's state (inside should_commit): it becomes the peer's global model, then the
        round (which it took part in with nothing) is applied to it as to everyone.

        Each rank of the group healed from its own peer, which sent its state between two of its steps: the ranks
        of that group need not have been at the same point then. What the group's ranks must agree on (the inner
        optimizer state, the loop's counters, how far the peers were into their next round) is local rank 0's."""
        if self.node_group is not None and self.node_size > 1:
            shared = {"extra": healed.get("extra"), "round_steps": healed.get("round_steps")}
            healed = {**healed, **broadcast_object(shared, dist.get_global_rank(self.node_group, 0), self.node_group)}
        if self.extra_state is not None and healed.get("extra") is not None:
            self.extra_state[1](healed["extra"])
        self.outer.load_state_dict(healed["outer"])
        self.anchor = healed["anchor"].to(self.anchor.dtype).clone()
        self._round_s = healed.get("round_s")
        self.stats.committed = int(healed["committed"])
        self.stats.heals += 1
        self.stats.healed_at = time.time()
        self.stats.samples_discarded += rnd.samples + self._carry_samples
        self._carry, self._carry_samples = None, 0
        self._residual = None  # this group's own held-back progress, replaced with the rest of its state
        if committed:
            self._apply(rnd, header, replace=True)
        else:
            copy_flat_(self.tensors, self._gather(self.anchor)[: self.numel])
            self._base = self.anchor.clone()
        # After the round: its counts held this group's own (zeros for a new group), the peer's are the job's.
        for counter, value in zip(self.counters, healed.get("counters") or (), strict=False):
            counter.copy_(value)
        if self.on_heal is not None:
            # With staleness 1 the peer had taken `round_steps` steps of its next round when it sent its state, and
            # commits this round after `local_steps` of them (rounds of a fixed step count).
            done = healed.get("round_steps")
            behind = 0 if done is None or self.dynamic else self.local_steps - int(done)
            self.on_heal(max(behind, 0))

    # -- the heal's state ------------------------------------------------------------------------------------------

    def _heal_state(self) -> dict[str, Any]:
        """What a joiner receives (read by torchft's quorum thread, between two optimizer steps)."""
        state: dict[str, Any] = {
            "signature": self.signature,
            "anchor": self.anchor.clone(),
            "outer": self.outer.state_dict(),
            "round_s": self._round_s,
            "committed": self.stats.committed,
            # Steps this group will take between this heal and the round's commit: with staleness 1 the round in
            # flight commits at the end of the next one, of which `_steps` are done.
            "round_steps": None if self._gated or self.staleness == 0 else self._steps,
            "counters": [c.detach().cpu().clone() for c in self.counters],
        }
        if self.extra_state is not None:
            state["extra"] = self.extra_state[0]()
        return state

    def _load_heal(self, state: dict[str, Any]) -> None:
        """torchft's call when this group heals (inside ``start_quorum``, so on the exchange thread with
        ``staleness=1``): check, then keep it; :meth:`_finish_heal` applies it on the main thread."""
        diff = first_difference(self.signature, [(n, tuple(s)) for n, s in state["signature"]])
        if diff is not None:
            raise ModelMismatchError(
                f"this node's model is not the one the running job trains: {diff}. HINT: start the node with the "
                "same LightningModule and hyperparameters as the others"
            )
        if state["anchor"].numel() != self.shard_numel:
            raise ModelMismatchError(
                f"the live peer's shard has {state['anchor'].numel()} elements, this rank's {self.shard_numel}; HINT: "
                "every node needs the same number of ranks (devices) and the same model"
            )
        self._healed = state

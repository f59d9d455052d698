"""Who stops together on SIGTERM: Lightning's per-step check, scoped to the ranks that train in lockstep.

In Lightning 2.6.6 every training step of a multi-rank run broadcasts a SIGTERM flag from rank 0 over the default
group (``_TrainingEpochLoop._broadcast_sigterm_tensor``) and reads it back with ``.item()``. For DDP that costs
little: its gradient all-reduce puts every rank in lockstep anyway. For the strategies of this pack it is a
collective over the whole world at every step, the very thing they exist to avoid:

* under async training (``async_ssp``, ``auto_sync``'s async mode) it makes every rank wait for rank 0 at every step
  (rank 0 becomes the pacer), and it hangs when ranks train different numbers of batches (``claim_batches``);
* under ``hier_sync`` it puts the nodes back in step with rank 0 at every step, across the slow link that the
  averager's ``max_delay`` lets them run apart on, and a step waits for the link's round trip. On the emulated
  cluster (2 cores, a veth link with no added latency) that was within the noise: ``syncasync-bench --quick
  --repeats 3`` gave ``hier_sync`` 1528 samples/s [1454-1555] with the node's check against 1504 [1419-1568] with
  Lightning's broadcast on ``hetero_slow_link`` (time to target 10.6 s against 11.3 s), and 56.6 [52-58] against
  53.8 [54-57] on ``slow_link``. A real link's latency is not emulated here (no ``netem``);
* on a GPU the ``.item()`` of a CUDA flag is a host sync per step.

So each strategy replaces the per-step broadcast with a check over the ranks that must stop at the same step,
because they share a collective every step: the node for ``hier_sync`` and the sharded strategies (DDP or FSDP2
inside it), the rank alone when it trains apart from everyone (a peer that exits is then caught by the exchange's
liveness timeout and ``PeerWatchdog``, which name it). The node's check is a MAX over a gloo group of the node: any
rank of the node that received SIGTERM stops the whole node at the same step (Lightning's broadcast honours rank
0's signal only), and the flag is a CPU tensor, so on a GPU the check never waits for the device. SLURM and
torchrun signal every task, so in practice every node stops within a step or two of the others.

Lightning's SIGTERM handler has a collective of its own: on a multi-rank run it broadcasts a flag from rank 0 over
the default group from inside the handler, to pair with rank 0's per-step broadcast. Without that per-step
broadcast, a signalled rank other than 0 blocked in its handler until rank 0 failed (measured with ``async_ssp`` at
2 ranks, rank 1 signalled at step 4: rank 1 sat in the handler's broadcast until rank 0's round timed out 20 s
later, ``peer_timeout_s=20``), and one that met a default-group broadcast of rank 0's (a consistent cut broadcasts
the merged model on it) would have paired with it. So the handler's notifier is replaced too, by one that does what
it does without the collective: mark the trainer as signalled, and pass the signal to the processes a launcher
started, once. It leaves the trainer's flag to the check: Lightning's loop also stops a signalled rank at the end of
its step on that flag, alone, where the check stops the rank's whole group at the start of the next step.

The check also runs when validation starts during fit: a signal in the training step before a validation would
otherwise wait for the whole validation to end (the notifier leaves the trainer's flag alone during training, where
Lightning's evaluation loop would have read it), which a short grace period (SLURM's ``KillWait``: 30 s by default)
may not allow. Every rank of a group starts validation after the same step when validation is placed by batches or
epochs; with a time-based ``val_check_interval`` each rank decides on its own clock, so there the check is the
rank's own, and a signalled rank's validation stops at its first batch, as under Lightning.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from datetime import timedelta
from types import FrameType
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_syncasync.algorithms._comm import all_reduce_, new_subgroups
from lightning_syncasync.algorithms.topology import Topology


def scoped_sigterm_check(
    trainer: pl.Trainer, group: dist.ProcessGroup | None = None, signalled: threading.Event | None = None
) -> Callable[[], None]:
    """Replace Lightning's per-step SIGTERM broadcast for this fit, and its handler's broadcast; returns what undoes
    both.

    Args:
        trainer: the fitting trainer.
        group: the ranks that stop together: a gloo group (the flag is a CPU tensor), every rank of it calling this.
            ``None``, or a group of one rank, checks this rank's own flag only.
        signalled: the event the notifier sets (the caller's, to learn of a signal while blocked elsewhere).
    """
    loop = trainer.fit_loop.epoch_loop
    together = group is not None and dist.get_world_size(group) > 1
    connector = getattr(trainer, "_signal_connector", None)
    restore_handler: list[Callable[[], None]] = []
    if signalled is None:
        signalled = threading.Event()  # set by the handler's notifier; the trainer learns it here, with its group

    def swap() -> None:
        if not restore_handler and _lightnings_notifier(connector) is not None:
            restore_handler.append(_without_handler_broadcast(trainer, connector, signalled))

    # Lightning registers its handler after the strategy's setup (before the sanity check): swapped as it is
    # registered, or at once when it is already (auto_sync entering a mode mid-fit).
    wrapped: Callable[[], None] | None = None
    swap()
    if not restore_handler and connector is not None:
        register = connector.register_signal_handlers

        def register_then_swap() -> None:
            register()
            swap()

        connector.register_signal_handlers = wrapped = register_then_swap

    def check() -> None:
        swap()  # a handler registered some other way (once swapped, nothing to do)
        stop = signalled.is_set() or bool(getattr(trainer, "received_sigterm", False))
        if together:
            flag = torch.tensor([int(stop)], dtype=torch.int32, device="cpu")  # a gloo group's
            all_reduce_(flag, group, op=dist.ReduceOp.MAX)
            stop = bool(flag.item())
        if stop:
            if connector is not None:
                connector.received_sigterm = True  # what Lightning's loops and the user's hooks read
            raise SIGTERMException()

    loop._broadcast_sigterm_tensor = check  # type: ignore[method-assign]

    # Validation during fit: the check first (module docstring). Lightning calls the epoch loop's ``val_loop.run()``
    # for it, and for the sanity check, which comes before any step and needs no check (the notifier sets the
    # trainer's flag there itself).
    val_loop = getattr(loop, "val_loop", None)
    val_run = getattr(val_loop, "run", None)

    def check_then_validate() -> Any:
        if not getattr(trainer, "sanity_checking", False):
            if not together or getattr(trainer, "_val_check_time_interval", None) is None:
                check()
            elif signalled.is_set() and connector is not None:
                connector.received_sigterm = True  # this rank's validation stops at its first batch
        assert val_run is not None
        return val_run()

    if val_run is not None:
        val_loop.run = check_then_validate  # type: ignore[union-attr]

    def undo() -> None:
        if signalled.is_set() and connector is not None:
            connector.received_sigterm = True  # a signal no check acted on yet is not lost (Lightning's loops read it)
        if loop.__dict__.get("_broadcast_sigterm_tensor") is check:
            del loop._broadcast_sigterm_tensor
        if val_run is not None and vars(val_loop).get("run") is check_then_validate:
            del val_loop.run  # type: ignore[union-attr]
        if wrapped is not None and vars(connector).get("register_signal_handlers") is wrapped:
            del connector.register_signal_handlers
        for restore in restore_handler:
            restore()
        restore_handler.clear()

    return undo


class SigtermScope:
    """A strategy's :func:`scoped_sigterm_check` for the fit (or the mode) it is in: :meth:`install` replaces one
    already installed, :meth:`undo` is safe to call at any time, and a strategy that holds one pickles (spawn)."""

    def __init__(self) -> None:
        self._undo: Callable[[], None] | None = None
        self._signalled: threading.Event | None = None

    def install(self, trainer: pl.Trainer, group: dist.ProcessGroup | None = None) -> None:
        """:func:`scoped_sigterm_check` over ``group`` (``None``: the rank alone)."""
        self.undo()
        self._signalled = threading.Event()
        self._undo = scoped_sigterm_check(trainer, group, self._signalled)

    def requested(self) -> bool:
        """Whether this rank received SIGTERM during the fit: what a wait on the link polls, so that a signal stops a
        rank blocked on a round (issue 64: a link-bound job ran on for minutes after SIGTERM)."""
        return self._signalled is not None and self._signalled.is_set()

    def __getstate__(self) -> dict[str, Any]:
        return {"_undo": None, "_signalled": None}  # an Event does not pickle (spawn); nothing is installed there

    def undo(self) -> None:
        """Put Lightning's check and handler back (a signal not acted on yet goes to Lightning's flag)."""
        undo, self._undo = self._undo, None
        if undo is not None:
            undo()


def _lightnings_notifier(connector: Any) -> list[Any] | None:
    """The registered SIGTERM handler's list of handlers when it holds Lightning's notifier, else ``None`` (not
    registered yet, or a user's own handler)."""
    handlers = getattr(signal.getsignal(signal.SIGTERM), "signal_handlers", None)
    notifier = getattr(connector, "_sigterm_notifier_fn", None)
    return handlers if isinstance(handlers, list) and notifier is not None and notifier in handlers else None


def _without_handler_broadcast(trainer: pl.Trainer, connector: Any, signalled: threading.Event) -> Callable[[], None]:
    """Swap Lightning's SIGTERM notifier in the registered handler for one without its broadcast (module
    docstring); returns what swaps it back. During training it sets ``signalled`` instead of the trainer's flag:
    Lightning's loop also stops a signalled rank at the end of its step on that flag, alone, where the check stops
    the rank's whole group at the start of the next. Outside training (validation, the sanity check) it sets the
    trainer's flag too, so Lightning's evaluation loop stops at its next batch, as it would without the pack."""
    handlers = _lightnings_notifier(connector)
    assert handlers is not None
    notifier = connector._sigterm_notifier_fn

    def notify(signum: int, frame: FrameType | None) -> None:
        if not signalled.is_set():
            # os.write, not logging or print: the handler may interrupt a write to the same stream mid-way.
            os.write(2, f"rank {trainer.global_rank}: received SIGTERM; stopping at the next step\n".encode())
            launcher = trainer.strategy.launcher
            if launcher is not None:
                launcher.kill(signum)  # as Lightning's: the processes a launcher started get it too
        signalled.set()
        if not trainer.training:
            connector.received_sigterm = True

    original = list(handlers)
    handlers[:] = [notify if h == notifier else h for h in handlers]

    def restore() -> None:
        handlers[:] = original

    return restore


def node_stop_groups(topology: Topology, timeout: timedelta) -> dist.ProcessGroup | None:
    """This rank's node as a gloo group for :func:`scoped_sigterm_check` (every rank creates every node's, as torch
    requires), or ``None`` when each node is one rank. ``timeout``: the strategy's peer timeout, so a check whose peer
    left without it fails within that, not torch's default 30 minutes."""
    if topology.node_size == 1:
        return None
    return new_subgroups(topology.all_nodes(), backend="gloo", timeout=timeout)

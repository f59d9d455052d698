"""``PeerWatchdog``: a run with a dead, frozen or cut-off rank ends on every rank, fast, naming that rank.

Without it, Lightning's ``ddp`` on gloo waits for a frozen peer until the process group's timeout (30 minutes by
default), and a killed peer shows up as ``Connection closed by peer [10.0.0.2]:41234`` on some ranks only. With it
(any strategy; ``hier_sync``, ``async_ssp``, ``auto_sync`` and ``ddp_measured`` add one themselves):

* every rank heartbeats through the job's store (:class:`~lightning_syncasync.algorithms.watchdog.Heartbeat`);
* a rank silent for ``timeout_s`` is named on every rank (``PeerLostError: rank 3 is lost: ...`` on stderr), the
  loggers are flushed, and after ``grace_s`` the process ends with exit code :data:`EXIT_PEER_LOST` (75,
  ``EX_TEMPFAIL``: torchrun's ``--max-restarts`` restarts it). The hard exit is deliberate: on gloo a collective
  already waiting for the lost peer cannot be interrupted (not even by ``ProcessGroup.abort``), and no collective
  can complete any more;
* when a collective fails first (a killed peer's sockets close at once), Lightning's exception path calls
  :meth:`on_exception`, which names the rank whose heartbeat stopped; a rank that fails by itself (an exception in
  user code) publishes its own failure, so the others name it instead of each other;
* a rank that ends normally says so, and is never blamed for its silence afterwards.

Checkpoints already written are untouched; resume from the last one (``ckpt_path="last"``).
"""

from __future__ import annotations

import logging
import os
import sys
import time
import uuid
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from lightning_syncasync.algorithms._comm import broadcast_object
from lightning_syncasync.algorithms.watchdog import Heartbeat, PeerLostError, check_settings

log = logging.getLogger(__name__)

EXIT_PEER_LOST = 75  # EX_TEMPFAIL: a temporary failure, worth a restart


class PeerWatchdog(Callback):
    """End every rank within ``timeout_s + grace_s`` of a peer's death, hang or disconnection, naming the peer.

    Args:
        timeout_s: heartbeat silence after which a rank (or the store's host) is declared lost. Legitimately slow
            phases (a long checkpoint write, validation on one rank) keep heartbeating: only a dead, stopped or
            unreachable process is silent.
        interval_s: heartbeat period (default ``min(1, timeout_s / 10)``).
        grace_s: after a verdict, how long the process may take to end by itself before it is ended.
        exit_code: the exit status of a process ended by the watchdog.

    Example::

        trainer = L.Trainer(strategy="hier_sync", devices=4, callbacks=[PeerWatchdog(timeout_s=60)])
    """

    def __init__(
        self, timeout_s: float = 30.0, interval_s: float | None = None, grace_s: float = 5.0, exit_code: int = 75
    ) -> None:
        check_settings(timeout_s, interval_s)
        if grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {grace_s}")
        if not 1 <= exit_code <= 255:
            raise ValueError(f"exit_code must be in 1..255, got {exit_code}; HINT: 75 (EX_TEMPFAIL)")
        self.timeout_s, self.interval_s, self.grace_s, self.exit_code = timeout_s, interval_s, grace_s, exit_code
        self.heartbeat: Heartbeat | None = None
        self._trainer: pl.Trainer | None = None
        self._generation = 0  # one heartbeat namespace per setup (fit, then test, ...): same order on every rank

    @property
    def lost(self) -> str | None:
        """The verdict (who was lost and why), once there is one."""
        return None if self.heartbeat is None else self.heartbeat.lost

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.heartbeat is not None or trainer.world_size < 2 or not dist.is_initialized():
            return
        self._trainer = trainer
        self._generation += 1
        # Every rank must use the same key namespace, and it must differ from every earlier attempt's (torchrun's
        # store outlives its workers). torchrun's restart count alone does neither once a node is replaced: the new
        # node's agent counts its restarts from 0 while the survivors' agent has counted one, so each side watched
        # keys the other never wrote and both declared the other lost after timeout_s (measured: a ddp job under
        # torchrun --nnodes=1:2 whose node 1 was killed and started again). Rank 0 draws the namespace and
        # broadcasts it (one small collective at setup, in the same order on every rank).
        token = [broadcast_object(f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}-{uuid.uuid4().hex[:12]}", 0)]
        store = self._own_connection() or dist.distributed_c10d._get_default_store()
        self.heartbeat = Heartbeat(
            store, trainer.global_rank, trainer.world_size, timeout_s=self.timeout_s, interval_s=self.interval_s,
            on_lost=self._on_lost, prefix=f"syncasync/wd/{token[0]}/{self._generation}",
        ).start()  # fmt: skip

    def _own_connection(self) -> dist.Store | None:
        """A client connection of its own to the job's store (``MASTER_ADDR:MASTER_PORT``, the store Lightning's and
        torchrun's launches create). Sharing the default store object would queue the heartbeats behind other
        threads' blocking store calls (an SSP exchange waiting on a peer's key), and a verdict could then arrive
        only after the store's host left."""
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not host or not port:
            return None
        try:
            return dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                                 timeout=timedelta(seconds=max(self.timeout_s, 5.0)))  # fmt: skip
        except Exception as err:  # noqa: BLE001 - the default store still works
            log.debug("no own store connection (%s); sharing the default store", err)
            return None

    def _say(self, message: str) -> None:
        rank = self._trainer.global_rank if self._trainer is not None else "?"
        sys.stderr.write(f"PeerLostError (rank {rank}): {message}\n")
        sys.stderr.flush()

    def _on_lost(self, message: str) -> None:
        # Judge thread: the main thread may be stuck in a collective that will never finish.
        self._say(f"{message}; ending this process in {self.grace_s:g}s (exit code {self.exit_code})")
        if self._trainer is not None:
            for logger in self._trainer.loggers:
                try:
                    logger.save()  # what was logged so far reaches the disk
                except Exception:  # noqa: BLE001 - best effort on the way out
                    pass
        time.sleep(self.grace_s)
        os._exit(self.exit_code)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        hb = self.heartbeat
        if hb is None:
            return
        if isinstance(exception, SIGTERMException):
            # A stop on notice, not a lost peer: the pack's strategies agree the signal over the ranks that stop
            # together, so they all raise it at the same step. Looking for a culprit here cost seconds (a few
            # heartbeats, and two more on rank 0) before the strategy's own on_exception ran, in which a
            # fault-tolerant node commits its last round: the other nodes' quorum waited for it (issue 65: 10.5 s).
            hb.stop(finished=True)
            return
        # A killed peer closes its sockets at once, so the collective fails before its heartbeat looks silent:
        # wait a few heartbeats for the evidence (a PeerLostError of a strategy may only know the peer group).
        verdict = hb.blame(wait_s=min(self.timeout_s, 5 * hb.interval_s))
        if verdict is None:
            if isinstance(exception, PeerLostError):
                verdict = str(exception)
            else:  # no peer is silent: this rank is where it started, unless the store itself is gone
                own = f"rank {hb.rank} failed: {type(exception).__name__}: {exception}"[:500]
                verdict = hb.publish(own) or hb.store_lost()
        hb.lost = hb.lost or verdict
        self._say(verdict)
        if trainer.global_rank == 0:
            # Under Lightning's own launch this process hosts the store: leaving at once would take the verdict
            # with it, and the others would blame this rank instead of the lost one. Stay for two heartbeats.
            time.sleep(2 * hb.interval_s + 0.5)
        hb.stop(finished=False)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop(finished=self.heartbeat.lost is None)
            self.heartbeat = None

    def state_dict(self) -> dict[str, Any]:
        return {}  # nothing to resume: liveness starts afresh


def ensure_watchdog(trainer: pl.Trainer, timeout_s: float) -> None:
    """Add a :class:`PeerWatchdog` (``timeout_s`` capped at 30 s) unless the user configured one; for strategies,
    from ``setup_environment`` (the callbacks' ``setup`` hooks run after it, on the live list)."""
    if not any(isinstance(c, PeerWatchdog) for c in trainer.callbacks):
        trainer.callbacks.append(PeerWatchdog(timeout_s=min(30.0, timeout_s)))

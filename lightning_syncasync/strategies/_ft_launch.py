"""How a fault-tolerant node meets the others: its group id and the number of groups from the environment
torchft's examples use, the Lighthouse's reachability and the errors that name it, a joiner's first epoch that starts
part-way, and torchft's logging kept to what a user can act on (``FaultTolerantStrategy``)."""

from __future__ import annotations

import itertools
import logging
import os
import socket
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlparse

from torch.utils.data import Sampler

from lightning_syncasync.algorithms.averaging.elastic import (
    LIGHTHOUSE_ENV,
    QuorumError,
)
from lightning_syncasync.algorithms.averaging.rounds import NonFiniteRoundError
from lightning_syncasync.strategies._async_step import DivergenceError

# torchft's own examples name a node's group and the number of groups with these variables (train_ddp.py).
REPLICA_GROUP_ENV = "REPLICA_GROUP_ID"
NUM_REPLICA_GROUPS_ENV = "NUM_REPLICA_GROUPS"


class _SkipsOnce(Sampler):
    """A training sampler whose next epoch can start ``n`` batches in (a joiner's first epoch). ``set_epoch`` and
    the length are the wrapped sampler's (Lightning shuffles and counts through them)."""

    def __init__(self, sampler: Any, batch_size: int) -> None:
        self.sampler, self.batch_size = sampler, batch_size
        self._skip = 0

    def skip_batches(self, n: int) -> None:
        self._skip = max(0, n) * self.batch_size

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[Any]:
        skip, self._skip = self._skip, 0
        it = iter(self.sampler)
        for _ in itertools.islice(it, skip):
            pass
        yield from it


class _NamesLighthouse:
    """A context in which a missing quorum names the Lighthouse's address."""

    def __init__(self, address: str) -> None:
        self.address = address

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, err: Any, tb: Any) -> bool:
        if isinstance(err, QuorumError) and self.address not in str(err):
            raise QuorumError(f"{err} (Lighthouse: {self.address})") from err
        if isinstance(err, NonFiniteRoundError):
            raise DivergenceError(
                f"this node's progress in round {err.index} was not finite (nan or inf); stopped before it reached "
                "the other nodes, which go on without it. HINT: lower the learning rate (or fix the loss), then "
                "start the node again: it heals from a live node"
            ) from err
        return False


def check_reachable(address: str, timeout_s: float, owner: str) -> None:
    """Refuse, within ``timeout_s``, a Lighthouse that does not answer on its port (the message names it)."""
    parsed = urlparse(address if "://" in address else f"http://{address}")
    host, port = parsed.hostname, parsed.port
    if not host or not port:
        raise ValueError(
            f"{owner}: the Lighthouse address {address!r} has no host:port; HINT: http://HOST:29510 "
            "(torchft_lighthouse's default port)"
        )
    deadline = time.monotonic() + timeout_s
    last: OSError | None = None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, deadline - time.monotonic())):
                return
        except OSError as err:
            last = err
            time.sleep(0.2)
    raise ConnectionError(
        f"{owner}: cannot reach the Lighthouse at {address} within connect_timeout_s={timeout_s:g} ({last}). HINT: "
        f"start it (`torchft_lighthouse --min_replicas 1 --bind [::]:{port}`) on {host}, or set {LIGHTHOUSE_ENV} "
        "to where it runs"
    )


def quiet_torchft_logs() -> None:
    """torchft logs every quorum and every commit at INFO (a line per rank per round), which Hydra's and Lightning's
    logging configurations print; keep its warnings and errors only, unless the user set a level for them."""
    for name in ("torchft", "torchft_commits", "torchft_quorums", "torchft_errors"):
        logger = logging.getLogger(name)
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.WARNING)
    manager_log = logging.getLogger("torchft.manager")
    if not any(isinstance(f, _NoFlightRecorder) for f in manager_log.filters):
        manager_log.addFilter(_NoFlightRecorder())


class _NoFlightRecorder(logging.Filter):
    """torchft warns at every process-group reconfiguration that it cannot reset NCCL's flight recorder, also on a
    CPU run that has no NCCL (the rounds here run on gloo): nothing for the user to act on."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "NCCL flight recorder" not in record.getMessage()


def _env_int(var: str, setting: str) -> int:
    value = os.environ.get(var, "")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{var}={value!r} is not an integer ({setting}); HINT: 0, 1, ... for the nodes") from None

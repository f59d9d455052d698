"""torchft's side of the fault-tolerant rounds: the ``torchft.Manager`` of one rank of a replica group, made with its
process group and checkpoint transport advertised at this node's address (:func:`advertised_host`), and the part of
the manager that :class:`~lightning_syncasync.algorithms.averaging.elastic.ElasticRounds` uses (``QuorumManager``).

torchft is optional (``pip install -e ".[ft]"``): it is imported only when a manager is made."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol

import torch

from lightning_syncasync.algorithms.averaging.ft_host import advertised_host

__all__ = ["FT_HINT", "LIGHTHOUSE_ENV", "QuorumManager", "make_manager", "require_torchft"]

FT_HINT = 'HINT: pip install -e ".[ft]"'
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"


class QuorumManager(Protocol):
    """What :class:`ElasticRounds` uses of ``torchft.Manager`` (typed here so this module imports no torchft)."""

    def start_quorum(self) -> None: ...
    def allreduce(self, tensor: torch.Tensor, should_quantize: bool = False, reduce_op: Any = ...) -> Any: ...
    def should_commit(self) -> bool: ...
    def num_participants(self) -> int: ...
    def current_step(self) -> int: ...
    def errored(self) -> Any: ...
    def report_error(self, e: Exception) -> None: ...
    def register_state_dict_fn(self, key: str, load: Callable[[Any], None], save: Callable[[], Any]) -> None: ...
    def disallow_state_dict_read(self) -> None: ...
    def allow_state_dict_read(self) -> None: ...


def require_torchft(owner: str) -> Any:
    """``import torchft``, or an ``ImportError`` that says how to install it."""
    # The Rust side (the Lighthouse client and the manager server) logs every quorum at INFO to stderr; its logger
    # reads RUST_LOG once, when the extension loads. Warnings and errors only, unless the user chose a level.
    os.environ.setdefault("RUST_LOG", "warn")
    try:
        import torchft
    except ImportError as err:
        raise ImportError(
            f"{owner} needs torchft (PyTorch's fault-tolerance library), which is not installed. {FT_HINT}"
        ) from err
    return torchft


def make_manager(
    owner: str,
    rank: int,
    world_size: int,
    replica_id: str,
    lighthouse: str,
    min_replicas: int,
    timeout_s: float,
    quorum_timeout_s: float,
    connect_timeout_s: float = 10.0,
    store_addr: str | None = None,
    store_port: int | None = None,
) -> Any:
    """This rank's ``torchft.Manager``: one per rank of a replica group (rank 0 runs the group's manager server;
    the group's TCPStore, the one ``init_process_group`` started, must exist), with a process group that torchft
    reconfigures over this local rank of every group present.

    ``use_async_quorum=False``: a group that heals takes the live peer's state before the round's exchange and then
    takes part in it, and nothing it computed before healing is mixed into the quorum's model.

    gloo on every device: the rounds exchange a CPU copy of the shard (what ``SYNCASYNC_EXCHANGE_BACKEND=gloo`` does
    for the other strategies' background exchanges). torchft's ``ProcessGroupNCCL`` would keep a GPU job's exchange on
    the device; it is not used until it has been run on a GPU (docs/fault_tolerance.md)."""
    torchft = require_torchft(owner)
    timeout = timedelta(seconds=timeout_s)
    # Every address the other nodes use to reach this node is the advertised one (advertised_host): the group's
    # store (the one the launcher started: it listens on every interface), the manager server, the checkpoint
    # server, and the exchange's gloo sockets.
    host = advertised_host(lighthouse)
    if store_addr is None:
        store_addr, store_port = host, store_port or int(os.environ["MASTER_PORT"])
    own_device = not os.environ.get("GLOO_SOCKET_IFNAME")
    pg = _gloo_at(torchft, host, timeout) if own_device else torchft.ProcessGroupGloo(timeout=timeout)
    return torchft.Manager(
        pg=pg,
        load_state_dict=None,
        state_dict=None,
        min_replica_size=min_replicas,
        use_async_quorum=False,
        timeout=timeout,
        quorum_timeout=timedelta(seconds=quorum_timeout_s),
        connect_timeout=timedelta(seconds=connect_timeout_s),
        rank=rank,
        world_size=world_size,
        store_addr=store_addr,
        store_port=store_port,
        lighthouse_addr=lighthouse,
        replica_id=replica_id,
        hostname=host,
        checkpoint_transport=_transport(torchft, host, timeout),
        init_sync=True,
    )


def _gloo_at(torchft: Any, host: str, timeout: timedelta) -> Any:
    """torchft's reconfigurable gloo group, with its sockets on ``host``. gloo's default device is the hostname's
    address, which is loopback where ``/etc/hosts`` maps the hostname to 127.0.0.1 (containers, network namespaces):
    the peers would then be told to connect to their own loopback. ``GLOO_SOCKET_IFNAME``, when set, wins (the
    caller keeps torchft's own group then). The body is torchft 0.2's ``_create_pg`` with a device in the options."""
    from torch.distributed import ProcessGroup
    from torch.distributed import ProcessGroupGloo as BaseGloo

    class _GlooAt(torchft.ProcessGroupGloo):
        def _create_pg(self, store: Any, rank: int, world_size: int) -> Any:
            options = BaseGloo._Options()
            options._timeout = self._timeout
            options._devices = [BaseGloo.create_device(hostname=host)]
            pg = ProcessGroup(store, rank, world_size)
            pg._set_default_backend(ProcessGroup.BackendType.GLOO)
            backend = BaseGloo(store, rank, world_size, options)
            backend._set_sequence_number_for_group()
            if self._global_ranks:
                backend.options.global_ranks_in_group = self._global_ranks
            if self._group_rank and self._group_world_size:
                backend.options.group_name = (
                    f"torchft_quorum_{self._quorum_id}_rank_{self._group_rank % self._group_world_size}"
                )
            for device in ("cpu", "cuda"):
                if device == "cpu" or torch.cuda.is_available():
                    pg._register_backend(torch.device(device), ProcessGroup.BackendType.GLOO, backend)
            return pg

    return _GlooAt(timeout=timeout)


def _transport(torchft: Any, host: str, timeout: timedelta) -> Any:
    """torchft's HTTP checkpoint transport, advertised at ``host`` (torchft's own uses the hostname, which emulated
    nodes share)."""
    from torchft.checkpointing import HTTPTransport

    class _HostTransport(HTTPTransport):
        def address(self) -> str:
            return super().address().replace(f"//{socket.gethostname()}:", f"//{host}:", 1)

    transport = _HostTransport(timeout=timeout, num_chunks=0)
    # http.server prints an access line to stderr for every state a joiner fetches ("GET /checkpoint/16/full HTTP/1.1"
    # 200): noise in a user's run. The handler class is this transport's own (torchft defines it per server).
    transport._server.RequestHandlerClass.log_message = lambda *args: None
    return transport

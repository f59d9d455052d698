"""Communication helpers shared by the algorithms: a daemon thread for blocking collectives, and all-gather."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist


class CommThread:
    """One daemon thread that runs blocking collectives in submission order (so every rank issues them in the same
    order). Daemon: a collective stuck on a dead peer must not keep the interpreter from exiting."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.Queue[tuple[Callable[[], Any], Future[Any]] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        fut: Future[Any] = Future()
        self._jobs.put((fn, fut))
        return fut

    def close(self) -> None:
        self._jobs.put(None)

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, fut = job
            try:
                fut.set_result(fn())
            except BaseException as err:  # noqa: BLE001 - handed to the waiting thread
                fut.set_exception(err)


def all_gather_flat(out: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """All-gather ``tensor`` from every rank of ``group`` into the flat ``out`` (rank order)."""
    # torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns); older torch has only it.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, tensor, group=group)

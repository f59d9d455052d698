"""Measured FSDP2 collectives: the all-gathers of parameters and reduce-scatters of gradients inside a node.

FSDP2 (``torch.distributed.fsdp.fully_shard``) issues its collectives itself, where no DDP comm hook can see them.
An ``FSDPModule`` takes a custom all-gather and reduce-scatter (``set_custom_all_gather``,
``set_custom_reduce_scatter``; in torch 2.9 and newer, not in 2.6, where nothing is measured); these are torch's
default ones with the bytes (and, for a blocking call, the time) recorded in a
:class:`~lightning_syncasync.algorithms.stats.StatsRecorder`. Bytes follow the recorder's convention: the tensor
handed to each collective (the shard for an all-gather, the whole gradient bucket for a reduce-scatter).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from lightning_syncasync.algorithms.stats import Scope, StatsRecorder

try:  # torch's default comms live in a private module; without them nothing is measured (and nothing breaks)
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter
except ImportError:  # pragma: no cover - torch versions before the custom-comm API
    DefaultAllGather = DefaultReduceScatter = None  # type: ignore[assignment,misc]


def measure_fsdp_collectives(
    module: torch.nn.Module, recorder: StatsRecorder, scope: Scope = "intra", hsdp: bool = False
) -> int:
    """Route every FSDP unit of ``module`` through measured all-gathers and reduce-scatters; returns how many units
    were found (0 when ``module`` is not sharded or this torch lacks the API).

    With ``hsdp`` (FSDP2 on a 2-D mesh: sharded inside the node, replicated across) each unit also all-reduces its
    reduce-scattered gradient shard across the replicas; FSDP2 calls the all-reduce hook with that shard once it is
    reduced, and its bytes count as inter-node traffic."""
    if DefaultAllGather is None:
        return 0
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in module.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.set_custom_all_gather(_MeasuredAllGather(recorder, scope))
        unit.set_custom_reduce_scatter(_MeasuredReduceScatter(recorder, scope))
        if hsdp:
            unit.set_all_reduce_hook(lambda shard: recorder.record_blocking(_bytes(shard), "inter", 0.0))
    return len(units)


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _waited_s(tensor: torch.Tensor, async_op: bool, start: float) -> float:
    """The host's wait for one of FSDP2's collectives: the host clock since ``start`` for a blocking one on the CPU
    (gloo blocks the host), else 0. On an accelerator FSDP2 issues it from a stream of its own and the host returns
    at the launch; the loop's stream waits for it later, on FSDP2's events, which this wrapper cannot time."""
    if async_op or tensor.device.type != "cpu":
        return 0.0
    return time.perf_counter() - start


# Defined only where torch has the base classes: subclassing the ``None`` above would fail at import, and with it
# every strategy of the package on an older torch (seen on torch 2.6).
if DefaultAllGather is not None:

    class _MeasuredAllGather(DefaultAllGather):  # type: ignore[misc,valid-type]
        def __init__(self, recorder: StatsRecorder, scope: Scope) -> None:
            super().__init__()
            self.recorder, self.scope = recorder, scope

        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, async_op: bool = False):  # type: ignore[no-untyped-def]
            start = time.perf_counter()
            work = super().__call__(output_tensor, input_tensor, group, async_op)
            # An async all-gather is waited on by FSDP later (prefetching the next unit behind this one's compute): only
            # its bytes are known here; so for any of them on an accelerator (_waited_s).
            waited = _waited_s(input_tensor, async_op, start)
            self.recorder.record_blocking(_bytes(input_tensor), self.scope, waited)
            return work

    class _MeasuredReduceScatter(DefaultReduceScatter):  # type: ignore[misc,valid-type]
        def __init__(self, recorder: StatsRecorder, scope: Scope) -> None:
            super().__init__()
            self.recorder, self.scope = recorder, scope

        def __call__(  # type: ignore[no-untyped-def]
            self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any, async_op: bool = False
        ):
            start = time.perf_counter()
            work = super().__call__(output_tensor, input_tensor, group, op, async_op)
            waited = _waited_s(input_tensor, async_op, start)
            self.recorder.record_blocking(_bytes(input_tensor), self.scope, waited)
            return work

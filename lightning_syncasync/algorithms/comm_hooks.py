"""A DDP communication hook that measures what DDP's gradient all-reduce costs.

torch's DDP launches one all-reduce per gradient bucket during backward and waits for all of them at the end of
backward. Wrapping the default hook (``allreduce_hook``) lets us count the bytes of every bucket and stamp when each
all-reduce was launched and completed, which :class:`~lightning_syncasync.algorithms.stats.StatsRecorder` turns
into bytes per step and the time backward spent blocked on the network.

Lightning's ``DDPStrategy`` registers ``ddp_comm_hook`` only on CUDA (``_register_ddp_hooks`` checks
``root_device.type == "cuda"``), so on CPU a hook passed to the strategy is silently ignored. Callers register this
one directly on the ``DistributedDataParallel`` module, which works on gloo as well as NCCL.
"""

# No `from __future__ import annotations` here: DDP's register_comm_hook inspects the hook's annotations at run
# time and rejects string annotations ("bucket annotation should be dist.GradBucket").
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from lightning_syncasync.algorithms.stats import Scope, StatsRecorder, timing_event

HookFn = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


class MeasuredAllReduce:
    """DDP comm-hook state that records bytes and timing of every bucket into a :class:`StatsRecorder`.

    Args:
        recorder: where the measurements go.
        scope: ``"inter"`` when the DDP process group spans nodes, ``"intra"`` otherwise; or a function called per
            bucket that returns the scope of the collective ``inner_hook`` is about to issue, or ``None`` when it
            issues none (e.g. post-local SGD switching from the global group to the node group after warm-up).
        process_group: the group DDP reduces over (``None``: the default group).
        inner_hook: the hook doing the actual communication, ``allreduce_hook`` by default. It is called as
            ``inner_hook(inner_state, bucket)``.
        inner_state: the state for ``inner_hook`` (default: ``process_group``, which is what ``allreduce_hook`` takes).

    Example::

        ddp = DistributedDataParallel(model)
        MeasuredAllReduce(recorder, scope="intra").register(ddp)
    """

    def __init__(
        self,
        recorder: StatsRecorder,
        scope: Scope | Callable[[], Scope | None] = "intra",
        process_group: dist.ProcessGroup | None = None,
        inner_hook: HookFn | None = None,
        inner_state: Any = None,
    ) -> None:
        if not isinstance(recorder, StatsRecorder):
            raise TypeError(f"recorder must be a StatsRecorder, got {type(recorder).__name__}")
        if not callable(scope) and scope not in ("intra", "inter"):
            raise ValueError(f"scope must be 'intra', 'inter' or a function returning one, got {scope!r}")
        self.recorder = recorder
        self.scope = scope
        self.process_group = process_group
        self.inner_hook: HookFn = inner_hook if inner_hook is not None else allreduce_hook
        self.inner_state = inner_state if inner_state is not None else process_group
        self._group_size: int | None = None

    def _alone(self) -> bool:
        """Whether the default all-reduce runs on a group of one rank (a one-rank virtual node, ``devices=1``): it
        moves no byte, so nothing is recorded. A custom ``inner_hook`` picks its own group and is always measured."""
        if self._group_size is None:
            self._group_size = dist.get_world_size(self.process_group)
        return self.inner_hook is allreduce_hook and self._group_size == 1

    def register(self, ddp_module: torch.nn.parallel.DistributedDataParallel) -> None:
        """Register on a DDP module. DDP accepts one comm hook per module, before the first backward."""
        ddp_module.register_comm_hook(self, MeasuredAllReduce.hook)

    @staticmethod
    def hook(state: "MeasuredAllReduce", bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        scope = state.scope() if callable(state.scope) else state.scope
        if scope is None or state._alone():
            return state.inner_hook(state.inner_state, bucket)
        # On CUDA the hook returns before the all-reduce runs: events on the streams time it (algorithms/stats.py).
        launched = timing_event(buffer.device)
        state.recorder.record_launch(buffer.numel() * buffer.element_size(), scope, time.perf_counter(), launched)
        fut = state.inner_hook(state.inner_state, bucket)

        def _done(f: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            # A CUDA future runs its callbacks on a stream that waits for the all-reduce: the event marks its end.
            state.recorder.record_completion(time.perf_counter(), timing_event(buffer.device))
            return f.value()

        return fut.then(_done)


class SkipWhen:
    """Inner-hook state for :meth:`SkipWhen.hook`: all-reduce a bucket unless ``skip()`` says the gradients stay
    local (1-bit Adam after its warm-up exchanges momenta instead).

    Args:
        skip: called per bucket; ``True`` returns the local gradients without communication.
        process_group: the group to all-reduce over otherwise.
    """

    def __init__(self, skip: Callable[[], bool], process_group: dist.ProcessGroup | None = None) -> None:
        self.skip = skip
        self.process_group = process_group

    @staticmethod
    def hook(state: "SkipWhen", bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        if state.skip():
            fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut
        return allreduce_hook(state.process_group, bucket)

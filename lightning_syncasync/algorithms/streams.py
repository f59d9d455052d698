"""A CUDA stream of their own for the collectives that background threads run, ordered against the compute stream
by events, as torch's DDP orders its all-reduces (``torch/csrc/distributed/c10d/reducer.cpp``).

Why: the pack's background exchanges (the averager's compressed rounds, async rounds, per-step SSP, the compressed
DDP hook) run blocking collectives on a thread of their own, so that on CPU they overlap the training loop. On CUDA,
a thread that issues work without a stream of its own issues it on the device's default stream, the one the
training loop computes on: every NCCL collective then makes the compute stream wait for it (``work.wait()``), and
every kernel the exchange runs (encoding, decoding, the outer step) queues behind the next step's forward. The
overlap measured on CPU would be lost.

So, on CUDA:

* the thread runs its job under :attr:`SideStream.stream`, after making it wait for an event the submitting thread
  recorded on its own current stream when it handed the inputs over (:meth:`SideStream.handoff`): the job sees the
  inputs as they were written, and nothing the loop enqueues later;
* at the end of the job the thread synchronises the side stream before it hands the results back, so a finished
  future means the data has arrived (the training loop's "is this round delivered?" is then true, not "is it
  enqueued?"), and the time the loop blocks on a result is the time it waited for the network;
* every CUDA tensor in the results is marked used by the submitter's stream (``record_stream``), so the caching
  allocator does not hand its memory to the side stream again while the loop still reads it.

On CPU every method is a no-op and jobs run as they are. ``enabled=False`` keeps the events and the final
synchronisation but runs the job on the thread's current stream (the default stream), which is what the pack did
before: the results are bitwise the same either way (the same kernels on the same data, in the same order), which
the ``gpu`` tests check. ``SYNCASYNC_SIDE_STREAM=0`` in the environment turns the side streams off for every
exchange of a run (to rule them out when debugging, or to measure what they gain).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch

T = TypeVar("T")

# "0" turns the side streams off for the whole process (module docstring).
SIDE_STREAM_ENV = "SYNCASYNC_SIDE_STREAM"


def _queued_on(device: torch.device | str) -> torch.device | None:
    """``device`` when it queues work the host can run ahead of: the machine's accelerator as torch knows it
    (``torch.accelerator``: CUDA, ROCm, XPU, MPS, a PrivateUse1 backend), not CUDA alone; ``None`` for the CPU (its
    operations have finished when they return) and for a device of another type."""
    device = torch.device(device)
    if device.type == "cpu":
        return None
    accelerator = torch.accelerator.current_accelerator()
    return device if accelerator is not None and accelerator.type == device.type else None


def wait_for_device(device: torch.device | str) -> None:
    """Block the host until ``device`` has run everything queued on it, on every stream: what a clock read after a
    timed operation needs on an accelerator, whose kernels run after the host has moved on. Returns at once on the
    CPU."""
    queued = _queued_on(device)
    if queued is not None:
        torch.accelerator.synchronize(queued)


def wait_for_current_stream(device: torch.device | str) -> None:
    """Block the host until the calling thread's current stream on ``device`` has run what is queued on it: a step's
    own work, which is the training loop's kernels and every collective the loop waited for (DDP, FSDP2, the
    compressed DDP hook and the delayed averager's due rounds make that stream wait on theirs). Unlike
    :func:`wait_for_device` it leaves the background threads' side streams alone: their collectives may be waiting
    for a slower rank, and a device-wide synchronize would wait for them too, so an asynchronous strategy would be
    paced by its stragglers again, and the stall counted as the step's compute.

    A backend whose streams cannot be synchronised one by one gets the device-wide wait."""
    queued = _queued_on(device)
    if queued is None:
        return
    try:
        torch.accelerator.current_stream(queued).synchronize()
    except (RuntimeError, NotImplementedError):
        wait_for_device(queued)


class SideStream:
    """Ordering of one background thread's CUDA work against the thread that submits it.

    Args:
        device: the device of the tensors the jobs work on (a CPU device makes every method a no-op).
        enabled: run the jobs on a stream of their own (``False``: on the thread's default stream; the same results,
            no overlap on GPUs). ``SYNCASYNC_SIDE_STREAM=0`` in the environment overrides it to ``False``.

    Example::

        side = SideStream(param.device)
        handoff = side.handoff()                       # on the training thread, after writing the inputs
        result = side.run(handoff, lambda: exchange())  # on the communication thread
    """

    def __init__(self, device: torch.device | str | None, enabled: bool = True) -> None:
        if not isinstance(enabled, bool):
            raise ValueError(f"enabled must be a bool, got {enabled!r}")
        self.device = torch.device("cpu") if device is None else torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.enabled = enabled and os.environ.get(SIDE_STREAM_ENV, "1") != "0"
        self.stream: Any = torch.cuda.Stream(self.device) if self.cuda and self.enabled else None

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def handoff(self) -> tuple[Any, Any] | None:
        """On the submitting thread, once the job's inputs are written: an event on its current stream (and the
        stream itself, which will read the results). ``None`` on CPU."""
        if not self.cuda:
            return None
        consumer = self.consumer()
        ready = torch.cuda.Event()
        ready.record(consumer)
        return ready, consumer

    def run(self, handoff: tuple[Any, Any] | None, fn: Callable[[], T]) -> T:
        """On the background thread: ``fn()`` after the inputs of ``handoff``, on the side stream, finished before
        it returns (module docstring)."""
        if handoff is None:
            return fn()
        ready, consumer = handoff
        with self.context() as stream:
            stream.wait_event(ready)
            out = fn()
            stream.synchronize()
        self.lend(out, consumer)
        return out

    @contextmanager
    def context(self) -> Iterator[Any]:
        """Run the enclosed CUDA work on the side stream (or the thread's current one when disabled), on the right
        device: a new thread starts on device 0, whatever device the training loop uses. Yields the stream."""
        if not self.cuda:
            yield None
            return
        with torch.cuda.device(self.device):
            stream = self.stream if self.stream is not None else torch.cuda.current_stream(self.device)
            with torch.cuda.stream(stream):
                yield stream

    def consumer(self) -> Any:
        """The calling thread's current stream (``None`` on CPU): what :meth:`follow` and :meth:`lend` take."""
        return torch.cuda.current_stream(self.device) if self.cuda else None

    def follow(self, consumer: Any) -> None:
        """Inside :meth:`context`: the side stream waits for everything enqueued on ``consumer`` so far (for
        threads that take tensors the loop wrote without a handoff event, as the SSP exchange's outbox)."""
        if self.cuda and consumer is not None:
            torch.cuda.current_stream(self.device).wait_stream(consumer)

    def flush(self) -> None:
        """Inside :meth:`context`: wait (this thread only) until the side stream's work is done."""
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()

    def lend(self, out: Any, consumer: Any) -> None:
        """Mark every CUDA tensor in ``out`` as read by ``consumer``, so its memory is not reused by the side stream
        before ``consumer`` is done with it."""
        if not self.cuda or consumer is None:
            return
        from torch.utils._pytree import tree_leaves

        for leaf in tree_leaves(out):
            if torch.is_tensor(leaf) and leaf.is_cuda:
                leaf.record_stream(consumer)

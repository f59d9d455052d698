"""Communication helpers shared by the algorithms: a daemon thread for blocking collectives, and the collectives
themselves.

Every collective of the pack goes through the functions here (a test checks it), because they put the tensor where
the backend needs it: NCCL takes CUDA tensors only, and the pack's CPU metadata (round counters, clocks) must travel
on the GPU there; gloo takes CPU tensors everywhere (CUDA tensors only for some collectives), so a model on a GPU
under gloo (several processes sharing one GPU) sends through a CPU copy. Where the tensor is already on the right
device, nothing is copied.
"""

from __future__ import annotations

import gc
import os
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from lightning_syncasync.algorithms.streams import SideStream

# The backend of the process groups the pack's background threads run collectives on (the averager's compressed
# rounds, async rounds, the per-step SSP exchange, the compressed DDP hook). Unset: the job's default backend.
EXCHANGE_BACKEND_ENV = "SYNCASYNC_EXCHANGE_BACKEND"


def exchange_backend() -> str | None:
    """The backend for the groups whose collectives a background thread issues: ``None`` (the job's default, NCCL
    on GPUs) or ``"gloo"`` when ``SYNCASYNC_EXCHANGE_BACKEND=gloo``.

    Why it exists: under NCCL those threads launch collectives on one communicator while the training thread (DDP's
    buckets, Lightning's own collectives) launches on another. NCCL documents concurrent communicators on one device
    as safe only when every rank orders all their operations the same way (NCCL user guide, "Using multiple NCCL
    communicators concurrently"; torch's ``new_group`` docs ask the same of threads), which two host threads do not
    guarantee: it usually works when both kernels fit on the GPU, and can hang when they do not. Over gloo the
    background hop has no GPU kernel to order (its tensors go through a CPU copy): the fix to reach for when a GPU
    job with a background exchange hangs (``docs/gpu.md``)."""
    value = os.environ.get(EXCHANGE_BACKEND_ENV, "")
    if value == "":
        return None
    if value != "gloo":
        raise ValueError(
            f"{EXCHANGE_BACKEND_ENV} must be unset or 'gloo', got {value!r}; HINT: unset it to use the job's own "
            "backend, or 'gloo' to keep the background exchanges off NCCL"
        )
    return value


class CommThread:
    """One daemon thread that runs blocking collectives in submission order (so every rank issues them in the same
    order). Daemon: a collective stuck on a dead peer must not keep the interpreter from exiting.

    Args:
        name: the thread's name.
        device: the device of the tensors the jobs use: on CUDA they run on a stream of their own, ordered after the
            submitting thread's work at :meth:`submit`, and a job's future completes once its data has arrived
            (:class:`~lightning_syncasync.algorithms.streams.SideStream`).
        side_stream: ``False`` runs CUDA jobs on the thread's default stream (the same results, no overlap).
    """

    def __init__(self, name: str, device: torch.device | str | None = None, side_stream: bool = True) -> None:
        self.side = SideStream(device, side_stream)
        self._jobs: queue.Queue[tuple[Callable[[], Any], Future[Any]] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        """Run ``fn`` on the thread, after the work this thread has enqueued so far on its CUDA stream."""
        fut: Future[Any] = Future()
        handoff = self.side.handoff()
        self._jobs.put((lambda: self.side.run(handoff, fn), fut))
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


def wire_device(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.device:
    """Where ``tensor`` must be for a collective on ``group``: its own device where the backend takes it there."""
    backend = str(dist.get_backend(group))
    if ":" in backend:  # "cpu:gloo,cuda:nccl": a backend per device type
        types = {part.split(":")[0] for part in backend.split(",")}
        return tensor.device if tensor.device.type in types else torch.device("cpu")
    return collective_device(group)


def _staged(fn: Callable[..., Any], outs: list[torch.Tensor], ins: list[torch.Tensor], group: Any) -> None:
    """Run ``fn(*outs, *ins)`` on copies on the wire device when the tensors are elsewhere, and copy the outputs
    back into ``outs`` (those may be among ``ins``: in-place collectives)."""
    dev = wire_device((outs or ins)[0], group)
    if all(t.device == dev for t in [*outs, *ins]):
        fn(*outs, *ins)
        return
    moved = {id(t): t.to(dev) for t in [*outs, *ins]}
    fn(*[moved[id(t)] for t in outs], *[moved[id(t)] for t in ins])
    for t in outs:
        t.copy_(moved[id(t)])


def all_reduce_(
    tensor: torch.Tensor, group: dist.ProcessGroup | None = None, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
) -> None:
    """In-place all-reduce of ``tensor`` over ``group`` (wherever ``tensor`` lives; module docstring)."""
    _staged(lambda t: dist.all_reduce(t, op=op, group=group), [tensor], [], group)


def broadcast_(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None) -> None:
    """In-place broadcast of ``tensor`` from global rank ``src`` over ``group``."""
    _staged(lambda t: dist.broadcast(t, src=src, group=group), [tensor], [], group)


def all_gather_flat(out: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """All-gather ``tensor`` from every rank of ``group`` into the flat ``out`` (rank order)."""
    _staged(lambda o, t: _all_gather_single()(o, t, group=group), [out], [tensor], group)


def start_all_gather_flat(out: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup | None) -> Any:
    """:func:`all_gather_flat` launched (``async_op``): its ``Work``, to ``wait()`` on later. Both tensors must be on
    the wire's device already (:func:`wire_device`): nothing is copied back."""
    return _all_gather_single()(out, tensor, group=group, async_op=True)


def _all_gather_single() -> Callable[..., Any]:
    # torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns); older torch has only it.
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def reduce_scatter_flat(out: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """Sum ``tensor`` over ``group`` and keep this rank's equal slice of the sum in ``out`` (rank order)."""
    # torch 2.13 renamed reduce_scatter_tensor to reduce_scatter_single (the old name warns); gloo supports both.
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    _staged(lambda o, t: scatter(o, t, group=group), [out], [tensor], group)


def all_to_all_flat(out: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """Equal slices of the flat ``tensor`` to every rank of ``group`` in rank order; theirs into ``out``."""
    _staged(lambda o, t: dist.all_to_all_single(o, t, group=group), [out], [tensor], group)


def destroy_groups(*groups: Any) -> None:
    """Release a strategy's communication at its teardown: collect the garbage first (torch's DDP wrapper sits in a
    reference cycle with its comm hook, so dropping it leaves it alive until a collection), then shut down the
    process groups the strategy created. Left to the interpreter's exit, the wrapper and gloo subgroups were torn
    down during finalization, which aborted the process now and then ("terminate called without an active
    exception": 2 runs in 8 of a 2-process DDP fit with a measuring hook, 1 in 4 of the hier_sync resume test;
    0 in 12 and 0 in 12 after)."""
    gc.collect()
    for group in groups:
        if group is None or group is dist.GroupMember.NON_GROUP_MEMBER or not dist.is_initialized():
            continue
        try:
            dist.destroy_process_group(group)
        except (ValueError, RuntimeError):  # already destroyed, or unknown to this process
            pass


def new_subgroups(enumeration: list[list[int]], **kwargs: Any) -> Any:
    """This rank's group among ``enumeration`` (``torch.distributed.new_subgroups_by_enumeration``: every rank
    creates every group, in the same order; ``kwargs`` are its ``timeout``/``backend``).

    Why not call torch's directly: a job whose default group is gloo bound to an accelerator (Lightning passes
    ``device_id=root_device`` to ``init_process_group`` for any device but the CPU, so ``process_group_backend="gloo"``
    on GPUs) fails to create any group that leaves a rank out. torch 2.13 then asks the default group's backend for
    that device to "split" without the rank (``perform_nocolor_split``); gloo says it supports splitting but has no
    such method, and every rank raises ``AttributeError``. The bound device serves only that split, which gloo does
    not need (it builds a subgroup through the store), so it is hidden from torch while the groups are created.
    Found by the tests' emulated accelerator (``tests/_emulated_device.py``); NCCL and CPU jobs are unaffected.
    """
    with unsplittable_bound_device_hidden():
        group, _ = dist.new_subgroups_by_enumeration(enumeration, **kwargs)
    return group


def hide_unsplittable_bound_device() -> Callable[[], None]:
    """Hide the default group's bound device from torch when its backend cannot split (gloo bound to an
    accelerator: see :func:`new_subgroups`); returns what puts it back (a no-op when nothing was hidden).

    For group creation that spans code the pack does not own: Lightning's ``ModelParallelStrategy`` builds its device
    mesh right after the process group, in one method, and ``init_device_mesh`` makes each mesh dimension's group by
    ``split_group`` whenever the default group has a bound device, which gloo's options cannot even be copied for
    (``TypeError: cannot pickle '_Options'``). Found by the emulated accelerator for the sharded strategies.
    """
    default = dist.distributed_c10d._get_default_group()
    bound = getattr(default, "bound_device_id", None)
    if bound is None:
        return lambda: None
    try:
        source = default._get_backend(bound)
    except RuntimeError:  # no backend for the bound device: torch does not split either
        return lambda: None
    if hasattr(source, "perform_nocolor_split"):
        return lambda: None  # NCCL: it splits, and its eager initialisation wants the bound device
    # Hidden, torch makes groups with new_group through the store: always correct, one call per group.
    default.bound_device_id = None

    def restore() -> None:
        default.bound_device_id = bound

    return restore


@contextmanager
def unsplittable_bound_device_hidden() -> Iterator[None]:
    """:func:`hide_unsplittable_bound_device` for the duration of a block."""
    restore = hide_unsplittable_bound_device()
    try:
        yield
    finally:
        restore()


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where tensors for a collective on ``group`` must live: the current CUDA device under NCCL, else the CPU."""
    backend = str(dist.get_backend(group))
    if "nccl" in backend and ":" not in backend:  # "cpu:gloo,cuda:nccl" takes CPU tensors as well
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class InconsistentSettingsError(ValueError):
    """Ranks were started with different values of a setting that must be the same everywhere."""


def check_same_on_every_rank(owner: str, settings: dict[str, Any], group: dist.ProcessGroup | None = None) -> None:
    """Raise on every rank if any of ``settings`` differs between ranks (e.g. ``staleness=2`` on one node and 3 on
    another, which would otherwise deadlock or silently diverge).

    One all-gather of a CRC32 per setting: tensors only, nothing unpickled from other ranks. Every rank raises, naming
    the settings that differ, its own value and the ranks that disagree with it.
    """
    import zlib

    names = sorted(settings)
    if not names or not dist.is_initialized() or dist.get_world_size(group) < 2:
        return
    crcs = [zlib.crc32(repr(settings[n]).encode()) for n in names]
    mine = torch.tensor(crcs, dtype=torch.int64, device="cpu")
    gathered = torch.empty(dist.get_world_size(group) * len(crcs), dtype=torch.int64, device="cpu")
    all_gather_flat(gathered, mine, group)
    table = gathered.view(-1, len(crcs))
    bad = [i for i in range(len(names)) if not bool((table[:, i] == mine[i]).all())]
    if bad:
        parts = [
            f"{names[i]}={settings[names[i]]!r} here (rank {dist.get_rank()}), different on ranks "
            f"{[r for r in range(table.shape[0]) if table[r, i] != mine[i]]}"
            for i in bad
        ]
        raise InconsistentSettingsError(
            f"{owner}: settings differ across ranks: {'; '.join(parts)}; HINT: every node must start with the same "
            "configuration (check each node's overrides and environment)"
        )


def broadcast_object(obj: Any, src: int, group: dist.ProcessGroup | None = None) -> Any:
    """Global rank ``src``'s ``obj`` on every rank of ``group`` (two broadcasts: the size, then the bytes).

    ``torch.save``'s bytes, read back with ``weights_only=True``: tensors, numbers, strings and containers of them
    (optimizer and scheduler state dicts), never code, as ``torch.load`` reads a checkpoint."""
    import io

    mine = dist.get_rank() == src
    size = torch.zeros(1, dtype=torch.int64, device="cpu")
    data = torch.empty(0, dtype=torch.uint8, device="cpu")
    if mine:
        buf = io.BytesIO()
        torch.save(obj, buf)
        data = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        size[0] = data.numel()
    broadcast_(size, src, group)
    if not mine:
        data = torch.empty(int(size.item()), dtype=torch.uint8, device="cpu")
    broadcast_(data, src, group)
    return obj if mine else torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)


def all_gather_state(state: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's ``state`` (nested dicts/lists of tensors and plain values, the same layout on every rank, e.g.
    a compressor's residuals), on every rank, in rank order, its tensors on the CPU: it goes into checkpoints, and
    ``world`` copies of a model-sized residual or optimizer state kept on a GPU would run out of its memory at the
    first checkpoint of a model that trains fine (one tensor's gather at a time is on the device).

    Tensors only on the wire (one all-gather per tensor): unlike ``all_gather_object`` nothing received from another
    rank is unpickled. The layout (keys, shapes, dtypes and the plain values) is checked equal on every rank first.
    """
    from torch.utils._pytree import tree_flatten, tree_unflatten

    leaves, spec = tree_flatten(state)
    layout = repr((spec, [(tuple(x.shape), str(x.dtype)) if torch.is_tensor(x) else x for x in leaves]))
    check_same_on_every_rank("checkpoint state", {"layout": layout}, group)
    world = dist.get_world_size(group)
    per_rank = [list(leaves) for _ in range(world)]
    for i, leaf in enumerate(leaves):
        if torch.is_tensor(leaf):
            sent = leaf.detach().contiguous()
            out = torch.empty((world, *sent.shape), dtype=sent.dtype, device=sent.device)
            all_gather_flat(out.view(-1), sent.view(-1), group)
            for r in range(world):
                per_rank[r][i] = out[r].to("cpu", copy=True)
            del out
    return [tree_unflatten(x, spec) for x in per_rank]

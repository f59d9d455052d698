"""An accelerator emulated on the CPU: the pack's device rules checked at run time on a machine without a GPU.

``tests/test_device_ready.py`` reads the source for the rules that keep tensors on the right device, and the ``gpu``
tests check them at run time, but only where a GPU is. This module gives every machine a second device, ``emugpu``,
whose tensors hold their data in CPU tensors and report ``emugpu:0``. The pack's algorithms run on it unchanged, with
real gloo collectives between real processes (through the pack's staging to the wire device, as for a model on a GPU
under gloo), and the module enforces what an accelerator would:

* an operation that mixes an ``emugpu`` tensor with a CPU tensor of one or more dimensions raises
  :class:`DeviceMismatch`, as torch raises "Expected all tensors to be on the same device" for CUDA (a 0-d CPU tensor
  passes as a scalar, and ``copy_``/``to`` cross devices on purpose);
* a tensor made with ``device=`` that device, ``like`` one of its tensors, or by an operation on them, is on it;
* every point where a GPU would make the host wait for the device (``.item()``, ``bool()`` or ``float()`` of a device
  tensor, a copy to the host, an operation whose result size depends on the data) is recorded in :data:`HOST_SYNCS`
  with the line of the pack that asked for it.

How: torch's PrivateUse1 backend, set up from Python (``_setup_privateuseone_for_python_backend``, which gives
autograd and indexing the device guard they need), renamed ``emugpu``, and a tensor subclass that dispatches every
operation to the CPU data (:class:`OnDevice`). A ``cuda`` device cannot be emulated this way (a build without CUDA
has no device guard for it, and autograd aborts the process), so the pack's CUDA-only branches (side streams, timing
events, the compiled codec) stay for the ``gpu`` tests; everything that should follow the model's device is checked.
FSDP2 (the sharded strategies) runs on it with no-op streams and events and its storage frees sent to the CPU data
(:func:`_fsdp2_frees_host_storage`).

The backend is set up once per process and renames a process-wide slot, so :func:`install` runs in child processes
only: the rank jobs of ``tests/_rank_job.py`` (``--accelerator emugpu``, with :func:`accelerator` for Lightning), a
pytest of ``tests/gpu`` with ``SYNCASYNC_GPU_TESTS_DEVICE=emugpu``, the ranks of ``run_distributed``. (A forked child
of a process that has run a backward pass cannot train on it: autograd's engine sized its per-device queues before
the device existed.)

Usage::

    device = install()
    w = [torch.zeros(7, device=device)]
    ...  # the pack's algorithms on those tensors; w[0].host is the CPU data
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

import lightning_syncasync

NAME = "emugpu"
PACKAGE = str(Path(lightning_syncasync.__file__).parent)

# Where the host waited for the device: (what, the pack's innermost frame "file:line function").
HOST_SYNCS: list[tuple[str, str]] = []
# Called at each of those, in the thread that waits (tests/_rank_job.py counts the pack's steady-step syncs).
ON_SYNC: list[Callable[[], None]] = []

aten = torch.ops.aten
# Operations that take tensors on different devices on purpose.
_CROSS_DEVICE = {aten.copy_.default, aten._to_copy.default, aten.copy.default}
# Operations whose result's size depends on the data: an accelerator copies that size to the host.
_DATA_DEPENDENT = {aten.nonzero.default, aten.masked_select.default, aten._unique2.default}


class DeviceMismatch(RuntimeError):
    """An operation mixed a device tensor with a CPU tensor of one or more dimensions, which a GPU refuses."""


class OnDevice(torch.Tensor):
    """A tensor that reports ``emugpu:0`` and holds its data in a CPU tensor, :attr:`host`."""

    host: torch.Tensor

    @staticmethod
    def __new__(cls, host: torch.Tensor) -> OnDevice:
        out = torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls,
            host.size(),
            strides=host.stride(),
            storage_offset=host.storage_offset(),
            dtype=host.dtype,
            layout=host.layout,
            device=torch.device(NAME, 0),
            requires_grad=False,
        )
        out.host = host
        return out

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # noqa: ARG002 - torch passes it
        return f"OnDevice({self.host!r})"

    def __reduce_ex__(self, protocol: Any) -> Any:
        # Saved as its CPU data, which is how a checkpoint's CUDA tensors come back under Lightning (it loads them
        # onto the CPU): the pack then has to put them back on the device, as on a GPU.
        return self.host.__reduce_ex__(protocol)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        return _dispatch(func, args, kwargs or {})


def _where() -> str:
    """The innermost frame of the pack in the current stack (else the innermost one outside torch and this file)."""
    frames = [f for f in traceback.extract_stack() if f.filename != __file__]
    ours = [f for f in frames if f.filename.startswith(PACKAGE)]
    f = (ours or [f for f in frames if "/torch/" not in f.filename] or frames)[-1]
    return f"{Path(f.filename).name}:{f.lineno} {f.name}"


def _sync(what: str) -> None:
    HOST_SYNCS.append((what, _where()))
    for hook in ON_SYNC:
        hook()


def _on_device(device: Any) -> bool:
    return device is not None and torch.device(device).type == NAME


def _host(x: Any) -> Any:
    return x.host if isinstance(x, OnDevice) else x


def _dispatch(func: Any, args: tuple, kwargs: dict) -> Any:
    flat, _ = tree_flatten((args, kwargs))
    mine = [t for t in flat if isinstance(t, OnDevice)]
    cpu = [t for t in flat if isinstance(t, torch.Tensor) and not isinstance(t, OnDevice)]
    device = kwargs.get("device")
    if mine and func not in _CROSS_DEVICE and any(t.dim() > 0 for t in cpu):
        shapes = [tuple(t.shape) for t in cpu if t.dim() > 0]
        raise DeviceMismatch(
            f"Expected all tensors to be on the same device, but found at least two devices, {NAME}:0 and cpu! "
            f"({func} with CPU tensors of shapes {shapes}, at {_where()})"
        )
    if mine and (func is aten._local_scalar_dense.default or func in _DATA_DEPENDENT):
        _sync(str(func))
    elif mine and func is aten._to_copy.default and device is not None and not _on_device(device):
        _sync("copy to the host")
    elif func is aten.copy_.default and isinstance(args[1], OnDevice) and not isinstance(args[0], OnDevice):
        _sync("copy to the host")
    if func is aten.record_stream.default:
        return None
    # The result is on the device when the operation names it, or names no device and reads a device tensor.
    on_device = _on_device(device) or (device is None and bool(mine))
    if device is not None:
        kwargs = {**kwargs, "device": torch.device("cpu")}
    out = func(*tree_map(_host, args), **tree_map(_host, kwargs))
    if not on_device:
        return out
    # An in-place operation (or one with out=) returns its argument itself: the same device tensor, not a new one.
    given = {id(t.host): t for t in mine}
    return tree_map(
        lambda t: (given[id(t)] if id(t) in given else OnDevice(t)) if isinstance(t, torch.Tensor) else t, out
    )


class _Stream(torch.cpu.Stream):
    """A stream of the emulated device: CPU's no-op stream, with what a device stream also has for FSDP2 and
    torch.distributed.checkpoint."""

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def record_event(self, event: Any = None) -> Any:
        return torch.cpu.Event() if event is None else event  # FSDP2's HSDP asserts an event on a device


_STREAM = _Stream()
_LIBRARY: Any = None


def install() -> torch.device:
    """Set the device up in this process (once; later calls return it): the PrivateUse1 backend renamed ``emugpu``,
    and the three kernels torch's own code reaches it through. A factory (``torch.zeros(..., device=...)``, on any
    thread) dispatches to the backend's ``empty``; ``torch.tensor(...)`` and ``.to()`` copy with Python's dispatch
    turned off, through ``_copy_from``. Every other operation takes a device tensor and goes to :class:`OnDevice`."""
    global _LIBRARY
    if _LIBRARY is None:
        from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

        _setup_privateuseone_for_python_backend(NAME)
        # The device runs each operation when it is dispatched, so its streams and events have nothing to order:
        # FSDP2 (the sharded strategies) overlaps its collectives on streams from the device's module, torch.emugpu,
        # and torch.distributed.checkpoint stages a save on one.
        module = getattr(torch, NAME)
        module.Stream, module.Event = _Stream, torch.cpu.Event
        module.current_stream = lambda device=None: _STREAM
        module.stream = lambda stream: contextlib.nullcontext()
        module.synchronize = lambda device=None: None
        lib = torch.library.Library("aten", "IMPL")  # noqa: TOR901 - kernels for an existing op, one backend
        lib.impl("empty.memory_format", _empty, "PrivateUse1")
        lib.impl("empty_strided", _empty_strided, "PrivateUse1")
        lib.impl("_copy_from", _copy_from, "PrivateUse1")
        _LIBRARY = lib
        _fsdp2_frees_host_storage()
        # gloo serves the device as it serves CUDA (a process group made with device_id=emugpu:0 needs a backend for
        # it); its collectives see the CPU data, through the pack's staging as for a model on a GPU under gloo.
        capability = torch.distributed.Backend.backend_capability["gloo"]
        if NAME not in capability:
            capability.append(NAME)
    return torch.device(NAME, 0)


def _fsdp2_frees_host_storage() -> None:
    """FSDP2 frees a gathered parameter between uses by resizing its storage to 0 (and back before the next
    all-gather); a device tensor here has no storage of its own, so that resize goes to its CPU data's storage, which
    every view of it shares, as a GPU tensor's views share its memory."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    def alloc_storage(tensor: torch.Tensor) -> None:
        host = _host(tensor)
        size = host.numel() * host.itemsize
        if (storage := host.untyped_storage()).size() != size:
            storage.resize_(size)

    def free_storage(tensor: torch.Tensor) -> None:
        if (storage := _host(tensor).untyped_storage()).size() != 0:
            storage.resize_(0)

    _fsdp_param.alloc_storage = _fsdp_param_group.alloc_storage = alloc_storage
    _fsdp_param.free_storage = free_storage


def _empty(size: Any, dtype: Any = None, layout: Any = None, device: Any = None, pin_memory: Any = None,
           memory_format: Any = None) -> OnDevice:  # fmt: skip
    return OnDevice(torch.empty(size, dtype=dtype, layout=layout, device="cpu", memory_format=memory_format))


def _empty_strided(size: Any, stride: Any, dtype: Any = None, layout: Any = None, device: Any = None,
                   pin_memory: Any = None) -> OnDevice:  # fmt: skip
    return OnDevice(torch.empty_strided(size, stride, dtype=dtype, layout=layout, device="cpu"))


def _copy_from(src: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    if isinstance(src, OnDevice) and not isinstance(dst, OnDevice):
        _sync("copy to the host")
    _host(dst).copy_(_host(src))
    return dst


def single_device_strategy() -> Any:
    """Plain Lightning's one-device strategy on the emulated device: Lightning's ``"auto"`` puts a one-device run of
    an accelerator it does not know on the CPU."""
    from lightning.pytorch.strategies import SingleDeviceStrategy

    return SingleDeviceStrategy(device=install())


def accelerator() -> Any:
    """A Lightning accelerator for the device (built here so that importing this module does not import Lightning)."""
    from lightning.pytorch.accelerators import Accelerator

    class EmulatedAccelerator(Accelerator):
        """One ``emugpu`` device per process, as ``devices=1`` with one GPU per node."""

        def setup_device(self, device: torch.device) -> None:
            if device.type != NAME:
                raise ValueError(f"EmulatedAccelerator takes {NAME} devices, got {device}")

        def teardown(self) -> None:
            pass

        def get_device_stats(self, device: Any) -> dict[str, Any]:
            return {}

        @staticmethod
        def parse_devices(devices: Any) -> int:
            if devices not in (1, "1", "auto"):
                raise ValueError(f"the emulated device is one per process (devices=1), got devices={devices!r}")
            return 1

        @staticmethod
        def get_parallel_devices(devices: Any) -> list[torch.device]:
            return [install()]

        @staticmethod
        def auto_device_count() -> int:
            return 1

        @staticmethod
        def is_available() -> bool:
            return True

        @classmethod
        def name(cls) -> str:
            return NAME

    # Lightning's DDP gives torch's DDP device_ids=[index] for any device that is not the CPU, and then makes a
    # torch.cuda.Stream for the wrapping. torch's DDP takes device_ids=None for a module on one device (of any type),
    # which is what the emulated device gets: the wrapping on CUDA is Lightning's code, not the pack's.
    from lightning.pytorch.strategies import DDPStrategy

    own = DDPStrategy.determine_ddp_device_ids
    if not getattr(own, "_emulated", False):

        def determine_ddp_device_ids(self: DDPStrategy) -> list[int] | None:
            return None if self.root_device.type == NAME else own(self)

        determine_ddp_device_ids._emulated = True  # type: ignore[attr-defined]
        DDPStrategy.determine_ddp_device_ids = determine_ddp_device_ids  # type: ignore[method-assign]
    install()
    return EmulatedAccelerator()

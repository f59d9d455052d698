"""One rank of a Lightning fit of 1, 2 or 4 ranks, started the way torchrun starts ranks (environment variables, no
launcher of Lightning's): the device tests run these on the CPU, sharing one GPU over gloo, or on the accelerator
emulated on the CPU (``--accelerator emugpu``, ``tests/_emulated_device.py``).

    python tests/_rank_job.py --accelerator cuda --strategy hier_sync --options '{"compression": "int8"}' --out DIR

On a device it also records the host syncs this package's code makes during the steady steps (``_HostSyncs``) and,
at one rank, the device operations of each steady step (``_DeviceOps``).

Each rank trains the same small model with a BatchNorm (buffers to keep in sync) for ``--steps`` steps on ``--ranks``
nodes of 1 rank (``num_nodes=2, devices=1``: every strategy's cross-node path runs; a strategy's ``node_size`` can
group them; with ``--ranks 1`` the strategy keeps its default backend, NCCL on a GPU), then writes
``DIR/rank{R}.pt``: the final parameters and buffers (on the CPU), the losses, and every tensor the pack's objects
hold at the last step (their path, device type, dtype and size), found by :func:`owned_tensors`. ``--save`` and
``--resume`` take a checkpoint mid-fit and resume from it; ``--strategy auto`` is plain Lightning. ``--nan-at`` makes
rank 0's loss NaN at a step, ``--sigterm-at`` has rank 1 send itself SIGTERM at a step; a rank whose fit ends in an
exception writes which, and at which step, to ``DIR/rank{R}.stopped.json``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import traceback
from collections import deque
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, TensorDataset


class DeviceModel(LightningModule):
    """Linear layers and a BatchNorm, SGD: small, and every update the same function of the data on any device."""

    def __init__(self, nan_at: int | None = None, sigterm_at: int | None = None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 4))
        self.nan_at = nan_at  # rank 0's loss is NaN at this global step (decided on the host: no sync)
        self.sigterm_at = sigterm_at  # rank 1 sends itself SIGTERM at this global step (as SLURM would)
        # On the loss's device: reading each one back (float()) would be a host sync every step, which _HostSyncs
        # exists to catch in the pack's code, and which would slow the steps it watches.
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        if self.nan_at == self.trainer.global_step and self.global_rank == 0:
            loss = loss * float("nan")
        if self.sigterm_at == self.trainer.global_step and self.global_rank == 1:
            import os
            import signal

            os.kill(os.getpid(), signal.SIGTERM)
        self.losses.append(loss.detach())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        # Each rank its own data (the seed differs by rank), the same on every device type.
        g = torch.Generator().manual_seed(100 + self.global_rank)
        x = torch.randn(512, 16, generator=g)
        y = (x[:, :4].argmax(dim=1)).long()
        return DataLoader(TensorDataset(x, y), batch_size=32, shuffle=False)


class ManualDeviceModel(DeviceModel):
    """DeviceModel under manual optimization: the strategy sees the step in ``opt.step()``, inside training_step, and
    checks the gradients there (what_is_checked), not the loss Lightning is handed."""

    def __init__(self, nan_at: int | None = None, sigterm_at: int | None = None) -> None:
        super().__init__(nan_at, sigterm_at)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        opt = self.optimizers()
        opt.zero_grad()
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        opt.step()
        return loss


class ShardedDeviceModel(DeviceModel):
    """DeviceModel for the sharded strategies: FSDP2 shards each linear layer over the node's ranks (no BatchNorm,
    whose running statistics FSDP2 leaves as plain tensors beside sharded weights)."""

    def __init__(self, nan_at: int | None = None, sigterm_at: int | None = None) -> None:
        super().__init__(nan_at, sigterm_at)
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))

    def configure_model(self) -> None:
        from lightning_syncasync.demo._shard import shard_if_meshed

        # On the device before sharding, as a GPU user's module may be: the emulated device's tensors cannot take a
        # CPU parameter's place in FSDP2's own move (set_data between tensor types), which nn.Module.to replaces.
        self.to(self.trainer.strategy.root_device)
        shard_if_meshed(self, (self.net[0], self.net[2]))


def owned_tensors(obj: Any, path: str = "", seen: set[int] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor reachable from ``obj`` through this package's objects (strategies, exchanges, averagers,
    compressors, hooks, callbacks) and the containers they hold, by attribute path. Foreign objects (the model, its
    optimizers, Lightning's and torch's objects) are not entered: their devices are Lightning's business."""
    seen = set() if seen is None else seen
    out: dict[str, torch.Tensor] = {}
    if id(obj) in seen:
        return out
    seen.add(id(obj))
    if torch.is_tensor(obj):
        out[path] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(owned_tensors(v, f"{path}[{k!r}]", seen))
    elif isinstance(obj, list | tuple | deque):
        for i, v in enumerate(obj):
            out.update(owned_tensors(v, f"{path}[{i}]", seen))
    elif type(obj).__module__.startswith("lightning_syncasync") and hasattr(obj, "__dict__"):
        for k, v in vars(obj).items():
            if isinstance(v, nn.Module | torch.optim.Optimizer):
                continue
            out.update(owned_tensors(v, f"{path}.{k}" if path else k, seen))
    return out


class _Report(Callback):
    """After every training step (the last one is kept: before the strategy's end-of-fit cut, when rounds are still in
    flight), what the pack's objects hold, and where. Every step, not the step count: with claimed batches
    (``async_ssp``) a rank's steps are its share of a budget, not ``max_steps``."""

    def __init__(self) -> None:
        self.tensors: list[tuple[str, str, str, int]] = []
        self.groups: dict[str, str] = {}

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        owners = {"strategy": trainer.strategy, "callbacks": [c for c in trainer.callbacks if c is not self]}
        self.tensors = [(p, t.device.type, str(t.dtype), t.numel()) for p, t in sorted(owned_tensors(owners).items())]
        # The backend of every process group the strategy holds (its own attributes and a `_groups` dict).
        held = {
            **vars(trainer.strategy),
            **{f"_groups[{k!r}]": g for k, g in getattr(trainer.strategy, "_groups", {}).items()},
        }
        self.groups = {k: str(dist.get_backend(g)) for k, g in held.items() if isinstance(g, dist.ProcessGroup)}


class _DeviceOps(Callback):
    """The operations on device tensors the training thread dispatches in each steady step (as ``_HostSyncs``
    watches), views excepted: on a GPU each one is a kernel the host launches, so what a strategy adds to plain
    Lightning's count is device work, and host time, that it adds to every step. Counted by a dispatch mode, which
    autograd carries into its backward threads."""

    def __init__(self, steps: int) -> None:
        self.watched = range(2, steps - 1)
        self.per_step: list[int] = []
        self._mode: Any = None

    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        if trainer.global_step in self.watched:
            self._mode = _CountDeviceOps()
            self._mode.__enter__()

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self.per_step.append(self._mode.count)
            self._mode = None


def _is_view(func: Any) -> bool:
    returns = func._schema.returns
    return bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write


class _CountDeviceOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if not _is_view(func):
            tensors = [t for t in (*args, *(kwargs or {}).values(), out) if isinstance(t, torch.Tensor)]
            made_on = (kwargs or {}).get("device")  # a factory
            if any(t.device.type != "cpu" for t in tensors) or (made_on and torch.device(made_on).type != "cpu"):
                self.count += 1
        return out


class _SaveAt(Callback):
    """A checkpoint after a given step, inside the fit as ``ModelCheckpoint`` takes one: the strategies make theirs
    at a consistent cut, which changes the run that goes on, so a resumed run is compared with the run that saved."""

    def __init__(self, step: int, path: str) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


class _Stopped(Callback):
    """The exception that ended this rank's fit and the step it ended at, in ``DIR/rank{R}.stopped.json`` (written in
    Lightning's ``on_exception``, before the teardown, which a job that fails may not let finish)."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        record = {"exception": type(exception).__name__, "message": str(exception), "step": trainer.global_step}
        (Path(self.out) / f"rank{trainer.global_rank}.stopped.json").write_text(json.dumps(record))


# tests/_emulated_device.py, when the job runs on the emulated accelerator.
_EMULATED: Any = None


class _HostSyncs(Callback):
    """On a GPU: every synchronising CUDA operation (``.item()``, a copy to the host, ...) that this package's code
    makes on the training thread during the steady steps (from the third step to the one before the last), by the
    frame that asked for it, with the steps it happened in: a host sync in every step stops the host from queueing
    ahead of the GPU. ``torch.cuda.set_sync_debug_mode`` reports the implicit ones; the explicit ones it does not
    (``torch.cuda.synchronize``, ``Event.synchronize``, ``Stream.synchronize``) are counted through wrappers. The
    frame that asked is the innermost one outside torch, Lightning (and its utilities, torchmetrics) and these
    wrappers: a sync the pack's code asks for counts, also through Lightning (a ``self.log`` of a CUDA tensor);
    one the test model or Lightning's loop asks for does not, even when it runs inside a hook of the pack's (the
    loss closure runs inside its ``optimizer_step``); nor do the communication threads'. On the emulated accelerator
    (``tests/_emulated_device.py``) the emulator reports every sync it sees, to the same count."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.syncs: dict[str, list[int]] = {}
        self.watched = list(range(2, steps - 1))  # the global steps watched
        self._step = 0
        self._saved: Any = None

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._step = trainer.global_step
        if trainer.global_step == 2:
            self._watch(True)
        elif trainer.global_step == self.steps - 1:
            self._watch(False)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._watch(False)

    def _note(self) -> None:
        """Count the sync being made now against the frame that asked for it, if that frame is the pack's."""
        import threading
        import traceback

        if threading.current_thread() is not threading.main_thread():
            return
        outside = [f for f in traceback.extract_stack() if not _not_the_asker(f)]
        caller = outside[-1] if outside else None
        if caller is not None and "lightning_syncasync" in caller.filename:
            where = f"{caller.filename.rpartition('lightning_syncasync')[2]}:{caller.lineno}"
            steps = self.syncs.setdefault(where, [])
            if self._step not in steps:
                steps.append(self._step)

    def _watch(self, on: bool) -> None:
        import warnings

        if _EMULATED is not None:  # tests/_emulated_device.py reports every sync it sees
            hooks = _EMULATED.ON_SYNC
            if on and self._note not in hooks:
                hooks.append(self._note)
            elif not on and self._note in hooks:
                hooks.remove(self._note)
            return
        if on and self._saved is None:
            cuda = torch.cuda
            self._saved = (warnings.showwarning, cuda.synchronize, cuda.Event.synchronize, cuda.Stream.synchronize)
            show, device_sync, event_sync, stream_sync = self._saved

            def record(message: Any, category: Any, *args: Any, **kwargs: Any) -> None:
                if "synchronizing CUDA operation" not in str(message):
                    return show(message, category, *args, **kwargs)
                self._note()
                return None

            def synchronize(*args: Any, **kwargs: Any) -> Any:
                self._note()
                return device_sync(*args, **kwargs)

            def event_synchronize(event: Any) -> Any:
                self._note()
                return event_sync(event)

            def stream_synchronize(stream: Any) -> Any:
                self._note()
                return stream_sync(stream)

            warnings.showwarning = record
            warnings.simplefilter("always")
            torch.cuda.synchronize = synchronize  # type: ignore[assignment]
            torch.cuda.Event.synchronize = event_synchronize  # type: ignore[method-assign]
            torch.cuda.Stream.synchronize = stream_synchronize  # type: ignore[method-assign]
            torch.cuda.set_sync_debug_mode("warn")
        elif not on and self._saved is not None:
            torch.cuda.set_sync_debug_mode("default")
            (warnings.showwarning, torch.cuda.synchronize, torch.cuda.Event.synchronize,  # type: ignore[method-assign]
             torch.cuda.Stream.synchronize) = self._saved  # fmt: skip
            self._saved = None


# Where a sync is made or passed through, never asked for: torch (the operation), Lightning and the libraries it logs
# through, the warnings machinery (``_py_warnings`` from Python 3.14), and _HostSyncs' own wrappers.
_PASS_THROUGH_DIRS = tuple(
    str(Path(module.__file__).parent) + "/"
    for module in (
        torch,
        importlib.import_module("lightning"),
        importlib.import_module("lightning_utilities"),
        importlib.import_module("torchmetrics"),
    )  # fmt: skip
    if module.__file__ is not None
)
_WRAPPERS = ("_note", "record", "synchronize", "event_synchronize", "stream_synchronize")


def _not_the_asker(frame: traceback.FrameSummary) -> bool:
    """Whether a frame only makes or passes on a sync (see ``_PASS_THROUGH_DIRS``) rather than asking for it."""
    if frame.filename.startswith(_PASS_THROUGH_DIRS) or Path(frame.filename).name in ("warnings.py", "_py_warnings.py"):
        return True
    if _EMULATED is not None and frame.filename == _EMULATED.__file__:
        return True
    return frame.filename == __file__ and frame.name in _WRAPPERS


def _whole(value: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--strategy", required=True)
    p.add_argument("--options", default="{}")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    # Nodes of one device each (a strategy's node_size can group them: 4 ranks as 2 nodes of 2).
    p.add_argument("--ranks", type=int, default=2, choices=(1, 2, 4))
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--adaptive-batch", action="store_true", help="with AdaptiveBatchSize (per-rank batch weights)")
    p.add_argument("--save", default=None, help="save a checkpoint here after step --save-step (every rank calls)")
    p.add_argument("--save-step", type=int, default=None, help="the step after which --save is written")
    p.add_argument("--resume", default=None, help="resume the fit from this checkpoint (up to --steps in all)")
    # Lightning resumes a fit stopped by max_steps inside its epoch, where the sampler's order is not the one the
    # uninterrupted run takes: with epochs of this many steps, the fit ends by its epoch count (--steps in all) and a
    # checkpoint falls at an epoch's end, so a resumed run sees the uninterrupted one's batches.
    p.add_argument("--epoch-steps", type=int, default=None, help="batches per epoch; the fit ends on epochs")
    p.add_argument("--nan-at", type=int, default=None, help="rank 0's loss is NaN at this global step")
    p.add_argument("--sigterm-at", type=int, default=None, help="rank 1 sends itself SIGTERM at this global step")
    p.add_argument("--manual", action="store_true", help="the model steps its optimizer itself (manual optimization)")
    args = p.parse_args(argv)
    if args.save and args.save_step is None:
        p.error("--save needs --save-step")
    if args.epoch_steps is not None and args.steps % args.epoch_steps:
        p.error("--steps must be a whole number of --epoch-steps")

    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_syncasync  # noqa: F401 - registers the strategy names

    torch.set_num_threads(1)
    seed_everything(args.seed, workers=True)
    strategy: Any = "auto"  # "auto": plain Lightning (one device), the reference for the pack's added device work
    if args.strategy != "auto":
        entry = StrategyRegistry[args.strategy]
        options = {**entry["init_params"], **json.loads(args.options)}
        if args.ranks > 1:
            options["process_group_backend"] = "gloo"  # two ranks on one GPU: NCCL cannot put both on one device
        strategy = entry["strategy"](**options)
    report = _Report()
    syncs = _HostSyncs(args.steps)
    ops = _DeviceOps(args.steps)
    on_device = args.accelerator in ("gpu", "cuda", "emugpu")
    callbacks: list[Callback] = [report, _Stopped(args.out)] + ([syncs] if on_device else [])
    if on_device and args.ranks == 1:
        # One rank only (the count test_one_gpu.py checks): at two, the counting mode would also be active in the
        # backward threads, where the compressing DDP hook runs the codec that torch.compile fuses on a GPU.
        callbacks.append(ops)
    if args.save:
        callbacks.append(_SaveAt(args.save_step, args.save))
    if args.adaptive_batch:
        from lightning_syncasync.callbacks import AdaptiveBatchSize

        callbacks.append(AdaptiveBatchSize(interval=4))
    model_cls = ShardedDeviceModel if "sharded" in args.strategy else ManualDeviceModel if args.manual else DeviceModel
    model = model_cls(args.nan_at, args.sigterm_at)
    accelerator: Any = args.accelerator
    if accelerator == "emugpu":  # an accelerator emulated on the CPU (tests/_emulated_device.py)
        global _EMULATED
        import _emulated_device

        _EMULATED = _emulated_device
        accelerator = _emulated_device.accelerator()
        if strategy == "auto":
            strategy = _emulated_device.single_device_strategy()
    trainer = Trainer(
        accelerator=accelerator,
        devices=1,
        num_nodes=args.ranks,
        # "warn": deterministic kernels where torch has them, a warning (not an error) where it has none.
        deterministic="warn" if args.deterministic else False,
        strategy=strategy,
        # max_steps ends the fit (claimed batches split an epoch unevenly), or with --epoch-steps the epoch count.
        max_steps=args.steps if args.epoch_steps is None else -1,
        max_epochs=100 if args.epoch_steps is None else args.steps // args.epoch_steps,
        limit_train_batches=args.epoch_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=callbacks,
    )
    trainer.fit(model, ckpt_path=args.resume)
    rank = trainer.global_rank
    # A sharded model's entries are DTensors: gathered whole (every rank calls, in the same order), so a record is
    # the model's full state whatever the strategy.
    state = {k: _whole(v).detach().cpu() for k, v in model.state_dict().items()}
    torch.save(
        {
            "rank": rank,
            "state": state,
            "losses": [float(x) for x in model.losses],
            "tensors": report.tensors,
            "syncs": syncs.syncs,
            "device_ops": ops.per_step,
            "groups": report.groups,
            # auto_sync: a non-finite loss held back in async mode (read after fit; no switcher cleared it).
            "diverged": getattr(trainer.strategy, "diverged", None),
        },
        Path(args.out) / f"rank{rank}.pt",
    )
    # The job's group ends here, not in the interpreter's finalization: left to it, a 4-rank CPU job of
    # ddp_measured (2 nodes of 2, int8) aborted at exit once ("terminate called without an active exception").
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What every strategy of the pack does for reliability (issue 10): a ``PeerWatchdog`` so a lost peer ends the run
fast and by name, a setup-time check that every rank was started with the same settings, a check that a strategy
keeping whole replicas was not given a sharded model, and :class:`~lightning_syncasync.plugins.AtomicCheckpointIO` as
the default checkpoint I/O."""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from typing import Any

from lightning.pytorch.plugins.io import CheckpointIO
from typing_extensions import override

from lightning_syncasync.algorithms._comm import check_same_on_every_rank
from lightning_syncasync.plugins.checkpoint_io import AtomicCheckpointIO, check_lightning_checkpoint

# Upstream warnings every rank prints once per run, the same line each time (filtered on ranks other than 0):
# torch 2.13 deprecates `LeafSpec`, which Lightning 2.6's `utilities/_pytree.py` still builds on every batch transfer.
PER_RANK_REPEATS: list[tuple[str, type[Warning]]] = [
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning),
]


class WatchedStrategy:
    """Mixin (before the Lightning base): adds a :class:`~lightning_syncasync.callbacks.watchdog.PeerWatchdog` with
    the strategy's ``peer_timeout_s`` (capped at 30 s) unless the user configured one, and checks at setup, on
    every rank, that the constructor's settings are the same on every rank (a node started with ``staleness=3``
    while the others have 2 would otherwise hang at an SSP gate or silently drift)."""

    _checkpoint_io: CheckpointIO | None

    @property
    def checkpoint_io(self) -> CheckpointIO:
        if self._checkpoint_io is None:  # the user's plugin (Trainer(plugins=[...])) wins
            self._checkpoint_io = AtomicCheckpointIO()
        return super().checkpoint_io  # type: ignore[misc]

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO) -> None:
        self._checkpoint_io = io

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only)  # type: ignore[misc]
        check_lightning_checkpoint(checkpoint, checkpoint_path)
        return checkpoint

    def consistent_settings(self) -> dict[str, Any]:
        """The constructor settings that must agree across ranks: every plain-valued constructor argument kept as
        an attribute of the same name, and the fields of its options object (``options``)."""
        out = {}
        for name in inspect.signature(type(self).__init__).parameters:
            value = getattr(self, name, None) if name not in ("self", "kwargs") else None
            if dataclasses.is_dataclass(value) and not isinstance(value, type):
                out.update({f"options.{k}": v for k, v in dataclasses.asdict(value).items()})
            elif isinstance(value, (bool, int, float, str, tuple, list, dict)):
                out[name] = value
        return out

    @override
    def setup_distributed(self) -> None:
        super().setup_distributed()  # type: ignore[misc]
        check_same_on_every_rank(getattr(self, "strategy_name", type(self).__name__), self.consistent_settings())

    @override
    def setup_environment(self) -> None:
        super().setup_environment()  # type: ignore[misc]
        if self.global_rank != 0:  # type: ignore[attr-defined]
            # Rank 0 shows each upstream warning; every other rank printed the same lines again.
            for message, category in PER_RANK_REPEATS:
                warnings.filterwarnings("ignore", message=message, category=category)
        module = self.lightning_module  # type: ignore[attr-defined]
        # At one rank there is no peer to lose, and a callback that does nothing still costs Lightning's dispatch of
        # every hook at every step.
        if module is not None and self.world_size > 1:  # type: ignore[attr-defined]
            from lightning_syncasync.callbacks.watchdog import ensure_watchdog  # callbacks sit above strategies

            ensure_watchdog(module.trainer, float(getattr(self, "peer_timeout_s", 30.0)))

    def setup(self, trainer: Any) -> None:
        # configure_model has run (Lightning calls it before strategy.setup), and DDP has not wrapped the model yet.
        if getattr(self, "_device_mesh", None) is None:  # the sharding strategies give the module a mesh
            check_not_sharded(self.lightning_module, getattr(self, "strategy_name", type(self).__name__))  # type: ignore[attr-defined]
        super().setup(trainer)  # type: ignore[misc]


def check_not_sharded(module: Any, name: str) -> None:
    """Refuse a module whose ``configure_model`` sharded it (FSDP2's DTensors) under a strategy that keeps a whole
    replica per rank: its averaging, rounds and compression work on whole tensors, and a DTensor there would fail deep
    in a collective or, worse, average shards as if they were replicas."""
    if module is None:
        return
    from torch.distributed.tensor import DTensor

    sharded = [n for n, p in module.named_parameters() if isinstance(p, DTensor)]
    if sharded:
        raise ValueError(
            f"{name} keeps a whole replica of the model on every rank, but configure_model sharded parameter(s) "
            f"{sharded[:3]}{' ...' if len(sharded) > 3 else ''} with FSDP2 (DTensors); HINT: use hier_sync_sharded or "
            "async_ssp_sharded (FSDP2 inside each node), or leave the model unsharded"
        )

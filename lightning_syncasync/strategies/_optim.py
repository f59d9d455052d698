"""The torch optimizer behind Lightning's ``LightningOptimizer`` wrapper (the strategies step or inspect the raw one:
the wrapper's ``step`` would call back into the strategy)."""

from __future__ import annotations

from typing import Any


def unwrap_optimizer(optimizer: Any) -> Any:
    return getattr(optimizer, "_optimizer", optimizer)


def broadcast_optimizer_state(optimizers: list[Any], src: int = 0, group: Any = None) -> None:
    """Make every rank's optimizer state (Adam's moments and step counts, SGD's momentum) rank ``src``'s, in place.

    Training modes that let the states drift apart (``async_ssp``'s rounds, ``auto_sync``'s hier and async modes)
    call it at a consistent cut, where the model becomes one: so does this, so that a checkpoint (which holds rank
    0's) is every rank's state and resuming is exact. A collective over the default group: every rank calls it at
    the same cut. The layout (which state each parameter has, and its shapes) must be the same on every rank; it is
    checked first, so a rank that has not stepped yet fails with a clear error instead of a mismatched collective.

    Sharded models (FSDP2: the states are DTensors): each rank broadcasts its local shards over ``group``, the ranks
    that hold the same shard on every node (``src`` is a global rank of that group).
    """
    import torch

    from lightning_syncasync.algorithms._comm import check_same_on_every_rank
    from lightning_syncasync.algorithms._flat import broadcast_flat_

    tensors = []
    layout = []
    for k, optimizer in enumerate(optimizers):
        opt = unwrap_optimizer(optimizer)
        params = [p for pg in opt.param_groups for p in pg["params"]]
        for i, p in enumerate(params):
            state = opt.state.get(p, {})
            for key in sorted(k2 for k2, v in state.items() if torch.is_tensor(v)):
                tensors.append(local_part(state[key]))
                layout.append((k, i, key, tuple(state[key].shape), str(state[key].dtype)))
    check_same_on_every_rank("the optimizer state at a consistent cut", {"layout": layout})
    broadcast_flat_(tensors, src, group)


def local_part(t: Any) -> Any:
    """This rank's part of ``t``: the local shard of a DTensor (a view of its storage), else ``t``."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t

"""One rank of a one- or two-rank Lightning fit, started the way torchrun starts ranks (environment variables, no
launcher of Lightning's): the device tests run these on the CPU, or sharing one GPU over gloo.

    python tests/_rank_job.py --accelerator cuda --strategy hier_sync --options '{"compression": "int8"}' --out DIR

Each rank trains the same small model with a BatchNorm (buffers to keep in sync) for ``--steps`` steps on ``--ranks``
nodes of 1 rank (``num_nodes=2, devices=1``: every strategy's cross-node path runs; with ``--ranks 1`` the strategy
keeps its default backend, NCCL on a GPU), then writes ``DIR/rank{R}.pt``: the final
parameters and buffers (on the CPU), the losses, and every tensor the pack's objects hold at the last step (their
path, device type, dtype and size), found by :func:`owned_tensors`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import deque
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class DeviceModel(LightningModule):
    """Linear layers and a BatchNorm, SGD: small, and every update the same function of the data on any device."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 4))
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        # Each rank its own data (the seed differs by rank), the same on every device type.
        g = torch.Generator().manual_seed(100 + self.global_rank)
        x = torch.randn(512, 16, generator=g)
        y = (x[:, :4].argmax(dim=1)).long()
        return DataLoader(TensorDataset(x, y), batch_size=32, shuffle=False)


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

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        owners = {"strategy": trainer.strategy, "callbacks": [c for c in trainer.callbacks if c is not self]}
        self.tensors = [(p, t.device.type, str(t.dtype), t.numel()) for p, t in sorted(owned_tensors(owners).items())]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--strategy", required=True)
    p.add_argument("--options", default="{}")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    p.add_argument("--ranks", type=int, default=2, choices=(1, 2))
    p.add_argument("--deterministic", action="store_true")
    args = p.parse_args(argv)

    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_syncasync  # noqa: F401 - registers the strategy names

    torch.set_num_threads(1)
    seed_everything(args.seed, workers=True)
    entry = StrategyRegistry[args.strategy]
    options = {**entry["init_params"], **json.loads(args.options)}
    if args.ranks > 1:
        options["process_group_backend"] = "gloo"  # two ranks on one GPU: NCCL cannot put both on one device
    strategy = entry["strategy"](**options)
    report = _Report()
    model = DeviceModel()
    trainer = Trainer(
        accelerator=args.accelerator,
        devices=1,
        num_nodes=args.ranks,
        deterministic=args.deterministic,
        strategy=strategy,
        max_steps=args.steps,
        max_epochs=100,  # max_steps ends the fit (claimed batches split an epoch unevenly)
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[report],
    )
    trainer.fit(model)
    rank = trainer.global_rank
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    torch.save(
        {"rank": rank, "state": state, "losses": model.losses, "tensors": report.tensors},
        Path(args.out) / f"rank{rank}.pt",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

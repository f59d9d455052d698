"""Your own LightningModule trained with ``hier_sync``, ``SyncMonitor`` and ``AdaptiveBatchSize``, from plain Python.

Nothing here comes from ``lightning_syncasync.demo``: the model, the data (a synthetic classification task built in
this file) and the loop settings are what a user would write. Run it from anywhere::

    python examples/own_module.py                          # 2 CPU processes over gloo, 200 steps
    python examples/own_module.py --max-steps 20           # a quick try
    python examples/own_module.py --devices 4 --node-size 2  # one machine as 2 virtual nodes of 2 ranks
    # 2 real nodes of 4 GPUs: on each node, with NODE_RANK, MASTER_ADDR and MASTER_PORT set (or under torchrun)
    python examples/own_module.py --accelerator gpu --devices 4 --num-nodes 2 --node-size 0

It ends with ``SyncMonitor``'s per-rank table and one line with the final validation accuracy.
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_syncasync  # noqa: F401  (registers the strategy names; must come before Trainer(strategy=...))
from lightning_syncasync.callbacks import AdaptiveBatchSize, SyncMonitor
from lightning_syncasync.strategies import HierSyncStrategy


def make_datasets(
    num_samples: int = 4096, features: int = 16, classes: int = 4, seed: int = 0
) -> tuple[TensorDataset, TensorDataset]:
    """A synthetic task: Gaussian inputs labelled by a fixed random two-layer teacher network (80/20 split).

    Map-style ``TensorDataset``s, which is what ``AdaptiveBatchSize`` needs: it splits each global batch by index, so
    the dataset must have ``__len__`` (an ``IterableDataset`` is refused). The data comes from its own seeded
    generator, so every rank (each one runs this file) builds the same data.
    """
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, features, generator=g)
    teacher_in = torch.randn(features, 32, generator=g)
    teacher_out = torch.randn(32, classes, generator=g)
    y = (torch.tanh(x @ teacher_in) @ teacher_out).argmax(dim=1)
    split = num_samples * 4 // 5
    return TensorDataset(x[:split], y[:split]), TensorDataset(x[split:], y[split:])


class MLPClassifier(L.LightningModule):
    """A plain MLP classifier: nothing in it knows about the strategy or the callbacks."""

    def __init__(self, features: int = 16, classes: int = 4, hidden: int = 64, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(features, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        # A mean over the batch (torch's default): AdaptiveBatchSize's unbiased weighting of unequal per-rank batches
        # assumes it (pass loss_reduction="sum" to the callback for a summed loss).
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        # Each rank validates its share of the data: sync_dist averages over the ranks.
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", (logits.argmax(dim=1) == y).float().mean(), sync_dist=True, prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=200, help="optimizer steps (default 200)")
    parser.add_argument("--val-every", type=int, default=50, help="validate every N steps (and at the last one)")
    parser.add_argument("--batch-size", type=int, default=32, help="per-rank batch size before rebalancing")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2, help="processes per node")
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument(
        "--node-size",
        type=int,
        default=1,
        help="ranks per (virtual) node for hier_sync; 0 = the real nodes (default 1: see the comment in main())",
    )
    parser.add_argument("--inter-period", type=int, default=4, help="steps between two cross-node averagings")
    parser.add_argument("--out-dir", default="outputs/own_module", help="logs and checkpoints")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> float:
    args = parse_args(argv)
    L.seed_everything(args.seed, workers=True)
    train_set, val_set = make_datasets(seed=args.seed)
    # shuffle=True, no custom sampler: Lightning swaps in its DistributedSampler and AdaptiveBatchSize replaces that
    # with its own index-splitting sampler (a custom sampler or batch_sampler would be refused).
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True)
    val_loader = DataLoader(val_set, batch_size=256)

    # hier_sync forms its nodes from the cluster: world_size // num_nodes ranks per node. With devices=2 and
    # num_nodes=1 that is one node of 2 ranks, where hier_sync is plain DDP (it warns so at setup) and the
    # hierarchy never runs. node_size=1 makes each process its own virtual node: DDP inside a node is then a no-op
    # and the two processes' models are averaged every `inter_period` steps in the background, applied `max_delay`
    # steps late, as across real nodes (the name "hier_sync_virtual" does the same for 2 processes). On a real
    # cluster pass --node-size 0 so the real nodes are used.
    # AdaptiveBatchSize keeps each node's share of the global batch fixed under hier_sync (nodes are averaged
    # uniformly) and rebalances ranks inside a node: with one rank per virtual node it measures and logs but keeps
    # the even split; --devices 4 --node-size 2 (or real nodes of several ranks) lets it move samples.
    strategy = HierSyncStrategy(
        node_size=args.node_size or None,
        inter_period=args.inter_period,
        max_delay=1,
        # Lightning's default launcher ("popen") re-runs this script (`python examples/own_module.py ...`) for the
        # other ranks, which is right for a script: MLPClassifier is defined here and every rank defines it again.
        # Inside a notebook use start_method="fork" (examples/notebook.py).
        start_method="popen",
    )
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=strategy,
        max_steps=args.max_steps,
        # Validation counted in steps across epochs (check_val_every_n_epoch=None), so a short run validates too.
        val_check_interval=min(args.val_every, args.max_steps),
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        log_every_n_steps=10,
        logger=CSVLogger(args.out_dir, name="csv"),
        default_root_dir=args.out_dir,
        enable_progress_bar=False,
        callbacks=[SyncMonitor(), AdaptiveBatchSize(interval=10)],
    )
    model = MLPClassifier()
    trainer.fit(model, train_dataloaders=train_loader, val_dataloaders=val_loader)
    val_acc = float(trainer.callback_metrics["val_acc"])
    if trainer.is_global_zero:  # every rank runs this script; one line is enough
        print(f"final val_acc={val_acc:.4f} after {trainer.global_step} steps on {trainer.world_size} ranks")
    return val_acc


if __name__ == "__main__":
    main()

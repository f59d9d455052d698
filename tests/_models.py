"""Test models shared by several test files, at module level so that spawn can pickle them."""

from __future__ import annotations

import torch
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class TinyModel(LightningModule):
    """Module level so that spawn can pickle it."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(256, 8, generator=g)
        return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=16)


class TinyOneBitModel(TinyModel):
    """TinyModel trained with 1-bit Adam (3 warm-up steps)."""

    def configure_optimizers(self):
        from lightning_syncasync.algorithms.onebit_adam import OneBitAdam

        return OneBitAdam(self.parameters(), lr=0.01, warmup_steps=3)

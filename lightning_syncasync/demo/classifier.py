"""Configurable image classifier used as the demo/benchmark model for the sync/async strategies.

Two architectures cover the two regimes that matter when comparing gradient-synchronisation strategies: ``"mlp"`` has
many parameters per FLOP (communication-bound), ``"convnet"`` has few parameters but much compute per parameter
(compute-bound, the natural workload for straggler experiments).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

from lightning_syncasync.demo._shard import shard_if_meshed

_ARCHS = ("mlp", "convnet")
_OPTIMIZERS = ("adam", "sgd", "adamw")
_SCHEDULES = ("constant", "cosine")


class WarmupCosine:
    """Learning-rate multiplier: a linear warm-up, then constant or a cosine decay to ``min_lr_ratio``.

    A module-level class rather than a lambda so the scheduler can be pickled and its state checkpointed.

    Args:
        warmup_steps: Steps of linear warm-up from ``1 / warmup_steps`` to 1 (0: none).
        total_steps: Steps over which the cosine runs (warm-up included); ``None`` keeps the rate constant after the
            warm-up.
        min_lr_ratio: Multiplier the cosine ends at.

    Example::

        >>> f = WarmupCosine(warmup_steps=2, total_steps=6)
        >>> [round(f(s), 2) for s in range(7)]
        [0.5, 1.0, 1.0, 0.85, 0.5, 0.15, 0.0]
    """

    def __init__(self, warmup_steps: int, total_steps: int | None = None, min_lr_ratio: float = 0.0) -> None:
        self.warmup_steps = warmup_steps
        self.total_steps = total_steps
        self.min_lr_ratio = min_lr_ratio

    def __call__(self, step: int) -> float:
        """Return the multiplier for optimizer step ``step`` (0-based)."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.total_steps is None:
            return 1.0
        # Step `warmup_steps` is the peak and the budget's last step (total_steps - 1) is one step short of the floor,
        # so no step within the budget is wasted at a zero learning rate.
        decay = self.total_steps - self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / decay) if decay > 0 else 1.0
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_mlp(input_shape: list[int], num_classes: int, hidden: int, depth: int) -> nn.Sequential:
    """Build ``Flatten -> depth x (Linear(hidden) + ReLU) -> Linear(num_classes)``.

    Args:
        input_shape: Shape of one input sample.
        num_classes: Number of output logits.
        hidden: Width of each hidden layer.
        depth: Number of hidden layers.

    Returns:
        The network.
    """
    layers: list[nn.Module] = [nn.Flatten()]
    width = math.prod(input_shape)
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


def build_convnet(
    input_shape: list[int], num_classes: int, channels: int, depth: int, fc_hidden: int = 0, batch_norm: bool = False
) -> nn.Sequential:
    """Build ``depth x (Conv3x3(channels) [+ BatchNorm] + ReLU [+ MaxPool2d(2)]) -> head``: the head is a global
    average pool and a Linear, or with ``fc_hidden`` a flatten, a wide ``Linear(fc_hidden)`` + ReLU and a Linear
    (a classic CNN whose parameters sit mostly in that layer: the several-MB model of a link-bound job).

    A block is followed by ``MaxPool2d(2)`` only while both spatial sides are still >= 2, so deep stacks on tiny
    images (e.g. 8x8 digits) keep working at 1x1 resolution.

    Args:
        input_shape: ``[C, H, W]`` of one input sample.
        num_classes: Number of output logits.
        channels: Channels of every conv layer.
        depth: Number of conv blocks.
        fc_hidden: Width of a fully-connected hidden layer on the flattened features (0: global average pool).
        batch_norm: A BatchNorm2d after every conv (buffers that the strategies keep apart between cuts).

    Returns:
        The network.
    """
    in_channels, height, width = input_shape
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers.append(nn.Conv2d(in_channels, channels, kernel_size=3, padding=1))
        if batch_norm:
            layers.append(nn.BatchNorm2d(channels))
        layers.append(nn.ReLU())
        in_channels = channels
        if height >= 2 and width >= 2:
            layers.append(nn.MaxPool2d(2))
            height, width = height // 2, width // 2
    if fc_hidden:
        layers += [nn.Flatten(), nn.Linear(channels * height * width, fc_hidden), nn.ReLU()]
        layers.append(nn.Linear(fc_hidden, num_classes))
    else:
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, num_classes)]
    return nn.Sequential(*layers)


class Classifier(LightningModule):
    """MLP or small convnet classifier with cross-entropy loss and torchmetrics accuracy.

    Logged metrics: ``train_loss`` (per step, progress bar), ``train_acc`` (per epoch), ``val_loss``/``val_acc``
    (per epoch, synchronised across ranks; ``val_acc`` on the progress bar), ``test_loss``/``test_acc``.
    ``predict_step`` returns the predicted class indices.

    Attributes:
        input_shape: Resolved shape of one input sample.
        net: The underlying ``nn.Sequential``.
        train_acc: Training accuracy metric.
        val_acc: Validation accuracy metric.
        test_acc: Test accuracy metric.

    Example::

        model = Classifier(input_shape=[1, 28, 28], arch="convnet", depth=4, lr=1.6e-2, warmup_steps=25,
                           schedule="cosine")
        L.Trainer(max_steps=400).fit(model, datamodule=Mnist5kDataModule(batch_size=40))
    """

    def __init__(
        self,
        input_shape: list[int] | None = None,
        num_classes: int = 10,
        arch: str = "mlp",
        hidden: int = 128,
        depth: int = 2,
        channels: int = 32,
        fc_hidden: int = 0,
        batch_norm: bool = False,
        lr: float = 1e-3,
        optimizer: str = "adam",
        weight_decay: float = 0.0,
        momentum: float = 0.9,
        warmup_steps: int = 0,
        schedule: str = "constant",
        min_lr_ratio: float = 0.0,
        total_steps: int | None = None,
    ) -> None:
        """Validate the configuration and build the network.

        Args:
            input_shape: Shape of one input sample; defaults to ``[1, 8, 8]`` (digits). ``"convnet"`` needs
                ``[C, H, W]``.
            num_classes: Number of classes, >= 2.
            arch: ``"mlp"`` or ``"convnet"``.
            hidden: Hidden width of the MLP (ignored by the convnet).
            depth: Number of hidden layers (MLP) or conv blocks (convnet), >= 1.
            channels: Conv channels of the convnet (ignored by the MLP).
            fc_hidden: Convnet only: width of a fully-connected hidden layer on the flattened conv features (0, the
                default: global average pooling). 512 on 28x28 inputs with depth 2 makes a 3.3 MB model.
            batch_norm: Convnet only: BatchNorm2d after every conv.
            lr: Learning rate, > 0.
            optimizer: ``"adam"``, ``"sgd"`` (with ``momentum``) or ``"adamw"``.
            weight_decay: Weight decay, >= 0.
            momentum: SGD momentum in ``[0, 1)`` (ignored by Adam/AdamW).
            warmup_steps: Optimizer steps of linear learning-rate warm-up, >= 0 (0: none).
            schedule: Learning rate after the warm-up: ``"constant"`` or ``"cosine"`` (decays to
                ``min_lr_ratio * lr`` at ``total_steps``). With the defaults (no warm-up, constant) no scheduler is
                created at all.
            min_lr_ratio: Final learning rate of the cosine as a fraction of ``lr``, in ``[0, 1]``.
            total_steps: Length of the cosine in optimizer steps, warm-up included; ``None`` takes the Trainer's
                ``estimated_stepping_batches`` (``max_steps`` when it is set). A run without a step budget (only
                ``max_time``) keeps the rate constant after the warm-up, with a warning.

        Raises:
            ValueError: If any argument is out of range.
        """
        super().__init__()
        if input_shape is None:
            input_shape = [1, 8, 8]
        if (
            # Any non-string sequence, so OmegaConf ListConfigs work without _convert_.
            not isinstance(input_shape, Sequence)
            or isinstance(input_shape, str)
            or len(input_shape) == 0
            or not all(isinstance(d, int) and d >= 1 for d in input_shape)
        ):
            raise ValueError(
                f"input_shape must be a non-empty list of integers >= 1, got {input_shape!r}; "
                "set model.input_shape to the data's input shape, e.g. [1, 8, 8]"
            )
        if not isinstance(num_classes, int) or num_classes < 2:
            raise ValueError(
                f"num_classes must be an integer >= 2, got {num_classes!r}; set model.num_classes to the data's classes"
            )
        if arch not in _ARCHS:
            raise ValueError(f"arch must be one of {_ARCHS}, got {arch!r}; set model.arch to 'mlp' or 'convnet'")
        if arch == "convnet" and len(input_shape) != 3:
            raise ValueError(
                f"input_shape must have 3 dims [C, H, W] for arch='convnet', got {list(input_shape)!r}; "
                "set model.input_shape to e.g. [1, 8, 8] or use model.arch='mlp'"
            )
        if not isinstance(hidden, int) or hidden < 1:
            raise ValueError(f"hidden must be an integer >= 1, got {hidden!r}; set model.hidden to e.g. 128")
        if not isinstance(depth, int) or depth < 1:
            raise ValueError(f"depth must be an integer >= 1, got {depth!r}; set model.depth to e.g. 2")
        if not isinstance(channels, int) or channels < 1:
            raise ValueError(f"channels must be an integer >= 1, got {channels!r}; set model.channels to e.g. 32")
        if isinstance(fc_hidden, bool) or not isinstance(fc_hidden, int) or fc_hidden < 0:
            raise ValueError(
                f"fc_hidden must be an integer >= 0, got {fc_hidden!r}; HINT: 0 (global pooling) or e.g. 512"
            )
        if (fc_hidden or batch_norm) and arch != "convnet":
            raise ValueError(
                f"fc_hidden={fc_hidden} and batch_norm={batch_norm} shape the convnet, and arch={arch!r}; HINT: "
                "model.arch=convnet, or model.hidden/model.depth for the MLP"
            )
        if not 0.0 < lr < math.inf:
            raise ValueError(f"lr must be a finite number > 0, got {lr!r}; set model.lr to e.g. 1e-3")
        if optimizer not in _OPTIMIZERS:
            raise ValueError(
                f"optimizer must be one of {_OPTIMIZERS}, got {optimizer!r}; set model.optimizer to 'adam', 'sgd' "
                "or 'adamw'"
            )
        if not 0.0 <= weight_decay < math.inf:
            raise ValueError(
                f"weight_decay must be a finite number >= 0, got {weight_decay!r}; set model.weight_decay to e.g. 0.0"
            )
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum!r}; set model.momentum to e.g. 0.9")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(
                f"warmup_steps must be an integer >= 0, got {warmup_steps!r}; HINT: set model.warmup_steps to 0 to "
                "disable the warm-up, or e.g. 25"
            )
        if schedule not in _SCHEDULES:
            raise ValueError(
                f"schedule must be one of {_SCHEDULES}, got {schedule!r}; HINT: set model.schedule to 'constant' or "
                "'cosine'"
            )
        if isinstance(min_lr_ratio, bool) or not isinstance(min_lr_ratio, (int, float)) or not 0 <= min_lr_ratio <= 1:
            raise ValueError(
                f"min_lr_ratio must be in [0, 1], got {min_lr_ratio!r}; HINT: set model.min_lr_ratio to e.g. 0.0"
            )
        if total_steps is not None and (
            isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps <= warmup_steps
        ):
            raise ValueError(
                f"total_steps must be an integer > warmup_steps ({warmup_steps}) or None, got {total_steps!r}; "
                "HINT: leave model.total_steps unset to use the Trainer's max_steps"
            )
        self.save_hyperparameters()
        self.input_shape: list[int] = list(input_shape)
        if arch == "mlp":
            self.net = build_mlp(self.input_shape, num_classes, hidden, depth)
        else:
            self.net = build_convnet(self.input_shape, num_classes, channels, depth, fc_hidden, batch_norm)
        # Micro averaging is plain accuracy; torchmetrics' default (macro) would average per-class recalls instead.
        self.train_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Compute class logits.

        Args:
            x: Batch of inputs, shape ``(B, *input_shape)``.

        Returns:
            Logits of shape ``(B, num_classes)``.

        Raises:
            ValueError: If the input does not match ``input_shape``.
        """
        if list(x.shape[1:]) != self.input_shape:
            raise ValueError(
                f"input batch has per-sample shape {list(x.shape[1:])}, but the model was built for input_shape="
                f"{self.input_shape}; set model.input_shape to match the data module"
            )
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """Cross-entropy on one batch.

        Args:
            batch: ``(inputs, labels)``.
            batch_idx: Index of the batch in the epoch.

        Returns:
            The loss, for automatic optimisation.
        """
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.train_acc(logits, y)
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_acc", self.train_acc, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        """Accumulate validation loss and accuracy.

        Args:
            batch: ``(inputs, labels)``.
            batch_idx: Index of the batch.
        """
        x, y = batch
        logits = self(x)
        self.val_acc(logits, y)
        self.log("val_loss", F.cross_entropy(logits, y), on_step=False, on_epoch=True, sync_dist=True)
        self.log("val_acc", self.val_acc, on_step=False, on_epoch=True, prog_bar=True)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        """Accumulate test loss and accuracy.

        Args:
            batch: ``(inputs, labels)``.
            batch_idx: Index of the batch.
        """
        x, y = batch
        logits = self(x)
        self.test_acc(logits, y)
        self.log("test_loss", F.cross_entropy(logits, y), on_step=False, on_epoch=True, sync_dist=True)
        self.log("test_acc", self.test_acc, on_step=False, on_epoch=True)

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        """Predict class indices.

        Args:
            batch: ``(inputs, labels)`` or a bare input tensor.
            batch_idx: Index of the batch.
            dataloader_idx: Index of the dataloader.

        Returns:
            Predicted classes, shape ``(B,)``.
        """
        x = batch[0] if isinstance(batch, (list, tuple)) else batch
        return self(x).argmax(dim=-1)

    def configure_model(self) -> None:
        """Shard with FSDP2 when the strategy gives a device mesh (``hier_sync_sharded``, ``ModelParallelStrategy``):
        each layer with parameters is its own unit."""
        shard_if_meshed(self, [m for m in self.net if any(True for _ in m.parameters(recurse=False))])

    def configure_optimizers(self) -> Any:
        """Create the configured optimizer, with a per-step learning-rate schedule when one is configured.

        Returns:
            Adam, AdamW or SGD with momentum over all parameters; with ``warmup_steps > 0`` or
            ``schedule="cosine"``, a dict adding a step-interval ``LambdaLR`` over :class:`WarmupCosine`.
        """
        hp = self.hparams
        optimizer: torch.optim.Optimizer
        if hp.optimizer == "sgd":
            optimizer = torch.optim.SGD(self.parameters(), lr=hp.lr, momentum=hp.momentum, weight_decay=hp.weight_decay)
        elif hp.optimizer == "adamw":
            optimizer = torch.optim.AdamW(self.parameters(), lr=hp.lr, weight_decay=hp.weight_decay)
        else:
            optimizer = torch.optim.Adam(self.parameters(), lr=hp.lr, weight_decay=hp.weight_decay)
        # hparams saved before these arguments existed (old checkpoints) read as "no schedule".
        warmup, schedule = hp.get("warmup_steps", 0), hp.get("schedule", "constant")
        if warmup == 0 and schedule == "constant":
            return optimizer
        total = self.lr_total_steps() if schedule == "cosine" else None
        multiplier = WarmupCosine(warmup, total, hp.get("min_lr_ratio", 0.0))
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def lr_total_steps(self) -> int | None:
        """Length of the cosine: ``total_steps``, else the Trainer's step budget, else ``None`` (with a warning)."""
        if self.hparams.get("total_steps") is not None:
            return int(self.hparams["total_steps"])
        if self._trainer is None:
            return None  # outside a Trainer (syncasync-advise's probe times steps and never reaches the decay)
        estimated = self.trainer.estimated_stepping_batches
        if math.isfinite(estimated) and estimated > self.hparams.get("warmup_steps", 0):
            return int(estimated)
        rank_zero_warn(
            f"model.schedule='cosine' has no step budget to decay over (the Trainer estimates {estimated} steps); "
            "the learning rate stays constant after the warm-up. HINT: set trainer.max_steps or model.total_steps"
        )
        return None

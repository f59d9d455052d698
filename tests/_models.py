"""Test models shared by several test files, at module level so that spawn can pickle them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule
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
        from lightning_syncasync.algorithms.compression.onebit_adam import OneBitAdam

        return OneBitAdam(self.parameters(), lr=0.01, warmup_steps=3)


class TinyLoggingModel(TinyModel):
    """TinyModel that logs with sync_dist inside training_step, keeps a torchmetrics metric and validates;
    ``slow_rank`` sleeps ``delay`` seconds per step (a persistent straggler)."""

    def __init__(self, slow_rank: int | None = None, delay: float = 0.05) -> None:
        super().__init__()
        import torchmetrics

        self.train_acc = torchmetrics.classification.BinaryAccuracy()
        self.slow_rank, self.delay = slow_rank, delay

    def training_step(self, batch, batch_idx):
        import time

        if self.global_rank == self.slow_rank:
            time.sleep(self.delay)
        x, y = batch
        logits = self.net(x)
        loss = nn.functional.cross_entropy(logits, y)
        self.train_acc(logits.argmax(-1), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True, sync_dist=True)
        self.log("train_acc", self.train_acc, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y), sync_dist=True)

    def val_dataloader(self):
        return self.train_dataloader()


class NaNAfterModel(TinyModel):
    """TinyModel whose loss turns NaN at its third step (divergence detection)."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.global_step >= 2 else loss


class ManualNaNModel(TinyModel):
    """Manual optimisation with one optimizer; its loss turns NaN from step ``at`` on (on ``rank`` only, if given).
    Lightning's closure returns no loss then: divergence detection must read the gradients."""

    def __init__(self, at: int = 2, rank: int | None = None) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.at, self.rank = at, rank

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        if self.global_step >= self.at and self.rank in (None, self.global_rank):
            loss = loss * float("nan")
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return loss


class NaNFirstMicroBatchModel(TinyModel):
    """TinyModel whose loss is NaN in the first micro-batch of each pair from step ``at`` on (on ``rank`` only, if
    given). With ``accumulate_grad_batches=2`` the closure's loss, the last micro-batch's, stays finite: divergence
    detection must read the accumulated gradients."""

    def __init__(self, at: int = 2, rank: int | None = None) -> None:
        super().__init__()
        self.at, self.rank = at, rank

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if batch_idx % 2 == 0 and self.global_step >= self.at and self.rank in (None, self.global_rank):
            return loss * float("nan")
        return loss


# A NaN for the async modes' check to catch before it leaves the rank: (model, what their error names, Trainer's
# accumulate_grad_batches). In the closure's loss; only in the gradients (manual optimization: the closure returns no
# loss); in an earlier micro-batch (the closure's loss is the last one's, the NaN is in the accumulated gradients).
NAN_CASES = [
    (NaNAfterModel, "loss", 1),
    (ManualNaNModel, r"the gradients' L1 norm \(manual optimization\)", 1),
    (NaNFirstMicroBatchModel, r"the loss or the gradients' L1 norm \(gradient accumulation\)", 2),
]


class ManualTwoOptimizersModel(TinyModel):
    """Manual optimisation with two optimizers (one per layer) and manual gradient clipping."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt_a, opt_b = self.optimizers()
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        opt_a.zero_grad()
        opt_b.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(opt_a, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
        opt_a.step()
        opt_b.step()
        return loss

    def configure_optimizers(self):
        return (
            torch.optim.SGD(self.net[0].parameters(), lr=0.1),
            torch.optim.Adam(self.net[2].parameters(), lr=0.01),
        )


class IterableDataModel(TinyModel):
    """TinyModel fed by an iterable dataset (no __len__): AdaptiveBatchSize must refuse it clearly."""

    def train_dataloader(self):
        from torch.utils.data import IterableDataset

        class Stream(IterableDataset):
            def __iter__(self):
                g = torch.Generator().manual_seed(0)
                for _ in range(64):
                    x = torch.randn(8, generator=g)
                    yield x, (x[0] > 0).long()

        return DataLoader(Stream(), batch_size=16)


class LinearLossModel(TinyModel):
    """Loss ``mean(w . x)`` on zero-mean inputs: per-sample gradients are the inputs themselves, whatever ``w`` is,
    so the gradient noise scale is about the dataset size (512) for the whole run: grow_batch must grow."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(8, 1, bias=False)

    def training_step(self, batch, batch_idx):
        x, _ = batch
        return self.net(x).mean()

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(512, 8, generator=g)
        return DataLoader(TensorDataset(x, torch.zeros(512)), batch_size=16)


class ConstantGradModel(TinyModel):
    """Loss ``(w * c_rank).sum()``: rank r's gradient is ``r + 1`` everywhere, whatever the weights and the data, so
    after T SGD steps every correct data-parallel scheme (sync, hierarchical, asynchronous, any mix) holds exactly
    ``w0 - lr * T * mean_r(r + 1)``: a lost or twice-applied update shows. Powers of two keep it exact in fp32.
    ``slow_rank`` sleeps ``delay`` seconds per step (a persistent straggler)."""

    lr = 0.125

    def __init__(self, slow_rank: int | None = None, delay: float = 0.02) -> None:
        super().__init__()
        self.net = nn.Linear(16, 1, bias=False)
        nn.init.zeros_(self.net.weight)
        self.slow_rank, self.delay = slow_rank, delay

    def training_step(self, batch, batch_idx):
        import time

        if self.global_rank == self.slow_rank:
            time.sleep(self.delay)
        w = self.net.weight
        return (w * float(self.global_rank + 1)).sum() + 0.0 * batch[0].sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class EpochLoggedConstantGradModel(ConstantGradModel):
    """ConstantGradModel that logs its loss per epoch with ``sync_dist``: a collective of Lightning's at every epoch
    end, outside any validation."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss


class ScheduledModel(ConstantGradModel):
    """ConstantGradModel with a step-interval ``LambdaLR`` (linear decay to 0 over ``total`` steps): whether a rank's
    schedule follows its own steps or the run's global progress shows in its ``last_epoch`` and final rate."""

    def __init__(self, slow_rank: int | None = None, delay: float = 0.02, total: int = 24) -> None:
        super().__init__(slow_rank, delay)
        self.total = total

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, _LinearDecay(self.total))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class _LinearDecay:
    def __init__(self, total: int) -> None:
        self.total = total

    def __call__(self, step: int) -> float:
        return max(0.0, 1.0 - step / self.total)


class NaNInAsyncModel(TinyLoggingModel):
    """TinyLoggingModel whose loss is NaN on rank 0 for one step once the strategy runs asynchronously (after
    ``after`` async steps), to exercise the switcher's rollback."""

    def __init__(self, slow_rank: int | None = None, delay: float = 0.05, after: int = 3) -> None:
        super().__init__(slow_rank, delay)
        self.after = after
        self.async_steps = 0
        self.poisoned = False

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if getattr(self.trainer.strategy, "mode", "") == "async":
            self.async_steps += 1
            if self.global_rank == 0 and self.async_steps > self.after and not self.poisoned:
                self.poisoned = True
                return loss * float("nan")
        return loss


class PacedModel(TinyModel):
    """TinyModel whose step computes for ``step_s`` seconds per 16 samples (a sleep in proportion to the batch, as
    real compute is), ``slow`` times that on ``slow_rank``: compute times that transient pauses (the emulator's
    jitter, a multiple of the step) can be read against."""

    def __init__(self, step_s: float = 0.015, slow_rank: int | None = None, slow: float = 1.0) -> None:
        super().__init__()
        self.step_s, self.slow_rank, self.slow = step_s, slow_rank, slow

    def training_step(self, batch, batch_idx):
        import time

        per_16 = self.step_s * (self.slow if self.global_rank == self.slow_rank else 1.0)
        time.sleep(per_16 * len(batch[0]) / 16)
        return super().training_step(batch, batch_idx)


class LrBlowUpModel(TinyModel):
    """TinyModel that trains to a low loss, with ``slow_rank`` sleeping ``delay`` seconds per step (so the switcher
    goes async), then multiplies its learning rate by ``factor`` once, after ``after`` steps in async mode: a real
    divergence, whose loss stays finite for a while. A rollback restores the optimizer's state, learning rate
    included."""

    def __init__(self, slow_rank: int = 1, delay: float = 0.05, after: int = 4, factor: float = 100.0) -> None:
        super().__init__()
        self.slow_rank, self.delay, self.after, self.factor = slow_rank, delay, after, factor
        self.async_steps = 0
        self.blown_at: int | None = None

    def training_step(self, batch, batch_idx):
        import time

        if self.global_rank == self.slow_rank:
            time.sleep(self.delay)
        if getattr(self.trainer.strategy, "mode", "") == "async":
            self.async_steps += 1
            if self.async_steps == self.after and self.blown_at is None:
                self.blown_at = self.global_step
                for group in self.trainer.optimizers[0].param_groups:
                    group["lr"] *= self.factor
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


class ValidationProbeModel(TinyModel):
    """TinyModel that validates on a few batches and remembers the weights each validation saw (``seen``)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[torch.Tensor] = []

    def validation_step(self, batch, batch_idx):
        if batch_idx == 0:
            self.seen.append(torch.cat([p.detach().flatten() for p in self.parameters()]))
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y), sync_dist=True)

    def val_dataloader(self):
        g = torch.Generator().manual_seed(1)
        x = torch.randn(64, 8, generator=g)
        return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=16)


class RecordSteps(Callback):
    """Each rank saves its parameters at the start and end of every step, and what ``ValidationProbeModel``
    validated, to ``rank{r}.pt`` in ``out``."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.steps: list[torch.Tensor] = []
        self.starts: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.starts.append(torch.cat([p.detach().flatten() for p in pl_module.parameters()]))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps.append(torch.cat([p.detach().flatten() for p in pl_module.parameters()]))

    def on_fit_end(self, trainer, pl_module):
        out = {"steps": self.steps, "starts": self.starts, "seen": pl_module.seen}
        torch.save(out, Path(self.out) / f"rank{trainer.global_rank}.pt")


class RecordWarnings(Callback):
    """Each rank writes every warning raised during its fit to ``out/warnings{rank}.json`` (forked ranks' warnings
    never reach pytest's capture)."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.messages: list[str] = []
        self._restore: Any = None

    def setup(self, trainer, pl_module, stage):
        import warnings

        original = warnings.showwarning

        def record(message, category, filename, lineno, file=None, line=None):
            self.messages.append(f"{category.__name__}: {message}")

        warnings.simplefilter("always")  # every copy, as a user's log would show with -W always
        warnings.showwarning = record
        self._restore = original

    def teardown(self, trainer, pl_module, stage):
        import json
        import warnings

        warnings.showwarning = self._restore
        (Path(self.out) / f"warnings{trainer.global_rank}.json").write_text(json.dumps(self.messages))


class TinyAdamModel(TinyLoggingModel):
    """TinyLoggingModel trained with Adam (per-rank optimizer state under round-level async)."""

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


class ShardedTinyModel(TinyModel):
    """TinyModel that shards itself with FSDP2 over ``device_mesh["data_parallel"]`` when a model-parallel strategy
    gives it a mesh (Lightning's ModelParallelStrategy: every rank; hier_sync_sharded: the node), and stays a plain
    module otherwise (so the replicated strategies train the same module)."""

    def configure_model(self):
        from lightning_syncasync.demo._shard import shard_if_meshed

        shard_if_meshed(self, (self.net[0], self.net[2]))


class ShardedTinyAdamModel(ShardedTinyModel):
    """ShardedTinyModel trained with Adam (optimizer state to shard)."""

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)

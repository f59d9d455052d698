"""Issue 23 (9): the final model is merged before any user ``on_train_end`` runs, on 2 gloo processes (fork).

Lightning 2.6 calls ``on_train_end`` on the callbacks, then on the LightningModule, then on the strategy
(``FitLoop.on_run_end``); a strategy that keeps per-node or per-rank replicas must have merged them by the first.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _models import TinyModel
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

from lightning_syncasync.strategies.async_ssp import AsyncSSPStrategy
from lightning_syncasync.strategies.auto_sync import AutoSyncStrategy
from lightning_syncasync.strategies.hier_sync import HierSyncStrategy
from lightning_syncasync.strategies.measured_ddp import MeasuredDDPStrategy

TOL = 1e-6  # fp32 rounding of weights of order 1
STEPS = 5  # not a multiple of inter_period=3: the replicas trained apart for 2 steps since the last round


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().flatten().float() for t in tensors])


def _spread(flat: torch.Tensor) -> float:
    """The largest difference between two ranks' ``flat`` (a collective on the default group: every rank calls it
    together, so every rank gets the same answer)."""
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return max(float((g - gathered[0]).abs().max()) for g in gathered)


class BatchNormModel(TinyModel):
    """TinyModel with a BatchNorm layer (float buffers that each rank updates from its own batches), which checks
    from its own ``on_train_end`` whether every rank holds the same model."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 2))
        self.seen: dict[str, float] = {}

    def on_train_end(self) -> None:
        self.seen = {"params": _spread(_flat(self.parameters()))}


class CheckSameModel(Callback):
    """In ``on_train_end`` (the first user hook that sees the final model), whether every rank holds the same
    parameters and floating-point buffers; in ``on_fit_end`` (after the strategy's own ``on_train_end``), whether the
    model is still the one ``on_train_end`` saw. Each rank writes ``rank{r}.json``."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.params = _flat(pl_module.parameters())
        buffers = [b for b in pl_module.buffers() if b.is_floating_point()]
        self.seen = {"params": _spread(self.params), "buffers": _spread(_flat(buffers))}

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        unchanged = torch.equal(_flat(pl_module.parameters()), self.params)
        result = {"callback": self.seen, "module": pl_module.seen, "unchanged_after": unchanged}
        (Path(self.out) / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


def _fit(out: Path, strategy) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=STEPS, logger=False, default_root_dir=out,
        callbacks=[CheckSameModel(str(out))], enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    torch.manual_seed(0)
    trainer.fit(BatchNormModel())
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


STRATEGIES = {
    # Virtual nodes of one rank: each rank is a node whose replica trains apart between rounds.
    "hier_sync": lambda: HierSyncStrategy(node_size=1, inter_period=3, max_delay=1, start_method="fork"),
    # Nesterov's outer step moves the model even when the replicas agree: a second round would show.
    "hier_sync_nesterov": lambda: HierSyncStrategy(
        node_size=1, inter_period=3, max_delay=1, outer="nesterov", outer_lr=0.7, start_method="fork"
    ),
    "auto_sync_hier": lambda: AutoSyncStrategy(
        mode="hier", switcher=False, node_size=1, inter_period=3, max_delay=1, start_method="fork"
    ),
    "auto_sync_async": lambda: AutoSyncStrategy(mode="async", switcher=False, start_method="fork"),
    "async_ssp": lambda: AsyncSSPStrategy(start_method="fork"),
    "post_local_sgd": lambda: MeasuredDDPStrategy(
        local_sgd="post_local_sgd", averaging_period=3, node_size=1, start_method="fork"
    ),
}


@pytest.mark.spawn
@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_user_hooks_see_one_merged_model(tmp_path, name):
    ranks = _fit(tmp_path, STRATEGIES[name]())
    for r in ranks:
        seen = [r["callback"]["params"], r["callback"]["buffers"], r["module"]["params"]]
        # Up to rounding: a hier round moves each replica by (global - its own snapshot), which lands on the global
        # model to the last bit or so. The replicas unmerged differ by whole training steps (about 1e-2 here).
        assert max(seen) <= TOL, f"{name}: on_train_end saw the ranks differ by {r}"
        # The strategy's own on_train_end (its safety net) does not merge a second time.
        assert r["unchanged_after"], f"{name}: the model changed after the callbacks' on_train_end"


@pytest.mark.spawn
@pytest.mark.timeout(120)
def test_ddp_control(tmp_path):
    # DDP's replicas are equal after every step. Its buffers are not: DDP broadcasts rank 0's at the start of each
    # forward, and the last forward updated each rank's BatchNorm statistics from its own batch.
    for r in _fit(tmp_path, DDPStrategy(start_method="fork")):
        assert r["callback"]["params"] == r["module"]["params"] == 0.0 and r["unchanged_after"]


class RecordMergeHooks(Callback):
    """At train start: whether the fit loop's ``on_run_end`` is the strategy's merge wrapper around the loop's own
    method (one wrapper, not a wrapper of a wrapper), and which callbacks the Trainer holds."""

    def __init__(self) -> None:
        self.seen: list[tuple[bool, bool, list[str]]] = []

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        wrapper = trainer.fit_loop.__dict__.get("on_run_end")
        wrapped_once = getattr(wrapper.__wrapped__, "__func__", None) is type(trainer.fit_loop).on_run_end
        names = [type(c).__name__ for c in trainer.callbacks]
        self.seen.append((getattr(wrapper, "_syncasync_merge", False), wrapped_once, names))


@pytest.mark.timeout(120)
def test_a_reused_trainer_wraps_the_fit_loop_once_per_fit_and_not_after(tmp_path):
    # One process (Lightning runs it in this one): the Trainer object that fit the model is the one reused.
    record = RecordMergeHooks()
    trainer = Trainer(
        accelerator="cpu", devices=1, strategy=HierSyncStrategy(), max_steps=2, logger=False, default_root_dir=tmp_path,
        callbacks=[record], enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(BatchNormModel())
    assert "on_run_end" not in trainer.fit_loop.__dict__
    trainer.fit_loop.epoch_loop.max_steps = 4  # the first fit used up max_steps=2
    trainer.fit(BatchNormModel())
    # No callback of the strategy's: Lightning would dispatch each of its hooks at every step (host time).
    assert record.seen == [(True, True, ["RecordMergeHooks"]), (True, True, ["RecordMergeHooks"])]
    assert "on_run_end" not in trainer.fit_loop.__dict__

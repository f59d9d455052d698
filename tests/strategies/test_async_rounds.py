"""async_ssp's round mode (the default, ``local_steps > 1``) with Lightning on gloo processes: every step counted
once under a straggler with claimed batches, the merged model at validation and at the end, optimizer states at a
cut, exact resume, divergence, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _models import (
    NAN_CASES,
    ConstantGradModel,
    EpochLoggedConstantGradModel,
    ScheduledModel,
    TinyAdamModel,
)
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_syncasync.callbacks import SyncMonitor
from lightning_syncasync.strategies.async_ssp import AsyncSSPStrategy


class Record(Callback):
    """Each rank writes its step count, the weights each validation saw, its final weights and optimizer state."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.steps = 0
        self.vals: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps += 1

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if batch_idx == 0 and trainer.state.fn == "fit" and not trainer.sanity_checking:
            self.vals.append(torch.cat([p.detach().flatten() for p in pl_module.parameters()]))

    def on_train_end(self, trainer, pl_module):
        rounds = trainer.strategy.rounds  # after the final cut
        self.rounds = (list(rounds.stats.local_steps), list(rounds.stats.lags)) if rounds is not None else (None, None)

    def on_fit_end(self, trainer, pl_module):
        opt = trainer.optimizers[0]
        moments = [s["exp_avg"].flatten() for s in opt.state.values() if "exp_avg" in s]
        torch.save(
            {
                "steps": self.steps,
                "vals": self.vals,
                "final": torch.cat([p.detach().flatten() for p in pl_module.parameters()]),
                "moments": torch.cat(moments) if moments else None,
                "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
                "local_steps": self.rounds[0],
                "lags": self.rounds[1],
                "schedule_steps": [c.scheduler.last_epoch for c in trainer.lr_scheduler_configs],
            },
            Path(self.out) / f"rank{trainer.global_rank}.pt",
        )


# The defaults, which these tests of wall-clock rounds and claimed batches ask for by name: rounds of wall-clock
# length, claimed batches where the loop allows, no warm-up. BALANCED is auto_sync's async mode (20 synchronous steps,
# rounds of a fixed step count, the AdaptiveBatchSize the strategy then adds), tested below.
WALL_CLOCK = {"dynamic_local_steps": True, "claim_batches": None, "warmup_steps": 0}
BALANCED = {"dynamic_local_steps": False, "claim_batches": False, "warmup_steps": None}


def _fit(out: Path, strategy, model, devices=2, steps=16, ckpt_path=None, callbacks=(), **trainer_kwargs):
    out.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False, default_root_dir=out,
        callbacks=[SyncMonitor(summary_file=str(out / "summary.json"), print_summary=False), Record(str(out)),
                   *callbacks],
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks), enable_progress_bar=False,
        enable_model_summary=False, **trainer_kwargs,
    )  # fmt: skip
    torch.manual_seed(0)
    trainer.fit(model, ckpt_path=ckpt_path)
    return [torch.load(out / f"rank{r}.pt") for r in range(devices)], trainer


@pytest.mark.timeout(300)
def test_every_step_counts_once_and_the_fast_rank_takes_more_under_a_straggler(tmp_path):
    # Rank 1 sleeps 40 ms a step. Rounds of wall-clock length and claimed batches (on with claim_batches=None here:
    # validation is at epoch ends) let rank 0 take more steps; the merged model must hold every step of both exactly.
    res, trainer = _fit(tmp_path, AsyncSSPStrategy(local_steps=4, start_method="fork", **WALL_CLOCK),
                        ConstantGradModel(slow_rank=1, delay=0.04), steps=24, limit_val_batches=0)  # fmt: skip
    steps = [r["steps"] for r in res]
    assert sum(steps) >= 48 and steps[0] > 1.5 * steps[1], steps  # the budget over ranks; the fast rank took more
    expected = -ConstantGradModel.lr * sum(n * (r + 1) for r, n in enumerate(steps)) / 2
    for r in res:
        assert torch.equal(r["final"], torch.full_like(r["final"], expected)), (r["final"][:3], expected)
        assert max(r["lags"]) <= 1  # the staleness bound, in rounds
    assert trainer.max_steps == 24  # given back as the user set it


class Early(Callback):
    """Each rank's weights after each of its first ``n`` steps."""

    def __init__(self, out: str, n: int) -> None:
        self.out, self.n, self.weights = out, n, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if len(self.weights) < self.n:
            self.weights.append(torch.cat([p.detach().flatten() for p in pl_module.parameters()]))

    def on_fit_end(self, trainer, pl_module):
        torch.save(self.weights, Path(self.out) / f"early{trainer.global_rank}.pt")


@pytest.mark.timeout(300)
def test_a_synchronous_warm_up_steps_every_replica_alike_then_the_rounds_start(tmp_path):
    # Rank r's gradient is r + 1 everywhere and rank 1 sleeps 40 ms a step. In the 6-step warm-up the gradients are
    # averaged, so after step k both replicas hold -lr x 1.5 x k exactly, and the slow rank's dealt batches keep the
    # two in step (16 batches an epoch: 6 dealt to each, the other 4 claimed). Then the rounds let rank 0 take more,
    # and the merged model still holds every step of both exactly once.
    settings = {**WALL_CLOCK, "warmup_steps": 6}
    strategy = AsyncSSPStrategy(local_steps=2, peer_timeout_s=20, start_method="fork", **settings)
    res, _ = _fit(tmp_path, strategy, ConstantGradModel(slow_rank=1, delay=0.04), steps=24, limit_val_batches=0,
                  callbacks=[Early(str(tmp_path), 6)])  # fmt: skip
    early = [torch.load(tmp_path / f"early{r}.pt") for r in range(2)]
    for k in range(6):
        want = torch.full_like(early[0][k], -ConstantGradModel.lr * 1.5 * (k + 1))
        assert torch.equal(early[0][k], want) and torch.equal(early[1][k], want), (k, early[0][k][:2], early[1][k][:2])
    steps = [r["steps"] for r in res]
    assert sum(steps) >= 48 and steps[0] > 1.5 * steps[1], steps
    expected = -ConstantGradModel.lr * sum(n * (r + 1) for r, n in enumerate(steps)) / 2
    for r in res:
        assert torch.equal(r["final"], torch.full_like(r["final"], expected)), (r["final"][:3], expected)
        assert len(r["local_steps"]) >= 2  # rounds ran after the warm-up


@pytest.mark.timeout(300)
def test_an_epoch_end_collective_is_a_cut_not_a_deadlock(tmp_path):
    # Rounds of 2 steps, claimed batches, rank 1 slow: rank 0 takes most of each epoch's 32 batches and runs rounds
    # ahead, so it waits at the bound for rank 1's next round. Rank 1 runs out of batches and enters the epoch-end
    # reduction of train_loss (no validation to cut first). Before the fix it never ended its round there, and rank 0
    # timed out at the bound (PeerLostError after peer_timeout_s). Now the reduction cuts first: no hang, every step
    # counted once, the merged model everywhere.
    strategy = AsyncSSPStrategy(local_steps=2, peer_timeout_s=20, start_method="fork", claim_batches=None,
                                warmup_steps=0)  # fmt: skip
    res, _ = _fit(tmp_path, strategy, EpochLoggedConstantGradModel(slow_rank=1, delay=0.03), steps=48,
                  limit_val_batches=0)  # fmt: skip
    steps = [r["steps"] for r in res]
    assert sum(steps) >= 96 and steps[0] > 1.5 * steps[1], steps
    expected = -ConstantGradModel.lr * sum(n * (r + 1) for r, n in enumerate(steps)) / 2
    for r in res:
        assert torch.equal(r["final"], torch.full_like(r["final"], expected)), (r["final"][:3], expected)
        assert "train_loss" in r["metrics"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert all(r["sync_point_s"] > 0 for r in summary["ranks"])  # the cuts are sync points, measured


@pytest.mark.timeout(300)
def test_learning_rate_schedules_follow_global_progress_under_claimed_batches(tmp_path):
    # Rank 1 is 4x slower: rank 0 takes most of the 2 x 24 batches. Its schedule must not run out (lr 0) half-way
    # while rank 1's lags: both follow the steps DDP would have taken, batches claimed over ranks / 2.
    res, trainer = _fit(tmp_path, AsyncSSPStrategy(local_steps=4, start_method="fork", **WALL_CLOCK),
                        ScheduledModel(slow_rank=1, delay=0.04, total=24), steps=24, limit_val_batches=0)  # fmt: skip
    steps = [r["steps"] for r in res]
    assert steps[0] > 1.5 * steps[1], steps
    (fast,), (slow,) = (r["schedule_steps"] for r in res)
    # Each schedule stands at the global count (claimed / 2) of the rank's last batch, not at the rank's own count.
    # The fast rank claims the last batches, so it ends near the 24 DDP would take; the slow one hands its epoch
    # tails over, so its last batch comes earlier, but still far past its own 10-odd steps.
    assert 24 - 3 <= fast <= 24 + 1, (fast, steps)
    assert 1.5 * steps[1] <= slow <= 24 + 1, (slow, steps)
    assert "lr_scheduler_step" not in vars(trainer.lightning_module)  # the module is given back as it was


@pytest.mark.timeout(300)
def test_validation_and_the_end_of_fit_see_one_merged_model_and_optimizer_state(tmp_path):
    res, _ = _fit(tmp_path, AsyncSSPStrategy(local_steps=3, start_method="fork"), TinyAdamModel(slow_rank=1,
                  delay=0.02), steps=16, limit_val_batches=2, check_val_every_n_epoch=1)  # fmt: skip
    assert len(res[0]["vals"]) >= 1 and len(res[0]["vals"]) == len(res[1]["vals"])
    for a, b in zip(res[0]["vals"], res[1]["vals"], strict=True):
        assert torch.equal(a, b)  # every validation sees the same merged model on every rank
    assert torch.equal(res[0]["final"], res[1]["final"])
    assert torch.equal(res[0]["moments"], res[1]["moments"])  # Adam's state too, so a checkpoint is everyone's
    for r in res:
        assert "val_loss" in r["metrics"] and "train_acc" in r["metrics"]  # Lightning's collectives and torchmetrics
    # The cuts and Lightning's epoch-end collectives are sync points, measured apart (and part of the wall time).
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert all(0 < r["sync_point_s"] and 0 < r["sync_point_frac"] < 1 for r in summary["ranks"]), summary["ranks"]


@pytest.mark.timeout(400)
def test_resume_from_a_checkpoint_continues_the_same_trajectory(tmp_path):
    # Deterministic rounds (every round 3 steps) and no claimed batches: the run's trajectory is a function of the
    # data, so the resumed run must end bitwise where the uninterrupted one ended. 8 batches per rank and epoch.
    def make():
        return AsyncSSPStrategy(local_steps=3, dynamic_local_steps=False, claim_batches=False, start_method="fork")

    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=8, save_top_k=-1)
    full, _ = _fit(tmp_path / "full", make(), TinyAdamModel(), callbacks=[ckpt], limit_val_batches=0)
    path = tmp_path / "ckpt" / "epoch=0-step=8.ckpt"
    assert torch.load(path, weights_only=True)["async_ssp"]["delivered"] >= 2
    resumed, _ = _fit(tmp_path / "resumed", make(), TinyAdamModel(), ckpt_path=str(path), limit_val_batches=0,
                      callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt2", every_n_train_steps=8)])  # fmt: skip
    for r in range(2):
        assert resumed[r]["steps"] == 8
        torch.testing.assert_close(resumed[r]["final"], full[r]["final"], rtol=0, atol=0)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("model", "what", "accumulate"), NAN_CASES)
def test_a_nan_loss_stops_the_run_naming_the_rank_and_round(tmp_path, model, what, accumulate):
    with pytest.raises(Exception, match=rf"rank \d: {what} is nan in round"):
        _fit(tmp_path, AsyncSSPStrategy(local_steps=2, start_method="fork"), model(), limit_val_batches=0,
             accumulate_grad_batches=accumulate)  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"local_steps": 0}, "local_steps must be an integer >= 1"),
        ({"staleness": None}, "staleness must be an integer >= 0 with local_steps > 1"),
        ({"staleness": -1}, "staleness"),
        ({"outer": "adam"}, "outer must be one of"),
        ({"outer_lr": 0.0}, "outer_lr must be > 0"),
        ({"outer_momentum": 1.0}, r"outer_momentum must be in \[0, 1\)"),
        ({"round_s": 0.0}, "round_s must be > 0"),
        ({"round_s": 2.0, "dynamic_local_steps": False}, "round_s=2.0 is a wall-clock round length"),
        ({"outer_momentum_every": 0}, "outer_momentum_every"),
        ({"warmup_steps": -1}, "warmup_steps must be an integer >= 0"),
        ({"adaptive_batch": True, "claim_batches": True}, "both replace the training loader's sampler"),
        ({"adaptive_batch": True, "claim_batches": None}, "both replace the training loader's sampler"),
        ({"warmup_steps": 4, "local_steps": 1, "staleness": 1}, "warmup_steps=4 is a synchronous start"),
    ],
)
def test_bad_round_settings_are_refused_with_a_hint(kwargs, match):
    with pytest.raises(ValueError, match=match) as err:
        AsyncSSPStrategy(**kwargs)
    assert "HINT" in str(err.value)


class Balance(Callback):
    """Each rank's AdaptiveBatchSize callbacks at the end of fit: (required, split in force, decisions taken)."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_fit_end(self, trainer, pl_module):
        from lightning_syncasync.callbacks import AdaptiveBatchSize

        found = [(c.required, c.current_sizes, len(c.decisions)) for c in trainer.callbacks
                 if isinstance(c, AdaptiveBatchSize)]  # fmt: skip
        torch.save(found, Path(self.out) / f"balance{trainer.global_rank}.pt")


@pytest.mark.timeout(300)
def test_balanced_rounds_warm_up_then_run_fixed_rounds_with_batches_balanced_to_speed(tmp_path):
    # max_steps=40: the warm-up is a tenth of the run (min(20, 40 // 10) = 4 synchronous steps, replicas alike); then
    # rounds of 4 steps on both ranks (no claimed batches: each rank takes max_steps), and the AdaptiveBatchSize the
    # strategy adds gives rank 1, which sleeps 40 ms a step, the smaller share of each step's batch.
    seen = [Early(str(tmp_path), 6), Balance(str(tmp_path))]
    res, _ = _fit(tmp_path, AsyncSSPStrategy(start_method="fork", **BALANCED), TinyAdamModel(slow_rank=1, delay=0.04),
                  steps=40, limit_val_batches=0, callbacks=seen)  # fmt: skip
    early = [torch.load(tmp_path / f"early{r}.pt") for r in range(2)]
    for k in range(4):
        assert torch.equal(early[0][k], early[1][k]), k  # the warm-up: every replica takes the averaged step
    assert not torch.equal(early[0][5], early[1][5])  # then each trains its own replica on its own batches
    assert [r["steps"] for r in res] == [40, 40]
    for r in res:
        # Rounds of 4 steps; a round cut short by a cut (an epoch's end) has fewer.
        assert max(r["local_steps"]) == 4 and sum(r["local_steps"]) == 40 - 4, r["local_steps"]
    balance = [torch.load(tmp_path / f"balance{r}.pt") for r in range(2)]
    for found in balance:
        assert len(found) == 1 and found[0][0] is False, found  # one, added by the strategy, not required
    ((_, sizes, decisions),) = balance[0]
    assert decisions >= 1 and sizes is not None and sizes[1] < sizes[0], (sizes, decisions)
    assert torch.equal(res[0]["final"], res[1]["final"])  # the end of fit's cut: one merged model


@pytest.mark.timeout(300)
def test_balanced_rounds_train_an_iterable_dataset_with_even_batches(tmp_path):
    # AdaptiveBatchSize cannot split an iterable dataset's batches by index: the one the strategy added steps aside
    # (with a log line) instead of failing a run on a callback the user never asked for.
    from _models import IterableDataModel

    strategy = AsyncSSPStrategy(local_steps=2, start_method="fork", **BALANCED)
    res, _ = _fit(tmp_path, strategy, IterableDataModel(), steps=4, limit_val_batches=0,
                  callbacks=[Balance(str(tmp_path))])  # fmt: skip
    assert [r["steps"] for r in res] == [4, 4]
    for r in range(2):
        assert torch.load(tmp_path / f"balance{r}.pt") == [(False, None, 0)]


def test_per_step_mode_still_takes_asp():
    assert not AsyncSSPStrategy(local_steps=1, staleness=None).round_mode
    assert AsyncSSPStrategy().round_mode


@pytest.mark.timeout(120)
@pytest.mark.parametrize("devices", [1, 2])
def test_a_warm_up_as_long_as_the_run_is_refused_at_setup(tmp_path, devices):
    # At 2 ranks claimed batches turn max_steps into a budget over ranks at setup: the check must read it first.
    trainer = Trainer(accelerator="cpu", devices=devices, strategy=AsyncSSPStrategy(warmup_steps=8,
                      start_method="fork"), max_steps=8, limit_val_batches=0, logger=False, default_root_dir=tmp_path,
                      enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False)  # fmt: skip
    with pytest.raises(Exception, match=r"warmup_steps=8\) is longer than the run \(max_steps=8\).*HINT"):
        trainer.fit(TinyAdamModel())

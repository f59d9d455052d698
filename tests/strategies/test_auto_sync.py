"""auto_sync with Lightning on gloo processes (spawn): random switches lose nothing, sync mode is DDP, the switcher's
decisions and rollback, resume in the saved mode, bad input."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch
from _models import (
    ConstantGradModel,
    LrBlowUpModel,
    ManualNaNModel,
    NaNFirstMicroBatchModel,
    NaNInAsyncModel,
    RecordSteps,
    RecordWarnings,
    TinyModel,
    ValidationProbeModel,
)
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy

from lightning_syncasync.algorithms.topology import Topology
from lightning_syncasync.callbacks import SyncMonitor, SyncSwitcher
from lightning_syncasync.strategies.auto_sync import AutoSyncStrategy, ModeUnavailableError


class RandomSwitches(Callback):
    """Before each step, switch to a random mode (the same draw on every rank: one seed)."""

    def __init__(self, seed: int, modes: tuple[str, ...], p: float = 0.4) -> None:
        self.rng = random.Random(seed)
        self.modes, self.p = modes, p
        self.seen: list[str] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step and self.rng.random() < self.p:
            trainer.strategy.switch_mode(self.rng.choice(self.modes), trainer.global_step)
        self.seen.append(trainer.strategy.mode)


class ToAsync(Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 2:
            trainer.strategy.switch_mode("async", 2)


class Final(Callback):
    def __init__(self, out: str) -> None:
        self.out = out

    def on_fit_end(self, trainer, pl_module):
        torch.save(
            {
                "final": torch.cat([p.detach().flatten() for p in pl_module.parameters()]),
                "mode": getattr(trainer.strategy, "mode", "sync"),
                "switches": list(getattr(trainer.strategy, "switches", [])),
                "decisions": next((c.decisions for c in trainer.callbacks if isinstance(c, SyncSwitcher)), []),
                "seen": next((c.seen for c in trainer.callbacks if isinstance(c, RandomSwitches)), []),
                "diverged": getattr(trainer.strategy, "diverged", None),
            },
            Path(self.out) / f"rank{trainer.global_rank}.pt",
        )


def _fit(out: Path, strategy, model, devices=2, steps=8, callbacks=(), ckpt_path=None, val=False, **trainer_kw):
    out.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False, default_root_dir=out,
        callbacks=[SyncMonitor(summary_file=str(out / "summary.json"), print_summary=False), Final(str(out)),
                   *callbacks],
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks), enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=2 if val else 0, val_check_interval=4 if val else None,
        **trainer_kw,
    )  # fmt: skip
    torch.manual_seed(0)
    trainer.fit(model, ckpt_path=ckpt_path)
    return [torch.load(out / f"rank{r}.pt") for r in range(devices)], json.loads((out / "summary.json").read_text())


@pytest.mark.timeout(240)
def test_hier_mode_validates_the_mean_of_the_node_replicas(tmp_path):
    # hier_sync's rule in auto_sync's hier mode: no cross-node round within 6 steps, so the nodes drift apart, and
    # validation (after steps 2, 4, 6) sees their mean while training continues from each node's own replica.
    trainer = Trainer(
        accelerator="cpu", devices=4, max_steps=6, logger=False, default_root_dir=tmp_path,
        strategy=AutoSyncStrategy(mode="hier", switcher=False, node_size=2, inter_period=100, start_method="fork"),
        callbacks=[RecordSteps(str(tmp_path))], val_check_interval=2, limit_val_batches=2, num_sanity_val_steps=0,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    torch.manual_seed(0)
    trainer.fit(ValidationProbeModel())
    res = [torch.load(tmp_path / f"rank{r}.pt") for r in range(4)]
    for i, step in enumerate((1, 3)):
        node0, node1 = res[0]["steps"][step], res[2]["steps"][step]
        assert not torch.allclose(node0, node1)
        for r in range(4):
            torch.testing.assert_close(res[r]["seen"][i], (node0 + node1) / 2)
            torch.testing.assert_close(res[r]["starts"][step + 1], res[r]["steps"][step], rtol=0, atol=0)


@pytest.mark.timeout(240)
def test_random_switches_under_a_straggler_lose_no_update(tmp_path):
    # 4 processes as 2 virtual nodes, rank 3 a persistent straggler, the mode redrawn at random step boundaries.
    steps = 24
    strategy = AutoSyncStrategy(switcher=False, node_size=2, compensation="none", max_delay=1, inter_period=2,
                                staleness=2, start_method="fork")  # fmt: skip
    ranks, summary = _fit(tmp_path, strategy, ConstantGradModel(slow_rank=3), devices=4, steps=steps,
                          callbacks=[RandomSwitches(seed=8, modes=("sync", "hier", "async"))])  # fmt: skip
    seen = ranks[0]["seen"]
    assert {"sync", "hier", "async"} <= set(seen) and len(ranks[0]["switches"]) >= 8  # a real mix of switches
    for r in ranks:
        assert r["seen"] == seen  # every rank switched at the same steps
        torch.testing.assert_close(r["final"], ranks[0]["final"], rtol=0, atol=0)  # one model
    # Every update applied once: w0 - lr * T * mean(1, 2, 3, 4), exactly.
    want = torch.full((16,), -ConstantGradModel.lr * steps * 2.5)
    torch.testing.assert_close(ranks[0]["final"], want, rtol=0, atol=1e-6)
    assert summary["mode"] == ranks[0]["mode"]


@pytest.mark.timeout(240)
def test_sync_mode_equals_ddp(tmp_path):
    torch.manual_seed(0)
    ddp, _ = _fit(tmp_path / "ddp", DDPStrategy(start_method="fork"), TinyModel())
    torch.manual_seed(0)
    auto, summary = _fit(tmp_path / "auto", AutoSyncStrategy(switcher=False, start_method="fork"), TinyModel())
    for r in range(2):
        torch.testing.assert_close(auto[r]["final"], ddp[0]["final"], rtol=0, atol=1e-6)
    assert summary["mode"] == "sync" and summary["ranks"][0]["bytes_intra_per_step"] > 0


@pytest.mark.timeout(240)
def test_switcher_goes_async_under_a_straggler_and_rolls_back_on_divergence(tmp_path):
    # No batch rebalancing: a persistent straggler then means async. A NaN on rank 0 in async mode is held back,
    # the next window rolls back to the last good state in sync mode, and async stays off for the cooldown.
    switcher = SyncSwitcher(window=3, warmup_steps=3, dwell_windows=1, rebalance=False, straggler_high=1.5,
                            straggler_low=1.2, jitter_high=5.0, jitter_low=4.0, cooldown_windows=20,
                            allow_async=True)  # fmt: skip
    model = NaNInAsyncModel(slow_rank=1, delay=0.1, after=2)
    ranks, summary = _fit(tmp_path, AutoSyncStrategy(start_method="fork"), model, steps=21, callbacks=[switcher],
                          val=True)  # fmt: skip
    kinds = [(e["kind"], e["mode"], e["next"]) for e in summary["events"]]
    assert ("switch", "sync", "async") in kinds
    assert ("rollback", "async", "sync") in kinds
    rollback = next(e for e in summary["events"] if e["kind"] == "rollback")
    assert "non-finite" in rollback["reason"] and "restored the last good state" in rollback["reason"]
    after = [d for d in ranks[0]["decisions"] if d["step"] > rollback["step"]]
    assert after and all(d["next"] == "sync" for d in after)  # async is off after it diverged
    # At least one later window saw the straggler again and named the ban as the reason to stay synchronous.
    assert any("diverged recently" in d["reason"] for d in after), ranks[0]["decisions"]
    for r in ranks:
        assert torch.isfinite(r["final"]).all()
        torch.testing.assert_close(r["final"], ranks[0]["final"], rtol=0, atol=0)
        assert r["decisions"] == ranks[0]["decisions"]  # one decision per window, the same on every rank


@pytest.mark.timeout(240)
def test_a_learning_rate_times_100_in_async_mode_is_caught_and_rolled_back(tmp_path):
    # The divergence guard's floor and spread (issue 66) must not hide a real blow-up: the loss is low (a separable
    # task trained to near zero), then the learning rate goes x100 in async mode. Its window is rolled back to the
    # last good state (the learning rate with it), async is banned, and training ends with a low loss again.
    # Synchronous for 30 steps (the warm-up: the loss gets low), then async under the straggler, then the blow-up.
    switcher = SyncSwitcher(window=3, warmup_steps=30, dwell_windows=1, rebalance=False, straggler_high=1.5,
                            straggler_low=1.2, jitter_high=5.0, jitter_low=4.0, cooldown_windows=50,
                            allow_async=True)  # fmt: skip
    model = LrBlowUpModel(slow_rank=1, delay=0.03, after=4)
    ranks, summary = _fit(tmp_path, AutoSyncStrategy(start_method="fork"), model, steps=54, callbacks=[switcher])
    rollbacks = [e for e in summary["events"] if e["kind"] == "rollback"]
    assert [(e["mode"], e["next"]) for e in rollbacks] == [("async", "sync")], summary["events"]
    reason = rollbacks[0]["reason"]
    assert "restored the last good state" in reason and "loss " in reason, reason
    before = [d for d in ranks[0]["decisions"] if d["step"] < rollbacks[0]["step"]]
    low = float(before[-2]["signals"].rsplit("loss ", 1)[1])
    assert low < 0.2, before  # the guard held at a low loss until the blow-up
    for r in ranks:
        assert torch.isfinite(r["final"]).all()
        torch.testing.assert_close(r["final"], ranks[0]["final"], rtol=0, atol=0)
    last = float(ranks[0]["decisions"][-1]["signals"].rsplit("loss ", 1)[1])
    assert last < low, ranks[0]["decisions"][-1]  # the restored state (its learning rate too) trained on


@pytest.mark.timeout(240)
@pytest.mark.parametrize("local_steps", [1, 2])
@pytest.mark.parametrize("how", ["manual", "accumulate"])
def test_a_nan_the_closure_loss_misses_is_held_back_in_async_mode(tmp_path, local_steps, how):
    # Lightning's closure returns no loss under manual optimization, and only the last micro-batch's under gradient
    # accumulation: the gradients are checked too, and a non-finite one is dropped (rank 0 from step 2 on), so no
    # replica ever holds a NaN.
    strategy = AutoSyncStrategy(mode="async", local_steps=local_steps, switcher=False, start_method="fork")
    if how == "manual":
        ranks, _ = _fit(tmp_path, strategy, ManualNaNModel(at=2, rank=0), steps=6)
    else:
        ranks, _ = _fit(tmp_path, strategy, NaNFirstMicroBatchModel(at=2, rank=0), steps=6, accumulate_grad_batches=2)
    assert all(bool(torch.isfinite(r["final"]).all()) for r in ranks)
    assert ranks[0]["diverged"] is not None and not math.isfinite(ranks[0]["diverged"])
    assert ranks[1]["diverged"] is None


@pytest.mark.timeout(240)
def test_resume_continues_in_the_saved_mode(tmp_path):
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)
    strategy = AutoSyncStrategy(switcher=False, compensation="none", start_method="fork")
    _fit(tmp_path / "a", strategy, ConstantGradModel(slow_rank=1), steps=4, callbacks=[ToAsync(), ckpt])
    path = next((tmp_path / "ckpt").glob("*.ckpt"))
    assert torch.load(path, weights_only=False)["auto_sync"]["mode"] == "async"
    strategy = AutoSyncStrategy(switcher=False, compensation="none", start_method="fork")
    ranks, summary = _fit(tmp_path / "b", strategy, ConstantGradModel(slow_rank=1), steps=8, ckpt_path=str(path))
    assert summary["mode"] == "async" and ranks[0]["mode"] == "async"
    want = torch.full((16,), -ConstantGradModel.lr * 8 * 1.5)
    for r in ranks:
        torch.testing.assert_close(r["final"], want, rtol=0, atol=1e-6)


def test_bad_input():
    with pytest.raises(ValueError, match="mode must be one of"):
        AutoSyncStrategy(mode="fast")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="staleness"):
        AutoSyncStrategy(staleness=-1)
    with pytest.raises(ValueError, match="inter_period"):
        AutoSyncStrategy(inter_period=0)
    with pytest.raises(ValueError, match="node_size"):
        AutoSyncStrategy(node_size=0)
    with pytest.raises(ValueError, match="ddp_comm_hook"):
        AutoSyncStrategy(ddp_comm_hook=lambda *a: None)
    with pytest.raises(ValueError, match="window"):
        SyncSwitcher(window=1)
    with pytest.raises(ValueError, match="dwell_windows"):
        SyncSwitcher(dwell_windows=0)
    with pytest.raises(ValueError, match="straggler_low"):
        SyncSwitcher(straggler_high=1.1, straggler_low=1.2)
    # hier on one node without virtual nodes: refused, nothing changes.
    strategy = AutoSyncStrategy(switcher=False)
    strategy.topology = Topology.from_cluster(4, 1, None)
    with pytest.raises(ModeUnavailableError, match="node_size"):
        strategy.switch_mode("hier")
    assert strategy.mode == "sync" and strategy.available_modes == ("sync", "async")


def test_switcher_needs_auto_sync():
    trainer = Trainer(accelerator="cpu", devices=1, callbacks=[SyncSwitcher()], logger=False, max_steps=1,
                      enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    with pytest.raises(ValueError, match="auto_sync"):
        trainer.fit(TinyModel())


@pytest.mark.timeout(240)
def test_the_gathering_callbacks_raise_no_deprecation_warning(tmp_path):
    # SyncMonitor, SyncSwitcher (a window every 3 steps) and AdaptiveBatchSize all gather per-rank figures; through
    # Lightning's all_gather each call warned "torch.distributed.nn.functional.all_gather is deprecated".
    from lightning_syncasync.callbacks import AdaptiveBatchSize

    switcher = SyncSwitcher(window=3, warmup_steps=3, dwell_windows=1)
    callbacks = [switcher, AdaptiveBatchSize(interval=3, warmup_steps=2), RecordWarnings(str(tmp_path))]
    _fit(tmp_path, AutoSyncStrategy(start_method="fork"), TinyModel(), steps=12, callbacks=callbacks)
    for rank in range(2):
        messages = json.loads((tmp_path / f"warnings{rank}.json").read_text())
        assert not [m for m in messages if "all_gather" in m], messages
    decisions = torch.load(tmp_path / "rank0.pt")["decisions"]
    assert len(decisions) >= 2  # the switcher did gather, window after window


@pytest.mark.timeout(240)
def test_async_rounds_and_the_switchers_window_collective_do_not_deadlock(tmp_path):
    # The jitter_long deadlock (issue 49's runs): the switcher gathers every rank's window at the same step, so a
    # fast rank waits there for a slow one; rounds of wall-clock length kept ending on the slow rank meanwhile (past
    # their deadlines, with no new step), until its staleness bound needed a round the blocked fast rank had not
    # launched: each waited for the other, and the run died on peer_timeout_s. Rounds in auto_sync now end by step.
    # straggler_low=1: once async, it stays async (every window's ratio is >= 1), and the window gathers go on.
    switcher = SyncSwitcher(window=3, first_window=3, warmup_steps=0, dwell_windows=1, rebalance=False,
                            straggler_high=1.05, straggler_low=1.0, jitter_high=5.0, jitter_low=4.0,
                            allow_async=True)  # fmt: skip
    strategy = AutoSyncStrategy(local_steps=2, staleness=1, compensation="none", peer_timeout_s=20.0,
                                start_method="fork")  # fmt: skip
    steps = 40
    ranks, summary = _fit(tmp_path, strategy, ConstantGradModel(slow_rank=1, delay=0.05), steps=steps,
                          callbacks=[switcher])  # fmt: skip
    assert ("switch", "sync", "async") in [(e["kind"], e["mode"], e["next"]) for e in summary["events"]]
    want = torch.full((16,), -ConstantGradModel.lr * steps * 1.5)  # every update applied once, whatever the modes
    for r in ranks:
        torch.testing.assert_close(r["final"], want, rtol=0, atol=1e-6)
    # In async mode the window gather is not a barrier: it travels in the background and each decision reads the
    # window before (PendingRows), the same numbers on every rank, so the same decisions at the same steps.
    in_async = [d for d in ranks[0]["decisions"] if d["mode"] == "async"]
    assert in_async and all(d["window_step"] == d["step"] - 3 for d in in_async), ranks[0]["decisions"]
    assert all("window_step" not in d for d in ranks[0]["decisions"] if d["mode"] == "sync")
    for r in ranks:
        assert r["decisions"] == ranks[0]["decisions"]

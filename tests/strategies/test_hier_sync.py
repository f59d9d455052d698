"""hier_sync on 4 gloo processes as 2 virtual nodes of 2 (spawn)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from _models import RecordSteps, TinyAdamModel, TinyModel, ValidationProbeModel
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

from lightning_syncasync.callbacks import SyncMonitor
from lightning_syncasync.strategies.auto_sync import AutoSyncStrategy
from lightning_syncasync.strategies.hier_sync import HierSyncStrategy


class RecordParams(Callback):
    """Each rank writes its parameters after every step (spawn returns only rank 0's)."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.steps: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps.append(torch.cat([p.detach().flatten() for p in pl_module.parameters()]))

    def on_fit_end(self, trainer, pl_module):
        # After the strategy's on_train_end (which drains the last cross-node round).
        final = torch.cat([p.detach().flatten() for p in pl_module.parameters()])
        torch.save({"steps": self.steps, "final": final}, Path(self.out) / f"rank{trainer.global_rank}.pt")


def _fit(
    out: Path, strategy, steps: int = 8, ckpt_path: str | None = None, callbacks=(), model_cls=TinyModel
) -> tuple[list[dict], dict]:
    out.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(
        accelerator="cpu", devices=4, strategy=strategy, max_steps=steps, logger=False, default_root_dir=out,
        callbacks=[SyncMonitor(summary_file=str(out / "summary.json"), print_summary=False), RecordParams(str(out)),
                   *callbacks],
        enable_checkpointing=bool(callbacks), enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    torch.manual_seed(0)
    trainer.fit(model_cls(), ckpt_path=ckpt_path)
    return [torch.load(out / f"rank{r}.pt") for r in range(4)], json.loads((out / "summary.json").read_text())


PARAM_BYTES = sum(p.numel() * 4 for p in TinyModel().parameters())


@pytest.mark.timeout(300)
def test_synchronous_setting_equals_flat_ddp_after_every_step(tmp_path):
    ddp, _ = _fit(tmp_path / "ddp", DDPStrategy(start_method="fork"))
    hier, summary = _fit(tmp_path / "hier", HierSyncStrategy(inter_period=1, max_delay=0, node_size=2,
                                                             start_method="fork"))  # fmt: skip
    for r in range(4):
        assert len(hier[r]["steps"]) == 8
        for got, want in zip(hier[r]["steps"], ddp[0]["steps"], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for rank in summary["ranks"]:
        assert rank["bytes_intra_per_step"] > PARAM_BYTES  # node gradient all-reduce + in-node all-gather
        # Each local rank sends its half of the (padded) model across nodes every step.
        assert rank["bytes_inter_per_step"] == pytest.approx(-(-PARAM_BYTES // 8) * 4, rel=0.01)
    assert summary["mode"] == "hier"


@pytest.mark.timeout(300)
def test_warmup_steps_are_flat_ddp_then_nodes_train_apart(tmp_path):
    ddp, _ = _fit(tmp_path / "ddp", DDPStrategy(start_method="fork"))
    res, summary = _fit(tmp_path / "warm", HierSyncStrategy(warmup_steps=3, inter_period=4, max_delay=1, node_size=2,
                                                            start_method="fork"))  # fmt: skip
    for r in range(4):
        for step in range(3):  # the warm-up: DDP's gradient all-reduce over every rank
            torch.testing.assert_close(res[r]["steps"][step], ddp[0]["steps"][step], rtol=1e-5, atol=1e-6)
    # Then each node trains on its own (first round launched at step 3 + 4 = 7): the nodes part, inside a node
    # the replicas stay equal, and fit() ends with one merged model.
    assert not torch.allclose(res[0]["steps"][3], res[2]["steps"][3])
    torch.testing.assert_close(res[0]["steps"][5], res[1]["steps"][5])
    for r in res[1:]:
        torch.testing.assert_close(r["final"], res[0]["final"])
    for rank in summary["ranks"]:
        # Inter-node over the 8 steps: the 3 warm-up steps' gradient all-reduce and the round launched at step 7
        # (half of the padded model per local rank); fit's final exact round comes after the last step is counted.
        half = -(-PARAM_BYTES // 8) * 4
        assert rank["bytes_inter_per_step"] * 8 == pytest.approx(3 * PARAM_BYTES + half, rel=0.01)


@pytest.mark.timeout(300)
def test_delayed_averaging_ends_with_one_merged_model(tmp_path):
    # inter_period=3 over 8 steps: the last launch is at step 6, so the nodes have unmerged progress at the end.
    res, summary = _fit(tmp_path / "delay", HierSyncStrategy(inter_period=3, max_delay=1, node_size=2,
                                                             start_method="fork"))  # fmt: skip
    # Inside a node the replicas never differ; across nodes they do between averagings.
    for step in range(8):
        torch.testing.assert_close(res[0]["steps"][step], res[1]["steps"][step])
        torch.testing.assert_close(res[2]["steps"][step], res[3]["steps"][step])
    assert not torch.allclose(res[0]["steps"][0], res[2]["steps"][0])
    # fit() ends at a consistent cut: every rank ends with the same model.
    for r in res[1:]:
        torch.testing.assert_close(r["final"], res[0]["final"])
    assert all(r["bytes_inter_per_step"] > 0 for r in summary["ranks"])


def _fit_validating(out: Path, validate: bool, checkpoint: bool = False) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    callbacks: list[Callback] = [RecordSteps(str(out))]
    if checkpoint:
        callbacks.append(ModelCheckpoint(dirpath=out / "ckpt", save_top_k=-1))
    trainer = Trainer(
        accelerator="cpu", devices=4, max_steps=6, logger=False, default_root_dir=out, callbacks=callbacks,
        # No cross-node round in these 6 steps: the two nodes' replicas drift apart.
        strategy=HierSyncStrategy(inter_period=100, max_delay=1, node_size=2, start_method="fork"),
        val_check_interval=2, limit_val_batches=2 if validate else 0, num_sanity_val_steps=0,
        enable_checkpointing=checkpoint, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    torch.manual_seed(0)
    trainer.fit(ValidationProbeModel())
    return [torch.load(out / f"rank{r}.pt") for r in range(4)]


@pytest.mark.timeout(300)
def test_validation_sees_the_mean_of_the_node_replicas_and_leaves_training_alone(tmp_path):
    plain = _fit_validating(tmp_path / "plain", validate=False)
    res = _fit_validating(tmp_path / "val", validate=True)
    for r in range(4):
        assert len(res[r]["seen"]) == 3  # after steps 2, 4 and 6
        for step, (got, want) in enumerate(zip(res[r]["steps"], plain[r]["steps"], strict=True)):
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"rank {r} step {step}")  # bitwise
    for i, step in enumerate((1, 3, 5)):
        node0, node1 = res[0]["steps"][step], res[2]["steps"][step]
        assert not torch.allclose(node0, node1)  # the nodes did drift apart...
        for r in range(4):  # ...and every rank validated their mean, not its own node's replica
            torch.testing.assert_close(res[r]["seen"][i], (node0 + node1) / 2)
            if step + 1 < 6:  # the next step starts from the replica, untouched
                torch.testing.assert_close(res[r]["starts"][step + 1], res[r]["steps"][step], rtol=0, atol=0)


@pytest.mark.timeout(300)
def test_a_checkpoint_saved_during_validation_holds_the_merged_model(tmp_path):
    # ModelCheckpoint saves in its on_validation_end, before the strategy puts the replica back: the checkpoint's
    # consistent cut must start from the training state, not from the mean lent to validation.
    res = _fit_validating(tmp_path / "ckpt", validate=True, checkpoint=True)
    for r in range(4):
        assert len(res[r]["seen"]) == 3
    # No round was in flight, so the cut is the exact mean of the replicas: what validation saw.
    for i, name in enumerate(("epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt")):
        state = torch.load(tmp_path / "ckpt" / "ckpt" / name, weights_only=True)["state_dict"]
        saved = torch.cat([state[k].flatten() for k in ("net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias")])
        torch.testing.assert_close(saved, res[0]["seen"][i])
    # And training went on from that cut (not from the replica lent away during validation): steps 3 and 5 start
    # from the merged model on every rank.
    for i, step in enumerate((2, 4)):
        for r in range(4):
            torch.testing.assert_close(res[r]["starts"][step], res[0]["seen"][i])


@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    "extra",
    [
        {"outer": "nesterov", "outer_lr": 0.7},
        {"compression": "int8", "compression_options": {"rounding": "stochastic"}},
    ],
    ids=["nesterov", "int8"],
)
def test_resume_continues_the_same_trajectory(tmp_path, extra):
    strategy = dict(inter_period=1, max_delay=1, node_size=2, start_method="fork", **extra)
    checkpoint = _resume_at_step_4_matches(tmp_path, lambda: HierSyncStrategy(**strategy), TinyModel)
    assert "hier_sync" in checkpoint  # the outer momentum and step travel


def _resume_at_step_4_matches(tmp_path: Path, make, model_cls) -> dict:
    """Train 8 steps saving at step 4, resume a second run from that checkpoint, and check every rank's steps 5-8
    match the uninterrupted run's. Returns the checkpoint."""
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)
    full, _ = _fit(tmp_path / "full", make(), callbacks=[ckpt], model_cls=model_cls)
    path = tmp_path / "ckpt" / "epoch=0-step=4.ckpt"
    resumed, _ = _fit(tmp_path / "resumed", make(), ckpt_path=str(path), model_cls=model_cls,
                      callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt2", every_n_train_steps=4)])  # fmt: skip
    for r in range(4):
        for got, want in zip(resumed[r]["steps"], full[r]["steps"][4:], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    return torch.load(path, weights_only=True)


@pytest.mark.timeout(400)
def test_resume_with_adam_restores_every_nodes_optimizer_state(tmp_path):
    # The nodes train apart with their own Adam moments between rounds; a checkpoint of rank 0's alone restarted
    # node 1 from node 0's moments (0.013 off at the first resumed step).
    strategy = dict(inter_period=2, max_delay=1, node_size=2, start_method="fork")
    checkpoint = _resume_at_step_4_matches(tmp_path, lambda: HierSyncStrategy(**strategy), TinyAdamModel)
    nodes = checkpoint["hier_sync_node_optimizer_states"]
    assert len(nodes) == 2
    moments = [node[0]["state"][0]["exp_avg"] for node in nodes]
    assert not torch.equal(moments[0], moments[1])  # each node's own


@pytest.mark.timeout(400)
def test_auto_sync_in_hier_mode_resumes_every_nodes_optimizer_state(tmp_path):
    # auto_sync's hier mode runs the same averager, and its nodes' Adam moments part the same way.
    make = lambda: AutoSyncStrategy(  # noqa: E731
        mode="hier", switcher=False, inter_period=2, max_delay=1, node_size=2, start_method="fork"
    )
    checkpoint = _resume_at_step_4_matches(tmp_path, make, TinyAdamModel)
    assert len(checkpoint["hier_sync_node_optimizer_states"]) == 2


class RecordOptimizerAtStart(Callback):
    """Each rank writes its optimizer's state as training starts (after the checkpoint was restored), and the
    warnings raised since setup (in the rank's own process: a forked rank's warnings never reach pytest's)."""

    def __init__(self, out: str) -> None:
        self.out = out
        self._watch: warnings.catch_warnings | None = None
        self._seen: list[warnings.WarningMessage] = []

    def setup(self, trainer, pl_module, stage):
        self._watch = warnings.catch_warnings(record=True)
        self._seen = self._watch.__enter__()
        warnings.simplefilter("always")

    def on_train_start(self, trainer, pl_module):
        assert self._watch is not None
        self._watch.__exit__(None, None, None)
        state = trainer.optimizers[0].state_dict()
        messages = [str(w.message) for w in self._seen]
        record = {"state": state, "warnings": messages, "step": trainer.global_step}
        torch.save(record, Path(self.out) / f"optimizer{trainer.global_rank}.pt")


@pytest.mark.timeout(400)
def test_a_checkpoint_of_two_nodes_resumes_on_one_from_the_mean_of_their_optimizer_states(tmp_path):
    # A lost node, or a fine-tune on one machine: 2 nodes of 2 saved at a consistent cut, resumed as 1 node of 2.
    # The saved model is the merged one; each node's Adam moments were their own, and the new node starts from their
    # mean (it was refused before: "resume on as many nodes").
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)
    _fit(tmp_path / "full", HierSyncStrategy(inter_period=2, max_delay=1, node_size=2, start_method="fork"), steps=4,
         callbacks=[ckpt], model_cls=TinyAdamModel)  # fmt: skip
    path = tmp_path / "ckpt" / "epoch=0-step=4.ckpt"
    nodes = torch.load(path, weights_only=True)["hier_sync_node_optimizer_states"]
    out = tmp_path / "resumed"
    out.mkdir()
    trainer = Trainer(
        accelerator="cpu", devices=2, max_steps=6, logger=False, default_root_dir=out,
        strategy=HierSyncStrategy(inter_period=2, max_delay=1, node_size=2, start_method="fork"),
        callbacks=[RecordOptimizerAtStart(str(out))], enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(TinyAdamModel(), ckpt_path=str(path))
    for rank in range(2):
        record = torch.load(out / f"optimizer{rank}.pt", weights_only=True)
        assert record["step"] == 4  # resumed from the checkpoint (it was refused before)
        if rank == 0:  # rank_zero_warn
            assert any("optimizer states of 2 nodes and this run has 1: every node starts from their mean" in m
                       for m in record["warnings"]), record["warnings"]  # fmt: skip
        got = record["state"]["state"]
        for key, entry in got.items():
            saved = [node[0]["state"][key] for node in nodes]
            assert not torch.equal(saved[0]["exp_avg"], saved[1]["exp_avg"])  # the nodes' moments had parted
            for name in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(entry[name], (saved[0][name] + saved[1][name]) / 2)
            assert torch.equal(entry["step"], saved[0]["step"])


@pytest.mark.timeout(200)
def test_node_size_that_does_not_divide_the_world_fails_at_setup(tmp_path):
    with pytest.raises(Exception, match="node_size=3 does not divide"):
        _fit(tmp_path / "bad", HierSyncStrategy(node_size=3, start_method="fork"), steps=1)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"inter_period": 0}, "inter_period"),
        ({"max_delay": -1}, "max_delay"),
        ({"node_size": 0}, "node_size"),
        ({"outer": "adam"}, "outer"),
        ({"outer_lr": -1.0}, "outer_lr"),
        ({"outer_momentum": 1.5}, "outer_momentum"),
        ({"model_averaging_period": 4}, "model_averaging_period"),
        ({"compression": "int3"}, "compression must be one of"),
        ({"compression": "powersgd", "compression_options": {"rank": 0}}, "rank must be"),
        ({"peer_timeout_s": 0}, "peer_timeout_s"),
        ({"warmup_steps": -1}, "warmup_steps"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        HierSyncStrategy(**kwargs)


def test_registered_names():
    import lightning_syncasync  # noqa: F401

    t = Trainer(strategy="hier_sync_spawn", accelerator="cpu", devices=2, logger=False)
    assert isinstance(t.strategy, HierSyncStrategy) and t.strategy._start_method == "spawn"


def _fit_with(out: Path, strategy, model_cls, **trainer_kwargs) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(
        accelerator="cpu", devices=4, strategy=strategy, max_steps=8, logger=False, default_root_dir=out,
        callbacks=[RecordParams(str(out))], enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, **trainer_kwargs,
    )  # fmt: skip
    torch.manual_seed(0)  # the same initial weights in every run
    trainer.fit(model_cls())
    return [torch.load(out / f"rank{r}.pt") for r in range(4)]


@pytest.mark.timeout(300)
def test_gradient_accumulation_equals_ddp(tmp_path):
    ddp = _fit_with(tmp_path / "ddp", DDPStrategy(start_method="fork"), TinyModel, accumulate_grad_batches=2)
    strategy = HierSyncStrategy(inter_period=1, max_delay=0, node_size=2, start_method="fork")
    hier = _fit_with(tmp_path / "hier", strategy, TinyModel, accumulate_grad_batches=2)
    for r in range(4):
        torch.testing.assert_close(hier[r]["final"], ddp[0]["final"], rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(300)
def test_manual_optimisation_with_two_optimizers_and_clipping(tmp_path):
    from _models import ManualTwoOptimizersModel

    strategy = HierSyncStrategy(inter_period=2, max_delay=1, node_size=2, start_method="fork")
    res = _fit_with(tmp_path / "manual", strategy, ManualTwoOptimizersModel)
    # One averaging step per training step (after the last optimizer), and fit ends with one merged model.
    for r in res[1:]:
        torch.testing.assert_close(r["final"], res[0]["final"])
    assert not torch.allclose(res[0]["final"], res[0]["steps"][0])


@pytest.mark.timeout(120)
def test_one_rank_says_it_is_plain_lightning_and_names_the_virtual_nodes(tmp_path):
    # One process in this process, so the notice is seen here (forked ranks' warnings are not).
    monitor = SyncMonitor(print_summary=False)
    trainer = Trainer(accelerator="cpu", devices=1, strategy=HierSyncStrategy(), max_steps=1, logger=False,
                      default_root_dir=tmp_path, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[monitor])  # fmt: skip
    with pytest.warns(
        UserWarning, match=r"one rank, so there is nothing to average.*node_size.*hier_sync_virtual"
    ) as seen:
        trainer.fit(TinyModel())
    assert len([w for w in seen if "nothing to average" in str(w.message)]) == 1  # one line, not one per step
    # ... and the summary's header says it too, where a user reads the run's figures (the warning scrolls away).
    (note,) = monitor.summary["notes"]
    assert note.startswith("one node: every step was plain Lightning at one device") and "hier_sync_virtual" in note


@pytest.mark.timeout(200)
def test_virtual_nodes_from_the_registered_name(tmp_path):
    import lightning_syncasync  # noqa: F401  (registers hier_sync_virtual)
    from lightning_syncasync.callbacks._summary import _topology_text

    out = tmp_path / "virtual"
    out.mkdir()
    # The registered name's settings, forked (the name's popen launcher would re-run pytest in the child; that the
    # name itself builds this strategy is tested in test_registry.py).
    params = StrategyRegistry["hier_sync_virtual"]["init_params"]
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy=HierSyncStrategy(**params, start_method="fork"), max_steps=4,
        logger=False, default_root_dir=out,
        callbacks=[SyncMonitor(summary_file=str(out / "summary.json"), print_summary=False)],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(TinyModel())
    summary = json.loads((out / "summary.json").read_text())
    # 2 ranks on one machine as 2 virtual nodes of 1: the cross-node average runs, and a one-rank node's gradient
    # "all-reduce" moves no byte.
    assert (summary["num_nodes"], summary["node_size"], summary["machines"]) == (2, 1, 1)
    assert _topology_text(summary) == "2 rank(s) as 2 virtual node(s) of 1 on 1 machine(s)"
    # Virtual nodes average: nothing to warn about, only where the period came from (4 steps, nothing measured yet
    # in 4 steps).
    assert [n.split(":")[0] for n in summary["notes"]] == ["hier_sync round length"], summary["notes"]
    assert summary["compression"] is None
    assert all(r["bytes_intra_per_step"] == 0 and r["bytes_inter_per_step"] > 0 for r in summary["ranks"])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"virtual_nodes": 0}, "virtual_nodes must be an integer >= 1"), ({"virtual_nodes": 2, "node_size": 1}, "both")],
)
def test_bad_virtual_nodes(kwargs, match):
    with pytest.raises(ValueError, match=match):
        HierSyncStrategy(**kwargs)

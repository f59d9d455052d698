"""Lightning's per-step SIGTERM broadcast, scoped to the ranks that train in lockstep (strategies/_sigterm.py): the
node for hier_sync and hier_sync_sharded, the rank alone under async training."""

from __future__ import annotations

import json
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from _models import TinyModel
from _ranks import RankJob
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_syncasync.algorithms.topology import Topology
from lightning_syncasync.strategies._sigterm import node_stop_groups, scoped_sigterm_check
from lightning_syncasync.strategies.auto_sync import AutoSyncStrategy
from lightning_syncasync.strategies.hier_sync import HierSyncStrategy
from lightning_syncasync.testing import run_distributed


def _stops(rank: int, world: int, signalled: int, scope: str) -> dict:
    # 4 ranks as 2 nodes of 2; only `signalled` received SIGTERM. Lightning's loop object is real, the trainer only
    # what the check reads.
    loop = _TrainingEpochLoop.__new__(_TrainingEpochLoop)
    loop.val_loop = _ValLoop()
    trainer = SimpleNamespace(fit_loop=SimpleNamespace(epoch_loop=loop), received_sigterm=rank == signalled)
    group = node_stop_groups(Topology(world, 2), timedelta(seconds=30)) if scope == "node" else None
    undo = scoped_sigterm_check(trainer, group)  # type: ignore[arg-type]
    stopped = []
    for _ in range(3):  # the check runs at every step; the flag stays set once received
        try:
            loop._broadcast_sigterm_tensor()
            stopped.append(False)
        except SIGTERMException:
            stopped.append(True)
    try:  # validation during fit: the same check first (a signal in the step before it is not held until its end)
        validated = loop.val_loop.run()
    except SIGTERMException:
        validated = None
    undo()
    restored = "_broadcast_sigterm_tensor" not in loop.__dict__ and "run" not in vars(loop.val_loop)
    dist.barrier()
    return {"stopped": stopped, "validated": validated, "restored": restored,
            "backend": dist.get_backend(group) if group else None}  # fmt: skip


class _ValLoop:
    def run(self) -> str:
        return "validated"


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("scope", "want"), [("node", [False, False, True, True]), ("rank", [False] * 3 + [True])])
def test_a_signal_on_any_rank_stops_its_node_and_only_its_node(scope, want):
    # Rank 3, not rank 0: Lightning's broadcast from rank 0 would ignore this signal entirely.
    res = run_distributed(_stops, 4, 3, scope)
    assert [r["stopped"] == [True] * 3 for r in res] == want
    assert all(r["stopped"] in ([True] * 3, [False] * 3) for r in res)
    assert [r["validated"] is None for r in res] == want
    assert all(r["validated"] in (None, "validated") for r in res)
    assert all(r["restored"] for r in res)
    if scope == "node":
        assert {r["backend"] for r in res} == {"gloo"}  # a CPU flag: on a GPU the check never waits for the device


@pytest.mark.parametrize("training", [False, True])
def test_the_handler_is_swapped_as_lightning_registers_it_and_no_signal_is_lost(capfd, training):
    # Lightning's own connector, in this process: registered after the strategy's setup (as in a fit), the handler
    # holds the pack's notifier, which makes no collective. Outside training (validation, the sanity check) it sets
    # the trainer's flag at once, for Lightning's evaluation loop, and the check stops; in training it leaves the
    # flag to the group's check, and a signal no check acted on is handed to Lightning's flag when the check goes
    # (auto_sync leaving a mode, the end of fit). Undo restores everything.
    import os
    import signal

    from lightning.pytorch.trainer.states import RunningStage

    trainer = Trainer(accelerator="cpu", devices=1, logger=False)
    trainer.state.stage = RunningStage.TRAINING if training else RunningStage.VALIDATING
    connector = trainer._signal_connector
    before = signal.getsignal(signal.SIGTERM)
    undo = scoped_sigterm_check(trainer, None)
    connector.register_signal_handlers()
    try:
        handlers = signal.getsignal(signal.SIGTERM).signal_handlers
        assert connector._sigterm_notifier_fn not in handlers
        os.kill(os.getpid(), signal.SIGTERM)
        assert "rank 0: received SIGTERM; stopping at the next step" in capfd.readouterr().err
        assert trainer.received_sigterm is not training
        if not training:
            with pytest.raises(SIGTERMException):
                trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor()
    finally:
        undo()
        assert trainer.received_sigterm  # not lost
        assert connector._sigterm_notifier_fn in signal.getsignal(signal.SIGTERM).signal_handlers  # swapped back
        assert "register_signal_handlers" not in vars(connector)
        connector.teardown()
    assert signal.getsignal(signal.SIGTERM) == before


class RecordCheck(Callback):
    """Which SIGTERM check the loop runs during training: Lightning's (the class's) or a scoped one."""

    def __init__(self) -> None:
        self.during: list[bool] = []
        self.after: bool | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.during.append("_broadcast_sigterm_tensor" in trainer.fit_loop.epoch_loop.__dict__)

    def on_fit_end(self, trainer, pl_module):
        self.after = "_broadcast_sigterm_tensor" in trainer.fit_loop.epoch_loop.__dict__
        out = f"{trainer.default_root_dir}/rank{trainer.global_rank}.pt"
        torch.save({"during": self.during, "after": self.after}, out)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["hier_sync", "auto_sync_hier", "auto_sync_sync"])
def test_strategies_scope_the_check_while_their_nodes_run_apart(tmp_path, strategy):
    make = {
        "hier_sync": lambda: HierSyncStrategy(node_size=1, inter_period=2, start_method="fork"),
        "auto_sync_hier": lambda: AutoSyncStrategy(mode="hier", node_size=1, switcher=False, start_method="fork"),
        "auto_sync_sync": lambda: AutoSyncStrategy(mode="sync", switcher=False, start_method="fork"),
    }[strategy]
    trainer = Trainer(accelerator="cpu", devices=2, strategy=make(), max_steps=4, logger=False,
                      default_root_dir=tmp_path, callbacks=[RecordCheck()], enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(TinyModel())
    for rank in range(2):
        record = torch.load(tmp_path / f"rank{rank}.pt")
        # Sync mode is DDP over every rank, in lockstep anyway: Lightning's own check stays there.
        assert record["during"] == [strategy != "auto_sync_sync"] * 4, record
        assert record["after"] is False  # undone when the fit ends


def _stopped(job: RankJob, out) -> dict[int, dict]:
    """The job fails (a signalled run does not finish): each rank's exception and the step it stopped at."""
    with pytest.raises(AssertionError) as failed:
        job.wait()
    records = {int(p.name[4]): json.loads(p.read_text()) for p in out.glob("rank*.stopped.json")}
    assert records, str(failed.value)
    return records


@pytest.mark.timeout(180)
def test_a_signalled_node_stops_together_and_the_other_node_is_told_by_name(tmp_path):
    # 4 ranks as 2 nodes of 2; rank 1 (not rank 0) sends itself SIGTERM during step 4. Its whole node stops at the
    # start of step 5 with Lightning's SIGTERMException; the other node's ranks end with an error naming a rank of
    # that node (the watchdog's, or their inter-node round's naming its cross-node peer), not a hang. Before the
    # handler's broadcast was replaced, rank 1 sat in it until its peers failed (with async_ssp at 2 ranks: 20 s, a
    # round's timeout) and ended with "Connection closed by peer", not SIGTERMException.
    job = RankJob(tmp_path, "hier_sync", "cpu", {"node_size": 2, "inter_period": 2}, steps=60, ranks=4,
                  timeout_s=90, sigterm_at=4)  # fmt: skip
    stopped = _stopped(job, tmp_path)
    assert [stopped[r]["exception"] for r in (0, 1)] == ["SIGTERMException"] * 2, stopped
    assert stopped[0]["step"] == stopped[1]["step"] == 5, stopped
    for r in (2, 3):
        if r in stopped:  # (a rank ended by the watchdog's hard exit writes nothing)
            message = stopped[r]["message"]
            assert ("rank 0" in message or "rank 1" in message) and stopped[r]["exception"] != "SIGTERMException"


class _CountsValidation(TinyModel):
    def __init__(self) -> None:
        super().__init__()
        self.validated = 0

    def validation_step(self, batch, batch_idx):
        self.validated += 1

    def val_dataloader(self):
        return self.train_dataloader()


class _SignalBeforeValidation(Callback):
    """Installs the rank's own check (as the async strategies do) and sends this process SIGTERM during the training
    batch after which validation runs."""

    def __init__(self, at_batch: int) -> None:
        self.at_batch = at_batch
        self.scope: object | None = None

    def setup(self, trainer, pl_module, stage):
        from lightning_syncasync.strategies._sigterm import SigtermScope

        self.scope = SigtermScope()
        self.scope.install(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == self.at_batch:
            import os
            import signal

            os.kill(os.getpid(), signal.SIGTERM)

    def teardown(self, trainer, pl_module, stage):
        self.scope.undo()  # type: ignore[union-attr]


def test_a_signal_in_the_step_before_validation_stops_before_validating(tmp_path):
    # In the training step after which validation runs, the notifier leaves Lightning's flag to the check, which the
    # loop runs at the next step: after the whole validation, without the check at validation start. Lightning's
    # own loop, a real signal; Lightning would have stopped at its first validation batch, this stops before it.
    model = _CountsValidation()
    trainer = Trainer(accelerator="cpu", devices=1, max_epochs=3, limit_train_batches=4, limit_val_batches=5,
                      num_sanity_val_steps=0, logger=False, default_root_dir=tmp_path, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[_SignalBeforeValidation(at_batch=3)])  # fmt: skip
    with pytest.raises(SIGTERMException):
        trainer.fit(model)
    assert model.validated == 0
    assert trainer.received_sigterm
    assert trainer.current_epoch == 0 and trainer.global_step == 4

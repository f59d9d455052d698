"""DeepSpeedCPUStrategy: ZeRO on CPU processes (gloo), presets, checkpoint resume, and the rejected settings."""

from __future__ import annotations

import pytest
import torch
from _host import deepspeed_cpu_fp16, deepspeed_runs_fp16  # tests/ is on sys.path through its conftest
from _models import TinyAdamModel, TinyModel
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

pytest.importorskip("deepspeed", reason="DeepSpeed is part of the dev install (pip install -e '.[dev]')")

from lightning_syncasync.strategies.deepspeed_cpu import DeepSpeedCPUStrategy  # noqa: E402


def _trainer(tmp_path, strategy, precision, max_steps, callbacks=()):
    return Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        precision=precision,
        max_steps=max_steps,
        default_root_dir=tmp_path,
        logger=False,
        enable_checkpointing=bool(callbacks),
        callbacks=list(callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
    )


@pytest.mark.timeout(300)
def test_zero2_bf16_trains_on_two_cpu_processes_and_resumes_from_its_checkpoint(tmp_path):
    torch.manual_seed(0)
    model = TinyModel()
    before = [p.detach().clone() for p in model.parameters()]
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    trainer = _trainer(tmp_path, DeepSpeedCPUStrategy(stage=2, start_method="fork"), "bf16-mixed", 4, [ckpt])
    trainer.fit(model)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)), "nothing trained"
    last = tmp_path / "ckpt" / "last.ckpt"
    assert last.is_dir(), "DeepSpeed checkpoints are directories of sharded states"
    assert _saved(last)["global_step"] == 4
    # Resume: the run continues from step 4 (optimizer state, ZeRO shards and loop progress restored) to step 6.
    again = ModelCheckpoint(dirpath=tmp_path / "ckpt2", every_n_train_steps=1, save_top_k=-1, filename="{step}")
    resumed = _trainer(tmp_path, DeepSpeedCPUStrategy(stage=2, start_method="fork"), "bf16-mixed", 6, [again])
    resumed.fit(TinyModel(), ckpt_path=str(last))
    # Only steps 5 and 6 ran: a restart from scratch would have saved steps 1-6.
    assert sorted(p.name for p in (tmp_path / "ckpt2").iterdir()) == ["step=5.ckpt", "step=6.ckpt"]
    state = _saved(tmp_path / "ckpt2" / "step=6.ckpt")
    assert state["global_step"] == 6 and state["global_steps"] == 6  # Lightning's and DeepSpeed's step counters


def _saved(checkpoint_dir):
    """The non-sharded part of a DeepSpeed checkpoint directory (Lightning's loop state lives there)."""
    return torch.load(checkpoint_dir / "checkpoint" / "mp_rank_00_model_states.pt", weights_only=False)


@pytest.mark.timeout(300)
def test_zero3_with_offload_trains_on_two_cpu_processes(tmp_path):
    strategy = DeepSpeedCPUStrategy(stage=3, offload_optimizer=True, offload_parameters=True, start_method="fork")
    trainer = _trainer(tmp_path, strategy, "bf16-mixed", 3)
    trainer.fit(TinyModel())
    assert trainer.state.finished


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"stage": 4}, "ZeRO stage 0, 1, 2 or 3"),
        ({"stage": 2, "offload_parameters": True}, "offload_parameters needs ZeRO stage 3"),
        ({"staleness": 2}, r"staleness \(async_ssp\)"),
        ({"inter_period": 2}, r"inter_period \(hier_sync\)"),
        ({"config": {"optimizer": {"type": "OneBitAdam"}}}, "removed from DeepSpeed.*OneBitAdam"),
        ({"config": {"compression_training": {}}}, "compression_training was removed.*compression="),
        ({"config": {"zero_optimization": {"stage": 7}}}, "zero_optimization.stage"),
        ({"start_method": "thread"}, "start_method"),
    ],
)
def test_bad_settings_are_refused_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DeepSpeedCPUStrategy(**kwargs)


@pytest.mark.parametrize("supported", [False, True], ids=["cpu_without_fp16", "cpu_with_fp16"])
def test_fp16_follows_what_the_deepspeed_accelerator_reports(tmp_path, supported):
    # A faked accelerator, so both answers are checked on every machine, whatever its CPU supports.
    with deepspeed_cpu_fp16(supported):
        if supported:
            trainer = _trainer(tmp_path, DeepSpeedCPUStrategy(start_method="fork"), "16-mixed", 1)
            assert trainer.precision == "16-mixed"
        else:
            with pytest.raises(ValueError, match="fp16.*not supported.*bf16-mixed"):
                _trainer(tmp_path, DeepSpeedCPUStrategy(start_method="fork"), "16-mixed", 1)


@pytest.mark.timeout(300)
def test_fp16_on_this_machine_trains_or_is_refused_as_its_accelerator_reports(tmp_path):
    # The real accelerator: where it reports fp16 (oneDNN's fp16 kernels on this CPU), ZeRO-2 fp16 with dynamic loss
    # scaling trains; elsewhere the Trainer refuses it up front, naming bf16-mixed. A small initial loss scale
    # (2^4), so that overflow-skipped steps do not use up the few steps.
    strategy = DeepSpeedCPUStrategy(stage=2, start_method="fork", initial_scale_power=4)
    if not deepspeed_runs_fp16():
        with pytest.raises(ValueError, match="fp16.*not supported.*bf16-mixed"):
            _trainer(tmp_path, strategy, "16-mixed", 4)
        return
    torch.manual_seed(0)
    model = TinyModel()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = _trainer(tmp_path, strategy, "16-mixed", 4)
    trainer.fit(model)
    assert trainer.state.finished
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)), "nothing trained"


@pytest.mark.parametrize(
    ("config", "precision", "match"),
    [
        ({"fp16": {"enabled": True}}, "bf16-mixed", "enables fp16.*'bf16-mixed'.*precision='16-mixed'"),
        ({"fp16": {"enabled": True}}, "32-true", "enables fp16.*'32-true'"),
        ({"bf16": {"enabled": True}}, "32-true", "enables bf16.*precision='bf16-mixed'"),
    ],
)
def test_a_config_precision_other_than_the_trainers_is_refused_when_the_trainer_is_built(config, precision, match):
    # DeepSpeed would assert in every process at initialize (Lightning adds its precision's section beside it).
    strategy = DeepSpeedCPUStrategy(config={**config, "zero_optimization": {"stage": 2}}, start_method="fork")
    with pytest.raises(ValueError, match=match):
        Trainer(accelerator="cpu", devices=2, strategy=strategy, precision=precision, logger=False)


@pytest.mark.timeout(300)
def test_a_user_config_that_offloads_the_optimizer_trains_the_modules_own_optimizer(tmp_path):
    # DeepSpeed refuses ZeRO-Offload with a client optimizer unless zero_force_ds_cpu_optimizer is false (its
    # ZeRORuntimeException at initialize); the presets set it, and so does a user config that does not choose.
    config = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    strategy = DeepSpeedCPUStrategy(config=config, start_method="fork")
    assert strategy.config["zero_force_ds_cpu_optimizer"] is False and "zero_force_ds_cpu_optimizer" not in config
    chosen = DeepSpeedCPUStrategy(config={**config, "zero_force_ds_cpu_optimizer": True}, start_method="fork")
    assert chosen.config["zero_force_ds_cpu_optimizer"] is True  # the user's choice stays
    torch.manual_seed(0)
    model = TinyAdamModel()  # Adam: an optimizer DeepSpeed has tested with ZeRO (SGD also needs its "untested" key)
    before = [p.detach().clone() for p in model.parameters()]
    trainer = _trainer(tmp_path, strategy, "bf16-mixed", 3)
    trainer.fit(model)
    assert trainer.state.finished
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)), "nothing trained"

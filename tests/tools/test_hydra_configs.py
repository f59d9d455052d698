"""Every config group composes, validates against its schema and instantiates; bad input fails at composition."""

from __future__ import annotations

import re
from pathlib import Path

import hydra
import pytest
from _host import deepspeed_runs_fp16
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import ConfigCompositionException
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from lightning.pytorch.loggers import Logger
from lightning.pytorch.strategies import Strategy
from omegaconf import OmegaConf, open_dict

import lightning_syncasync.train as train_app

CONF = Path(train_app.__file__).parent / "conf"


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.fixture(autouse=True)
def hydra_ctx():
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="lightning_syncasync.conf", version_base="1.3"):
        yield
    GlobalHydra.instance().clear()


def _compose(*overrides: str):
    cfg = compose("train", overrides=list(overrides), return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)  # so ${hydra:runtime.output_dir} resolves
    return cfg


def _build(obj_cfg):
    return hydra.utils.instantiate(obj_cfg, _convert_="all")


def test_default_job_composes_and_instantiates(tmp_path):
    cfg = _compose(f"hydra.runtime.output_dir={tmp_path}")
    assert cfg.trainer.accelerator == "cpu" and cfg.trainer.devices == 2
    assert isinstance(_build(cfg.model), LightningModule)
    assert isinstance(_build(cfg.data), LightningDataModule)
    assert isinstance(_build(cfg.trainer.strategy), Strategy)
    assert all(isinstance(_build(c), Callback) for c in cfg.callbacks.values())
    assert all(isinstance(_build(c), Logger) for c in cfg.logger.values())


@pytest.mark.parametrize("strategy", _options("strategy"))
def test_every_strategy_config(strategy):
    cfg = _compose(f"strategy={strategy}", "trainer.devices=2")
    obj = _build(cfg.trainer.strategy)
    assert isinstance(obj, Strategy)
    trainer_cfg = OmegaConf.to_container(cfg.trainer, resolve=False)
    trainer_cfg.pop("default_root_dir")
    trainer_cfg["strategy"] = OmegaConf.to_container(cfg.strategy, resolve=True)
    if strategy == "deepspeed_fp16" and not deepspeed_runs_fp16():
        # fp16 needs CUDA or a CPU whose DeepSpeed accelerator reports fp16 kernels: elsewhere the Trainer refuses the
        # preset up front, naming the alternative. (Both answers are checked with a faked accelerator in
        # tests/strategies/test_deepspeed_cpu.py; here the machine's own answer decides.)
        with pytest.raises(Exception, match="fp16.*not supported.*bf16-mixed"):
            _build({**trainer_cfg, "logger": False})
        return
    trainer = _build({**trainer_cfg, "logger": False})
    assert isinstance(trainer, Trainer) and trainer.world_size == 2


def test_every_registered_name_is_a_strategy_config_with_the_same_class_and_settings():
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_syncasync.strategies import STRATEGIES

    for entry in STRATEGIES:
        cfg = _compose(f"strategy={entry.name}")
        assert cfg.trainer.strategy._target_ == entry.class_path, entry.name
        for key, value in StrategyRegistry[entry.name]["init_params"].items():
            assert cfg.trainer.strategy.get(key, "popen" if key == "start_method" else None) == value, (entry.name, key)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["strategy=hier_synk"], "strategy=hier_synk is not one of the strategy configs; HINT: did you mean "
                                 "strategy=hier_sync?"),
        (["-m", "strategy=ddp,asyc_ssp"], "did you mean strategy=async_ssp?"),
    ],
)  # fmt: skip
def test_a_misspelled_strategy_config_gets_a_suggestion(argv, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        train_app.check_group_choice(argv)
    train_app.check_group_choice(["strategy=hier_sync_virtual", "~strategy", "strategy=ddp,async_ssp"])  # all exist
    train_app.check_group_choice(["hydra.searchpath=[file://mine]", "strategy=my_own"])  # user configs: Hydra's call


def test_strategy_arguments_are_set_under_strategy():
    cfg = _compose("strategy=hier_sync", "strategy.max_delay=2", "strategy.node_size=2")
    assert cfg.trainer.strategy.max_delay == 2  # the Trainer sees what `strategy.` set
    obj = _build(cfg.trainer.strategy)
    assert (type(obj).__name__, obj.max_delay, obj.node_size) == ("HierSyncStrategy", 2, 2)
    with pytest.raises(ConfigCompositionException, match="max_delay"):
        _compose("strategy=hier_sync", "strategy.max_delay=soon")


@pytest.mark.parametrize("option", [o for o in _options("callbacks")])
def test_every_callbacks_config(option, tmp_path):
    cfg = _compose(f"callbacks={option}", f"hydra.runtime.output_dir={tmp_path}")
    for c in cfg.callbacks.values():
        assert isinstance(_build(c), Callback)


@pytest.mark.parametrize("option", _options("logger"))
def test_every_logger_config(option, tmp_path):
    cfg = _compose(f"logger={option}", f"hydra.runtime.output_dir={tmp_path}")
    for c in cfg.logger.values():
        assert isinstance(_build(c), Logger)


@pytest.mark.parametrize("option", _options("trainer"))
def test_every_trainer_config(option):
    cfg = _compose(f"trainer={option}")
    assert cfg.trainer._target_.endswith("Trainer")


@pytest.mark.parametrize(
    ("data", "model"), [("digits", "digits_mlp"), ("synthetic", "convnet"), ("text", "transformer_lm")]
)
def test_data_and_model_pairs(data, model):
    cfg = _compose(f"data={data}", f"model={model}")
    dm, m = _build(cfg.data), _build(cfg.model)
    assert isinstance(dm, LightningDataModule) and isinstance(m, LightningModule)


@pytest.mark.parametrize("experiment", _options("experiment"))
def test_every_experiment(experiment):
    cfg = _compose(f"experiment={experiment}")
    assert isinstance(_build(cfg.model), LightningModule)
    assert isinstance(_build(cfg.data), LightningDataModule)


def test_hparams_search_optuna_composes():
    cfg = _compose("hparams_search=optuna")
    assert cfg.hydra.sweeper.direction == "maximize"
    assert "model.lr" in cfg.hydra.sweeper.params


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("strategy.stalenes=3", "stalenes"),  # unknown key in a strategy
        ("model.hiden=64", "hiden"),  # unknown key in the model
        ("trainer.max_epochs=ten", "max_epochs"),  # wrong type
        ("data.batch_size=big", "batch_size"),  # wrong type
        ("strategy=hier_sink", "hier_sink"),  # unknown strategy name
        ("trainer.not_an_arg=1", "not_an_arg"),  # unknown Trainer argument
        ("callbacks.sync_monitor.smothing=0.5", "smothing"),  # unknown callback argument
    ],
)
def test_bad_input_fails_at_composition(override, match):
    with pytest.raises(ConfigCompositionException, match=match):
        _compose(override)


def test_forced_unknown_trainer_argument_fails_when_building_the_trainer():
    # `+key=value` tells Hydra to add a key on purpose; the Trainer then refuses it by name, still before training.
    cfg = _compose("+trainer.not_an_arg=1", "logger=none", "callbacks=none")
    with pytest.raises(Exception, match="not_an_arg"):
        _build(cfg.trainer)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["trainer.devices=0"], "trainer.devices"),
        (["trainer.devices=-4"], "trainer.devices"),
        (["trainer.devices=100000"], "trainer.devices"),
        (["trainer.num_nodes=0"], "trainer.num_nodes"),
        (["~strategy", "trainer.strategy=no_such_strategy"], "no_such_strategy"),
    ],
)
def test_impossible_settings_fail_before_training(overrides, match):
    cfg = _compose(*overrides)
    with pytest.raises(ValueError, match=match):
        train_app.validate_config(cfg)


def test_validate_config_accepts_the_defaults():
    cfg = _compose()
    train_app.validate_config(cfg)
    with open_dict(cfg):
        cfg.trainer.strategy = "ddp_spawn"
    train_app.validate_config(cfg)

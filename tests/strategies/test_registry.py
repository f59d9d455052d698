from __future__ import annotations

import importlib

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

import lightning_syncasync
from lightning_syncasync.strategies import STRATEGIES, StrategyEntry, register_strategies


class _ProbeStrategy(DDPStrategy):
    """A stand-in for a package strategy, registered through the same table mechanism."""


_ENTRIES = [
    StrategyEntry("syncasync_probe", f"{__name__}._ProbeStrategy", "probe"),
    StrategyEntry("syncasync_probe_spawn", f"{__name__}._ProbeStrategy", "probe (spawn)", {"start_method": "spawn"}),
]


@pytest.fixture
def clean_registry():
    yield
    for e in _ENTRIES:
        StrategyRegistry.remove(e.name) if e.name in StrategyRegistry else None


def test_import_registers_every_package_strategy_idempotently():
    importlib.reload(lightning_syncasync)  # a second import must not raise on duplicates
    for entry in STRATEGIES:
        assert entry.name in StrategyRegistry
        assert StrategyRegistry[entry.name]["init_params"] == entry.init_params
    assert register_strategies() == [e.name for e in STRATEGIES]


def test_registered_names_build_the_strategy_with_their_init_params(clean_registry):
    assert register_strategies(entries=_ENTRIES) == ["syncasync_probe", "syncasync_probe_spawn"]
    assert register_strategies(entries=_ENTRIES) == ["syncasync_probe", "syncasync_probe_spawn"]  # idempotent
    trainer = Trainer(strategy="syncasync_probe_spawn", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, _ProbeStrategy)
    assert trainer.strategy._start_method == "spawn"
    assert Trainer(strategy="syncasync_probe", accelerator="cpu", devices=2, logger=False).strategy._start_method == (
        "popen"
    )


def test_a_name_owned_by_someone_else_is_an_error(clean_registry):
    StrategyRegistry.register("syncasync_probe", DDPStrategy, description="someone else's")
    with pytest.raises(ValueError, match="already registered.*HINT"):
        register_strategies(entries=_ENTRIES[:1])


def test_unknown_strategy_name_fails_before_training():
    with pytest.raises(ValueError, match="hier_sink"):
        Trainer(strategy="hier_sink", accelerator="cpu", devices=1, logger=False)

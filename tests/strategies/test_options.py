"""The strategies' constructors after issue 67: a handful of settings, the expert ones behind one options object that
keeps working as keywords, from Hydra and from the Lightning CLI, and ``batches=`` in place of the two settings it
merged."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import yaml
from _commands import run_cli
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate
from lightning.pytorch.strategies import StrategyRegistry

from lightning_syncasync.configs import register_configs
from lightning_syncasync.strategies import (
    AsyncSSPStrategy,
    AutoSyncStrategy,
    HierSyncStrategy,
    ShardedAsyncSSPStrategy,
    ShardedHierSyncStrategy,
    pack_strategy_names,
)
from lightning_syncasync.strategies.options import (
    AsyncSSPOptions,
    AutoSyncOptions,
    FaultTolerantOptions,
    HierSyncOptions,
)

# A value away from each field's default, for every options class.
CHANGED = {
    "outer": "nesterov",
    "outer_lr": 0.5,
    "outer_momentum": 0.8,
    "outer_momentum_every": 3,
    "dynamic_local_steps": False,
    "round_s": None,  # needs dynamic rounds: checked on its own below
    "compensation": "dc_asgd",
    "lam": 0.5,
    "compression_options": {},  # needs a codec: checked on its own below
    "peer_timeout_s": 30.0,
    "round_interval_s": 0.01,
    "exchange_every": 2,
    "timeout_s": 5.0,
    "quorum_timeout_s": 60.0,
    "connect_timeout_s": 3.0,
}
SHARDED_ROUNDS_ONLY = ("compensation", "lam", "round_interval_s", "exchange_every")
FAMILIES = [
    (HierSyncStrategy, HierSyncOptions, ()),
    (ShardedHierSyncStrategy, HierSyncOptions, ()),
    (AsyncSSPStrategy, AsyncSSPOptions, ()),
    (ShardedAsyncSSPStrategy, AsyncSSPOptions, SHARDED_ROUNDS_ONLY),
    (AutoSyncStrategy, AutoSyncOptions, ()),
]


def test_every_registered_strategy_has_a_handful_of_settings():
    """Issue 67's target: at most 10 settings besides ``**kwargs`` and one options object."""
    for name in pack_strategy_names():
        cls = StrategyRegistry[name]["strategy"]
        params = inspect.signature(cls.__init__).parameters
        settings = [p for p, v in params.items() if p not in ("self", "options") and v.kind is not v.VAR_KEYWORD]
        assert len(settings) <= 10, (name, settings)


@pytest.mark.parametrize(("cls", "options_cls", "refused"), FAMILIES, ids=lambda x: getattr(x, "__name__", ""))
def test_each_option_works_as_a_keyword_and_in_options(cls, options_cls, refused):
    """The spelling before the options object still works and means the same as ``options=``."""
    for f in dataclasses.fields(options_cls):
        value = CHANGED[f.name]
        if f.name in refused or f.name in ("round_s", "compression_options"):
            continue
        by_keyword = cls(**{f.name: value})
        by_object = cls(options=options_cls(**{f.name: value}))
        by_dict = cls(options={f.name: value})
        for strategy in (by_keyword, by_object, by_dict):
            assert getattr(strategy.options, f.name) == value, (cls.__name__, f.name)
            if hasattr(strategy, f.name):  # what the strategy reads at setup
                assert getattr(strategy, f.name) == value, (cls.__name__, f.name)
    for name in refused:
        with pytest.raises(ValueError, match=f"does not use options \\['{name}'\\]"):
            cls(**{name: CHANGED[name]})


def test_round_s_and_compression_options_reach_the_strategy():
    s = AsyncSSPStrategy(compression="int8", options={"round_s": 0.5, "compression_options": {"chunk_size": 64}})
    assert (s.round_s, s.compression_options) == (0.5, {"chunk_size": 64})
    h = HierSyncStrategy(compression="int8", compression_options={"chunk_size": 64})
    assert h.compression_options == {"chunk_size": 64} and h.options.compression_options == {"chunk_size": 64}


def test_fault_tolerant_options():
    pytest.importorskip("torchft")
    from lightning_syncasync.strategies import FaultTolerantStrategy

    for f in dataclasses.fields(FaultTolerantOptions):
        value = CHANGED[f.name]
        assert getattr(FaultTolerantStrategy(**{f.name: value}), f.name) == value
        assert getattr(FaultTolerantStrategy(options={f.name: value}), f.name) == value


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ({}, "auto"),
        ({"claim_batches": True}, "claim"),
        ({"claim_batches": True, "adaptive_batch": False}, "claim"),
        ({"claim_batches": False, "adaptive_batch": True}, "rebalance"),
        ({"claim_batches": False, "adaptive_batch": False}, "even"),
    ],
)
def test_batches_is_the_two_settings_it_replaced(old, new):
    """Each old pair decides the same as its ``batches=`` mode (what setup reads: claim_batches, adaptive_batch),
    so the old spelling keeps working."""
    by_old, by_new = AsyncSSPStrategy(**old), AsyncSSPStrategy(batches=new)
    decide = lambda s: (bool(s.claim_batches), s.claim_batches is None, bool(s.adaptive_batch))  # noqa: E731
    assert decide(by_old) == decide(by_new)


def test_options_from_hydra():
    register_configs()  # the schemas (the train app does this at import)
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="lightning_syncasync.conf", version_base="1.3"):
        cfg = compose(
            "train",
            overrides=["strategy=async_ssp", "strategy.batches=rebalance", "strategy.options.outer=nesterov",
                       "+strategy.options.compression_options.chunk_size=64", "strategy.compression=int8"],
        )  # fmt: skip
        with pytest.raises(Exception, match="outr"):
            compose("train", overrides=["strategy=async_ssp", "strategy.options.outr=nesterov"])
    GlobalHydra.instance().clear()
    strategy = instantiate(cfg.strategy, _convert_="all")
    assert isinstance(strategy, AsyncSSPStrategy)
    assert (strategy.outer, strategy.adaptive_batch, strategy.claim_batches) == ("nesterov", True, False)
    assert strategy.compression_options == {"chunk_size": 64}


def test_options_from_the_lightning_cli():
    out = run_cli(
        "fit", "--trainer.strategy=lightning_syncasync.strategies.HierSyncStrategy",
        "--trainer.strategy.options.outer=nesterov", "--trainer.strategy.options.outer_lr=0.7", "--print_config",
    )  # fmt: skip
    args = yaml.safe_load(out)["trainer"]["strategy"]["init_args"]
    assert args["options"]["outer"] == "nesterov" and args["options"]["outer_lr"] == 0.7


def test_the_options_are_checked_to_agree_across_ranks():
    """Every rank compares its settings at setup (WatchedStrategy.consistent_settings): the options too, as the same
    settings were when they were keywords."""
    settings = AsyncSSPStrategy(local_steps=4, outer="nesterov").consistent_settings()
    assert settings["local_steps"] == 4 and settings["options.outer"] == "nesterov"
    assert settings["options.peer_timeout_s"] == 60.0
    assert settings["batches"] != AsyncSSPStrategy(batches="claim").consistent_settings()["batches"]

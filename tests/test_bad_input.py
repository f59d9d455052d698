"""Invalid configurations, one row each: rejected before training, naming the setting and the fix.

``CASES`` is the table. Every row is a test, and ``docs/bad_input.md`` is rendered from the rows with the messages the
code actually raised: ``SYNCASYNC_WRITE_DOCS=1 python -m pytest tests/test_bad_input.py`` rewrites it, and a plain run
fails when it is out of date. Everything runs in this process, without starting training processes: a check that
only fires once ranks run is not in the table.
"""

from __future__ import annotations

import functools
import os
import re
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from _commands import CommandFailed, run_cli, run_main
from _host import deepspeed_cpu_fp16
from _models import ManualTwoOptimizersModel, TinyModel
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import ConfigCompositionException, InstantiationException
from lightning.pytorch import Trainer
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from torch.utils.data import DataLoader, IterableDataset

import lightning_syncasync.train as train_app
from lightning_syncasync.advise.__main__ import main as advise_main
from lightning_syncasync.algorithms.averaging.ft_host import advertised_host, choose_host
from lightning_syncasync.algorithms.batching.balancer import BatchBalancer
from lightning_syncasync.algorithms.compression.compressor import Compressor
from lightning_syncasync.algorithms.compression.summable import check_groups
from lightning_syncasync.algorithms.costmodel import ScalingModel
from lightning_syncasync.algorithms.ssp.claim_sampler import ClaimingBatchSampler
from lightning_syncasync.algorithms.ssp.compensation import StaleGradientCompensation
from lightning_syncasync.bench.__main__ import main as bench_main
from lightning_syncasync.callbacks import AdaptiveBatchSize, StragglerEmulator, SyncMonitor, SyncSwitcher
from lightning_syncasync.emulate import network as network_mod
from lightning_syncasync.emulate.__main__ import main as emulate_main
from lightning_syncasync.strategies import check_strategy_name
from lightning_syncasync.strategies.async_ssp import AsyncSSPStrategy
from lightning_syncasync.strategies.async_ssp_sharded import ShardedAsyncSSPStrategy
from lightning_syncasync.strategies.auto_sync import AutoSyncStrategy
from lightning_syncasync.strategies.deepspeed_cpu import DeepSpeedCPUStrategy
from lightning_syncasync.strategies.fault_tolerant import FaultTolerantStrategy, check_reachable
from lightning_syncasync.strategies.hier_sync import HierSyncStrategy
from lightning_syncasync.strategies.hier_sync_sharded import ShardedHierSyncStrategy
from lightning_syncasync.strategies.measured_ddp import MeasuredDDPStrategy
from lightning_syncasync.strategies.options import HierSyncOptions

DOCS = Path(__file__).resolve().parents[1] / "docs" / "bad_input.md"
ENV_WRITE_DOCS = "SYNCASYNC_WRITE_DOCS"
MESSAGE_CHARS = 120

# When a setting is rejected (the "When rejected" column).
CONSTRUCTION = "construction"
CALL = "call, before any communication"
COMPOSITION = "config composition"
VALIDATION = "config validation"
PARSING = "argument parsing"
TRAINER = "Trainer(...)"
SETUP = "setup on every rank"
LAUNCH = "before anything starts"


@dataclass(frozen=True)
class Case:
    """One invalid configuration.

    Attributes:
        slug: the test id.
        surface: where the user sets it (a strategy, callback, algorithm or tool).
        setting: the setting as the user writes it.
        attempt: does what the user's setting does, up to the point where it must be rejected.
        error: the exception type expected.
        name: regex the message must contain: the setting's name.
        fix: regex the message must contain: the fix (the ``HINT:`` or an equivalent instruction).
        when: when it is rejected (one of the constants above).
    """

    slug: str
    surface: str
    setting: str
    attempt: Callable[[], object]
    error: type[BaseException]
    name: str
    fix: str
    when: str = CONSTRUCTION


class TrainingStarted(AssertionError):
    """Raised instead of the first training batch: the setting was not rejected in time."""


# -- how a user reaches each surface ----------------------------------------------------------------------------------


def _emulate(*argv: str) -> Callable[[], None]:
    return lambda: run_main(emulate_main, ["--nodes", "2", "--procs-per-node", "2", *argv])


def _emulate_without_root() -> None:
    # As a user without root on a machine with iproute2 (this one may be either).
    with (
        tempfile.TemporaryDirectory() as logs,
        mock.patch.object(network_mod.os, "geteuid", return_value=1000),
        mock.patch.object(network_mod.shutil, "which", return_value="/usr/sbin/ip"),
    ):
        argv = ["--nodes", "2", "--procs-per-node", "1", "--link-mbit", "100", "--no-cgroups", "--log-dir", logs]
        run_main(emulate_main, [*argv, "--", "true"])


def _without_torchft() -> None:
    # As on a machine where the ft extra is not installed.
    with mock.patch.dict("sys.modules", {"torchft": None}):
        Trainer(strategy="hier_sync_ft", accelerator="cpu", devices=1, logger=False)


def _ft_host_loopback() -> None:
    # advertised_host on this machine as torchft's manager would call it (the route lookup sends no packet).
    with mock.patch.dict(os.environ, {"SYNCASYNC_FT_HOST": "127.0.0.1"}):
        advertised_host("http://192.0.2.10:29510")


def _ft_spanning_nodes() -> None:
    trainer = Trainer(strategy="hier_sync_ft", accelerator="cpu", devices=1, num_nodes=2, logger=False)
    trainer.strategy.setup_environment()  # what fit() does first on every rank


def _advise(*argv: str) -> Callable[[], None]:
    return lambda: run_main(advise_main, list(argv))


def _bench(*argv: str) -> Callable[[], None]:
    def attempt() -> None:
        with tempfile.TemporaryDirectory() as out:
            run_main(bench_main, [*argv, "--out", out])

    return attempt


def _lightning_cli(*args: str) -> Callable[[], None]:
    """``syncasync-cli fit ARGS`` up to the Trainer (``run=False`` parses and instantiates, as ``fit`` does first)."""
    base = ["--trainer.logger=false", "--trainer.enable_checkpointing=false"]

    return lambda: run_cli(*base, *args, run=False)


def _train_app(*overrides: str) -> Callable[[], None]:
    """``syncasync-train OVERRIDES`` up to ``trainer.fit``: compose, validate and build what ``train.run`` builds."""

    def attempt() -> None:
        GlobalHydra.instance().clear()
        try:
            with (
                tempfile.TemporaryDirectory() as out,
                initialize_config_module(config_module="lightning_syncasync.conf", version_base="1.3"),
            ):
                cfg = compose(
                    "train", overrides=[*overrides, f"hydra.runtime.output_dir={out}"], return_hydra_config=True
                )
                HydraConfig.instance().set_config(cfg)  # ${hydra:runtime.output_dir} resolves as in the app
                train_app.validate_config(cfg)
                train_app._instantiate(cfg.data)
                train_app._instantiate(cfg.model)
                callbacks = train_app._instantiate_dict(cfg.callbacks)
                train_app._instantiate(cfg.trainer, callbacks=callbacks, logger=False)
        finally:
            GlobalHydra.instance().clear()

    return attempt


def _fit(*callbacks: Any, model: Any = None, **trainer_kwargs: Any) -> Callable[[], None]:
    """A single-process ``Trainer.fit`` (a check that fires in ``setup``/``on_fit_start`` fires there on every rank)."""

    def attempt() -> None:
        trainer = Trainer(
            accelerator="cpu", devices=1, max_steps=1, logger=False, callbacks=list(callbacks),
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **trainer_kwargs,
        )  # fmt: skip
        trainer.fit(model if model is not None else TinyModel())

    return attempt


def _fit_with_step_checkpoints() -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(
            accelerator="cpu", devices=1, max_steps=1, logger=False, default_root_dir=tmp,
            strategy=AsyncSSPStrategy(batches="claim"), callbacks=[ModelCheckpoint(every_n_train_steps=5)],
            enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        trainer.fit(TinyModel())


class _SelfSharded(TinyModel):
    """A module that shards itself with FSDP2 whatever the strategy (fully_shard with its default mesh, every rank)."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        fully_shard(self)


class _Stream(IterableDataset):
    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        for _ in range(64):
            x = torch.randn(8, generator=g)
            yield x, int(x[0] > 0)


class _StreamModel(TinyModel):
    def train_dataloader(self):
        return DataLoader(_Stream(), batch_size=16)


def _without_fp16(attempt: Callable[[], None]) -> Callable[[], None]:
    """``attempt`` on a CPU whose DeepSpeed accelerator lacks fp16 (faked: some CPUs have the kernels, some not)."""

    def run() -> None:
        with deepspeed_cpu_fp16(supported=False):
            attempt()

    return run


def _scaling_model(**kwargs: Any) -> Callable[[], None]:
    return lambda: ScalingModel(compute_s_per_sample=0.002, batch_size=32, grad_bytes=4e6, **kwargs)


# -- the table ---------------------------------------------------------------------------------------------------------


class _StalenessPerRank(AsyncSSPStrategy):
    """A node started with its own ``staleness`` (2 on rank 0, 3 on rank 1): a cross-rank mismatch."""

    def setup_distributed(self):
        self.staleness = 2 + self.local_rank
        try:
            super().setup_distributed()
        except ValueError:
            if self.local_rank:  # both ranks raise; rank 0's is the one reported, so the docs table is stable
                time.sleep(1.0)
            raise


def _mismatched_staleness_fit() -> None:
    from _models import TinyModel
    from lightning.pytorch import Trainer

    trainer = Trainer(accelerator="cpu", devices=2, strategy=_StalenessPerRank(start_method="fork"), max_steps=2,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False)  # fmt: skip
    trainer.fit(TinyModel())


CASES: list[Case] = [
    # strategy hier_sync
    Case("strategy-name", "strategy names", "check_strategy_name('ddp_measure')",
         lambda: check_strategy_name("ddp_measure"), ValueError, r"strategy='ddp_measure'",
         r"HINT: did you mean 'ddp_measured'\?", CALL),
    Case("hier-virtual-nodes", "strategy hier_sync", "HierSyncStrategy(virtual_nodes=0)",
         lambda: HierSyncStrategy(virtual_nodes=0), ValueError, r"virtual_nodes must be an integer >= 1",
         r"HINT: 2 splits each node's ranks"),
    Case("hier-virtual-and-node-size", "strategy hier_sync", "HierSyncStrategy(node_size=2, virtual_nodes=2)",
         lambda: HierSyncStrategy(node_size=2, virtual_nodes=2), ValueError,
         r"node_size=2 and virtual_nodes=2 both", r"HINT: give one of them"),
    Case("hier-inter-period", "strategy hier_sync", "HierSyncStrategy(inter_period=0)",
         lambda: HierSyncStrategy(inter_period=0), ValueError, r"inter_period",
         r"HINT: None \(the default\) decides it"),
    Case("hier-max-delay", "strategy hier_sync", "HierSyncStrategy(max_delay=-1)",
         lambda: HierSyncStrategy(max_delay=-1), ValueError, r"max_delay",
         r"HINT: None \(the default\) takes the shortest delay"),
    Case("hier-outer", "strategy hier_sync", "HierSyncStrategy(outer='momentum')",
         lambda: HierSyncStrategy(outer="momentum"), ValueError, r"outer must", r"HINT: 'average'"),
    Case("hier-outer-momentum", "strategy hier_sync", "HierSyncStrategy(outer='nesterov', outer_momentum=1.0)",
         lambda: HierSyncStrategy(outer="nesterov", outer_momentum=1.0), ValueError, r"outer_momentum",
         r"HINT: DiLoCo uses 0.9"),
    Case("hier-warmup-steps", "strategy hier_sync", "HierSyncStrategy(warmup_steps=-1)",
         lambda: HierSyncStrategy(warmup_steps=-1), ValueError, r"warmup_steps", r"HINT: 0 starts hierarchical"),
    Case("hier-peer-timeout", "strategy hier_sync", "HierSyncStrategy(peer_timeout_s=0)",
         lambda: HierSyncStrategy(peer_timeout_s=0), ValueError, r"peer_timeout_s", r"HINT: 60"),
    Case("hier-comm-hook", "strategy hier_sync", "HierSyncStrategy(model_averaging_period=4)",
         lambda: HierSyncStrategy(model_averaging_period=4), ValueError, r"model_averaging_period",
         r"drop ddp_comm_hook/model_averaging_period"),
    Case("hier-typo-kwarg", "strategy hier_sync", "HierSyncStrategy(inter_perod=4)",
         lambda: HierSyncStrategy(inter_perod=4), ValueError, r"inter_perod is not a setting of hier_sync",
         r"HINT: did you mean inter_period\?"),
    Case("hier-compression-option-key", "strategy hier_sync",
         "HierSyncStrategy(compression='int8', compression_options={'chunk': 64})",
         lambda: HierSyncStrategy(compression="int8", compression_options={"chunk": 64}), ValueError,
         r"compression_options has unknown key", r"HINT: use some of .*chunk_size"),
    Case("hier-compression-option-seed", "strategy hier_sync",
         "HierSyncStrategy(compression='int8', compression_options={'seed': 1})",
         lambda: HierSyncStrategy(compression="int8", compression_options={"seed": 1}), ValueError,
         r"compression_options\['seed'\]", r"HINT: drop it"),
    Case("hier-options-without-compression", "strategy hier_sync",
         "HierSyncStrategy(compression_options={'chunk_size': 64})",
         lambda: HierSyncStrategy(compression_options={"chunk_size": 64}), ValueError,
         r"compression_options=.* given with compression='none'", r"HINT: set compression"),
    # strategy hier_sync_sharded
    Case("sharded-one-rank-per-node", "strategy hier_sync_sharded", "ShardedHierSyncStrategy(node_size=1)",
         lambda: ShardedHierSyncStrategy(node_size=1), ValueError, r"node_size=1 leaves one rank per node",
         r"HINT: use hier_sync \(replicas\)"),
    Case("sharded-start-method", "strategy hier_sync_sharded", "ShardedHierSyncStrategy(start_method='thread')",
         lambda: ShardedHierSyncStrategy(start_method="thread"), ValueError, r"start_method must be one of",
         r"HINT: 'fork'"),
    Case("sharded-hsdp-compression", "strategy hier_sync_sharded",
         "ShardedHierSyncStrategy(hsdp=True, compression='int8')",
         lambda: ShardedHierSyncStrategy(hsdp=True, compression="int8"), ValueError,
         r"compression='int8' with hsdp=True", r"HINT: drop hsdp"),
    Case("sharded-inter-period", "strategy hier_sync_sharded", "ShardedHierSyncStrategy(inter_period=0)",
         lambda: ShardedHierSyncStrategy(inter_period=0), ValueError, r"inter_period",
         r"HINT: None \(the default\) decides it"),
    Case("hier-max-delay-bool", "strategy hier_sync", "HierSyncStrategy(max_delay=True)",
         lambda: HierSyncStrategy(max_delay=True), ValueError, r"max_delay must be an integer >= 0 or None",
         r"HINT: None \(the default\) takes the shortest delay"),
    # strategy async_ssp
    Case("ssp-staleness", "strategy async_ssp", "AsyncSSPStrategy(staleness=-1)",
         lambda: AsyncSSPStrategy(staleness=-1), ValueError, r"staleness", r"HINT: 0 is synchronous"),
    Case("ssp-local-steps", "strategy async_ssp", "AsyncSSPStrategy(local_steps=0)",
         lambda: AsyncSSPStrategy(local_steps=0), ValueError, r"local_steps must be an integer >= 1",
         r"HINT: None \(the default\) decides the round length"),
    Case("ssp-rounds-asp", "strategy async_ssp", "AsyncSSPStrategy(staleness=None) (rounds need a bound)",
         lambda: AsyncSSPStrategy(staleness=None), ValueError, r"staleness must be an integer >= 0 with local_steps",
         r"HINT: 0 is synchronous rounds"),
    Case("ssp-outer", "strategy async_ssp", "AsyncSSPStrategy(outer='adam')",
         lambda: AsyncSSPStrategy(outer="adam"), ValueError, r"outer must be one of", r"HINT: 'average' is plain"),
    Case("ssp-outer-lr", "strategy async_ssp", "AsyncSSPStrategy(outer_lr=0)",
         lambda: AsyncSSPStrategy(outer_lr=0.0), ValueError, r"outer_lr must be > 0", r"HINT: 0.7 \(DiLoCo.s\)"),
    Case("ssp-outer-momentum", "strategy async_ssp", "AsyncSSPStrategy(outer_momentum=1.0)",
         lambda: AsyncSSPStrategy(outer_momentum=1.0), ValueError, r"outer_momentum must be in \[0, 1\)",
         r"HINT: DiLoCo uses 0.9"),
    Case("ssp-outer-momentum-every", "strategy async_ssp", "AsyncSSPStrategy(outer_momentum_every=0)",
         lambda: AsyncSSPStrategy(outer_momentum_every=0), ValueError, r"outer_momentum_every must be",
         r"HINT: delayed_nesterov updates its momentum"),
    Case("ssp-round-s", "strategy async_ssp", "AsyncSSPStrategy(round_s=0)",
         lambda: AsyncSSPStrategy(round_s=0.0), ValueError, r"round_s must be > 0", r"HINT: leave it None"),
    Case("ssp-warmup", "strategy async_ssp", "AsyncSSPStrategy(warmup_steps=-1)",
         lambda: AsyncSSPStrategy(warmup_steps=-1), ValueError, r"warmup_steps must be an integer >= 0",
         r"HINT: 0 \(the default\) starts the rounds"),
    Case("ssp-warmup-per-step", "strategy async_ssp", "AsyncSSPStrategy(warmup_steps=4, local_steps=1)",
         lambda: AsyncSSPStrategy(warmup_steps=4, local_steps=1), ValueError, r"warmup_steps=4 is a synchronous start",
         r"HINT: local_steps > 1"),
    Case("claim-lockstep", "algorithm ClaimingBatchSampler", "ClaimingBatchSampler(lockstep=-1)",
         lambda: ClaimingBatchSampler(100, 10, 0, 2, None, lockstep=-1), ValueError, r"lockstep must be",
         r"HINT: 0 claims"),
    Case("ssp-lam", "strategy async_ssp", "AsyncSSPStrategy(lam=-0.5)",
         lambda: AsyncSSPStrategy(lam=-0.5), ValueError, r"lam must", r"HINT: 0 turns DC-ASGD off"),
    Case("ssp-exchange-every", "strategy async_ssp", "AsyncSSPStrategy(exchange_every=0)",
         lambda: AsyncSSPStrategy(exchange_every=0), ValueError, r"exchange_every", r"HINT: 1 exchanges every step"),
    Case("ssp-typo-kwarg", "strategy async_ssp", "AsyncSSPStrategy(stalenes=3)",
         lambda: AsyncSSPStrategy(stalenes=3), ValueError, r"stalenes is not a setting of async_ssp",
         r"HINT: did you mean staleness\?"),
    Case("ssp-ddp-kwarg", "strategy async_ssp", "AsyncSSPStrategy(find_unused_parameters=True)",
         lambda: AsyncSSPStrategy(find_unused_parameters=True), ValueError,
         r"find_unused_parameters is not a setting of async_ssp \(it does not wrap the model in torch DDP\)",
         r"HINT: its settings are"),
    Case("ssp-staleness-differs-across-ranks", "strategy async_ssp",
         "staleness=2 on one node, staleness=3 on another", _mismatched_staleness_fit, Exception,
         r"staleness=.* different on ranks", r"HINT: every node must start with the same configuration", SETUP),
    Case("ssp-claim-val-interval", "strategy async_ssp",
         "AsyncSSPStrategy(batches='claim') with Trainer(val_check_interval=2)",
         _fit(strategy=AsyncSSPStrategy(batches="claim"), val_check_interval=2), ValueError,
         r"val_check_interval=2", r"HINT: use check_val_every_n_epoch", SETUP),
    Case("ssp-claim-with-adaptive-batch", "strategy async_ssp",
         "AsyncSSPStrategy(batches='claim') with an AdaptiveBatchSize callback",
         _fit(AdaptiveBatchSize(), strategy=AsyncSSPStrategy(batches="claim")), ValueError,
         r"both replace the training loader's sampler", r"HINT: drop one of them", SETUP),
    Case("ssp-adaptive-batch-and-claims", "strategy async_ssp",
         "AsyncSSPStrategy(adaptive_batch=True, claim_batches=True)",
         lambda: AsyncSSPStrategy(adaptive_batch=True, claim_batches=True), ValueError,
         r"both replace the training loader's sampler", r"HINT: batches='rebalance' to rebalance"),
    # batches= replaced claim_batches and adaptive_batch (issue 67): the old keywords alone still work
    # (tests/strategies/test_options.py), with the new one they are refused.
    Case("ssp-batches-and-old-keyword", "strategy async_ssp", "AsyncSSPStrategy(batches='even', claim_batches=True)",
         lambda: AsyncSSPStrategy(batches="even", claim_batches=True), ValueError,
         r"batches= replaced claim_batches and adaptive_batch", r"HINT: batches= alone"),
    Case("ssp-batches-unknown", "strategy async_ssp", "AsyncSSPStrategy(batches='shared')",
         lambda: AsyncSSPStrategy(batches="shared"), ValueError, r"batches='shared'",
         r"HINT: one of \['auto', 'claim', 'rebalance', 'even'\]"),
    Case("ssp-options-unknown", "strategy async_ssp", "AsyncSSPStrategy(options={'outr': 'nesterov'})",
         lambda: AsyncSSPStrategy(options={"outr": "nesterov"}), ValueError, r"unknown setting\(s\) \['outr'\]",
         r"HINT: AsyncSSPOptions takes \['outer'"),
    Case("ssp-options-twice", "strategy async_ssp", "AsyncSSPStrategy(outer='average', options={'outer': 'nesterov'})",
         lambda: AsyncSSPStrategy(outer="average", options={"outer": "nesterov"}), ValueError,
         r"\['outer'\] given both as keyword", r"HINT: set each once"),
    Case("ssp-options-type", "strategy async_ssp", "AsyncSSPStrategy(options=HierSyncOptions())",
         lambda: AsyncSSPStrategy(options=HierSyncOptions()), TypeError, r"expected a AsyncSSPOptions",
         r"HINT: options=AsyncSSPOptions\(...\)"),
    Case("ssp-option-typo", "strategy async_ssp", "AsyncSSPStrategy(outr='nesterov')",
         lambda: AsyncSSPStrategy(outr="nesterov"), ValueError, r"outr is not a setting of async_ssp",
         r"HINT: did you mean outer\?"),
    Case("sharded-per-step-option", "strategy async_ssp_sharded", "ShardedAsyncSSPStrategy(lam=2.0)",
         lambda: ShardedAsyncSSPStrategy(lam=2.0), ValueError, r"does not use options \['lam'\]",
         r"HINT: leave them at their defaults"),
    Case("sharded-typo", "strategy hier_sync_sharded", "ShardedHierSyncStrategy(inter_perod=2)",
         lambda: ShardedHierSyncStrategy(inter_perod=2), ValueError, r"inter_perod is not a setting",
         r"HINT: did you mean inter_period\?"),
    Case("ssp-claim-step-checkpoints", "strategy async_ssp",
         "AsyncSSPStrategy(batches='claim') with ModelCheckpoint(every_n_train_steps=5)",
         _fit_with_step_checkpoints, ValueError, r"every_n_train_steps", r"HINT: checkpoint every_n_epochs", SETUP),
    Case("ssp-two-optimizers", "strategy async_ssp", "AsyncSSPStrategy() with two optimizers",
         _fit(strategy=AsyncSSPStrategy(), model=ManualTwoOptimizersModel()), ValueError,
         r"exactly one optimizer", r"HINT: return one optimizer", SETUP),
    Case("ssp-sharded-model", "strategy async_ssp", "AsyncSSPStrategy() with a model sharded in configure_model",
         _fit(strategy=AsyncSSPStrategy(), model=_SelfSharded()), ValueError,
         r"async_ssp keeps a whole replica of the model on every rank", r"HINT: use hier_sync_sharded or "
         r"async_ssp_sharded", SETUP),
    # strategy async_ssp_sharded
    Case("ssp-sharded-per-step", "strategy async_ssp_sharded", "ShardedAsyncSSPStrategy(local_steps=1)",
         lambda: ShardedAsyncSSPStrategy(local_steps=1), ValueError, r"local_steps=1 is async_ssp's per-step mode",
         r"HINT: local_steps=2 or more"),
    Case("ssp-sharded-one-rank-per-node", "strategy async_ssp_sharded", "ShardedAsyncSSPStrategy(node_size=1)",
         lambda: ShardedAsyncSSPStrategy(node_size=1), ValueError, r"node_size=1 leaves one rank per node",
         r"HINT: use hier_sync \(replicas\)"),
    Case("ssp-sharded-outer", "strategy async_ssp_sharded", "ShardedAsyncSSPStrategy(outer='adam')",
         lambda: ShardedAsyncSSPStrategy(outer="adam"), ValueError, r"outer must be one of", r"HINT"),
    Case("claim-batch-size", "algorithm ClaimingBatchSampler", "ClaimingBatchSampler(batch_size=0)",
         lambda: ClaimingBatchSampler(100, 0, 0, 2, None), ValueError, r"batch_size must", r"HINT: the DataLoader"),
    Case("claim-too-few-batches", "algorithm ClaimingBatchSampler", "4 ranks, 3 batches per epoch",
         lambda: ClaimingBatchSampler(30, 10, 0, 4, None), ValueError, r"at least one batch per epoch",
         r"HINT: lower the batch size"),
    # strategy auto_sync
    Case("auto-staleness", "strategy auto_sync", "AutoSyncStrategy(staleness=-2)",
         lambda: AutoSyncStrategy(staleness=-2), ValueError, r"staleness", r"HINT: 0 is synchronous"),
    Case("auto-inter-period", "strategy auto_sync", "AutoSyncStrategy(inter_period=0)",
         lambda: AutoSyncStrategy(inter_period=0), ValueError, r"inter_period",
         r"HINT: None \(the default\) decides it"),
    Case("auto-comm-hook", "strategy auto_sync", "AutoSyncStrategy(ddp_comm_hook=fp16_compress_hook)",
         lambda: AutoSyncStrategy(ddp_comm_hook=_fp16_hook()), ValueError, r"ddp_comm_hook",
         r"drop ddp_comm_hook"),
    # strategy ddp_measured (and compressed DDP)
    Case("measured-compression-local-sgd", "strategy ddp_measured",
         "MeasuredDDPStrategy(local_sgd='post_local_sgd', compression='int8')",
         lambda: MeasuredDDPStrategy(local_sgd="post_local_sgd", compression="int8"), ValueError,
         r"compression='int8'", r"HINT: use hier_sync with compression"),
    Case("measured-local-sgd-hook", "strategy ddp_measured",
         "MeasuredDDPStrategy(local_sgd='hierarchical', model_averaging_period=4)",
         lambda: MeasuredDDPStrategy(local_sgd="hierarchical", model_averaging_period=4), ValueError,
         r"model_averaging_period", r"set local_sgd=None"),
    Case("measured-compression-name", "strategy ddp_measured", "MeasuredDDPStrategy(compression='zip')",
         lambda: MeasuredDDPStrategy(compression="zip"), ValueError, r"compression must", r"HINT: 'int8'"),
    Case("measured-compression-warmup-negative", "strategy ddp_measured",
         "MeasuredDDPStrategy(compression='sign', compression_warmup_steps=-1)",
         lambda: MeasuredDDPStrategy(compression="sign", compression_warmup_steps=-1), ValueError,
         r"compression_warmup_steps must be an integer >= 0", r"HINT: 0 compresses from the first step"),
    Case("measured-compression-warmup-without-compression", "strategy ddp_measured",
         "MeasuredDDPStrategy(compression_warmup_steps=10)",
         lambda: MeasuredDDPStrategy(compression_warmup_steps=10), ValueError,
         r"compression_warmup_steps=10 given with compression='none'", r"HINT: set compression"),
    Case("measured-compression-warmup-method", "strategy ddp_measured",
         "MeasuredDDPStrategy(compression='sign', compression_warmup_steps=20, compression_warmup='sign')",
         lambda: MeasuredDDPStrategy(compression="sign", compression_warmup_steps=20, compression_warmup="sign"),
         ValueError, r"compression_warmup must be one of", r"HINT: 'none' exchanges fp32"),
    Case("measured-compression-warmup-method-without-steps", "strategy ddp_measured",
         "MeasuredDDPStrategy(compression='sign', compression_warmup='int8')",
         lambda: MeasuredDDPStrategy(compression="sign", compression_warmup="int8"), ValueError,
         r"compression_warmup='int8' given without a warm-up", r"HINT: set compression_warmup_steps"),
    Case("measured-frozen-rms-without-warmup", "strategy ddp_measured",
         "MeasuredDDPStrategy(compression='sign', compression_frozen_rms=True)",
         lambda: MeasuredDDPStrategy(compression="sign", compression_frozen_rms=True), ValueError,
         r"compression_frozen_rms needs compression 'int8' or 'sign' and compression_warmup_steps >= 1",
         r"HINT: compression=sign compression_warmup_steps=20"),
    # strategy deepspeed_cpu and its presets
    Case("ds-offload-stage", "strategy deepspeed_cpu", "DeepSpeedCPUStrategy(stage=2, offload_parameters=True)",
         lambda: DeepSpeedCPUStrategy(stage=2, offload_parameters=True), ValueError, r"offload_parameters",
         r"set stage=3 or offload_parameters=False"),
    Case("ds-foreign-setting", "strategy deepspeed_cpu", "DeepSpeedCPUStrategy(staleness=1)",
         lambda: DeepSpeedCPUStrategy(staleness=1), ValueError, r"staleness \(async_ssp\)", r"Choose one strategy"),
    Case("ds-onebit-adam", "strategy deepspeed_cpu",
         "DeepSpeedCPUStrategy(config={'optimizer': {'type': 'OneBitAdam'}})",
         lambda: DeepSpeedCPUStrategy(config={"optimizer": {"type": "OneBitAdam"}}), ValueError, r"OneBitAdam",
         r"Use lightning_syncasync\.algorithms\.compression\.OneBitAdam"),
    Case("ds-compression-training", "strategy deepspeed_cpu",
         "DeepSpeedCPUStrategy(config={'compression_training': {...}})",
         lambda: DeepSpeedCPUStrategy(config={"compression_training": {}}), ValueError, r"compression_training",
         r"Use this project's compression= option"),
    Case("ds-config-file", "strategy deepspeed_cpu", "DeepSpeedCPUStrategy(config='no_such_ds_config.json')",
         lambda: DeepSpeedCPUStrategy(config="no_such_ds_config.json"), FileNotFoundError, r"config file",
         r"pass a dict or an existing JSON file"),
    Case("ds-config-precision", "strategy deepspeed_cpu",
         "DeepSpeedCPUStrategy(config={'fp16': {'enabled': True}}) with Trainer(precision='bf16-mixed')",
         lambda: Trainer(accelerator="cpu", devices=2, precision="bf16-mixed", logger=False,
                         strategy=DeepSpeedCPUStrategy(config={"fp16": {"enabled": True}})),
         ValueError, r"config enables fp16.*precision is 'bf16-mixed'", r"HINT: set precision='16-mixed'", TRAINER),
    Case("ds-preset-offload", "Hydra train app", "strategy=deepspeed_zero3_offload strategy.stage=2",
         _train_app("strategy=deepspeed_zero3_offload", "strategy.stage=2"), InstantiationException,
         r"offload_parameters", r"set stage=3"),
    Case("ds-preset-fp16-cpu", "Hydra train app", "strategy=deepspeed_fp16 (on a CPU without fp16 kernels)",
         _without_fp16(_train_app("strategy=deepspeed_fp16")), InstantiationException, r"precision='16-mixed'",
         r"use precision='bf16-mixed'", TRAINER),
    # compression
    Case("compressor-name", "algorithm Compressor", "HierSyncStrategy(compression='zip')",
         lambda: HierSyncStrategy(compression="zip"), ValueError, r"compression must", r"HINT: 'int8' cuts bytes"),
    Case("compressor-rank", "algorithm Compressor",
         "AsyncSSPStrategy(compression='powersgd', compression_options={'rank': 0})",
         lambda: AsyncSSPStrategy(compression="powersgd", compression_options={"rank": 0}), ValueError,
         r"rank must", r"HINT: PowerSGD uses 1-4"),
    Case("compressor-chunk-size", "algorithm Compressor",
         "HierSyncStrategy(compression='int8', compression_options={'chunk_size': 0})",
         lambda: HierSyncStrategy(compression="int8", compression_options={"chunk_size": 0}), ValueError,
         r"chunk_size", r"HINT: the default 256"),
    Case("compressor-int4-chunk-size", "algorithm Compressor",
         "MeasuredDDPStrategy(compression='int4', compression_options={'chunk_size': 12})",
         lambda: MeasuredDDPStrategy(compression="int4", compression_options={"chunk_size": 12}), ValueError,
         r"chunk_size must be a positive multiple of 8", r"HINT: the default 256"),
    Case("compressor-collective", "algorithm Compressor",
         "AsyncSSPStrategy(compression='int8', compression_options={'collective': 'ring'})",
         lambda: AsyncSSPStrategy(compression="int8", compression_options={"collective": "ring"}), ValueError,
         r"collective must be one of", r"HINT: 'auto' \(the default\)"),
    Case("compressor-summable-method", "algorithm Compressor",
         "HierSyncStrategy(compression='sign', compression_options={'collective': 'summable'})",
         lambda: HierSyncStrategy(compression="sign", compression_options={"collective": "summable"}), ValueError,
         r"collective='summable' needs integer codes an all-reduce can add \(int8, int4, int2\), got "
         r"compression='sign'", r"HINT: compression='int4' or 'int2' with collective='summable'"),
    Case("compressor-summable-world", "algorithm Compressor",
         "Compressor('int2', collective='summable') on 2**62 ranks (summable.check_groups(1, 2**62))",
         lambda: check_groups(1, 2**62), ValueError,
         r"collective='summable' takes at most \d+ ranks at 1 levels, got \d+: .* more than a 64-bit word holds",
         r"HINT: collective='two_phase'"),
    Case("compressor-codec", "algorithm Compressor",
         "HierSyncStrategy(compression='int8', compression_options={'codec': 'fused'})",
         lambda: HierSyncStrategy(compression="int8", compression_options={"codec": "fused"}), ValueError,
         r"codec must be one of \('auto', 'eager', 'compiled'\), got 'fused'", r"HINT: 'auto' \(the default\)"),
    Case("compressor-rounding", "algorithm Compressor", "Compressor('int8', rounding='up')",
         lambda: Compressor("int8", rounding="up"), ValueError, r"rounding", r"HINT: 'stochastic'"),
    Case("compressor-integer-tensor", "algorithm Compressor",
         "Compressor('int8').allreduce(torch.arange(8), ...)",
         lambda: Compressor("int8").allreduce(torch.arange(8), group=None, key="steps"), ValueError,
         r"floating-point tensor, got torch\.int64", r"HINT: non-float parameters", CALL),
    Case("compressor-sparse-gradient", "algorithm Compressor",
         "Compressor('sign').allreduce(<sparse gradient>, ...)",
         lambda: Compressor("sign").allreduce(_sparse_grad(), group=None, key="emb"), ValueError,
         r"dense tensor, got layout torch\.sparse_coo", r"HINT: densify it", CALL),
    # other algorithms
    Case("compensation-method", "algorithm StaleGradientCompensation", "StaleGradientCompensation('dc')",
         lambda: StaleGradientCompensation("dc"), ValueError, r"compensation must", r"HINT: 'dc_asgd_adaptive'"),
    Case("balancer-groups", "algorithm BatchBalancer", "BatchBalancer(global_batch=7, world_size=2, groups=[[0], [1]])",
         lambda: BatchBalancer(7, 2, groups=[[0], [1]]), ValueError, r"global batch 7", r"make it a multiple of 2"),
    Case("costmodel-straggler", "algorithm ScalingModel", "ScalingModel(..., straggler_factor=0.5)",
         _scaling_model(straggler_factor=0.5), ValueError, r"straggler_factor", r"HINT: 1 is no straggler"),
    # callbacks
    Case("monitor-smoothing", "callback SyncMonitor", "SyncMonitor(smoothing=1.0)",
         lambda: SyncMonitor(smoothing=1.0), ValueError, r"smoothing", r"0\.9 is a good default"),
    Case("monitor-warmup", "callback SyncMonitor", "SyncMonitor(warmup_steps=-1)",
         lambda: SyncMonitor(warmup_steps=-1), ValueError, r"warmup_steps", r"HINT: 0 aggregates every step"),
    Case("monitor-cuda-sync", "callback SyncMonitor", "SyncMonitor(cuda_sync='yes')",
         lambda: SyncMonitor(cuda_sync="yes"), ValueError, r"cuda_sync", r"HINT: true \(the default\)"),
    Case("adaptive-interval", "callback AdaptiveBatchSize", "AdaptiveBatchSize(interval=0)",
         lambda: AdaptiveBatchSize(interval=0), ValueError, r"interval", r"HINT: 10 decides every 10 batches"),
    Case("adaptive-persistence", "callback AdaptiveBatchSize", "AdaptiveBatchSize(persistence=0)",
         lambda: AdaptiveBatchSize(persistence=0), ValueError, r"persistence must be >= 1",
         r"HINT: 3 waits for three windows in a row"),
    Case("adaptive-min-max", "callback AdaptiveBatchSize", "AdaptiveBatchSize(min_batch=4, max_batch=2)",
         lambda: AdaptiveBatchSize(min_batch=4, max_batch=2), ValueError, r"min_batch \(4\) > max_batch \(2\)",
         r"lower min_batch or raise max_batch"),
    Case("adaptive-loss-reduction", "callback AdaptiveBatchSize", "AdaptiveBatchSize(loss_reduction='avg')",
         lambda: AdaptiveBatchSize(loss_reduction="avg"), ValueError, r"loss_reduction", r"HINT: 'mean'"),
    Case("adaptive-iterable", "callback AdaptiveBatchSize", "AdaptiveBatchSize() with an IterableDataset",
         _fit(AdaptiveBatchSize(), model=_StreamModel()), TypeError, r"AdaptiveBatchSize needs a map-style dataset",
         r"Use a map-style dataset, or drop AdaptiveBatchSize", SETUP),
    Case("adaptive-grow-accumulate", "callback AdaptiveBatchSize",
         "AdaptiveBatchSize(grow_batch=True) with Trainer(accumulate_grad_batches=2)",
         _fit(AdaptiveBatchSize(grow_batch=True), accumulate_grad_batches=2), ValueError,
         r"accumulate_grad_batches=2", r"or set grow_batch=False", SETUP),
    Case("adaptive-grow-async", "callback AdaptiveBatchSize",
         "AdaptiveBatchSize(grow_batch=True) with Trainer(strategy=AsyncSSPStrategy())",
         _fit(AdaptiveBatchSize(grow_batch=True), strategy=AsyncSSPStrategy()), ValueError,
         r"grow_batch needs a flat gradient all-reduce every step", r"Set grow_batch=False or use strategy='ddp'",
         SETUP),
    Case("switcher-window", "callback SyncSwitcher", "SyncSwitcher(window=1)",
         lambda: SyncSwitcher(window=1), ValueError, r"window must", r"HINT: 10 decides every 10 steps"),
    Case("switcher-straggler", "callback SyncSwitcher", "SyncSwitcher(straggler_low=1.5, straggler_high=1.3)",
         lambda: SyncSwitcher(straggler_low=1.5, straggler_high=1.3), ValueError, r"straggler_low",
         r"HINT: .*e\.g\. 1\.15 and 1\.3"),
    Case("switcher-comm-high", "callback SyncSwitcher", "SyncSwitcher(comm_high=1.5)",
         lambda: SyncSwitcher(comm_high=1.5), ValueError, r"comm_high", r"HINT: 0\.35"),
    Case("switcher-spike-floor", "callback SyncSwitcher", "SyncSwitcher(spike_floor=-0.1)",
         lambda: SyncSwitcher(spike_floor=-0.1), ValueError, r"spike_floor must be >= 0",
         r"HINT: 0\.1 ignores a rise under 10% of the first window's loss"),
    Case("switcher-strategy", "callback SyncSwitcher", "SyncSwitcher() with Trainer(strategy='auto')",
         _fit(SyncSwitcher()), ValueError, r"strategy='auto_sync'", r"HINT: Trainer\(strategy='auto_sync'", SETUP),
    Case("straggler-factor", "callback StragglerEmulator", "StragglerEmulator(slowdown='3:0.5')",
         lambda: StragglerEmulator(slowdown="3:0.5"), ValueError, r"slowdown factor", r"e\.g\. slowdown=3:1\.5"),
    Case("straggler-env-jitter", "callback StragglerEmulator", "SYNCASYNC_JITTER=2:4",
         lambda: StragglerEmulator.from_env({"SYNCASYNC_JITTER": "2:4"}), ValueError,
         r"SYNCASYNC_JITTER='2:4'", r"e\.g\. jitter=0\.1:4"),
    Case("straggler-env-schedule", "callback StragglerEmulator", "SYNCASYNC_SLOWDOWN_SCHEDULE=1:2@0.7-0.2",
         lambda: StragglerEmulator.from_env({"SYNCASYNC_SLOWDOWN_SCHEDULE": "1:2@0.7-0.2"}), ValueError,
         r"SYNCASYNC_SLOWDOWN_SCHEDULE", r"e\.g\. 3:2@0\.33-0\.67"),
    Case("straggler-env-seed", "callback StragglerEmulator", "SYNCASYNC_JITTER=0.1:4 SYNCASYNC_STRAGGLER_SEED=x",
         lambda: StragglerEmulator.from_env({"SYNCASYNC_JITTER": "0.1:4", "SYNCASYNC_STRAGGLER_SEED": "x"}),
         ValueError, r"SYNCASYNC_STRAGGLER_SEED", r"HINT: syncasync-emulate --seed"),
    # the Hydra train app
    Case("hydra-devices", "Hydra train app", "trainer.devices=0", _train_app("trainer.devices=0"), ValueError,
         r"trainer\.devices=0", r"HINT: use a positive count", VALIDATION),
    Case("hydra-num-nodes", "Hydra train app", "trainer.num_nodes=0", _train_app("trainer.num_nodes=0"), ValueError,
         r"trainer\.num_nodes=0", r"HINT: use trainer\.num_nodes=1", VALIDATION),
    Case("hydra-strategy-name", "Hydra train app", "~strategy trainer.strategy=hier_synk",
         _train_app("~strategy", "trainer.strategy=hier_synk"), ValueError, r"trainer\.strategy='hier_synk'",
         r"HINT: did you mean 'hier_sync'\? lightning_syncasync's names: hier_sync,", VALIDATION),
    Case("hydra-strategy-group", "Hydra train app", "strategy=hier_sink", _train_app("strategy=hier_sink"),
         ConfigCompositionException, r"strategy/hier_sink", r"Available options in 'strategy'", COMPOSITION),
    Case("hydra-staleness", "Hydra train app", "strategy=async_ssp strategy.staleness=-1",
         _train_app("strategy=async_ssp", "strategy.staleness=-1"), InstantiationException, r"staleness",
         r"HINT: 0 is synchronous"),
    Case("hydra-post-local-sgd-compression", "Hydra train app", "strategy=ddp_post_local_sgd strategy.compression=int8",
         _train_app("strategy=ddp_post_local_sgd", "strategy.compression=int8"), InstantiationException,
         r"compression='int8'", r"HINT: use hier_sync with compression"),
    Case("hydra-callback", "Hydra train app", "callbacks.sync_monitor.smoothing=1.5",
         _train_app("callbacks.sync_monitor.smoothing=1.5"), InstantiationException, r"smoothing",
         r"0\.9 is a good default"),
    Case("hydra-model", "Hydra train app", "model.depth=0", _train_app("model.depth=0"), InstantiationException,
         r"depth", r"set model\.depth to e\.g\. 2"),
    Case("hydra-lm-optimizer", "Hydra train app", "data=text model=transformer_lm model.optimizer=lamb",
         _train_app("data=text", "model=transformer_lm", "model.optimizer=lamb"), InstantiationException,
         r"optimizer must be 'adamw' or 'onebit_adam'", r"set model\.optimizer to 'adamw'"),
    # the Lightning CLI
    Case("cli-strategy-name", "Lightning CLI", "--trainer.strategy=hier_synk",
         _lightning_cli("--trainer.strategy=hier_synk"), CommandFailed, r"--trainer\.strategy='hier_synk'",
         r"HINT: did you mean 'hier_sync'\? lightning_syncasync's names: hier_sync,", VALIDATION),
    Case("cli-hier-inter-period", "Lightning CLI",
         "--trainer.strategy=HierSyncStrategy --trainer.strategy.init_args.inter_period=0",
         _lightning_cli("--trainer.strategy=HierSyncStrategy", "--trainer.strategy.init_args.inter_period=0"),
         CommandFailed, r"inter_period", r"HINT: None \(the default\) decides it"),
    Case("cli-ssp-compression", "Lightning CLI",
         "--trainer.strategy=AsyncSSPStrategy --trainer.strategy.init_args.compression=zip",
         _lightning_cli("--trainer.strategy=AsyncSSPStrategy", "--trainer.strategy.init_args.compression=zip"),
         CommandFailed, r"compression must", r"HINT: 'int8'"),
    Case("cli-callback", "Lightning CLI",
         "--trainer.callbacks+=AdaptiveBatchSize --trainer.callbacks.init_args.interval=0",
         _lightning_cli("--trainer.callbacks+=AdaptiveBatchSize", "--trainer.callbacks.init_args.interval=0"),
         CommandFailed, r"interval", r"HINT: 10 decides"),
    # syncasync-emulate
    Case("emulate-link-without-netns", "syncasync-emulate", "--no-netns --link-mbit 100",
         _emulate("--no-netns", "--link-mbit", "100", "--", "true"), CommandFailed, r"--link-mbit",
         r"drop --no-netns or drop --link-mbit", PARSING),
    Case("emulate-no-command", "syncasync-emulate", "(no training command after --)", _emulate(), CommandFailed,
         r"no training command", r"put it after --", PARSING),
    Case("emulate-straggler-form", "syncasync-emulate", "--straggler 3", _emulate("--straggler", "3", "--", "true"),
         CommandFailed, r"--straggler '3'", r"e\.g\. 3:1\.5", PARSING),
    Case("emulate-jitter", "syncasync-emulate", "--jitter 2:4", _emulate("--jitter", "2:4", "--", "true"),
         CommandFailed, r"jitter probability", r"e\.g\. jitter=0\.1:4", LAUNCH),
    Case("emulate-schedule", "syncasync-emulate", "--straggler-schedule 1:2@0.7-0.2",
         _emulate("--straggler-schedule", "1:2@0.7-0.2", "--", "true"), CommandFailed, r"schedule item",
         r"e\.g\. 3:2@0\.33-0\.67", LAUNCH),
    Case("emulate-link-schedule", "syncasync-emulate", "--link-schedule 10@0.6-0.2",
         _emulate("--link-schedule", "10@0.6-0.2", "--", "true"), CommandFailed, r"--link-schedule: link item",
         r"e\.g\. 20@0\.33-0\.67", LAUNCH),
    Case("emulate-without-root", "syncasync-emulate", "--link-mbit 100 (as a user without root)",
         _emulate_without_root, CommandFailed, r"network namespaces", r"HINT: run it with sudo, or pass --no-netns",
         LAUNCH),
    Case("emulate-node-faults", "syncasync-emulate", "--ft --node-faults kill:5@10",
         _emulate("--ft", "--node-faults", "kill:5@10", "--", "true"), CommandFailed, r"node 5 is outside",
         r"0\.\.1", LAUNCH),
    Case("emulate-node-faults-without-ft", "syncasync-emulate", "--node-faults kill:1@10 (without --ft)",
         _emulate("--node-faults", "kill:1@10", "--", "true"), CommandFailed, r"--node-faults needs --ft",
         r"HINT: add --ft", PARSING),
    # strategy hier_sync_ft / async_ssp_ft (torchft)
    Case("ft-torchft-missing", "strategy hier_sync_ft", "Trainer(strategy='hier_sync_ft') without torchft",
         _without_torchft, ImportError, r"needs torchft", r'HINT: pip install -e "\.\[ft\]"'),
    Case("ft-min-replicas", "strategy hier_sync_ft", "FaultTolerantStrategy(min_replicas=3, max_replicas=2)",
         lambda: FaultTolerantStrategy(min_replicas=3, max_replicas=2), ValueError, r"min_replicas=3",
         r"HINT: min_replicas <= 2"),
    Case("ft-replica-group", "strategy hier_sync_ft", "FaultTolerantStrategy(replica_group=2, max_replicas=2)",
         lambda: FaultTolerantStrategy(replica_group=2, max_replicas=2), ValueError, r"replica_group=2",
         r"HINT: number the nodes 0 \.\. 1"),
    Case("ft-staleness", "strategy hier_sync_ft", "FaultTolerantStrategy(staleness=2)",
         lambda: FaultTolerantStrategy(staleness=2), ValueError, r"staleness must be 0 or 1",
         r"HINT: 0 is synchronous"),
    Case("ft-compression", "strategy hier_sync_ft", "FaultTolerantStrategy(compression='sign')",
         lambda: FaultTolerantStrategy(compression="sign"), ValueError, r"compression='sign'",
         r"HINT: compression='int8' or 'int4'"),
    Case("ft-exchange", "strategy hier_sync_ft", "FaultTolerantStrategy(exchange='diloco')",
         lambda: FaultTolerantStrategy(exchange="diloco"), ValueError, r"exchange must be",
         r"HINT: 'elastic' is this pack's rounds"),
    Case("ft-num-nodes", "strategy hier_sync_ft", "Trainer(strategy='hier_sync_ft', num_nodes=2)",
         _ft_spanning_nodes, ValueError, r"num_nodes=2", r"HINT: start the same script on every node", SETUP),
    Case("ft-host-loopback", "strategy hier_sync_ft",
         "SYNCASYNC_FT_HOST=127.0.0.1 with the Lighthouse on another host", _ft_host_loopback, ValueError,
         r"SYNCASYNC_FT_HOST='127\.0\.0\.1' is a loopback address", r"HINT: set SYNCASYNC_FT_HOST to this node's",
         SETUP),
    Case("ft-host-only-loopback", "strategy hier_sync_ft",
         "the hostname and MASTER_ADDR only loopback, no other route, SYNCASYNC_FT_HOST unset",
         lambda: choose_host(None, "vm", [], "127.0.0.1", "192.0.2.10"), ValueError,
         r"hostname 'vm' resolves only to loopback.*MASTER_ADDR", r"HINT: export SYNCASYNC_FT_HOST=", SETUP),
    Case("ft-lighthouse-unreachable", "strategy hier_sync_ft", "TORCHFT_LIGHTHOUSE=http://127.0.0.1:9 (nothing there)",
         lambda: check_reachable("http://127.0.0.1:9", 1.0, "hier_sync_ft"), ConnectionError,
         r"cannot reach the Lighthouse at http://127\.0\.0\.1:9", r"HINT: start it", SETUP),
    Case("train-ft-strategy", "Hydra train app", "ft=2 strategy=hier_sync", _train_app("ft=2", "strategy=hier_sync"),
         ValueError, r"ft=2", r"HINT: add strategy=hier_sync_ft", VALIDATION),
    Case("train-data-order", "Hydra train app", "data_order=-1", _train_app("data_order=-1"), ValueError,
         r"data_order=-1", r"HINT: data_order=1", VALIDATION),
    Case("train-data-order-no-seed", "Hydra train app", "data_order=1 seed=null",
         _train_app("data_order=1", "seed=null"), ValueError, r"data_order=1 .*seed=null", r"HINT: set seed=42",
         VALIDATION),
    # syncasync-advise
    Case("advise-seconds", "syncasync-advise", "--seconds 0", _advise("--seconds", "0"), CommandFailed,
         r"--seconds must be", r"HINT: e\.g\. --seconds 5", PARSING),
    Case("advise-seconds-text", "syncasync-advise", "--seconds abc", _advise("--seconds", "abc"), CommandFailed,
         r"--seconds 'abc'", r"HINT: e\.g\. --seconds 5", PARSING),
    Case("advise-simulate-nodes", "syncasync-advise", "--simulate-nodes 8,x", _advise("--simulate-nodes", "8,x"),
         CommandFailed, r"--simulate-nodes", r"HINT: e\.g\. 8,64,512", PARSING),
    Case("bench-spawn-contender", "syncasync-bench", "--strategies hier_sync_spawn",
         _bench("--scenario", "smoke", "--strategies", "hier_sync_spawn"), CommandFailed,
         r"contender 'hier_sync_spawn'.*start_method='spawn'", r"HINT: use 'hier_sync' \(the emulator starts one",
         LAUNCH),
    Case("advise-strategies", "syncasync-advise", "--strategies ddp,hier_sink",
         _advise("--strategies", "ddp,hier_sink"), CommandFailed, r"--strategies: unknown \['hier_sink'\]",
         r"HINT: a comma-separated subset", PARSING),
    Case("advise-reps", "syncasync-advise", "--reps 0", _advise("--reps", "0"), CommandFailed, r"--reps",
         r"HINT: e\.g\. --reps 3", PARSING),
    Case("advise-params", "syncasync-advise", "--params no_such_params.json",
         _advise("--params", "no_such_params.json"), CommandFailed, r"--params no_such_params\.json",
         r"HINT: pass the file written by --calibrate", LAUNCH),
    Case("advise-local-sgd-steps", "syncasync-advise", "--local-sgd-steps 0.8", _advise("--local-sgd-steps", "0.8"),
         CommandFailed, r"--local-sgd-steps must be >= 1", r"HINT: 1 ranks by throughput alone", PARSING),
    Case("advise-shard", "syncasync-advise", "--shard maybe", _advise("--shard", "maybe"), CommandFailed,
         r"--shard 'maybe' is not one of auto, yes, no", r"HINT: --shard yes for a model that does not fit", PARSING),
]  # fmt: skip


def _fp16_hook() -> Any:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

    return fp16_compress_hook


def _sparse_grad() -> torch.Tensor:
    return torch.sparse_coo_tensor([[0, 2]], [1.0, -1.0], (4,))


# -- running a case ---------------------------------------------------------------------------------------------------


@functools.cache
def _outcome(slug: str) -> BaseException | None:
    """What the case raised (``None``: it was accepted), run once per session: the test and the docs share it."""
    case = next(c for c in CASES if c.slug == slug)
    started = TrainingStarted(f"{case.setting}: training started; it must be rejected before the first batch")
    with mock.patch.object(_TrainingEpochLoop, "advance", side_effect=started):
        try:
            case.attempt()
        except (Exception, SystemExit) as err:
            return err.with_traceback(None)
    return None


def _message(err: BaseException) -> str:
    """The text a user sees: the message and the causes a wrapper (Hydra) prints with it."""
    parts = [str(err)]
    cause = err.__cause__
    while cause is not None:
        if str(cause) not in "\n".join(parts):
            parts.append(str(cause))
        cause = cause.__cause__
    return "\n".join(parts)


@pytest.mark.parametrize("case", CASES, ids=[c.slug for c in CASES])
def test_rejected_before_training_naming_the_setting_and_the_fix(case: Case):
    err = _outcome(case.slug)
    assert err is not None, f"{case.surface}: {case.setting} was accepted"
    assert not isinstance(err, TrainingStarted), str(err)
    assert isinstance(err, case.error), (
        f"{case.setting}: expected {case.error.__name__}, got {type(err).__name__}: {err}"
    )
    if isinstance(err, CommandFailed):
        assert err.code not in (0, None)
    message = _message(err)
    assert re.search(case.name, message), f"{case.setting}: the message does not name the setting: {message}"
    assert re.search(case.fix, message), f"{case.setting}: the message gives no fix: {message}"


def test_the_table_covers_every_surface():
    slugs = [c.slug for c in CASES]
    assert len(slugs) == len(set(slugs)) and len(CASES) >= 30
    surfaces = {c.surface for c in CASES}
    for surface in (
        "strategy hier_sync", "strategy async_ssp", "strategy auto_sync", "strategy ddp_measured",
        "strategy deepspeed_cpu", "algorithm Compressor", "callback SyncMonitor", "callback AdaptiveBatchSize",
        "callback SyncSwitcher", "callback StragglerEmulator", "Hydra train app", "Lightning CLI",
        "syncasync-emulate", "syncasync-advise", "syncasync-bench", "strategy names",
    ):  # fmt: skip
        assert surface in surfaces, surface


# -- the docs table ---------------------------------------------------------------------------------------------------

HEADER = """\
# Rejected invalid configurations

Generated by `SYNCASYNC_WRITE_DOCS=1 python -m pytest tests/test_bad_input.py` from `CASES` in
`tests/test_bad_input.py`; do not edit by hand. Every row is a test: the setting is rejected before training starts,
with a message that names the setting and says how to fix it. The message column shows the start of the message the
code raised when this file was generated, from its first line naming the setting ("…" marks lines left out before it,
such as Hydra's or jsonargparse's own).
"""


def _excerpt(message: str, name: str) -> str:
    """About ``MESSAGE_CHARS`` characters of ``message`` from its first line naming the setting."""
    lines = message.splitlines()
    at = next((i for i, line in enumerate(lines) if re.search(name, line)), 0)
    flat = " ".join(" ".join(lines[at:]).split()).removeprefix("- ")
    if at:
        flat = "… " + flat
    if len(flat) > MESSAGE_CHARS:
        flat = flat[: MESSAGE_CHARS - 1].rstrip() + "…"
    return flat


def _code(text: str) -> str:
    text = text.replace("|", "\\|")
    return f"`` {text} ``" if "`" in text else f"`{text}`"


def render_markdown(cases: Sequence[Case] = CASES) -> str:
    """``docs/bad_input.md``: the table, with each case's message as raised now."""
    rows = ["| Surface | Setting | When rejected | Message |", "| --- | --- | --- | --- |"]
    for case in cases:
        err = _outcome(case.slug)
        message = _excerpt(_message(err), case.name) if err is not None else "(accepted!)"
        rows.append(f"| {case.surface} | {_code(case.setting)} | {case.when} | {_code(message)} |")
    return f"{HEADER}\n{len(cases)} cases.\n\n" + "\n".join(rows) + "\n"


def test_docs_table_is_up_to_date():
    text = render_markdown()
    if os.environ.get(ENV_WRITE_DOCS) == "1":
        DOCS.parent.mkdir(exist_ok=True)
        DOCS.write_text(text)
        return
    assert DOCS.is_file() and DOCS.read_text() == text, (
        f"{DOCS} is out of date; regenerate it with {ENV_WRITE_DOCS}=1 python -m pytest tests/test_bad_input.py"
    )

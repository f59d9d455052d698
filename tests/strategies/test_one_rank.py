"""At one rank the strategies step aside: no DDP wrapper, no watchdog, no switcher, no batch claims (the host time
each would cost every step is measured by ``scripts/host_overhead.py``), and the DDP-based ones train exactly as
Lightning's DDP does at one rank (DDP's division by a world of one and its sum over one rank are exact)."""

from __future__ import annotations

import functools
import warnings
from typing import Any

import pytest
import torch
from _models import TinyAdamModel
from lightning.pytorch import Callback, Trainer
from torch.nn.parallel import DistributedDataParallel

import lightning_syncasync  # noqa: F401  (registers the strategy names)
from lightning_syncasync.algorithms.ssp.claim_sampler import ClaimingBatchSampler
from lightning_syncasync.callbacks import AdaptiveBatchSize, SyncSwitcher
from lightning_syncasync.callbacks.watchdog import PeerWatchdog
from lightning_syncasync.strategies.async_ssp import AsyncSSPStrategy


class UnusedHeadModel(TinyAdamModel):
    """A second head that the loss never uses: DDP refuses it at two ranks unless told (find_unused_parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.unused_head = torch.nn.Linear(8, 2)


class _Seen(Callback):
    """What the loop ran with: the model's wrapper, the callbacks and the batch sampler, read at the first batch."""

    def __init__(self) -> None:
        self.wrapped: bool | None = None
        self.callbacks: list[type] = []
        self.batch_sampler: type | None = None

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.wrapped is None:
            self.wrapped = isinstance(trainer.strategy.model, DistributedDataParallel)
            self.callbacks = [type(c) for c in trainer.callbacks]
            self.batch_sampler = type(trainer.train_dataloader.batch_sampler)


def _fit(strategy: Any, tmp_path: Any, steps: int = 6) -> tuple[dict[str, torch.Tensor], _Seen, Trainer]:
    torch.manual_seed(0)
    model = TinyAdamModel()
    seen = _Seen()
    trainer = Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=steps, logger=False,
                      default_root_dir=tmp_path, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[seen])  # fmt: skip
    trainer.fit(model)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, seen, trainer


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["hier_sync", "auto_sync", "ddp_measured", "ddp_measured_int8"])
def test_a_ddp_based_strategy_at_one_rank_is_unwrapped_and_trains_as_lightnings_ddp(name, tmp_path):
    if name == "ddp_measured_int8":
        from lightning_syncasync.strategies.measured_ddp import MeasuredDDPStrategy

        strategy: Any = MeasuredDDPStrategy(compression="int8")  # at one rank nothing is sent, so nothing quantized
    else:
        strategy = name
    # Lightning's DDP, not its single-device strategy: a distributed strategy's loader gets a DistributedSampler,
    # which shuffles the order.
    ddp, ddp_seen, _ = _fit("ddp", tmp_path / "ddp")
    ours, seen, trainer = _fit(strategy, tmp_path / "ours")
    assert ddp_seen.wrapped is True
    assert seen.wrapped is False, f"{name} wrapped the model in DDP at one rank"
    assert PeerWatchdog not in seen.callbacks  # no peer to lose
    assert SyncSwitcher not in seen.callbacks  # auto_sync: nothing to switch between
    assert trainer.global_step == 6
    for key, value in ddp.items():
        assert torch.equal(ours[key], value), f"{name}: {key} differs from Lightning's DDP's"


@pytest.mark.timeout(120)
def test_async_ssp_at_one_rank_claims_no_batches_unless_asked(tmp_path):
    _, seen, _ = _fit(AsyncSSPStrategy(), tmp_path / "default")
    assert seen.batch_sampler is not ClaimingBatchSampler  # no other rank to share the epoch with
    assert PeerWatchdog not in seen.callbacks
    assert AdaptiveBatchSize not in seen.callbacks  # nor to balance batches against
    _, seen, _ = _fit(AsyncSSPStrategy(claim_batches=True), tmp_path / "asked")
    assert seen.batch_sampler is ClaimingBatchSampler


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["hier_sync", "auto_sync", "ddp_measured"])
def test_unused_parameters_at_one_rank_get_the_warning_ddp_would_make_an_error_at_two(name, tmp_path):
    # What a one-rank trial would otherwise hide: the same model under Lightning's ddp_spawn at 2 ranks stops with
    # "parameters that were not used in producing the loss" (checked by hand: 2 ranks cost 20 s here).
    def fit(**kwargs: Any) -> list[str]:
        from lightning.pytorch.strategies import StrategyRegistry

        entry = StrategyRegistry[name]
        strategy = entry["strategy"](**{**entry["init_params"], **kwargs})
        trainer = Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=3, logger=False,
                          default_root_dir=tmp_path, enable_checkpointing=False, enable_progress_bar=False,
                          enable_model_summary=False)  # fmt: skip
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            trainer.fit(UnusedHeadModel())
        return [str(w.message) for w in seen if "got no gradient" in str(w.message)]

    said = fit()
    assert len(said) == 1, said  # once per fit, not per step
    assert "unused_head.weight" in said[0] and "find_unused_parameters=True" in said[0]
    assert fit(find_unused_parameters=True) == []  # told: nothing to warn about


@pytest.mark.timeout(120)
def test_a_checkpoint_with_residuals_of_more_ranks_resumes_at_one_rank(tmp_path):
    # At one rank no compressing hook runs, so residuals saved by a 2-rank run have nothing to feed: not a reason to
    # refuse the resume.
    from lightning_syncasync.strategies.measured_ddp import _CKPT_KEY, MeasuredDDPStrategy

    _, _, trainer = _fit(MeasuredDDPStrategy(compression="int8"), tmp_path / "first", steps=2)
    path = tmp_path / "two_ranks.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=False)
    checkpoint[_CKPT_KEY] = {"world_size": 2, "ranks": [{"residuals": {}}, {"residuals": {}}]}
    torch.save(checkpoint, path)
    resumed = Trainer(accelerator="cpu", devices=1, strategy=MeasuredDDPStrategy(compression="int8"), max_steps=4,
                      logger=False, default_root_dir=tmp_path, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False)  # fmt: skip
    resumed.fit(TinyAdamModel(), ckpt_path=str(path))
    assert resumed.global_step == 4


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("name", "added"), [("auto_sync", {"SyncSwitcher", "AdaptiveBatchSize"}),
                                             ("async_ssp", {"AdaptiveBatchSize"})])  # fmt: skip
def test_a_two_rank_checkpoint_resumes_at_one_rank_without_asking_for_the_callbacks_the_strategy_added(
    tmp_path, name, added
):
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_syncasync.strategies.auto_sync import AutoSyncStrategy

    # async_ssp adds AdaptiveBatchSize with balanced rounds (no claimed batches, adaptive_batch=None).
    balanced = functools.partial(AsyncSSPStrategy, dynamic_local_steps=False, claim_batches=False)
    make = {"auto_sync": AutoSyncStrategy, "async_ssp": balanced}[name]

    def checkpoints() -> ModelCheckpoint:
        return ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)

    # At two ranks auto_sync adds a SyncSwitcher, which adds AdaptiveBatchSize; balanced async_ssp adds
    # AdaptiveBatchSize: they save state.
    Trainer(accelerator="cpu", devices=2, strategy=make(start_method="fork"), max_steps=2, logger=False,
            default_root_dir=tmp_path, callbacks=[checkpoints()], enable_progress_bar=False,
            enable_model_summary=False).fit(TinyAdamModel())  # fmt: skip
    path = tmp_path / "ckpt" / "epoch=0-step=2.ckpt"
    assert added <= set(torch.load(path, weights_only=False)["callbacks"])
    resumed = Trainer(accelerator="cpu", devices=1, strategy=make(), max_steps=4, logger=False,
                      default_root_dir=tmp_path, callbacks=[checkpoints()], enable_progress_bar=False,
                      enable_model_summary=False)  # fmt: skip
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        resumed.fit(TinyAdamModel(), ckpt_path=str(path))
    assert resumed.global_step == 4
    asked = [str(w.message) for w in said if "callbacks used to create the checkpoint" in str(w.message)]
    assert not asked, asked  # Lightning asked the user to add the callbacks the strategy had added

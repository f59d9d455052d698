"""Every strategy whose background threads run collectives creates their groups through ``exchange_backend()``: a bad
``SYNCASYNC_EXCHANGE_BACKEND`` stops its setup with the setting's message. (On the CPU every group is gloo anyway, so
this is what shows here that the setting reaches each strategy; ``tests/gpu`` checks the backends under NCCL.)"""

from __future__ import annotations

import pytest
from _models import TinyModel
from lightning.pytorch import Trainer

from lightning_syncasync.algorithms._comm import EXCHANGE_BACKEND_ENV
from lightning_syncasync.strategies.async_ssp import AsyncSSPStrategy
from lightning_syncasync.strategies.auto_sync import AutoSyncStrategy
from lightning_syncasync.strategies.hier_sync import HierSyncStrategy
from lightning_syncasync.strategies.measured_ddp import MeasuredDDPStrategy

STRATEGIES = {
    "hier_sync": lambda: HierSyncStrategy(),
    "async_ssp": lambda: AsyncSSPStrategy(),
    "auto_sync": lambda: AutoSyncStrategy(),
    "ddp_measured_int8": lambda: MeasuredDDPStrategy(compression="int8"),  # the compressed hook's own groups
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_a_bad_exchange_backend_stops_the_setup_of(monkeypatch, tmp_path, name):
    monkeypatch.setenv(EXCHANGE_BACKEND_ENV, "nccl")
    trainer = Trainer(
        accelerator="cpu", devices=1, strategy=STRATEGIES[name](), max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    with pytest.raises(ValueError, match=f"{EXCHANGE_BACKEND_ENV} must be unset or 'gloo', got 'nccl'.*HINT"):
        trainer.fit(TinyModel())

"""Settings that differ across ranks are rejected at setup, on every rank, naming the setting (issue 10)."""

from __future__ import annotations

from pathlib import Path

import pytest
from _models import TinyModel
from lightning.pytorch import Trainer

from lightning_syncasync.algorithms._comm import InconsistentSettingsError
from lightning_syncasync.strategies.async_ssp import AsyncSSPStrategy
from lightning_syncasync.strategies.hier_sync import HierSyncStrategy

pytestmark = pytest.mark.faults


class _PerRank:
    """Mixin: this rank's value of one setting differs (as if each node had its own config), and how setup ended is
    written to ``out/rank{r}.txt``."""

    out = ""
    setting = ""

    def setup_distributed(self):
        setattr(self, self.setting, getattr(self, self.setting) + self.local_rank)
        try:
            super().setup_distributed()
        except InconsistentSettingsError as err:
            (Path(self.out) / f"rank{self.local_rank}.txt").write_text(str(err))
            raise


class PerRankSSP(_PerRank, AsyncSSPStrategy):
    setting = "staleness"


class PerRankHier(_PerRank, HierSyncStrategy):
    setting = "inter_period"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cls", [PerRankSSP, PerRankHier], ids=["async_ssp-staleness", "hier_sync-inter_period"])
def test_a_setting_that_differs_across_ranks_fails_setup_on_every_rank(tmp_path, cls):
    # hier_sync with a pinned period (the default, None, is decided from the link the same on every rank).
    strategy = cls(start_method="fork", **({"node_size": 1, "inter_period": 4} if cls is PerRankHier else {}))
    strategy.out = str(tmp_path)
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=2, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    with pytest.raises(Exception, match="settings differ across ranks"):
        trainer.fit(TinyModel())
    for r in range(2):
        msg = (tmp_path / f"rank{r}.txt").read_text()
        assert f"{cls.setting}=" in msg and f"different on ranks [{1 - r}]" in msg and "HINT" in msg, msg

"""MeasuredDDPStrategy on 4 gloo processes as 2 virtual nodes: exact against DDP, measured, torch's averagers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _models import TinyModel
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.strategies import DDPStrategy

from lightning_syncasync.callbacks import SyncMonitor
from lightning_syncasync.strategies.measured_ddp import MeasuredDDPStrategy


class SaveParams(Callback):
    """Each rank writes its parameters after its last step, so the test can compare ranks (spawn returns only rank
    0's): after the local SGD averaging of that step and before fit's final merge of the replicas."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step < trainer.max_steps:
            return
        flat = torch.cat([p.detach().flatten() for p in pl_module.parameters()])
        torch.save(flat, Path(self.out) / f"rank{trainer.global_rank}.pt")


def _fit(tmp_path: Path, strategy, steps: int = 8) -> tuple[list[torch.Tensor], dict]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    summary = tmp_path / "summary.json"
    trainer = Trainer(
        accelerator="cpu", devices=4, strategy=strategy, max_steps=steps, logger=False,
        callbacks=[SyncMonitor(summary_file=str(summary), print_summary=False), SaveParams(str(tmp_path))],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    torch.manual_seed(0)  # same initial weights in every run
    trainer.fit(TinyModel())
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(4)], json.loads(summary.read_text())


PARAM_BYTES = sum(p.numel() * 4 for p in TinyModel().parameters())


@pytest.mark.timeout(300)
def test_post_local_sgd_period_1_and_hierarchical_int8_track_ddp_and_are_measured_by_link(tmp_path):
    ddp, _ = _fit(tmp_path / "ddp", DDPStrategy(start_method="fork"))
    local, summary = _fit(
        tmp_path / "plsgd",
        MeasuredDDPStrategy(local_sgd="post_local_sgd", averaging_period=1, node_size=2, start_method="fork"),
    )
    # SGD without momentum: averaging node models every step == averaging gradients every step.
    for r in range(4):
        torch.testing.assert_close(local[r], ddp[0], rtol=1e-5, atol=1e-6)
    for rank in summary["ranks"]:
        assert rank["bytes_intra_per_step"] == PARAM_BYTES  # node-group gradient all-reduce
        assert rank["bytes_inter_per_step"] == PARAM_BYTES  # global parameter averaging
    assert summary["mode"] == "hier"
    # Compressed DDP across 2 virtual nodes is hierarchical: fp32 reduce-scatter + all-gather inside the node, int8
    # across, each local rank carrying half of the model. Replicas stay identical and track DDP.
    int8, summary = _fit(tmp_path / "int8", MeasuredDDPStrategy(compression="int8", node_size=2, start_method="fork"))
    for r in range(4):
        torch.testing.assert_close(int8[r], int8[0], rtol=0, atol=0)
    assert (int8[0] - ddp[0]).norm() <= 2e-2 * ddp[0].norm()
    for rank in summary["ranks"]:
        # TinyModel's buckets hold 706 elements (int8: 353 per half, 2 chunks of 256 with their scales).
        assert rank["bytes_inter_per_step"] == 2 * 256 + 2 * 4
        assert rank["bytes_intra_per_step"] == (706 + 353) * 4


@pytest.mark.timeout(300)
def test_hierarchical_averager_keeps_nodes_together_and_syncs_all_every_period(tmp_path):
    params, summary = _fit(
        tmp_path / "hier",
        MeasuredDDPStrategy(local_sgd="hierarchical", averaging_period=4, warmup_steps=2, node_size=2,
                            start_method="fork"),
        steps=10,
    )  # fmt: skip
    # Averager steps 0-9, warm-up 2: node averaging at 2,3,5,6,7,9; global at 4 and 8. The last step (9) averages
    # within nodes only, so nodes agree internally but differ from each other.
    torch.testing.assert_close(params[0], params[1])
    torch.testing.assert_close(params[2], params[3])
    assert not torch.allclose(params[0], params[2])
    for rank in summary["ranks"]:
        # 2 warm-up steps of flat DDP gradients (counted inter: the world group spans the virtual nodes) and 2 global
        # parameter averagings, over 10 steps; node averaging at 6 steps.
        assert rank["bytes_inter_per_step"] * 10 == pytest.approx(4 * PARAM_BYTES)
        assert rank["bytes_intra_per_step"] * 10 == pytest.approx(6 * PARAM_BYTES)


@pytest.mark.timeout(200)
def test_plain_mode_on_one_node_measures_like_ddp(tmp_path):
    params, summary = _fit(tmp_path / "plain", MeasuredDDPStrategy(start_method="fork"), steps=4)
    assert all(torch.equal(params[0], p) for p in params)
    assert all(r["bytes_intra_per_step"] == PARAM_BYTES and r["bytes_inter_per_step"] == 0 for r in summary["ranks"])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"local_sgd": "diloco"}, "local_sgd"),
        ({"averaging_period": 0}, "averaging_period"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"node_size": 0}, "node_size"),
        ({"local_sgd": "post_local_sgd", "model_averaging_period": 4}, "model_averaging_period"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MeasuredDDPStrategy(**kwargs)

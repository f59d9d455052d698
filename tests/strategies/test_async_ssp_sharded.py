"""async_ssp_sharded: FSDP2 inside each node, async rounds across nodes (4 gloo processes as 2 nodes of 2)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _models import ShardedTinyAdamModel, ShardedTinyModel
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from test_hier_sync_sharded import _fit, resume_at_step_4_matches

from lightning_syncasync.strategies.async_ssp import AsyncSSPStrategy
from lightning_syncasync.strategies.async_ssp_sharded import ShardedAsyncSSPStrategy
from lightning_syncasync.strategies.hier_sync_sharded import ShardedHierSyncStrategy


def _sharded(**kwargs):
    return ShardedAsyncSSPStrategy(virtual_nodes=2, start_method="fork", **kwargs)


@pytest.mark.timeout(300)
def test_synchronous_rounds_equal_hier_sync_sharded_step_by_step(tmp_path):
    # staleness=0 and rounds of 2 steps with plain averaging: each round's global step is the mean of the node models,
    # applied at once, which is hier_sync_sharded's average every 2 steps with no delay. (Plain SGD: the cut at the
    # epoch end, step 4, also makes the optimizer states node 0's, which hier_sync_sharded does not do.)
    hier_sync = ShardedHierSyncStrategy(virtual_nodes=2, inter_period=2, max_delay=0, start_method="fork")
    hier, _, _ = _fit(tmp_path / "hier", hier_sync, ShardedTinyModel, steps=8)
    rounds, summary, model = _fit(
        tmp_path / "rounds", _sharded(staleness=0, local_steps=2, dynamic_local_steps=False), ShardedTinyModel, 8
    )
    for r in range(4):
        assert len(rounds[r]) == 8
        for got, want in zip(rounds[r], hier[r], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # The nodes train apart inside a round (step 1 of each), and meet at its end (step 2).
    assert not torch.allclose(rounds[0][0], rounds[2][0])
    torch.testing.assert_close(rounds[0][1], rounds[2][1])
    # The main process gets the merged model back from the forked ranks.
    final = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    torch.testing.assert_close(final, _fit.final[0])
    param_bytes = sum(p.numel() * 4 for p in ShardedTinyModel().parameters())
    for rank in summary["ranks"]:
        # Across nodes: each rank's shard (half the model) per round of 2 steps, plus the exact rounds of the cuts at
        # the epoch ends and the rounds' metadata; never the whole model.
        assert param_bytes // 4 <= rank["bytes_inter_per_step"] < param_bytes // 2
        assert rank["bytes_intra_per_step"] == param_bytes // 2 + param_bytes  # FSDP's all-gather + reduce-scatter


@pytest.mark.timeout(300)
def test_late_rounds_keep_the_nodes_apart_and_merge_at_the_end_with_half_the_state(tmp_path):
    replicated, rep_summary, _ = _fit(
        tmp_path / "rep", AsyncSSPStrategy(local_steps=2, dynamic_local_steps=False, start_method="fork"),
        ShardedTinyAdamModel, steps=8,
    )  # fmt: skip
    sharded, summary, _ = _fit(tmp_path / "sh", _sharded(local_steps=2, dynamic_local_steps=False),
                               ShardedTinyAdamModel, steps=8)  # fmt: skip
    # One round late: the nodes never hold the same model during training, a node's two ranks always do.
    for step in range(8):
        torch.testing.assert_close(sharded[0][step], sharded[1][step])
        torch.testing.assert_close(sharded[2][step], sharded[3][step])
        assert not torch.allclose(sharded[0][step], sharded[2][step])
    for r in range(1, 4):
        torch.testing.assert_close(_fit.final[r], _fit.final[0])  # on_train_end: merged, one model everywhere
    for rep, sh in zip(rep_summary["ranks"], summary["ranks"], strict=True):
        assert sh["model_state_mb"] <= 0.6 * rep["model_state_mb"], (sh, rep)
        assert sh["staleness_mean"] > 0  # rounds were applied late, not at once


@pytest.mark.timeout(400)
def test_resume_from_a_distributed_checkpoint_is_exact(tmp_path):
    make = lambda: _sharded(local_steps=2, dynamic_local_steps=False, outer="nesterov", outer_lr=0.7)  # noqa: E731
    states = resume_at_step_4_matches(tmp_path, make, "syncasync_rounds")
    # Rounds 0 and 1 (ended at steps 2 and 4), and the cut's own round (no steps: it flushed round 1).
    assert all(s["delivered"] == 3 for s in states)
    momenta = [s["outer"]["buffer"] for s in states]
    assert not torch.equal(momenta[0], momenta[1])  # per rank: its shard's
    torch.testing.assert_close(momenta[0], momenta[2])  # the same shard on the other node: the same momentum


class RecordRounds(Callback):
    """The round state a rank starts from, after a checkpoint was loaded."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_start(self, trainer, pl_module):
        torch.save(trainer.strategy.rounds.state_dict(), Path(self.out) / f"rounds{trainer.global_rank}.pt")


@pytest.mark.timeout(400)
def test_two_nodes_resume_as_three_from_the_round_state_of_the_same_shards(tmp_path):
    def trainer(devices: int, nodes: int, steps: int, callbacks) -> Trainer:
        strategy = ShardedAsyncSSPStrategy(
            virtual_nodes=nodes, local_steps=2, dynamic_local_steps=False, outer="nesterov", outer_lr=0.7,
            compression="int8", start_method="fork",
        )  # fmt: skip
        return Trainer(
            accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False,
            default_root_dir=tmp_path, callbacks=callbacks, enable_checkpointing=True, enable_progress_bar=False,
            enable_model_summary=False,
        )  # fmt: skip

    torch.manual_seed(0)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4)
    trainer(4, 2, 4, [ckpt]).fit(ShardedTinyAdamModel())
    path = tmp_path / "ckpt" / "epoch=0-step=4.ckpt"
    saved = [torch.load(path / f"syncasync_rounds_rank{r}.pt", weights_only=True) for r in range(4)]
    torch.manual_seed(0)
    trainer(6, 3, 6, [RecordRounds(str(tmp_path))]).fit(ShardedTinyAdamModel(), ckpt_path=str(path))
    for r in range(6):
        got = torch.load(tmp_path / f"rounds{r}.pt", weights_only=True)
        same_shards = [saved[node * 2 + r % 2] for node in range(2)]
        # The outer momentum of this shard (the same on every node) and the round counters, as they were saved.
        torch.testing.assert_close(got["outer"]["buffer"], same_shards[0]["outer"]["buffer"], rtol=0, atol=0)
        assert got["delivered"] == same_shards[0]["delivered"] == 3
        assert got["compression"]["method"] == "int8" and not got["compression"]["server_residuals"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"local_steps": 1}, r"local_steps=1 is async_ssp's per-step mode.*HINT: local_steps=2 or more"),
        ({"local_steps": 0}, "local_steps must be an integer >= 1"),
        ({"staleness": -1}, "staleness must be an integer >= 0"),
        ({"node_size": 1}, "nothing to shard over"),
        ({"outer": "adam"}, "outer"),
        ({"start_method": "thread"}, "start_method must be one of"),
        ({"compression": "int8", "compression_options": {"chunk": 4}}, "unknown key"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ShardedAsyncSSPStrategy(**kwargs)

"""hier_sync_sharded: FSDP2 inside each node, DelayedAverager across nodes (4 gloo processes as 2 nodes of 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _models import ShardedTinyAdamModel, ShardedTinyModel, TinyModel
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy

from lightning_syncasync.callbacks import SyncMonitor
from lightning_syncasync.strategies._optim import unwrap_optimizer
from lightning_syncasync.strategies._sharded import _MergedWeightsLauncher
from lightning_syncasync.strategies.hier_sync import HierSyncStrategy
from lightning_syncasync.strategies.hier_sync_sharded import ShardedHierSyncStrategy, _local_optimizer_state

PARAM_BYTES = sum(p.numel() * 4 for p in ShardedTinyModel().parameters())


class _ForkedFSDP(ModelParallelStrategy):
    """Lightning's own FSDP2 strategy (the anchor), started by fork as the test needs; everything else unchanged."""

    def _configure_launcher(self):
        self._launcher = _MergedWeightsLauncher(self, start_method="fork")


class RecordFullParams(Callback):
    """The whole model after every step (a collective on sharded models: every rank calls it), saved by rank."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.steps: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in pl_module.parameters()]
        self.steps.append(torch.cat([p.detach().reshape(-1) for p in full]))

    def on_train_end(self, trainer, pl_module):
        # After the strategy's final merge, which runs before any user hook: the model a user's on_train_end sees.
        final = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in pl_module.parameters()]
        self.steps.append(torch.cat([p.detach().reshape(-1) for p in final]))
        torch.save(self.steps, Path(self.out) / f"rank{trainer.global_rank}.pt")


def _fit(out: Path, strategy, model_cls=ShardedTinyModel, steps: int = 6, ckpt_path=None, callbacks=()):
    out.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(
        accelerator="cpu", devices=4, strategy=strategy, max_steps=steps, logger=False, default_root_dir=out,
        callbacks=[SyncMonitor(summary_file=str(out / "summary.json"), print_summary=False),
                   RecordFullParams(str(out)), *callbacks],
        enable_checkpointing=bool(callbacks), enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = model_cls()
    trainer.fit(model, ckpt_path=ckpt_path)
    saved = [torch.load(out / f"rank{r}.pt") for r in range(4)]
    _fit.final = [s[-1] for s in saved]  # what on_train_end saw, per rank
    return [s[:-1] for s in saved], json.loads((out / "summary.json").read_text()), model


@pytest.mark.timeout(300)
def test_every_step_average_equals_fsdp_over_all_ranks(tmp_path):
    fsdp, fsdp_summary, _ = _fit(tmp_path / "fsdp", _ForkedFSDP(data_parallel_size=4, tensor_parallel_size=1))
    # SyncMonitor measures Lightning's own FSDP too: the all-gather of a quarter of the (padded) parameters and the
    # reduce-scatter of the whole padded gradient, every step.
    for rank in fsdp_summary["ranks"]:
        assert PARAM_BYTES < rank["bytes_intra_per_step"] < 2 * PARAM_BYTES
    ours, summary, model = _fit(
        tmp_path / "sharded",
        ShardedHierSyncStrategy(virtual_nodes=2, inter_period=1, max_delay=0, start_method="fork"),
    )
    for r in range(4):
        assert len(ours[r]) == 6
        for got, want in zip(ours[r], fsdp[0], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # FSDP2's own HSDP (sharded inside the node, gradient shards all-reduced across nodes every step), the
    # synchronous baseline of the benchmark, follows the same trajectory.
    hsdp, hsdp_summary, _ = _fit(tmp_path / "hsdp", ShardedHierSyncStrategy(virtual_nodes=2, hsdp=True,
                                                                        start_method="fork"))  # fmt: skip
    for got, want in zip(hsdp[3], fsdp[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert hsdp_summary["ranks"][0]["bytes_inter_per_step"] == PARAM_BYTES // 2  # the shard, every step
    # The main process gets the merged model back from the forked ranks.
    final = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    torch.testing.assert_close(final, ours[0][-1])
    for rank in summary["ranks"]:
        # Measured by SyncMonitor: inside the node FSDP's all-gather of this rank's half of the parameters and the
        # reduce-scatter of the whole gradient; across nodes the averager's round of the half, every step here,
        # with the round-length policy's 2 fp32 numbers riding on it.
        assert rank["bytes_intra_per_step"] == PARAM_BYTES // 2 + PARAM_BYTES
        assert rank["bytes_inter_per_step"] == PARAM_BYTES // 2 + 2 * 4


@pytest.mark.timeout(300)
def test_sharded_matches_replicated_hier_sync_and_holds_half_the_state(tmp_path):
    # Rounds every 2 steps, applied a step late: the node models drift apart between rounds, as in hier_sync.
    settings = {"virtual_nodes": 2, "inter_period": 2, "max_delay": 1, "start_method": "fork"}
    replicated, rep_summary, _ = _fit(tmp_path / "rep", HierSyncStrategy(**settings), ShardedTinyAdamModel, steps=8)
    sharded, sh_summary, _ = _fit(tmp_path / "sh", ShardedHierSyncStrategy(**settings), ShardedTinyAdamModel, steps=8)
    for r in range(4):
        for got, want in zip(sharded[r], replicated[r], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    # The nodes had drifted apart since the last round (step 6 launched it, applied at 7; step 8 trained apart), and
    # on_train_end sees them merged: one model on every rank.
    assert not torch.allclose(sharded[0][-1], sharded[2][-1])
    for r in range(1, 4):
        torch.testing.assert_close(_fit.final[r], _fit.final[0])
    # Parameters, gradients and Adam's moments: each rank holds its half of the node's model (the bound:
    # at most 1/2 + 10% of the replicated rank's).
    for rep, sh in zip(rep_summary["ranks"], sh_summary["ranks"], strict=True):
        assert rep["model_state_mb"] > 0
        assert sh["model_state_mb"] <= 0.6 * rep["model_state_mb"], (sh, rep)


@pytest.mark.timeout(400)
def test_resume_from_a_distributed_checkpoint_is_exact(tmp_path):
    make = lambda: ShardedHierSyncStrategy(  # noqa: E731
        virtual_nodes=2, inter_period=2, max_delay=1, outer="nesterov", outer_lr=0.7, start_method="fork"
    )
    states = resume_at_step_4_matches(tmp_path, make, "syncasync_averager")
    momenta = [s["momentum"] for s in states]
    assert all(m is not None for m in momenta) and not torch.equal(momenta[0], momenta[1])  # per rank: its shard


class RecordStart(Callback):
    """What a rank starts from, after a checkpoint was loaded: the whole model, the outer momentum of its shards and
    its optimizer shards."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_start(self, trainer, pl_module):
        full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in pl_module.parameters()]
        strategy = trainer.strategy
        state = {
            "model": torch.cat([p.detach().reshape(-1) for p in full]),
            "momentum": strategy.averager.outer_opt.buffer if strategy.averager is not None else None,
            "optimizer": _local_optimizer_state(unwrap_optimizer(strategy.optimizers[0])),
        }
        torch.save(state, Path(self.out) / f"start{trainer.global_rank}.pt")


@pytest.mark.timeout(400)
def test_another_number_of_nodes_resumes_from_the_mean_of_the_same_shards_and_another_node_size_is_refused(tmp_path):
    def fit(devices: int, nodes: int, steps: int, ckpt_path=None, callbacks=()) -> Path:
        out = tmp_path / f"{nodes}x{devices // nodes}"
        out.mkdir()
        strategy = ShardedHierSyncStrategy(
            virtual_nodes=nodes, inter_period=2, max_delay=1, outer="nesterov", outer_lr=0.7, start_method="fork"
        )
        trainer = Trainer(
            accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False,
            default_root_dir=out, callbacks=[RecordStart(str(out)), *callbacks], enable_checkpointing=bool(callbacks),
            enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        torch.manual_seed(0)
        trainer.fit(ShardedTinyAdamModel(), ckpt_path=ckpt_path)
        return out

    fit(4, 2, 4, callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4)])
    path = tmp_path / "ckpt" / "epoch=0-step=4.ckpt"
    saved = [torch.load(path / f"syncasync_averager_rank{r}.pt", weights_only=True) for r in range(4)]
    # 2 nodes of 2 resumed as 3 nodes of 2: a rank's shards are the same local rank's on every saved node.
    three = fit(6, 3, 6, ckpt_path=str(path))  # before: "the checkpoint's shards are for ..."
    for r in range(6):
        got = torch.load(three / f"start{r}.pt", weights_only=True)
        same_shards = [saved[node * 2 + r % 2] for node in range(2)]
        # The outer momentum is the same on every node (one global pseudo-gradient) and comes back as it was ...
        assert torch.equal(same_shards[0]["momentum"], same_shards[1]["momentum"])
        torch.testing.assert_close(got["momentum"], same_shards[0]["momentum"], rtol=0, atol=0)
        # ... and the nodes' optimizers, which trained apart, give their mean.
        for p, values in enumerate(got["optimizer"]):
            old = [s["optimizers"][0][p] for s in same_shards]
            assert not torch.equal(old[0]["exp_avg"], old[1]["exp_avg"])
            for name, value in values.items():
                want = (old[0][name] + old[1][name]) / 2 if value.is_floating_point() else old[0][name]
                torch.testing.assert_close(value, want, rtol=1e-6, atol=1e-7)

    # Another node size (one node of 4): the shards are cut elsewhere; refused on every rank, with the way on ...
    with pytest.raises(Exception, match=r"shards are for \{'world_size': 4, 'node_size': 2\}.*dcp_to_torch_save"):
        fit(4, 1, 6, ckpt_path=str(path))
    # ... which the hint describes: the folder converts to the merged model, the weights every resume starts from.
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(path, tmp_path / "weights.pt")
    model = ShardedTinyAdamModel()
    model.load_state_dict(torch.load(tmp_path / "weights.pt", weights_only=True)["state_dict"])
    start = torch.load(three / "start0.pt", weights_only=True)["model"]
    torch.testing.assert_close(torch.cat([p.detach().reshape(-1) for p in model.parameters()]), start)


def resume_at_step_4_matches(tmp_path: Path, make, state_prefix: str) -> list[dict]:
    """Train 8 steps of ShardedTinyAdamModel with a distributed checkpoint at step 4, resume a fresh run from it, and
    check the resumed steps equal the uninterrupted run's; returns each rank's state file written beside the
    checkpoint (``{state_prefix}_rank{R}.pt``)."""
    # 4 ranks x 4 batches per epoch: the checkpoint at step 4 is an epoch end, where Lightning resumes the data exactly.
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)
    full, _, _ = _fit(tmp_path / "full", make(), ShardedTinyAdamModel, steps=8, callbacks=[ckpt])
    path = tmp_path / "ckpt" / "epoch=0-step=4.ckpt"
    assert path.is_dir() and all((path / f"{state_prefix}_rank{r}.pt").is_file() for r in range(4))
    states = [torch.load(path / f"{state_prefix}_rank{r}.pt", weights_only=True) for r in range(4)]
    resumed, _, _ = _fit(tmp_path / "resumed", make(), ShardedTinyAdamModel, steps=8, ckpt_path=str(path),
                         callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt2", every_n_train_steps=8)])  # fmt: skip
    for r in range(4):
        assert len(resumed[r]) == 4
        for got, want in zip(resumed[r], full[r][4:], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    return states


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"node_size": 1}, "nothing to shard over"),
        ({"inter_period": 0}, "inter_period must be an integer >= 1"),
        ({"outer": "adam"}, "outer"),
        ({"start_method": "thread"}, "start_method must be one of"),
        ({"compression": "int8", "compression_options": {"chunk": 4}}, "unknown key"),
        ({"node_size": 2, "virtual_nodes": 2}, "both set the node size"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ShardedHierSyncStrategy(**kwargs)


class _NotSharded(TinyModel):
    def configure_model(self):
        pass  # overridden (Lightning insists) but shards nothing: a plain replica on every rank


class _NoParams(TinyModel):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.ReLU())

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        fully_shard(self, mesh=self.device_mesh["data_parallel"])  # what a user would write; nothing to shard

    def training_step(self, batch, batch_idx):
        return batch[0].sum() * 0.0

    def configure_optimizers(self):
        return None


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("devices", "model_cls", "match"),
    [
        # 2 ranks as 2 virtual nodes: one rank per node, nothing to shard over.
        (2, ShardedTinyModel, r"one rank per node, with nothing to shard over; HINT: use hier_sync \(replicas\)"),
        # A module whose configure_model does not shard (a plain replica on every rank).
        (
            4,
            _NotSharded,
            r"are not sharded over self.device_mesh\['data_parallel'\].*HINT: in configure_model call fully_shard",
        ),
        (4, _NoParams, r"has no parameters to shard; HINT"),
    ],
    ids=["one-rank-per-node", "not-sharded", "no-parameters"],
)
def test_bad_layouts_fail_at_setup_on_every_rank(tmp_path, devices, model_cls, match):
    trainer = Trainer(
        accelerator="cpu", devices=devices, max_steps=2, logger=False, default_root_dir=tmp_path,
        strategy=ShardedHierSyncStrategy(virtual_nodes=2, start_method="fork"),
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    with pytest.raises(Exception, match=match):
        trainer.fit(model_cls())

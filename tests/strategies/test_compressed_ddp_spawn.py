"""DDP with compressed gradient all-reduce (MeasuredDDPStrategy(compression=...)) on 2 gloo processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _models import TinyModel
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy

from lightning_syncasync.algorithms.compression.compressed_hook import CompressedAllReduce
from lightning_syncasync.algorithms.compression.compressor import Compressor
from lightning_syncasync.callbacks import SyncMonitor
from lightning_syncasync.strategies.measured_ddp import MeasuredDDPStrategy

PARAM_BYTES = sum(p.numel() * 4 for p in TinyModel().parameters())


class RecordParams(Callback):
    def __init__(self, out: str) -> None:
        self.out = out
        self.steps: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps.append(torch.cat([p.detach().flatten() for p in pl_module.parameters()]))

    def on_train_end(self, trainer, pl_module):
        torch.save(self.steps, Path(self.out) / f"rank{trainer.global_rank}.pt")


def _fit(out: Path, strategy, steps: int = 8, ckpt_path: str | None = None, callbacks=()) -> tuple[list, dict]:
    out.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, logger=False, default_root_dir=out,
        callbacks=[SyncMonitor(summary_file=str(out / "summary.json"), print_summary=False), RecordParams(str(out)),
                   *callbacks],
        enable_checkpointing=bool(callbacks), enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    torch.manual_seed(0)
    trainer.fit(TinyModel(), ckpt_path=ckpt_path)
    return [torch.load(out / f"rank{r}.pt") for r in range(2)], json.loads((out / "summary.json").read_text())


@pytest.mark.timeout(300)
def test_compressed_ddp_tracks_ddp_keeps_ranks_identical_and_sends_fewer_bytes(tmp_path):
    ddp, _ = _fit(tmp_path / "ddp", DDPStrategy(start_method="fork"))
    # int8 on this 706-parameter model: 3 chunks of 256 (the last one padded) and 3 scales = 27.6% of fp32.
    for method, ratio, tol in (("fp16", 0.5, 1e-3), ("int8", 0.28, 2e-2)):
        comp, summary = _fit(tmp_path / method, MeasuredDDPStrategy(compression=method, start_method="fork"))
        for got0, got1, want in zip(comp[0], comp[1], ddp[0], strict=True):
            torch.testing.assert_close(got0, got1)  # the same mean on every rank: replicas never drift
            assert (got0 - want).norm() <= tol * want.norm()
        for rank in summary["ranks"]:
            # Measured from the payload, not estimated: at most ratio x the fp32 gradients, and not nothing.
            assert 0.5 * ratio * PARAM_BYTES < rank["bytes_intra_per_step"] <= ratio * PARAM_BYTES


@pytest.mark.timeout(300)
def test_compression_warmup_is_exact_ddp_then_compresses(tmp_path):
    ddp, _ = _fit(tmp_path / "ddp", DDPStrategy(start_method="fork"))
    strategy = MeasuredDDPStrategy(compression="sign", compression_warmup_steps=3, start_method="fork")
    comp, summary = _fit(tmp_path / "sign", strategy)
    for step, (got0, got1, want) in enumerate(zip(comp[0], comp[1], ddp[0], strict=True)):
        torch.testing.assert_close(got0, got1)  # the same mean on every rank, in and after the warm-up
        err = float((got0 - want).norm() / want.norm())
        # Full precision for 3 steps (DDP's trajectory up to summation order), 1-bit signs after.
        assert err < 1e-6 if step < 3 else err > 1e-4, (step, err)
    for rank in summary["ranks"]:
        # Measured: 3 steps of fp32 gradients, then 5 of signs (3 chunks of 256 bits and 3 fp32 scales).
        assert rank["bytes_intra_per_step"] * 8 == pytest.approx(3 * PARAM_BYTES + 5 * (96 + 12))


class RecordGrads(Callback):
    """The averaged gradients DDP hands the optimizer, per step, and the hook's frozen RMS at the end (rank 0)."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.grads: list[list[torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads.append([p.grad.detach().clone() for p in pl_module.parameters()])

    def on_train_end(self, trainer, pl_module):
        if trainer.global_rank == 0:
            torch.save({"grads": self.grads, "rms": trainer.strategy._compressed._rms}, Path(self.out) / "grads.pt")


@pytest.mark.timeout(300)
def test_frozen_rms_is_the_warmups_gradient_rms_and_the_int8_warmup_sends_a_quarter(tmp_path):
    make = lambda warm: MeasuredDDPStrategy(  # noqa: E731
        compression="sign",
        compression_warmup_steps=3,
        compression_warmup=warm,
        compression_frozen_rms=True,
        start_method="fork",
    )
    comp, _ = _fit(tmp_path / "fp32", make("none"), callbacks=[RecordGrads(str(tmp_path / "fp32"))])
    for got0, got1 in zip(comp[0], comp[1], strict=True):
        torch.testing.assert_close(got0, got1)  # the RMS is the same on every rank: replicas never drift
    rec = torch.load(tmp_path / "fp32" / "grads.pt")
    assert len(rec["grads"]) == 8 and sorted(rec["rms"]) == list(range(len(rec["grads"][0])))
    for i, rms in rec["rms"].items():
        # The RMS over the 3 warm-up steps of the exact averaged gradients (the parameter's own, by index).
        want = torch.stack([step[i].flatten().double() for step in rec["grads"][:3]]).square().mean(0).sqrt()
        torch.testing.assert_close(rms, want.float().clamp_min(1e-3 * float(want.mean())), rtol=1e-5, atol=1e-9)
    # After the warm-up the optimizer sees each coordinate at its own scale: per coordinate, signs times the
    # chunk scale of g / rms times rms, not one magnitude per 256-element chunk as plain sign gives.
    after = torch.cat([g.flatten() for g in rec["grads"][5]]).abs()
    assert after.unique().numel() > 100
    _, summary = _fit(tmp_path / "int8", make("int8"))
    for rank in summary["ranks"]:
        # Measured: 3 warm-up steps of int8 (3 chunks of 256 bytes + 3 fp32 scales), then 5 of signs.
        assert rank["bytes_intra_per_step"] * 8 == pytest.approx(3 * (768 + 12) + 5 * (96 + 12))


@pytest.mark.timeout(400)
@pytest.mark.parametrize("method", ["int8", "powersgd", "sign", "sign_rms", "int4_two_phase"])
def test_resume_restores_every_ranks_residuals(tmp_path, method):
    options = {"rank": 2} if method == "powersgd" else {} if method.startswith("sign") else {"rounding": "stochastic"}
    if method == "int4_two_phase":
        # The two-phase layout forced on 2 ranks (auto all-gathers there): each rank's server residual, for the
        # shard it owns, must come back too.
        options["collective"] = "two_phase"
        method = "int4"
    # sign: the checkpoint falls inside a 10-step warm-up, so the resumed run must know how much of it is left;
    # sign_rms: also the warm-up's sums of squares, from which the RMS is frozen two steps after the resume.
    warmup = 10 if method.startswith("sign") else 0
    make = lambda: MeasuredDDPStrategy(  # noqa: E731
        compression=method.removesuffix("_rms"),
        compression_options=options,
        compression_warmup_steps=warmup,
        compression_frozen_rms=method == "sign_rms",
        start_method="fork",
    )
    # 2 ranks x 8 batches per epoch: the checkpoint at step 8 is an epoch end, where Lightning resumes the data exactly.
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=8, save_top_k=-1)
    full, _ = _fit(tmp_path / "full", make(), steps=12, callbacks=[ckpt])
    path = tmp_path / "ckpt" / "epoch=0-step=8.ckpt"
    state = torch.load(path, weights_only=True)["syncasync_compression"]
    assert state["world_size"] == 2 and len(state["ranks"]) == 2
    if options.get("collective") == "two_phase":
        assert all(rank["compressor"]["server_residuals"] for rank in state["ranks"])
    resumed, _ = _fit(tmp_path / "resumed", make(), steps=12, ckpt_path=str(path),
                      callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt2", every_n_train_steps=8)])  # fmt: skip
    for r in range(2):
        assert len(resumed[r]) == 4
        for got, want in zip(resumed[r], full[r][8:], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


class RecordResiduals(Callback):
    """The compressed hook's residuals as the fit starts (after a checkpoint was loaded), by rank."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_start(self, trainer, pl_module):
        hook = trainer.strategy._compressed
        held = {"residuals": dict(hook.residuals), "server": dict(hook.compressor.server_residuals)}
        torch.save(held, Path(self.out) / f"residuals{trainer.global_rank}.pt")


@pytest.mark.timeout(300)
def test_a_checkpoint_of_two_ranks_resumes_on_three_with_the_mean_of_their_residuals(tmp_path):
    # The two-phase layout forced on 2 ranks: each rank's own residuals and its shard's server residual.
    make = lambda: MeasuredDDPStrategy(  # noqa: E731
        compression="int4", compression_options={"collective": "two_phase"}, start_method="fork"
    )
    _fit(
        tmp_path / "two", make(), steps=4, callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4)]
    )
    path = tmp_path / "ckpt" / "epoch=0-step=4.ckpt"
    state = torch.load(path, weights_only=True)["syncasync_compression"]
    assert state["world_size"] == 2 and state["node_size"] is None
    assert all(rank["compressor"]["server_residuals"] for rank in state["ranks"])
    want = CompressedAllReduce.resized_state(state["ranks"], None)["residuals"]

    out = tmp_path / "three"
    out.mkdir()
    trainer = Trainer(
        accelerator="cpu", devices=3, strategy=make(), max_steps=6, logger=False, default_root_dir=out,
        callbacks=[RecordResiduals(str(out)), RecordParams(str(out))], enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    torch.manual_seed(0)
    trainer.fit(TinyModel(), ckpt_path=str(path))  # before: "residuals are for 2 ranks, this run has 3"
    for r in range(3):
        got = torch.load(out / f"residuals{r}.pt", weights_only=True)
        # Every rank holds the mean of the 2 saved ranks' residuals with their server residuals folded in: the
        # debt compression held back (algorithms test: the same as what the 2 ranks' own fold gives), none dropped.
        assert not got["server"] and set(got["residuals"]) == set(want)
        for i, residual in want.items():
            torch.testing.assert_close(got["residuals"][i], residual, rtol=0, atol=0)
        steps = torch.load(out / f"rank{r}.pt", weights_only=True)
        assert len(steps) == 2 and all(torch.isfinite(s).all() for s in steps)  # and it trains on, to step 6
    assert any(v.abs().max() > 0 for v in want.values())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"compression": "int3"}, "compression must be one of"),
        ({"compression": "int8", "local_sgd": "post_local_sgd"}, "cannot be combined"),
        ({"compression": "int8", "compression_options": {"chunk_size": 7}}, "chunk_size"),
        ({"compression": "sign", "compression_warmup_steps": -1}, "compression_warmup_steps must be"),
        ({"compression_warmup_steps": 10}, "compression_warmup_steps=10 given with compression='none'"),
        ({"compression": "sign", "compression_warmup_steps": 5, "compression_warmup": "sign"}, "compression_warmup"),
        ({"compression": "sign", "compression_warmup": "int8"}, "given without a warm-up"),
        ({"compression": "sign", "compression_frozen_rms": True}, "compression_frozen_rms needs"),
        ({"compression": "fp16", "compression_warmup_steps": 5, "compression_frozen_rms": True}, "frozen_rms needs"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MeasuredDDPStrategy(**kwargs)


@pytest.mark.timeout(300)
def test_onebit_adam_under_ddp_measured_stops_gradient_traffic_after_warmup(tmp_path):
    from _models import TinyOneBitModel

    out = tmp_path / "onebit"
    out.mkdir()
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy=MeasuredDDPStrategy(start_method="fork"), max_steps=8, logger=False,
        callbacks=[SyncMonitor(summary_file=str(out / "summary.json"), print_summary=False), RecordParams(str(out)),
                   ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=8, filename="last")],
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(TinyOneBitModel())
    # Each rank's 1-bit residuals reach the checkpoint (gathered as tensors), and it loads with weights_only=True.
    ranks = torch.load(out / "ckpt" / "last.ckpt", weights_only=True)["syncasync_onebit_adam"]
    assert (
        len(ranks) == 2
        and ranks[0][0]["residuals"]
        and ranks[0][0]["residuals"].keys() == ranks[1][0]["residuals"].keys()
    )
    key = next(iter(ranks[0][0]["residuals"]))
    assert not torch.equal(ranks[0][0]["residuals"][key], ranks[1][0]["residuals"][key])  # per rank, not rank 0's
    steps = [torch.load(out / f"rank{r}.pt") for r in range(2)]
    for a, b in zip(*steps, strict=True):
        torch.testing.assert_close(a, b)  # replicas agree every step, during and after warm-up
    summary = json.loads((out / "summary.json").read_text())
    for rank in summary["ranks"]:
        # 3 warm-up steps of fp32 gradients, then 5 steps of 1-bit momenta (3 chunks of 256 bits + 3 scales).
        assert rank["bytes_intra_per_step"] * 8 == pytest.approx(3 * PARAM_BYTES + 5 * (96 + 12))

    # Resumed on 3 ranks: every rank starts from the mean of the 2 saved ranks' residuals (nothing dropped).
    want = Compressor.resized_state([r[0] for r in ranks])["residuals"]
    more = tmp_path / "three"
    more.mkdir()
    trainer = Trainer(
        accelerator="cpu", devices=3, strategy=MeasuredDDPStrategy(start_method="fork"), max_steps=10, logger=False,
        callbacks=[RecordOneBitResiduals(str(more))], enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(TinyOneBitModel(), ckpt_path=str(out / "ckpt" / "last.ckpt"))  # before: rank 2 found no state
    for r in range(3):
        (got,) = torch.load(more / f"onebit{r}.pt", weights_only=True)
        assert got.keys() == want.keys()
        for k, residual in want.items():
            torch.testing.assert_close(got[k], residual, rtol=0, atol=0)


class RecordOneBitResiduals(Callback):
    """1-bit Adam's residuals as the fit starts (after a checkpoint was loaded), by rank."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_start(self, trainer, pl_module):
        held = [dict(o.compressor.residuals) for o in trainer.strategy._onebit()]
        torch.save(held, Path(self.out) / f"onebit{trainer.global_rank}.pt")


@pytest.mark.timeout(300)
def test_two_saves_at_one_step_gather_the_residuals_once(tmp_path, monkeypatch):
    # ModelCheckpoint with save_last saves twice per step (the step's file and last.ckpt). The residuals gather (a
    # model's worth of fp32 from every rank) runs once for both; the forked ranks inherit the counting wrapper.
    from lightning_syncasync.strategies import measured_ddp

    original = measured_ddp.all_gather_state

    def counted(state, group=None):
        import torch.distributed as dist

        with open(tmp_path / f"gathers{dist.get_rank()}", "a") as fh:
            fh.write("1\n")
        return original(state, group)

    monkeypatch.setattr(measured_ddp, "all_gather_state", counted)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1, save_last=True)
    _, summary = _fit(tmp_path / "run", MeasuredDDPStrategy(compression="int8", start_method="fork"), callbacks=[ckpt])
    for r in range(2):
        assert (tmp_path / f"gathers{r}").read_text().count("1") == 2  # steps 4 and 8, not 4 saves
    at_8 = torch.load(tmp_path / "ckpt" / "epoch=0-step=8.ckpt", weights_only=True)["syncasync_compression"]
    last = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)["syncasync_compression"]
    at_4 = torch.load(tmp_path / "ckpt" / "epoch=0-step=4.ckpt", weights_only=True)["syncasync_compression"]
    for a, b, c in zip(at_8["ranks"], last["ranks"], at_4["ranks"], strict=True):
        assert a["steps"] == b["steps"] == 8 and c["steps"] == 4
        for i in a["residuals"]:
            torch.testing.assert_close(a["residuals"][i], b["residuals"][i])
            assert not torch.equal(a["residuals"][i], c["residuals"][i])  # step 8's state, not step 4's reused
    assert summary["checkpoint_s"] > 0

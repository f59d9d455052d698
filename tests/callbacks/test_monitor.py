"""SyncMonitor with real Lightning runs: DDP over gloo (spawn) and a single process."""

from __future__ import annotations

import csv
import json
import time
from collections import Counter
from pathlib import Path

import pytest
from _models import TinyModel  # noqa: E402 (tests/ is on sys.path through its conftest)
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.io import TorchCheckpointIO

from lightning_syncasync.callbacks import SyncMonitor

PARAM_BYTES = sum(p.numel() * 4 for p in TinyModel().parameters())


def _fit(tmp_path: Path, model: TinyModel | None = None, **trainer_kwargs) -> dict:
    summary_file = tmp_path / "summary.json"
    kwargs = {"max_steps": 10, "log_every_n_steps": 1, **trainer_kwargs}
    trainer = Trainer(
        accelerator="cpu",
        logger=CSVLogger(tmp_path, name="csv", version=0),
        callbacks=[SyncMonitor(summary_file=str(summary_file))],
        enable_checkpointing=False,
        enable_model_summary=False,
        **kwargs,
    )
    trainer.fit(model or TinyModel())
    return json.loads(summary_file.read_text())


@pytest.mark.timeout(180)
def test_ddp_fork_reports_bytes_and_wait_per_step(tmp_path):
    summary = _fit(tmp_path, strategy="ddp_fork", devices=2, enable_progress_bar=False)
    assert summary["world_size"] == 2 and summary["mode"] == "sync" and len(summary["ranks"]) == 2
    for rank in summary["ranks"]:
        assert rank["steps"] == 10, summary
        # Measured from DDP's gradient buckets: exactly the model's gradient bytes every step, all intra-node.
        assert rank["bytes_intra_per_step"] == PARAM_BYTES
        assert rank["bytes_inter_per_step"] == 0
        assert rank["wait_s_per_step"] > 0, summary
        assert 0 < rank["wait_frac"] < 1, summary
        assert rank["samples_per_s"] > 0, summary
    assert summary["global_samples_per_s"] == pytest.approx(sum(r["samples_per_s"] for r in summary["ranks"]))
    with open(tmp_path / "csv" / "version_0" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    logged = {k for row in rows for k, v in row.items() if v}
    for name in (
        "compute_s",
        "wait_s",
        "bytes_intra",
        "bytes_inter",
        "samples_per_s",
        "staleness",
        "epoch_global_samples_per_s",
        "epoch_bytes_per_step",
    ):
        assert f"syncasync/{name}" in logged
    assert float(next(r for r in rows if r["syncasync/bytes_intra"])["syncasync/bytes_intra"]) == PARAM_BYTES


class _LateGather(Callback):
    """SyncSwitcher's and AdaptiveBatchSize's pattern: every rank gathers a row at the start of a step; rank 1 comes
    late, so rank 0 waits for it there."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        from lightning_syncasync.callbacks._stats_source import gather_rows

        if trainer.global_rank == 1:
            time.sleep(0.2)
        gather_rows(trainer, [float(batch_idx)])


@pytest.mark.timeout(180)
def test_a_wait_at_a_callbacks_gather_is_wait_not_compute(tmp_path):
    summary_file = tmp_path / "summary.json"
    trainer = Trainer(
        accelerator="cpu", strategy="ddp_fork", devices=2, max_steps=8, enable_progress_bar=False,
        callbacks=[SyncMonitor(summary_file=str(summary_file)), _LateGather()], logger=False,
        enable_checkpointing=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(TinyModel())
    ranks = json.loads(summary_file.read_text())["ranks"]
    # Rank 0 waited about 0.2 s a step at the gather: its wait, not its compute (which StragglerEmulator scales its
    # pauses by, and AdaptiveBatchSize its split). Rank 1's sleep is its own time, as an emulated pause is.
    assert ranks[0]["wait_s_per_step"] > 0.15, ranks[0]
    assert ranks[0]["wait_frac"] > 0.6, ranks[0]
    assert ranks[1]["wait_frac"] < 0.5, ranks[1]


class _BackgroundGather(Callback):
    """PendingRows' pattern: a row launched at one step and read at the next; rank 1 launches 1 s late at step 2."""

    def __init__(self, out: str) -> None:
        self.out, self.pending, self.seen = out, None, {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        from lightning_syncasync.callbacks._stats_source import PendingRows, ranks_apart

        step = trainer.global_step
        if self.pending is not None:
            self.seen["rows"] = self.pending.rows()
            self.pending = None
        if step == 2:
            if trainer.global_rank == 1:
                time.sleep(1.0)
            start = time.perf_counter()
            self.pending = PendingRows(trainer, [float(trainer.global_rank), float(step)])
            self.seen["launch_s"] = time.perf_counter() - start
            self.seen["asynchronous"] = ranks_apart(trainer)

    def on_fit_end(self, trainer, pl_module):
        (Path(self.out) / f"seen{trainer.global_rank}.json").write_text(json.dumps(self.seen))


@pytest.mark.timeout(180)
def test_a_gather_launched_in_the_background_returns_at_once_and_is_read_later(tmp_path):
    trainer = Trainer(
        accelerator="cpu", strategy="ddp_fork", devices=2, max_steps=5, enable_progress_bar=False,
        callbacks=[SyncMonitor(print_summary=False), _BackgroundGather(str(tmp_path))], logger=False,
        enable_checkpointing=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(TinyModel())
    seen = [json.loads((tmp_path / f"seen{r}.json").read_text()) for r in range(2)]
    # Rank 0 launched while rank 1 was still asleep for 1 s: the launch did not wait for it.
    assert seen[0]["launch_s"] < 0.5, seen
    for s in seen:
        assert s["rows"] == [[0.0, 2.0], [1.0, 2.0]], s
        assert s["asynchronous"] is False  # DDP's recorder is in sync mode: the callbacks keep their blocking gather


class _CountingLogs(TinyModel):
    """Counts ``self.log`` calls per name."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def log(self, name, value, *args, **kwargs):
        self.calls[name] += 1
        super().log(name, value, *args, **kwargs)


def test_per_step_values_are_logged_on_lightnings_logging_steps_and_the_summary_counts_every_step(tmp_path):
    # Each self.log costs host time every step; like Lightning's own monitors, SyncMonitor writes its per-step
    # values straight to the loggers where they write (log_every_n_steps), and still aggregates every step
    # (buffered: 70 steps cross one flush of the aggregates and end with a partial one).
    model = _CountingLogs()
    summary = _fit(tmp_path, model, devices=1, max_steps=70, log_every_n_steps=8, enable_progress_bar=False)
    with open(tmp_path / "csv" / "version_0" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("syncasync/compute_s")]
    assert [int(r["step"]) for r in rows] == list(range(7, 70, 8))
    # Not through self.log: a name there stays in Lightning's result collection, which it walks every step. Only
    # the once-per-epoch figures (reduced over the ranks) go that way.
    assert set(model.calls) == {"syncasync/epoch_global_samples_per_s", "syncasync/epoch_bytes_per_step"}, model.calls
    (rank,) = summary["ranks"]
    assert rank["steps"] == 70 and rank["samples_per_s"] > 0, summary


def test_under_gradient_accumulation_each_logging_step_is_written_once(tmp_path):
    # should_update_logs stays true for every micro-batch of a logging step; Lightning writes its own step values
    # once, after the optimizer step, and so must the monitor.
    _fit(tmp_path, devices=1, max_steps=8, accumulate_grad_batches=3, log_every_n_steps=2, enable_progress_bar=False)
    with open(tmp_path / "csv" / "version_0" / "metrics.csv") as f:
        steps = [int(r["step"]) for r in csv.DictReader(f) if r.get("syncasync/compute_s")]
    assert steps == [1, 3, 5, 7], steps


class _ReadProgressBar(Callback):
    def __init__(self) -> None:
        self.items: dict = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.items = trainer.progress_bar_callback.get_metrics(trainer, pl_module)


def test_single_process_reports_no_communication_and_shows_mode_in_progress_bar(tmp_path):
    reader = _ReadProgressBar()
    monitor = SyncMonitor()
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=5,
        logger=False,
        callbacks=[monitor, reader],
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(TinyModel())
    assert reader.items["mode"] == "local"
    assert reader.items["syncasync/sps"] > 0
    s = monitor.summary
    assert s["world_size"] == 1 and s["bytes_per_step"] == 0 and s["wait_s_per_step"] == 0
    assert s["ranks"][0]["steps"] == 5
    assert monitor.recorder is not None and len(monitor.recorder.history) == 5
    # the progress bar is handed back unchanged after fit
    assert "mode" not in trainer.progress_bar_callback.get_metrics(trainer, trainer.lightning_module)


class _SlowSaves(TorchCheckpointIO):
    """A checkpoint writer that takes 0.4 s per file, like a large state over a slow disk or link."""

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        time.sleep(0.4)
        super().save_checkpoint(checkpoint, path, storage_options)


@pytest.mark.timeout(180)
def test_checkpoint_saves_are_kept_out_of_step_times(tmp_path):
    # ModelCheckpoint saves after the monitor closed the step; without care its time reads as the next step's
    # compute (and made int8 look slower than fp32 DDP at 4 nodes, where a save gathers every rank's residuals).
    monitor = SyncMonitor(print_summary=False)
    trainer = Trainer(
        accelerator="cpu", devices=1, max_steps=8, logger=False, default_root_dir=tmp_path, plugins=[_SlowSaves()],
        callbacks=[monitor, ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)],
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    start = time.perf_counter()
    trainer.fit(TinyModel())
    elapsed = time.perf_counter() - start
    saves = len(list((tmp_path / "ckpt").glob("*.ckpt")))
    assert saves == 4
    s = monitor.summary
    assert s["checkpoint_s"] >= 0.4 * saves
    walls = [step.wall_s for step in monitor.recorder.history]
    assert max(walls) < 0.3, walls  # no step carries a 0.4 s save
    # Time-to-accuracy figures use training time, which leaves the saves out as it leaves validation out.
    assert monitor._train_s() < elapsed - 0.4 * saves


def test_bad_smoothing_is_rejected():
    with pytest.raises(ValueError, match="smoothing"):
        SyncMonitor(smoothing=1.0)


def test_optimizer_state_bytes_counts_the_moments_and_unwraps_wrappers():
    import torch

    from lightning_syncasync.callbacks._summary import _optimizer_state_bytes

    params = [torch.nn.Parameter(torch.zeros(10, 10)), torch.nn.Parameter(torch.zeros(5))]
    opt = torch.optim.Adam(params)
    assert _optimizer_state_bytes(opt) == 0  # no state before the first step
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    # exp_avg and exp_avg_sq, fp32, for 105 values; the scalar step counters are left out.
    assert _optimizer_state_bytes(opt) == 2 * 105 * 4

    class Wrapper:  # what Lightning's and DeepSpeed's optimizer wrappers look like from outside
        def __init__(self, inner):
            self.optimizer = inner

    assert _optimizer_state_bytes(Wrapper(Wrapper(opt))) == 2 * 105 * 4


def test_summary_printout_lists_policy_events(capsys):
    from lightning_syncasync.callbacks._summary import print_summary_table

    rank = {"rank": 0, "steps": 10, "samples_per_s": 5.0, "compute_s_per_step": 0.1, "wait_s_per_step": 0.01,
            "wait_frac": 0.1, "bytes_intra_per_step": 0, "bytes_inter_per_step": 0, "staleness_mean": 0.0,
            "staleness_max": 0}  # fmt: skip
    summary = {**rank, "strategy": "AutoSyncStrategy", "mode": "hier", "world_size": 1, "num_nodes": 1,
               "ranks": [rank], "global_samples_per_s": 5.0,
               "events": [{"kind": "switch", "step": 4, "train_s": 1.5, "mode": "sync", "next": "hier",
                           "reason": "communication 71% >= 35% of the step: hierarchical sync"}]}  # fmt: skip
    print_summary_table(summary, "run/summary.json")
    out = capsys.readouterr().out
    assert "events: 1 switch" in out
    assert "step 4 (1.5 s) switch: sync -> hier: communication 71% >= 35% of the step: hierarchical sync" in out
    assert 'every event with all its fields: run/summary.json ("events")' in out


def test_two_dozen_events_print_as_a_few_short_lines_with_every_switch_and_no_raw_float():
    # A new user's auto_sync run printed 24 rebalance and switch events, each over two lines with raw floats.
    import re

    from lightning_syncasync.callbacks._events import event_lines

    events = []
    for i in range(20):
        events.append({"kind": "rebalance", "step": 10 * i, "train_s": 0.5 * i, "batch": 10 * i,
                       "previous": [16, 16], "sizes": [17, 15], "throughput": [101.23, 95.5],
                       "predicted_speedup": 1.0666666666666667})  # fmt: skip
    reasons = ["communication 71% >= 35% of the step: hierarchical sync",
               "jitter 0.81 >= 0.5 on the slow link: asynchronous (SSP)", "homogeneous: synchronous"]  # fmt: skip
    for i, (a, b) in enumerate([("sync", "hier"), ("hier", "async"), ("async", "sync")]):
        events.append({"kind": "switch", "step": 40 * i, "train_s": 2.0 * i, "mode": a, "next": b,
                       "reason": reasons[i], "signals": "comm 71%, straggler ratio 1.00, jitter 0.05"})  # fmt: skip
    events.append({"kind": "rollback", "step": 150, "train_s": 9.0, "mode": "async", "next": "sync",
                   "reason": "divergence (loss 5 > 2 (2 x the median recent 1)) in async: " + "x" * 200})  # fmt: skip
    lines = event_lines(events, width=100, where="summary.json")
    assert len(lines) <= 8, lines
    assert lines[0] == "events: 20 rebalances, 3 switches, 1 rollback"
    assert all(len(line) <= 100 for line in lines) and lines[4].endswith("…")  # the long rollback reason
    for reason in reasons:
        assert any(reason in line for line in lines), lines
    assert "  batch split: 20 changes, the last step 190 (9.5 s): [16, 16] -> [17, 15], predicted 1.07x faster" in lines
    assert not re.search(r"\d\.\d{6,}", "\n".join(lines)), lines  # no float printed raw
    assert event_lines([]) == []


def test_summary_header_names_the_codec_and_the_strategys_notes(capsys):
    from lightning_syncasync.callbacks._summary import _codec, print_summary_table

    class Strategy:  # the two attributes every compressing strategy of the pack has
        compression, compression_options = "topk", {"ratio": 0.01}

    assert _codec(Strategy()) == "topk(ratio=0.01)"
    Strategy.compression = "none"
    assert _codec(Strategy()) is None
    rank = {"rank": 0, "steps": 10, "samples_per_s": 5.0, "compute_s_per_step": 0.1, "wait_s_per_step": 0.01,
            "wait_frac": 0.1, "bytes_intra_per_step": 0, "bytes_inter_per_step": 0, "staleness_mean": 0.0,
            "staleness_max": 0}  # fmt: skip
    summary = {**rank, "strategy": "HierSyncStrategy", "mode": "sync", "world_size": 2, "num_nodes": 1,
               "ranks": [rank], "global_samples_per_s": 5.0, "compression": "int8",
               "notes": ["one node: every step was plain DDP"]}  # fmt: skip
    print_summary_table(summary)
    out = capsys.readouterr().out
    header = out.split("┏")[0]  # above the table
    assert "(mode sync, compression int8)" in header and "NOTE: one node: every step was plain DDP" in header

"""The Hydra app end to end, as users run it (subprocesses: Lightning's `ddp` launcher re-runs the command)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def _train(tmp_path: Path, *overrides: str, multirun: bool = False, timeout: int = 240) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "lightning_syncasync.train", *(["-m"] if multirun else []), *overrides]
    cmd.append(f"hydra.sweep.dir={tmp_path}" if multirun else f"hydra.run.dir={tmp_path}")
    return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=timeout)


def _ends_with_the_summary(proc: subprocess.CompletedProcess, bar: bool) -> None:
    """Captured output is not a terminal: no progress bar unless asked for (issue 23 item 8), and an asked-for bar
    (rich) must not draw its final frame below the table either."""
    output = proc.stdout + proc.stderr
    assert ("Epoch 0" in proc.stdout) is bar and ("Epoch 0" in output) is bar, output[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    # The last table printed is the summary (its header has the wait column), its rows, then only the app's log line.
    top = max(i for i, line in enumerate(lines) if line.startswith("┏"))
    bottom = max(i for i, line in enumerate(lines) if line.startswith("└"))
    assert top < bottom and "wait ms/step" in lines[top + 1], proc.stdout[-3000:]
    assert all(line.startswith(("┃", "┡", "│")) for line in lines[top + 1 : bottom]), proc.stdout[-3000:]
    assert len(lines) == bottom + 2 and "done: val_acc=" in lines[-1], proc.stdout[-3000:]


@pytest.mark.timeout(300)
def test_default_job_reaches_95_percent_reports_ddp_bytes_and_wait_and_ends_with_the_summary(tmp_path):
    proc = _train(tmp_path)  # as the README's first command runs it, into a pipe
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["world_size"] == 2
    assert results["metrics"]["val_acc"] >= 0.95
    summary = results["sync_summary"]
    assert summary["bytes_per_step"] > 0 and summary["wait_s_per_step"] > 0
    assert "syncasync summary" in proc.stdout
    _ends_with_the_summary(proc, bar=False)
    assert (tmp_path / "checkpoints" / "last.ckpt").exists()
    # Nothing that says nothing about the run: Lightning's litlogger/litmodels tips, torch's LeafSpec deprecation.
    assert "Tip:" not in proc.stdout + proc.stderr and "LeafSpec" not in proc.stdout + proc.stderr


@pytest.mark.slow  # the default run checks the summary's place without a bar (the default job above)
@pytest.mark.timeout(300)
def test_an_asked_for_bar_in_a_log_file_ends_before_the_summary(tmp_path):
    proc = _train(tmp_path, "trainer.max_epochs=1", "trainer.enable_progress_bar=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    _ends_with_the_summary(proc, bar=True)


@pytest.mark.parametrize(
    ("trainer_kwargs", "callbacks", "tty", "expected"),
    [
        ({}, [], False, False),  # a log file or pipe: no bar
        ({"enable_progress_bar": None}, [], True, True),  # a terminal: a bar
        ({"enable_progress_bar": True}, [], False, True),  # the user's choice wins
        ({"enable_progress_bar": False}, [], True, False),
        ({}, ["rich"], False, True),  # a configured bar callback asks for a bar (Lightning refuses False beside it)
        ({"barebones": True}, [], True, None),  # barebones refuses any bar: Lightning decides
    ],
)
def test_progress_bar_setting_resolves_to_a_bar_only_on_a_terminal(trainer_kwargs, callbacks, tty, expected):
    import io

    from lightning.pytorch.callbacks import RichProgressBar

    from lightning_syncasync._progress_bar import resolve_enable_progress_bar

    class Stream(io.StringIO):
        def isatty(self) -> bool:
            return tty

    objects = [RichProgressBar() for _ in callbacks]
    assert resolve_enable_progress_bar(trainer_kwargs, objects, stream=Stream()) is expected


@pytest.mark.slow  # tests/examples runs a multirun over strategies (with a user's search path) in the default suite
@pytest.mark.timeout(400)
def test_multirun_over_strategies_gives_one_result_per_job(tmp_path):
    proc = _train(
        tmp_path,
        "strategy=ddp,ddp_spawn",
        "trainer.max_epochs=1",
        "trainer.enable_progress_bar=false",
        multirun=True,
        timeout=380,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = sorted(p for p in tmp_path.iterdir() if p.is_dir() and p.name.isdigit())
    assert [p.name for p in jobs] == ["0", "1"]
    for job, start_method in zip(jobs, ["popen", "spawn"], strict=True):
        res = json.loads((job / "results.json").read_text())
        assert res["config"]["trainer"]["strategy"]["start_method"] == start_method
        assert res["sync_summary"]["bytes_per_step"] > 0
        assert res["global_step"] > 0 and 0.0 < res["metrics"]["val_acc"] <= 1.0


@pytest.mark.timeout(120)
def test_bad_input_fails_before_training_with_a_named_setting(tmp_path):
    # The exit path, once, as a user's shell sees it; each bad setting's message (trainer.devices=0, model.depth=0,
    # ...) is checked in this process by tests/test_bad_input.py.
    override, message = "strategy=nope", "nope"
    proc = _train(tmp_path, override, timeout=100)
    assert proc.returncode != 0
    assert message in proc.stderr + proc.stdout
    assert "Epoch 0" not in proc.stdout


@pytest.mark.timeout(60)
def test_data_order_reseeds_the_batches_order_after_the_initialisation():
    # data_order=1 (the ddp_other_order contender): the model is built under the seed, then everything drawn after it
    # comes from another seed; Lightning's injected DistributedSampler reads it when fit() builds the loaders.
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.trainer.connectors.data_connector import _get_distributed_sampler
    from torch.utils.data import DataLoader

    from lightning_syncasync.train import reseed_after_init

    def order() -> list[int]:
        loader = DataLoader(list(range(64)), shuffle=True)
        sampler = _get_distributed_sampler(loader, shuffle=True, overfit_batches=0, num_replicas=1, rank=0)
        return list(sampler)

    def start(data_order: int) -> tuple[torch.Tensor, list[int], torch.Tensor]:
        pl.seed_everything(42, verbose=False)
        weights = torch.nn.Linear(4, 4).weight.detach().clone()  # the model, initialised under the seed
        if data_order:
            assert reseed_after_init(42, data_order) == 42 + 1000 * data_order
        return weights, order(), torch.rand(3)

    w0, order0, draw0 = start(0)
    w1, order1, draw1 = start(1)
    assert torch.equal(w0, w1)  # the same initial weights
    assert sorted(order0) == sorted(order1) and order0 != order1  # the same batches, in another order
    assert not torch.equal(draw0, draw1)  # and every later draw (dropout) is another
    assert start(1)[1] == order1  # reproducible

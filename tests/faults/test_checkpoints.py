"""Checkpoints (issue 10): a crash mid-write leaves nothing that loads as valid; truncated, foreign or unsafe files
are refused with a message naming the file and what to do; loads are weights_only by default."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _models import TinyModel
from lightning.pytorch import Trainer

from lightning_syncasync.plugins import AtomicCheckpointIO, CheckpointLoadError
from lightning_syncasync.strategies.async_ssp import AsyncSSPStrategy

pytestmark = pytest.mark.faults

WRITER = """
import sys, torch
from lightning_syncasync.plugins import AtomicCheckpointIO
io, path = AtomicCheckpointIO(), sys.argv[1]
big = torch.randn(40_000_000)  # 160 MB: long enough a write to be killed in the middle of it
for version in range(1000):
    io.save_checkpoint({"state_dict": {"w": big}, "version": version}, path)
"""


@pytest.mark.timeout(120)
def test_a_crash_mid_write_never_leaves_a_checkpoint_that_loads_as_valid(tmp_path):
    path = tmp_path / "last.ckpt"
    for attempt in range(2):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path)])
        deadline = time.monotonic() + 60
        # Kill while a temporary file is being written: on the first attempt before any checkpoint exists, on the
        # second while a complete one from the first attempt is being replaced.
        while not any(p.name.startswith(".last.ckpt.tmp") and p.stat().st_size > 0 for p in tmp_path.iterdir()):
            assert time.monotonic() < deadline and proc.poll() is None, "the writer never started a write"
            time.sleep(0.005)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        if attempt == 0:
            assert not path.exists()  # the only write was cut: no checkpoint, not a broken one
            AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": torch.ones(3)}, "version": -1}, path)
        else:
            ckpt = AtomicCheckpointIO().load_checkpoint(path)  # the previous checkpoint, whole
            assert ckpt["version"] == -1 and torch.equal(ckpt["state_dict"]["w"], torch.ones(3))


def _valid(tmp_path: Path) -> Path:
    path = tmp_path / "good.ckpt"
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      plugins=[AtomicCheckpointIO()])  # fmt: skip
    trainer.fit(TinyModel())
    trainer.save_checkpoint(path)
    return path


def _fit_from(tmp_path: Path, ckpt: Path) -> None:
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, plugins=[AtomicCheckpointIO()],
                      default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(TinyModel(), ckpt_path=ckpt)


@pytest.mark.timeout(60)
def test_truncated_foreign_and_unsafe_checkpoints_are_refused_clearly(tmp_path):
    good = _valid(tmp_path)
    assert AtomicCheckpointIO().load_checkpoint(good)["global_step"] == 2  # weights_only=True loads Lightning's own
    _fit_from(tmp_path, good)  # and resuming from it works

    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(
        CheckpointLoadError, match=r"truncated\.ckpt .*truncated, corrupt.*HINT: resume from an earlier"
    ):
        _fit_from(tmp_path, truncated)

    # A file of bare weights given as the checkpoint to resume from: our strategies refuse it by name (the plugin
    # alone must load it: Lightning's spawn launcher passes bare weights through it).
    foreign = tmp_path / "weights.pt"
    torch.save(TinyModel().state_dict(), foreign)
    assert set(AtomicCheckpointIO().load_checkpoint(foreign)) == set(TinyModel().state_dict())
    with pytest.raises(CheckpointLoadError, match=r"weights\.pt is not a Lightning checkpoint.*HINT: for bare weights"):
        AsyncSSPStrategy().load_checkpoint(foreign)

    unsafe = tmp_path / "unsafe.ckpt"
    torch.save({"state_dict": {}, "payload": Path("/etc/passwd")}, unsafe)  # an arbitrary object: needs unpickling
    with pytest.raises(CheckpointLoadError, match=r"weights_only=True refuses.*HINT: if you trust its source"):
        AtomicCheckpointIO().load_checkpoint(unsafe)

    with pytest.raises(FileNotFoundError, match="does not exist; HINT"):
        _fit_from(tmp_path, tmp_path / "missing.ckpt")

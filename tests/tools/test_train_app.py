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


@pytest.mark.timeout(300)
def test_default_job_reaches_95_percent_and_reports_ddp_bytes_and_wait(tmp_path):
    proc = _train(tmp_path, "trainer.enable_progress_bar=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["world_size"] == 2
    assert results["metrics"]["val_acc"] >= 0.95
    summary = results["sync_summary"]
    assert summary["bytes_per_step"] > 0 and summary["wait_s_per_step"] > 0
    # The summary table is printed at the end of fit.
    assert "syncasync summary" in proc.stdout and "wait ms/step" in proc.stdout
    assert (tmp_path / "checkpoints" / "last.ckpt").exists()


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
@pytest.mark.parametrize(
    ("override", "message"),
    [("trainer.devices=0", "trainer.devices"), ("strategy=nope", "nope"), ("model.depth=0", "depth")],
)
def test_bad_input_fails_before_training_with_a_named_setting(tmp_path, override, message):
    proc = _train(tmp_path, override, timeout=100)
    assert proc.returncode != 0
    assert message in proc.stderr + proc.stdout
    assert "Epoch 0" not in proc.stdout

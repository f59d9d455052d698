"""The DeepSpeed presets training the transformer demo on one GPU through the Hydra app. In a file of their own:
DeepSpeed's start on a GPU is the slowest and least predictable part of the GPU tests, so ``scripts/gpu_check.sh``
runs this file last, where a check stopped by its time limit loses only these."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from _gpu import CUDA, gpu_tests
from _ranks import REPO

pytestmark = gpu_tests

PRESETS = ["deepspeed_fp16", "deepspeed_zero2_bf16", "deepspeed_zero3_offload"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("preset", PRESETS)
def test_deepspeed_presets_train_the_transformer_demo_on_one_gpu(tmp_path, preset):
    pytest.importorskip("deepspeed", reason="DeepSpeed is an optional dependency (pip install '.[deepspeed]')")
    pytest.importorskip("hydra")
    if not CUDA:
        pytest.skip("the presets are GPU presets (fp16 needs CUDA)")
    cmd = [
        sys.executable,
        "-m",
        "lightning_syncasync.train",
        "experiment=lm",
        f"strategy={preset}",
        "trainer=gpu",
        "trainer.devices=1",
        "trainer.max_steps=30",
        "trainer.max_epochs=1",
        "trainer.limit_val_batches=2",
        "trainer.enable_progress_bar=false",
        "callbacks.model_checkpoint=null",
        f"hydra.run.dir={tmp_path}",
    ]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    summary = json.loads((tmp_path / "sync_summary.json").read_text())
    assert summary["ranks"][0]["steps"] >= 20, summary
    # SyncMonitor's peak CUDA allocation: the model, its ZeRO states and activations (a few MB at least).
    assert summary["cuda_peak_mb"] > 1.0, summary

"""A checkpoint taken mid-fit, resumed: the strategies' saved state back on the GPU (Lightning loads checkpoints
onto the CPU) and the resumed run where the run that saved it went. Two ranks sharing one GPU over gloo, as in
``test_shared_gpu.py``. In a file of its own: each case is two jobs in a row, so ``scripts/gpu_check.sh`` runs it
after the others."""

from __future__ import annotations

import pytest
from _gpu import ACCELERATOR, ROUNDS, STEPS, TOLERANCE, distance, gpu_tests, misplaced
from _ranks import RankJob

pytestmark = gpu_tests

# Each kind of state a checkpoint holds: outer momentum, compression residuals, PowerSGD's factors, round state.
RESUME_CASES = {
    "hier_sync": ("hier_sync", {"outer": "nesterov", "inter_period": 2, "compression": "int8"}),
    "async_ssp": ("async_ssp", {**ROUNDS, "claim_batches": False, "outer": "nesterov", "compression": "int8"}),
    "auto_sync": ("auto_sync", {"mode": "hier", "switcher": False, "inter_period": 2, "compression": "int8"}),
    "ddp_measured": ("ddp_measured", {"compression": "powersgd"}),
}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", sorted(RESUME_CASES))
def test_a_checkpoint_resumes_with_the_strategys_state_on_the_gpu(tmp_path, case):
    name, options = RESUME_CASES[case]
    ckpt, half = tmp_path / "half.ckpt", STEPS // 2
    kwargs = {"deterministic": True, "epoch_steps": half}  # the checkpoint at an epoch's end (_rank_job.py)
    whole = RankJob(tmp_path / "whole", name, ACCELERATOR, options, STEPS, save=ckpt, save_step=half, **kwargs).wait()
    resumed = RankJob(tmp_path / "resumed", name, ACCELERATOR, options, STEPS, resume=ckpt, **kwargs).wait()
    for a, b in zip(resumed, whole, strict=True):
        assert not misplaced(a["tensors"], "gloo"), misplaced(a["tensors"], "gloo")
        assert len(a["losses"]) == STEPS - half, "the resumed fit did not start where the first one stopped"
        # The same trajectory, within what CUDA's arithmetic can change (the CPU's tests check exact resume).
        assert distance(a["state"], b["state"]) < TOLERANCE[options["compression"]], case

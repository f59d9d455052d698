"""What the ``gpu`` tests share: the device they run on and the skip without one.

``SYNCASYNC_GPU_TESTS_DEVICE`` picks another device for a machine without a GPU (the tests that need CUDA itself,
its streams, events and DeepSpeed's kernels, still skip):

* ``emugpu``: an accelerator emulated on the CPU (``tests/_emulated_device.py``). Every tensor the pack should keep
  on the model's device must be there, an operation that mixes it with a CPU tensor fails as on a GPU, and the host
  syncs the pack asks for in every step are counted. The default suite runs all of them this way
  (``tests/test_emulated_gpu.py``);
* ``cpu``: a dry run of the tests' own logic.

Neither proves anything about CUDA's own behaviour; ``scripts/gpu_check.sh`` on a GPU does.
"""

from __future__ import annotations

import os

import pytest
import torch
from _gpu_hiding import HIDDEN, HIDDEN_REASON

DEVICE = os.environ.get("SYNCASYNC_GPU_TESTS_DEVICE", "cuda")
if DEVICE not in ("cuda", "emugpu", "cpu"):
    raise ValueError(f"SYNCASYNC_GPU_TESTS_DEVICE must be cuda, emugpu or cpu, got {DEVICE!r}")
CUDA = DEVICE == "cuda"
DRY_RUN = DEVICE == "cpu"
EMULATED = DEVICE == "emugpu"
# The accelerator name _rank_job.py takes (and Lightning, but for emugpu: lightning_accelerator()).
ACCELERATOR = {"cuda": "gpu", "emugpu": "emugpu", "cpu": "cpu"}[DEVICE]
if EMULATED:
    from _emulated_device import install

    install()  # tensors .to("emugpu") in the tests themselves

# A run that also selects CPU tests hides the GPU (tests/_gpu_hiding.py): the reasons say so, and how to run these.
_HIDDEN = f"; {HIDDEN_REASON}" if HIDDEN in os.environ else ""
needs_gpu = pytest.mark.skipif(
    CUDA and not torch.cuda.is_available(),
    reason=f"needs a CUDA GPU (scripts/gpu_check.sh runs these on one){_HIDDEN}",
)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason=f"needs CUDA itself (streams, events){_HIDDEN}")


def lightning_accelerator() -> object:
    """What a Trainer in the test process takes as ``accelerator=``."""
    if EMULATED:
        from _emulated_device import accelerator

        return accelerator()
    return ACCELERATOR


def lightning_strategy() -> object:
    """What a one-device Trainer in the test process takes as ``strategy=`` for plain Lightning."""
    if EMULATED:
        from _emulated_device import single_device_strategy

        return single_device_strategy()
    return "auto"


gpu_tests = [pytest.mark.gpu, needs_gpu]

# Tensors the pack keeps on the host on purpose, by the end of their attribute path: the learning rates the SSP
# exchange ships with each gradient (host figures, read with tolist), and a hier_sync round's all-reduce buffer
# under gloo (the wire's device: the CPU, allocated there because the collective is asynchronous).
HOST_SIDE = ("_outbox_lrs", "_acc_lrs")
WIRE_SIDE = (".buffer",)


def misplaced(tensors: list[tuple[str, str, str, int]], backend: str) -> list[str]:
    """The entries of a rank record's ``tensors`` that are not on the test device (nor host-side on purpose)."""
    want = DEVICE  # the device type the tensors must report
    bad = []
    for path, device, _, _ in tensors:
        if path.endswith(HOST_SIDE) and device == "cpu":
            continue
        if backend == "gloo" and path.endswith(WIRE_SIDE) and device == "cpu":
            continue
        if device != want:
            bad.append(f"{path} on {device}")
    return bad


# The multi-rank tests' shared settings: rounds that end at fixed steps (deterministic), the steps of a job, and the
# relative distance ||gpu - cpu|| / ||cpu|| allowed after them: fp32 reassociation for the exact paths; the
# quantisers can round an element the other way when its value moves by an ulp.
ROUNDS = {"local_steps": 2, "staleness": 1, "dynamic_local_steps": False}
STEPS = 12
TOLERANCE = {"int8": 5e-3, "powersgd": 5e-3, "sign": 5e-2}


def distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """``||a - b|| / ||b||`` over the floating-point entries of two state dicts."""
    keys = [k for k in a if a[k].is_floating_point()]
    diff = torch.cat([(a[k].float() - b[k].float()).reshape(-1) for k in keys]).norm()
    return float(diff / torch.cat([b[k].float().reshape(-1) for k in keys]).norm())

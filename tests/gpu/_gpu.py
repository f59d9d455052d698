"""What the ``gpu`` tests share: the device they run on and the skip without one.

``SYNCASYNC_GPU_TESTS_DEVICE=cpu`` runs them on the CPU instead (the tests that need CUDA itself still skip): a dry
run of the tests' own logic on a machine without a GPU. It proves nothing about CUDA; ``scripts/gpu_check.sh`` on a
GPU does.
"""

from __future__ import annotations

import os

import pytest
import torch

DEVICE = os.environ.get("SYNCASYNC_GPU_TESTS_DEVICE", "cuda")
DRY_RUN = DEVICE == "cpu"
ACCELERATOR = "cpu" if DRY_RUN else "gpu"

needs_gpu = pytest.mark.skipif(
    not DRY_RUN and not torch.cuda.is_available(),
    reason="needs a CUDA GPU (scripts/gpu_check.sh runs these on one)",
)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA itself (streams, events)")
gpu_tests = [pytest.mark.gpu, needs_gpu]

# Tensors the pack keeps on the host on purpose, by the end of their attribute path: the learning rates the SSP
# exchange ships with each gradient (host figures, read with tolist), and a hier_sync round's all-reduce buffer
# under gloo (the wire's device: the CPU, allocated there because the collective is asynchronous).
HOST_SIDE = ("_outbox_lrs", "_acc_lrs")
WIRE_SIDE = (".buffer",)


def misplaced(tensors: list[tuple[str, str, str, int]], backend: str) -> list[str]:
    """The entries of a rank record's ``tensors`` that are not on the test device (nor host-side on purpose)."""
    want = "cpu" if DRY_RUN else "cuda"
    bad = []
    for path, device, _, _ in tensors:
        if path.endswith(HOST_SIDE) and device == "cpu":
            continue
        if backend == "gloo" and path.endswith(WIRE_SIDE) and device == "cpu":
            continue
        if device != want:
            bad.append(f"{path} on {device}")
    return bad

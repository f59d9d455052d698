from __future__ import annotations

import os

import pytest

# Each test process and its children share 2 cores: one intra-op thread each keeps gloo tests from oversubscribing.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_configure(config):
    """Start autograd's engine here, before any test runs, on a machine without a GPU.

    The engine starts its threads at a process's first backward: one per device that a registered device guard
    reports then, and when there is any it marks the process's forks as unable to run a backward. On a CUDA build of
    torch (PyPI's default, also on machines without a GPU) Dynamo's tracing (its fake tensors) leaves a guard that
    reports a device (seen with torch 2.11 and 2.14.1, not with the CPU build of 2.13): after the compiled-codec
    tests, the first backward in this process then broke every later ``start_method="fork"`` rank ("Unable to handle
    autograd's threading in combination with fork-based multiprocessing"; 76 tests failed). Started now, with no
    device, the engine never starts device threads in this process, and its forks run backwards as a fresh
    interpreter would. With a GPU the engine starts a thread for it whatever runs first, so nothing is done there;
    nor under the emulated accelerator (``SYNCASYNC_GPU_TESTS_DEVICE=emugpu``), which the gpu tests install after
    this and then train on in this process: an engine sized for no device fails its first backward there (an
    internal assert in torch's engine.cpp).

    On a machine with a GPU, a run that selects CPU tests first hides the GPU from this process
    (``tests/_gpu_hiding.py``): its forked ranks would fail otherwise, whatever ran first; the engine is then started
    here as on a machine without one."""
    from _gpu_hiding import hide_gpu_for_cpu_tests, marker_names

    markers = marker_names(config.getini("markers"))
    hide_gpu_for_cpu_tests(config.getoption("markexpr") or "", config.args, config.rootpath, markers)
    import torch

    if not torch.cuda.is_available() and os.environ.get("SYNCASYNC_GPU_TESTS_DEVICE") != "emugpu":
        weight = torch.ones(1, requires_grad=True)
        weight.sum().backward()


@pytest.fixture(autouse=True)
def _isolated_environment():
    """Undo what a test leaves in os.environ: Lightning sets MASTER_PORT and PL_GLOBAL_SEED in the process that
    builds a Trainer, and a later test's subprocess would inherit a port that may no longer be free."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(autouse=True)
def _no_process_group_left():
    """A single-process fit that fails in setup (the bad-input rows, refused settings) leaves torch's default process
    group initialised in the pytest process; a later test's forked ranks would inherit it and fail to build their
    own groups (gloo raised std::bad_alloc)."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def pytest_collection_finish(session):
    """Freeze what collection built (Lightning, torch and every test module, imported) out of the collector's reach.
    A rank forked from this process runs ``gc.collect()`` at its strategy's teardown (``destroy_groups``), which
    otherwise walks the whole inherited heap: about 0.25 s per rank per fit here, for objects that are never garbage."""
    import gc

    gc.collect()
    gc.freeze()

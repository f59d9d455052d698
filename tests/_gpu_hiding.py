"""The CPU suite on a machine with a GPU: the GPU is hidden from a pytest run that selects CPU tests.

autograd's engine starts its threads at a process's first backward, one per device that a registered device guard
reports then, and when there is any it marks the process's later forks as unable to run a backward ("Unable to
handle autograd's threading in combination with fork-based multiprocessing"). The CPU suite runs backwards in the
pytest process and forks its ranks from it (``start_method="fork"``, ``run_distributed``): with a GPU visible,
every forked rank after the first backward in the pytest process fails. Shown on this project's machines with the
emulated accelerator standing for the GPU (``install()``, a backward, then a fork's backward raises that error);
forking the ranks from a clean fork server instead is not a drop-in change: Lightning's ``forkserver`` launch
passes neither the parent's environment nor its seeds (``_GlobalStateSnapshot`` is spawn's only). With every
``fork`` of the tests made ``forkserver``, 45 of the 399 tests in the 26 files that start ranks failed (2026-12-03):
11 where the sharded strategies refuse that start method, most of the others with results that no longer matched
their references.

So a run that can select a CPU test hides the GPU (``CUDA_VISIBLE_DEVICES=""``) in ``pytest_configure``, before
anything initialises CUDA (collection imports ``tests/gpu``, whose skip asks ``torch.cuda.is_available()``, and
CUDA reads the variable once, when it starts). The gpu tests of such a run skip in its process, saying why, and
``tests/test_gpu_hiding.py`` runs them in a child pytest with the GPU visible again (:func:`gpu_environment`), as
``pytest -m gpu tests/gpu`` and ``scripts/gpu_check.sh`` run them: runs that select only gpu tests (by ``-m`` or by
their paths) are left alone.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

# Set by hide_gpu_for_cpu_tests in the pytest process (and so in what it starts) to CUDA_VISIBLE_DEVICES's value
# before (JSON: null when unset): the gpu tests' skip reason says the GPU is hidden, and gpu_environment undoes it.
HIDDEN = "SYNCASYNC_TESTS_GPU_HIDDEN"
# Tells gpu_reported that a GPU is there: the test of this module's wiring on machines without one.
ASSUME_GPU = "SYNCASYNC_TESTS_ASSUME_GPU"
GPU_TESTS = Path(__file__).resolve().parent / "gpu"
HIDDEN_REASON = (
    "the GPU is hidden from a pytest run that also selects CPU tests (their forked ranks cannot run a backward once "
    "autograd has a thread for a GPU: tests/_gpu_hiding.py); tests/test_gpu_hiding.py runs tests/gpu in a child "
    "pytest that sees it, as `pytest -m gpu tests/gpu` and scripts/gpu_check.sh do"
)


def gpu_reported() -> bool:
    """Whether a CUDA GPU is visible, asked of NVML: ``torch.cuda.is_available()`` would start CUDA, after which
    hiding the GPU from this process no longer works. An NVML that does not answer (-1) counts as no GPU."""
    if os.environ.get(ASSUME_GPU) == "1":
        return True
    count = getattr(torch.cuda, "_device_count_nvml", None)  # private, in every torch the suite runs on (>= 2.9)
    if torch.version.cuda is None or count is None:
        return False
    try:
        return count() > 0
    except Exception:  # noqa: BLE001 - a private helper's failure is NVML not answering: no GPU known
        return False


def _under(arg: str, folder: Path, rootdir: Path) -> bool:
    path = Path(arg.split("::", 1)[0])
    path = (path if path.is_absolute() else rootdir / path).resolve()
    return path == folder or folder in path.parents


def selects_cpu_tests(markexpr: str, args: Sequence[str], rootdir: Path, markers: Sequence[str]) -> bool:
    """Whether a run with this ``-m`` expression and these paths can select a test that is not marked ``gpu``: every
    test outside ``tests/gpu``, with any of the suite's other ``markers`` (``-m spawn`` selects CPU tests)."""
    if args and all(_under(arg, GPU_TESTS, rootdir) for arg in args):
        return False
    if not markexpr.strip():
        return True
    try:
        from _pytest.mark.expression import Expression
    except ImportError:  # pytest's private parser moved: only the GPU check's own "-m gpu" is taken as gpu-only
        return markexpr.strip() != "gpu"
    expression = Expression.compile(markexpr)
    others = sorted(set(markers) - {"gpu"})
    subsets = itertools.chain.from_iterable(itertools.combinations(others, k) for k in range(len(others) + 1))
    return any(expression.evaluate(lambda name, _marks=set(marks), **_: name in _marks) for marks in subsets)


def marker_names(lines: Sequence[str]) -> list[str]:
    """The names of the markers the ini file registers (``"name: what it means"`` lines)."""
    return [line.split(":", 1)[0].split("(", 1)[0].strip() for line in lines]


def hide_gpu_for_cpu_tests(markexpr: str, args: Sequence[str], rootdir: Path, markers: Sequence[str]) -> bool:
    """Hide the GPU from this process and its children when a GPU is there and the run selects CPU tests; whether it
    did."""
    if not (selects_cpu_tests(markexpr, args, rootdir, markers) and gpu_reported()):
        return False
    os.environ[HIDDEN] = json.dumps(os.environ.get("CUDA_VISIBLE_DEVICES"))
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    return True


def gpu_environment(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with the GPU that :func:`hide_gpu_for_cpu_tests` hid visible again: for a child that runs the gpu
    tests."""
    out = dict(env)
    if HIDDEN not in out:
        return out
    was = json.loads(out.pop(HIDDEN))
    if was is None:
        out.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        out["CUDA_VISIBLE_DEVICES"] = was
    return out


def pytest_gpu_tests(junit: Path, selection: Sequence[str], env: Mapping[str, str]) -> dict:
    """Run ``selection`` of tests/gpu (``-m gpu``) in a child pytest with ``env``; its JUnit summary, read as the GPU
    check reads it. Fails, with the child's output, when it left no report, failed a test or exited non-zero."""
    from lightning_syncasync.bench._gpu_junit import summarise_junit

    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}"]
    proc = subprocess.run([*cmd, *selection], cwd=GPU_TESTS.parents[1], env=dict(env), capture_output=True, text=True)
    if not junit.exists():
        raise AssertionError(
            f"pytest left no report (exit {proc.returncode}):\n{proc.stdout[-4000:]}{proc.stderr[-4000:]}"
        )
    summary = summarise_junit(junit)
    failed = [c for c in summary["cases"] if c["outcome"] in ("failed", "error")]
    assert proc.returncode == 0 and not failed, failed or proc.stdout[-8000:]
    return summary

"""The CPU suite on a machine with a GPU hides the GPU from itself (``tests/_gpu_hiding.py``); GPU-only runs keep it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from _gpu_hiding import (
    ASSUME_GPU,
    HIDDEN,
    HIDDEN_REASON,
    gpu_environment,
    gpu_reported,
    marker_names,
    pytest_gpu_tests,
    selects_cpu_tests,
)

from lightning_syncasync.bench._gpu_junit import summarise_junit

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "markexpr, args, cpu",
    [
        ("not slow", [], True),  # the README's test command
        ("", [], True),
        ("", ["tests"], True),
        ("", ["tests/strategies/test_hier_sync.py::test_x"], True),
        ("slow", [], True),
        ("gpu or not slow", [], True),
        ("gpu", [], False),
        ("gpu", ["tests/gpu/test_one_gpu.py", "tests/gpu/test_shared_gpu.py"], False),  # scripts/gpu_check.sh
        ("", ["tests/gpu"], False),
        ("not slow", ["tests/gpu/test_one_gpu.py::test_x"], False),
        ("", ["tests/gpu", "tests/test_layers.py"], True),
        ("gpu and not slow", [], False),
        ("spawn", [], True),  # the other markers are on CPU tests
        ("faults and not slow", [], True),
        ("gpu and spawn", [], False),
        ("not gpu", ["tests/gpu"], False),
    ],
)
def test_a_run_that_can_select_a_cpu_test_is_told_apart_from_a_gpu_only_run(pytestconfig, markexpr, args, cpu):
    markers = marker_names(pytestconfig.getini("markers"))
    assert {"gpu", "slow", "spawn", "faults"} <= set(markers), markers
    assert selects_cpu_tests(markexpr, args, REPO, markers) is cpu


def test_a_gpu_is_assumed_only_when_asked_or_reported(monkeypatch):
    monkeypatch.setenv(ASSUME_GPU, "1")
    assert gpu_reported()
    monkeypatch.delenv(ASSUME_GPU)
    import torch

    # Without the variable it is NVML's count (CUDA builds only), which never starts CUDA.
    assert gpu_reported() == (torch.version.cuda is not None and torch.cuda._device_count_nvml() > 0)
    assert not torch.cuda.is_initialized()


@pytest.mark.parametrize("was", [None, "", "1", "0,1"])
def test_a_child_for_the_gpu_tests_sees_the_gpus_the_run_saw_before_it_hid_them(monkeypatch, was):
    import _gpu_hiding

    monkeypatch.setenv(ASSUME_GPU, "1")
    if was is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", was)
    monkeypatch.delenv(HIDDEN, raising=False)
    assert _gpu_hiding.hide_gpu_for_cpu_tests("not slow", [], REPO, ["gpu", "slow"])
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "" and HIDDEN in os.environ
    child = gpu_environment(os.environ)
    assert HIDDEN not in child and child.get("CUDA_VISIBLE_DEVICES") == was
    assert gpu_environment(child) == child  # nothing hidden: unchanged


@pytest.mark.timeout(1800)
def test_the_gpu_tests_hidden_from_this_run_pass_in_a_child_pytest_that_sees_the_gpu(tmp_path):
    # On a machine with a GPU, the README's test command runs the CPU suite with the GPU hidden and tests/gpu here,
    # with it, as scripts/gpu_check.sh would (no time budget: every test runs).
    if HIDDEN not in os.environ:
        pytest.skip("no GPU was hidden from this run: its gpu tests ran in this process (or skipped for want of one)")
    summary = pytest_gpu_tests(tmp_path / "gpu.xml", ["tests/gpu"], gpu_environment(os.environ))
    assert summary["tests"] > 0, summary
    assert not any(HIDDEN_REASON in (c["message"] or "") for c in summary["cases"]), "the child did not see the GPU"


def _child_pytest(tmp_path: Path, *args: str) -> tuple[dict, str]:
    """A child pytest that believes a GPU is there: its JUnit summary, and the CUDA_VISIBLE_DEVICES its tests saw."""
    probe = tmp_path / "test_probe.py"
    seen = tmp_path / "seen.txt"
    probe.write_text(
        "import os\n"
        "def test_probe():\n"
        f"    open({str(seen)!r}, 'w').write(repr(os.environ.get('CUDA_VISIBLE_DEVICES')))\n"
    )
    junit = tmp_path / "junit.xml"
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", HIDDEN)}
    env[ASSUME_GPU] = "1"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *args]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0 and junit.exists(), proc.stdout[-4000:] + proc.stderr[-4000:]
    return summarise_junit(junit), seen.read_text() if seen.exists() else ""


@pytest.mark.timeout(300)
def test_a_mixed_run_hides_the_gpu_and_its_gpu_tests_say_how_to_run_them(tmp_path):
    # The README's marker expression over a CPU test and a gpu test file: CUDA_VISIBLE_DEVICES is "" in the tests,
    # and every gpu test skips naming the command that runs it with the GPU.
    # The test above runs tests/gpu in a grandchild that is not told to hide it (here, without CUDA, they skip).
    child = "tests/test_gpu_hiding.py::test_the_gpu_tests_hidden_from_this_run_pass_in_a_child_pytest_that_sees_the_gpu"
    probe = str(tmp_path / "test_probe.py")
    summary, seen = _child_pytest(tmp_path, "-m", "not slow", probe, child, "tests/gpu/test_one_gpu.py")
    assert seen == "''", seen
    gpu = [c for c in summary["cases"] if "test_one_gpu" in c["name"]]
    assert gpu and all(c["outcome"] == "skipped" and HIDDEN_REASON in c["message"] for c in gpu), gpu
    assert [c["outcome"] for c in summary["cases"] if "hidden_from_this_run" in c["name"]] == ["passed"], summary


@pytest.mark.timeout(300)
def test_a_gpu_only_run_keeps_the_gpu(tmp_path):
    # scripts/gpu_check.sh's selection: nothing is hidden, and the gpu tests (no CUDA here) skip for want of one.
    summary, _ = _child_pytest(tmp_path, "-m", "gpu", "tests/gpu/test_one_gpu.py")
    assert summary["cases"] and all(c["outcome"] == "skipped" for c in summary["cases"]), summary
    assert not any(HIDDEN_REASON in c["message"] for c in summary["cases"]), summary

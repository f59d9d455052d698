"""python -m lightning_syncasync.bench.gpu: a seconds-long CPU smoke run of the whole check, and its refusals.

The check is meant for a GPU (scripts/gpu_check.sh); here it runs with ``--device cpu`` and tiny sizes, so what is
tested is the plumbing (every section measured, the JSON's shape, the process group torn down after each fit), not
the numbers."""

from __future__ import annotations

import datetime
import json
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _commands import CommandFailed, run_main

from lightning_syncasync.bench._gpu_device import DEFAULT_METHODS
from lightning_syncasync.bench._gpu_fit import (
    BASELINE,
    DATA_KWARGS,
    EXCLUDED_AT_WORLD_SIZE_1,
    MODEL_KWARGS,
    MONITORED,
    default_strategies,
    measure_strategies,
)
from lightning_syncasync.bench.gpu import TARGET_INT8, TARGET_STRATEGIES, build_parser, resolve_strategies, targets
from lightning_syncasync.bench.gpu import main as gpu_main
from lightning_syncasync.strategies import pack_strategy_names

pytest_plugins = ["pytester"]

REPO = Path(__file__).resolve().parents[2]

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="0" failures="1" skipped="1" tests="3">
<testcase classname="tests.gpu.test_x" name="test_ok" time="0.5"/>
<testcase classname="tests.gpu.test_x" name="test_bad" time="1.0">
<failure message="assert 1 == 2">tb</failure></testcase>
<testcase classname="tests.gpu.test_x" name="test_skip" time="0"><skipped message="no NCCL"/></testcase>
</testsuite></testsuites>
"""


def _positive(x: object) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x > 0


@pytest.fixture
def tiny_demo(monkeypatch):
    """The transformer demo at a size a CPU trains in milliseconds a step: these tests check the plumbing, and the
    check's 3 M-parameter default took most of their 30 s on 2 cores. The summary's settings record the size used."""
    tiny = {"d_model": 32, "n_layers": 1, "n_heads": 2, "seq_len": 16}
    for key, value in tiny.items():
        monkeypatch.setitem(MODEL_KWARGS, key, value)
    monkeypatch.setitem(DATA_KWARGS, "seq_len", tiny["seq_len"])
    monkeypatch.setitem(DATA_KWARGS, "batch_size", 8)
    # The corpus is cut short too (the demo builds it from every pydoc page by default).
    monkeypatch.setitem(DATA_KWARGS, "max_chars", 200_000)
    return tiny


@pytest.mark.timeout(180)
def test_cpu_smoke_run_writes_a_sane_summary(tmp_path, tiny_demo):
    out = tmp_path / "sub" / "gpu_check.json"
    junit = tmp_path / "gpu_tests.xml"
    junit.write_text(JUNIT)
    argv = ["--device", "cpu", "--numel", "100000", "--steps", "3", "--warmup-steps", "2", "--strategies",
            "hier_sync", "--rounds", "1", "--out", str(out), "--pytest-junitxml", str(junit),
            "--pytest-exit-code", "1"]  # fmt: skip
    table = run_main(gpu_main, argv)
    assert not dist.is_initialized()  # hier_sync's one-rank process group was torn down after its fit

    summary = json.loads(out.read_text())
    dev = summary["device"]
    assert dev["kind"] == "cpu" and dev["torch"] == torch.__version__ and dev["hostname"]
    assert "triton" in dev and "c_compiler" in dev  # what the fused codec needs, recorded (None where absent)
    assert datetime.datetime.fromisoformat(dev["date_utc"]).tzinfo is not None
    assert summary["settings"]["strategies"] == ["hier_sync"] and summary["settings"]["numel"] == 100_000
    assert summary["settings"]["model"]["d_model"] == tiny_demo["d_model"]  # the size the fits had, recorded

    assert _positive(summary["bandwidth_gbps"]) and summary["bandwidth"]["bytes_copied"] == 4 * 100_000 * 4
    # int8 twice: with the CPU's default codec (eager) and fused, the comparison the GPU run shows the other way.
    assert list(summary["compression"]) == ["int8", *DEFAULT_METHODS[1:], "int8+compiled"]  # the order measured
    assert summary["compression"]["int8"]["codec"] == "eager"
    assert summary["compression"]["int8+compiled"]["codec"] == "compiled"
    for method, rec in summary["compression"].items():
        assert rec["error"] is None, (method, rec["error"])
        assert _positive(rec["encode_s"]) and _positive(rec["decode_s"]) and _positive(rec["gbps"]), method
        assert rec["gbps"] == pytest.approx(100_000 * 4 / (rec["encode_s"] + rec["decode_s"]) / 1e9)
        assert rec["fraction_of_bandwidth"] == pytest.approx(rec["gbps"] / summary["bandwidth_gbps"])
        if method in ("int8", "int8+compiled", "int4", "sign"):  # the chunked codecs, also timed without feedback
            assert _positive(rec["gbps_without_error_feedback"]), method
            assert rec["encode_s_without_error_feedback"] > 0, method
            # The fused bound: 16 + 2c bytes per element with error feedback, 12 + 2c without (c: bytes of codes).
            code = {"int8": 1.0, "int4": 0.5, "sign": 0.125}[method.partition("+")[0]]
            assert rec["share_of_bound"] == pytest.approx(rec["fraction_of_bandwidth"] / (4 / (16 + 2 * code)))
            assert rec["bound_fraction_without_error_feedback"] == pytest.approx(4 / (12 + 2 * code))

    rates = summary["steps_per_s"]
    assert list(rates) == [BASELINE, MONITORED, "hier_sync"]
    for name, rec in rates.items():
        assert rec["error"] is None, (name, rec["error"])
        assert len(rec["runs"]) == 1 and _positive(rec["median"]) and _positive(rec["ratio_to_plain"]), name
    assert rates[BASELINE]["ratio_to_plain"] == 1.0
    assert rates["hier_sync"]["ratio_to_plain"] == pytest.approx(
        rates["hier_sync"]["median"] / rates[BASELINE]["median"]
    )
    assert rates[BASELINE]["strategy_class"] == "SingleDeviceStrategy"  # plain Lightning at one device
    assert rates["hier_sync"]["strategy_class"] == "HierSyncStrategy"

    assert set(summary["targets"]) == {TARGET_INT8, TARGET_STRATEGIES}
    assert all(isinstance(ok, bool) for ok in summary["targets"].values())
    pytest_results = summary["pytest"]
    assert pytest_results["exit_code"] == 1
    junit_summary = pytest_results["junit"]
    counts = {k: junit_summary[k] for k in ("tests", "passed", "failed", "error", "skipped")}
    assert counts == {"tests": 3, "passed": 1, "failed": 1, "error": 0, "skipped": 1}
    assert junit_summary["cases"][1]["message"] == "assert 1 == 2"
    assert "hier_sync" in table and "memory bandwidth" in table and "int8" in table


@pytest.mark.timeout(120)
def test_every_fit_is_kept_as_it_ends_so_a_stopped_check_loses_no_figure(tiny_demo):
    import copy

    args = build_parser().parse_args(["--steps", "3", "--warmup-steps", "2", "--rounds", "1"])
    seen: list[dict] = []
    measure_strategies(["hier_sync"], torch.device("cpu"), args, on_fit=lambda r: seen.append(copy.deepcopy(r)))
    assert [[n for n, rec in snap.items() if rec["runs"]] for snap in seen] == [
        [BASELINE],
        [BASELINE, MONITORED],
        [BASELINE, MONITORED, "hier_sync"],
    ]
    # Until every strategy has a figure, the target is "not measured", not met or missed on part of them.
    verdicts = [targets({"compression": {}, "steps_per_s": snap})[TARGET_STRATEGIES] for snap in seen]
    assert verdicts[:2] == [None, None] and isinstance(verdicts[2], bool)


def test_default_strategies_are_the_ones_that_run_at_one_rank():
    names = default_strategies()
    assert names and "hier_sync" in names
    assert not any(n.endswith("_spawn") or "sharded" in n or n in EXCLUDED_AT_WORLD_SIZE_1 for n in names)
    # An exclusion names a registered strategy: a renamed one must not slip into the default unnoticed.
    assert set(EXCLUDED_AT_WORLD_SIZE_1) <= set(pack_strategy_names())


def test_lightnings_ddp_runs_by_default_as_a_reference_outside_the_target():
    assert resolve_strategies(None) == [*default_strategies(), "ddp"]

    def rec(ratio):
        return {"median": ratio, "runs": [ratio], "ratio_to_plain": ratio, "error": None}

    summary = {"compression": {}, "steps_per_s": {BASELINE: rec(1.0), "hier_sync": rec(0.99), "ddp": rec(0.5)}}
    assert targets(summary)[TARGET_STRATEGIES] is True  # ddp's gap is reported, not the pack's to meet
    summary["steps_per_s"]["hier_sync"] = rec(0.9)
    assert targets(summary)[TARGET_STRATEGIES] is False


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: --device cuda is valid here")
def test_device_cuda_without_cuda_names_the_setting_and_the_fix(tmp_path):
    with pytest.raises(CommandFailed) as err:
        run_main(gpu_main, ["--device", "cuda", "--out", str(tmp_path / "x.json")])
    assert err.value.code == 2
    assert "--device" in str(err.value) and "HINT" in str(err.value) and "--device cpu" in str(err.value)
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--strategies", "hier_sync_spawn"], "--strategies 'hier_sync_spawn'"),
        (["--strategies", "hier_synk"], "did you mean 'hier_sync'"),
        (["--strategies", ","], "--strategies is empty"),
        (["--methods", "int8,powersgd"], "--methods"),
        (["--warmup-steps", "0"], "--warmup-steps must be >= 1"),
        (["--rounds", "0"], "--rounds must be >= 1"),
        (["--device", "tpu"], "--device"),
    ],
)
def test_bad_settings_are_refused_before_anything_runs(tmp_path, args, message):
    with pytest.raises(CommandFailed) as err:
        run_main(gpu_main, ["--device", "cpu", *args, "--out", str(tmp_path / "x.json")])
    assert err.value.code == 2 and message in str(err.value) and "HINT" in str(err.value)
    assert not (tmp_path / "x.json").exists()


def test_the_check_shares_its_test_time_out_per_file(pytester, monkeypatch):
    # tests/gpu/_budget.py, wired as tests/gpu/conftest.py wires it, on two files of quick tests: a deadline in the
    # past skips every test, saying why; one far off runs them all; no deadline (a plain pytest) runs them all.
    import time

    sys.path.insert(0, str(REPO / "tests" / "gpu"))
    try:
        from _budget import DEADLINE_ENV, file_deadline
    finally:
        sys.path.pop(0)
    pytester.makeconftest(
        f"import sys\nsys.path.insert(0, {str(REPO / 'tests' / 'gpu')!r})\nfrom _budget import skip_past_share\n\n"
        "def pytest_runtest_setup(item):\n    skip_past_share(item)\n"
    )
    pytester.makepyfile(test_a="def test_1(): pass\ndef test_2(): pass\n", test_b="def test_3(): pass\n")
    monkeypatch.setenv(DEADLINE_ENV, str(time.time() - 1))
    past = pytester.runpytest_inprocess("-rs", "-p", "no:cacheprovider")
    past.assert_outcomes(skipped=3)
    past.stdout.fnmatch_lines(["*not run: SYNCASYNC_GPU_CHECK_DEADLINE shares*test_a.py's share ran out*"])
    monkeypatch.setenv(DEADLINE_ENV, str(time.time() + 3600))
    pytester.runpytest_inprocess("-p", "no:cacheprovider").assert_outcomes(passed=3)
    monkeypatch.delenv(DEADLINE_ENV)
    pytester.runpytest_inprocess("-p", "no:cacheprovider").assert_outcomes(passed=3)
    # A file's share: the time left times its part of the tests left; what a file leaves goes to those after it.
    assert file_deadline(100.0, 190.0, 2, 3) == pytest.approx(160.0)
    assert file_deadline(150.0, 190.0, 1, 1) == pytest.approx(190.0)
    assert file_deadline(200.0, 190.0, 1, 1) == pytest.approx(200.0)  # past the deadline: no time at all

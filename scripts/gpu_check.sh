#!/usr/bin/env bash
# One-command GPU check: the GPU tests (tests/gpu, marker gpu), then the one-process benchmark
# (python -m lightning_syncasync.bench.gpu: memory bandwidth, codec throughput, steps/s of every strategy at one GPU).
#
#   scripts/gpu_check.sh [OUT_DIR] [BENCHMARK OPTIONS...]
#   scripts/gpu_check.sh gpu_check_out --rounds 5 --strategies hier_sync,async_ssp
#
# OUT_DIR (default gpu_check_out) receives gpu_tests.xml (JUnit) and gpu_tests.log, then gpu_check.json (the summary,
# the test results included) and gpu_bench.log. The benchmark runs even when the tests fail, so one run gives both;
# the exit status is non-zero when either failed.
#
# Sized for 8 minutes on one H200: each stage has a hard time limit, GPU_CHECK_TESTS_TIMEOUT_S (default 280) and
# GPU_CHECK_BENCH_TIMEOUT_S (default 140), so a hung NCCL start cannot eat the machine's time; with the kill grace and
# the start-up checks that is at most about 460 s. A stage past its limit gets SIGINT (SIGKILL 10 s later): pytest
# then still prints the failures so far and writes its JUnit file, and the benchmark's JSON already holds every figure
# read (it is rewritten after each one). The test files run in a fixed order, most telling first, the DeepSpeed
# presets (the slowest start) late; each test's outcome is logged as it ends. The test time is shared out over the
# files (tests/gpu/_budget.py, through SYNCASYNC_GPU_CHECK_DEADLINE, 20 s before the hard limit): a test whose file
# used up its share is skipped, saying so, so one slow file cannot leave the files after it never run.
# Inductor compiles in the test processes with one thread (TORCHINDUCTOR_COMPILE_THREADS, unless set): each rank job
# would otherwise start a pool of compile workers per CPU core.
# PYTHON picks the interpreter (default: python). The package need not be installed: the repo goes on PYTHONPATH.
# SYNCASYNC_GPU_CHECK_CPU=1 skips the CUDA check and benchmarks with --device cpu: only for trying this script on a
# machine without a GPU (add small sizes: --numel 1000000 --steps 5 --warmup-steps 3 --rounds 1).
set -euo pipefail

PYTHON="${PYTHON:-python}"
tests_timeout="${GPU_CHECK_TESTS_TIMEOUT_S:-280}"
bench_timeout="${GPU_CHECK_BENCH_TIMEOUT_S:-140}"
cpu_mode="${SYNCASYNC_GPU_CHECK_CPU:-0}"

# The first argument is the output folder unless it is already a benchmark option.
out_arg="gpu_check_out"
if [[ $# -gt 0 && "$1" != -* ]]; then
    out_arg="$1"
    shift
fi
mkdir -p "$out_arg"
out_dir="$(cd "$out_arg" && pwd)"  # absolute before the cd below, so a relative OUT_DIR means the caller's folder

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
PYTHONPATH="$repo_root${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONPATH

say() { echo "gpu_check: $*"; }

if [[ "$cpu_mode" == "1" ]]; then
    say "SYNCASYNC_GPU_CHECK_CPU=1: no CUDA check, benchmark on --device cpu (a smoke run of this script, not a GPU check)"
    device_args=(--device cpu)
else
    if ! "$PYTHON" -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
        torch_line="$("$PYTHON" -c 'import torch; print(f"torch {torch.__version__}, CUDA build {torch.version.cuda}")' 2>&1 || true)"
        {
            echo "gpu_check: error: no usable CUDA device: $PYTHON -c 'import torch; assert torch.cuda.is_available()'"
            echo "    failed ($torch_line)."
            echo "    HINT: run this on a GPU machine with a CUDA build of torch; check nvidia-smi and"
            echo "    CUDA_VISIBLE_DEVICES, or point PYTHON at the interpreter that has the CUDA build."
        } >&2
        exit 2
    fi
    device_args=()
fi

# What the GPU tests and the fused codec need besides CUDA, said up front (the check goes on either way): Triton and a
# C compiler (Triton builds its launcher with one; without, codec="auto" stays eager and the codec tests fail), the
# per-test time limits (pytest-timeout), and a compute mode that lets two processes share the GPU (the shared-GPU
# tests' ranks; "Exclusive_Process" refuses the second).
preflight="$("$PYTHON" - <<'PY' 2>&1 || true
import importlib.util, shutil, subprocess
def have(name):
    return "yes" if importlib.util.find_spec(name) is not None else "MISSING"
cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang") or "MISSING"
mode = "unknown (no nvidia-smi)"
if shutil.which("nvidia-smi"):
    run = subprocess.run(["nvidia-smi", "--query-gpu=compute_mode", "--format=csv,noheader"], capture_output=True,
                         text=True, timeout=20)
    mode = run.stdout.strip() or run.stderr.strip()
print(f"triton {have('triton')}, C compiler {cc}, pytest-timeout {have('pytest_timeout')}, compute mode {mode}")
PY
)"
say "preflight: $preflight"

# Results of an earlier run must not pass for this one's.
rm -f "$out_dir/gpu_tests.xml" "$out_dir/gpu_tests.log" "$out_dir/gpu_check.json" "$out_dir/gpu_bench.log"

tests_rc=0
if [[ ! -d tests/gpu ]]; then
    say "tests/gpu not found in $repo_root: no GPU tests to run (counted as a failure); going on to the benchmark"
    tests_rc=4  # pytest's own status for a missing test path
else
    # Most telling first: the codec and stream units, every strategy on one GPU, the shared-GPU ranks; any file
    # added later runs before the DeepSpeed presets; after them, the cases of 2 nodes of 2 ranks (8 processes each:
    # the replicated strategies, then the sharded ones) and the resume cases (two jobs in a row each).
    first=(tests/gpu/test_cuda_timing.py tests/gpu/test_one_gpu.py tests/gpu/test_shared_gpu.py)
    last=(tests/gpu/test_deepspeed_presets.py tests/gpu/test_nodes_gpu.py tests/gpu/test_sharded_gpu.py
        tests/gpu/test_resume_gpu.py)
    files=()
    for f in "${first[@]}"; do [[ -f "$f" ]] && files+=("$f"); done
    for f in tests/gpu/test_*.py; do
        [[ " ${first[*]} ${last[*]} " == *" $f "* ]] || files+=("$f")
    done
    for f in "${last[@]}"; do [[ -f "$f" ]] && files+=("$f"); done
    say "GPU tests (at most ${tests_timeout}s): pytest -m gpu ${files[*]}"
    TORCHINDUCTOR_COMPILE_THREADS="${TORCHINDUCTOR_COMPILE_THREADS:-1}" \
        SYNCASYNC_GPU_CHECK_DEADLINE="$(($(date +%s) + tests_timeout - 20))" \
        timeout -s INT -k 10 "$tests_timeout" "$PYTHON" -m pytest -m gpu "${files[@]}" -p no:cacheprovider -v \
        --junitxml "$out_dir/gpu_tests.xml" 2>&1 | tee "$out_dir/gpu_tests.log" || tests_rc=$?
    # Tests skipped because their file's share of the time ran out (tests/gpu/_budget.py): not a pass.
    unrun=0
    if [[ -f "$out_dir/gpu_tests.xml" ]]; then
        unrun="$("$PYTHON" -c 'import sys, xml.etree.ElementTree as ET
cases = ET.parse(sys.argv[1]).getroot().iter("testcase")
print(sum(any("share ran out" in (s.get("message") or "") for s in c.findall("skipped")) for c in cases))' \
            "$out_dir/gpu_tests.xml" 2>/dev/null || { grep -c "share ran out" "$out_dir/gpu_tests.log" || true; })"
    fi
    if [[ "$tests_rc" -eq 0 && "$unrun" -gt 0 ]]; then
        say "GPU tests: those that ran passed, but $unrun did not run (their file's share of ${tests_timeout}s ran" \
            "out; see 'share ran out' in $out_dir/gpu_tests.log); counted as a failure (status 6)"
        tests_rc=6  # not one of pytest's own statuses (0-5)
    fi
    case "$tests_rc" in
        0) say "GPU tests passed" ;;
        6) ;;
        1) say "GPU tests: some failed (see $out_dir/gpu_tests.log)" ;;
        5) say "GPU tests: none collected (no test under tests/gpu carries the gpu marker); counted as a failure" ;;
        124 | 137) say "GPU tests: stopped after ${tests_timeout}s (GPU_CHECK_TESTS_TIMEOUT_S)" ;;
        *) say "GPU tests: pytest exited with status $tests_rc (see $out_dir/gpu_tests.log)" ;;
    esac
fi

bench_args=(--out "$out_dir/gpu_check.json" --pytest-exit-code "$tests_rc")
if [[ -f "$out_dir/gpu_tests.xml" ]]; then
    bench_args+=(--pytest-junitxml "$out_dir/gpu_tests.xml")
fi
say "benchmark (at most ${bench_timeout}s): python -m lightning_syncasync.bench.gpu"
bench_rc=0
timeout -s INT -k 10 "$bench_timeout" "$PYTHON" -m lightning_syncasync.bench.gpu "${bench_args[@]}" \
    ${device_args[@]+"${device_args[@]}"} "$@" 2>&1 | tee "$out_dir/gpu_bench.log" || bench_rc=$?
case "$bench_rc" in
    0) say "benchmark done" ;;
    124 | 137) say "benchmark: stopped after ${bench_timeout}s (GPU_CHECK_BENCH_TIMEOUT_S); partial results kept" ;;
    *) say "benchmark: exited with status $bench_rc (see $out_dir/gpu_bench.log)" ;;
esac

say "summary: $out_dir/gpu_check.json (tests: status $tests_rc, benchmark: status $bench_rc)"
if [[ "$tests_rc" -ne 0 || "$bench_rc" -ne 0 ]]; then
    exit 1
fi

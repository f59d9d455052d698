"""Fault injection into every strategy (issue 10): a killed, hung (SIGSTOP) or failing rank ends the job on every
rank within the timeout, with an error naming the lost rank, and leaves no process behind.

Each job is 3 single-process "nodes" started by ``EmulatedCluster`` with torchrun's environment and no launcher
that would kill the survivors for us (its grace period is longer than the bound asserted), so the survivors must
notice the loss themselves, as on separate machines. The ranks of the jobs without network namespaces are forked
from a server that has imported Lightning once (``tests/_forked.py``: the emulator's own environment, wait and
clean-up, without 6 s of imports per rank). Detection time: from the faulty rank's stamp
(``syncasync-fault: ... (t=...)``) to the last survivor's exit, printed as ``FAULT-TIMING`` lines (the README's
failure table comes from them: ``pytest -m faults -s | grep FAULT-TIMING``).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _forked import ForkedCluster

from lightning_syncasync.emulate.cluster import EmulatedCluster

pytestmark = pytest.mark.faults

JOB = str(Path(__file__).with_name("fault_job.py"))
TIMEOUT_S = 5.0  # the watchdog / peer timeout of these jobs
GRACE_S = {"ddp": 1.0, "ddp_measured": 1.0}  # the job's own PeerWatchdog; the others add one (default grace)
DEFAULT_GRACE_S = 5.0


def _run(tmp_path: Path, strategy: str, fault: str, compression: str = "none", ranks: int = 3) -> dict:
    out = tmp_path / "out"
    out.mkdir()
    # The emulator's grace runs from the first exit: the killed rank's (then the survivors must beat it, or they are
    # SIGTERMed and the test fails), or a survivor's when the faulty rank is stopped (then it only bounds how long
    # the stopped rank is kept before the clean-up).
    grace = 8.0 if fault.startswith("stop") else 30.0
    cluster = ForkedCluster(nodes=ranks, procs_per_node=1, netns=False, cgroups=False, log_dir=tmp_path / "logs",
                            grace_s=grace, echo_rank0=False, fault=fault)  # fmt: skip
    report = cluster.run([sys.executable, JOB, strategy, compression, str(TIMEOUT_S), str(out)], timeout_s=150)
    logs = [(tmp_path / "logs" / f"rank{r}.log").read_text(errors="replace") for r in range(ranks)]
    stamp = re.search(r"syncasync-fault: rank (\d+) (\w+) at step (\d+) \(t=([\d.]+)\)", "\n".join(logs))
    assert stamp is not None, "the fault never fired:\n" + "\n".join(logs)
    leftovers = [p.pid for p in cluster.procs if _group_alive(p.pid)]
    return {"report": report, "logs": logs, "fault_t": float(stamp[4]), "leftovers": leftovers,
            "records": {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)
                        if (out / f"rank{r}.json").exists()}}  # fmt: skip


def _group_alive(pgid: int) -> bool:
    """Whether any process is left in the process group a rank led (the rank itself, or a child it started)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _check_survivors(res: dict, strategy: str, lost: int, label: str, bound_s: float) -> None:
    report, logs = res["report"], res["logs"]
    survivors = [r for r in range(len(logs)) if r != lost]
    assert not res["leftovers"], f"processes left behind: {res['leftovers']}"
    assert not report.interrupted
    for r in survivors:
        # Ended by itself (an error or the watchdog's exit), not by the emulator's clean-up after its grace period.
        assert report.exit_codes[r] not in (0, None, -15, -9), (r, report.exit_codes, logs[r][-3000:])
        assert report.exit_times[r] is not None
        named = re.search(rf"PeerLostError.*rank {lost} (is lost|failed)|rank {lost} \(", logs[r])
        said = [line for line in logs[r].splitlines() if "PeerLostError" in line or "lost" in line]
        assert named, f"rank {r} did not name rank {lost}: {said}\n{logs[r][-2000:]}"
    detect = max(report.exit_times[r] for r in survivors) - res["fault_t"]
    print(f"\nFAULT-TIMING {strategy} {label}: last survivor exited {detect:.1f}s after the fault "
          f"(timeout {TIMEOUT_S:g}s), exit codes {report.exit_codes}")  # fmt: skip
    assert detect <= bound_s, (detect, report.exit_codes)


KILL_CASES = [("ddp", "none"), ("hier_sync", "none"), ("async_ssp", "none"), ("auto_sync", "none"),
              ("ddp_measured", "int8"), ("hier_sync", "int8"), ("async_ssp", "int8"),
              ("auto_sync", "int8"), ("hier_sync_sharded", "none"), ("async_ssp_sharded", "none")]  # fmt: skip
# Ranks per job: the sharded strategies need nodes of 2 or more ranks (4 ranks as 2 virtual nodes of 2).
RANKS = {"hier_sync_sharded": 4, "async_ssp_sharded": 4}
# The default run (CI: under 15 minutes on 2 cores) kills a rank once per watchdog and exchange, 4-10 s each with
# the ranks forked from a preloaded server: async rounds (async_ssp), the compressed DDP hook (ddp_measured int8),
# the averager with FSDP2 inside the nodes (hier_sync_sharded: hier_sync's DelayedAverager and watchdog) and
# auto_sync's switching strategy; plain ddp's watchdog is in it through the store-host and raising-rank tests below.
# The rest run with `-m slow`, as do the hung ranks of all but async_ssp (9-13 s each: the timeout, then the grace).
_SLOW = pytest.mark.slow
_SLOW_KILLS = {("ddp", "none"), ("hier_sync", "none"), ("async_ssp", "int8"), ("auto_sync", "int8"),
               ("hier_sync", "int8"), ("async_ssp_sharded", "none")}  # fmt: skip
KILL_PARAMS = [pytest.param(s, c, marks=_SLOW) if (s, c) in _SLOW_KILLS else (s, c) for s, c in KILL_CASES]
HUNG_PARAMS = [pytest.param(s, marks=_SLOW) if s != "async_ssp" else s
               for s in ("ddp", "hier_sync", "async_ssp", "auto_sync")]  # fmt: skip


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("strategy", "compression"), KILL_PARAMS, ids=[f"{s}-{c}" for s, c in KILL_CASES])
def test_a_killed_worker_stops_every_other_rank_naming_it(tmp_path, strategy, compression):
    step = random.Random(f"{strategy}-{compression}").randint(5, 40)  # a random step, the same on every run
    res = _run(tmp_path, strategy, f"kill:1@{step}", compression, ranks=RANKS.get(strategy, 3))
    assert res["report"].exit_codes[1] == -9  # SIGKILL
    grace = GRACE_S.get(strategy, DEFAULT_GRACE_S)
    _check_survivors(res, f"{strategy}+{compression}", lost=1, label="SIGKILL", bound_s=TIMEOUT_S + grace + 10)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("strategy", HUNG_PARAMS)
def test_a_hung_worker_is_detected_by_the_same_timeout(tmp_path, strategy):
    res = _run(tmp_path, strategy, f"stop:1@{random.Random(strategy).randint(5, 40)}")
    grace = GRACE_S.get(strategy, DEFAULT_GRACE_S)
    _check_survivors(res, strategy, lost=1, label="SIGSTOP", bound_s=TIMEOUT_S + grace + 10)
    # Stopped until the emulator's clean-up (SIGTERM + SIGCONT), which it does not survive either: it fails, or stops
    # on the SIGTERM at its next step with Lightning's SIGTERMException (a SystemExit: status 0).
    assert res["report"].exit_codes[1] != 0 or "received SIGTERM; stopping" in res["logs"][1]


@pytest.mark.timeout(200)
def test_losing_the_store_host_names_rank_0(tmp_path):
    # Under Lightning's own launch rank 0 hosts the rendezvous store: the others lose their heartbeats' store too.
    res = _run(tmp_path, "ddp", "kill:0@20")
    _check_survivors(res, "ddp", lost=0, label="SIGKILL of rank 0", bound_s=TIMEOUT_S + 1 + 10)


@pytest.mark.timeout(200)
def test_a_rank_that_raises_is_named_as_the_origin(tmp_path):
    res = _run(tmp_path, "ddp", "raise:2@20")
    assert "injected fault on rank 2" in res["records"][2]["error"]
    _check_survivors(res, "ddp", lost=2, label="exception", bound_s=TIMEOUT_S + 1 + 10)
    assert any("rank 2 failed: RuntimeError: injected fault" in res["logs"][r] for r in (0, 1))


needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None, reason="network namespaces need root and iproute2"
)
CUT_TIMEOUT_S = 15.0  # above a 2 s cut plus TCP's retransmission back-off (0.2+0.4+0.8+1.6+3.2 s)


def _run_cut(tmp_path: Path, seconds: float, max_steps: int) -> tuple:
    out = tmp_path / "out"
    out.mkdir()
    cluster = EmulatedCluster(nodes=2, procs_per_node=1, link_mbit=1000, netns=True, cgroups=False,
                              log_dir=tmp_path / "logs", grace_s=30.0, echo_rank0=False,
                              fault=f"cut:1@20+{seconds:g}")  # fmt: skip
    report = cluster.run([sys.executable, JOB, "ddp", "none", str(CUT_TIMEOUT_S), str(out), str(max_steps)],
                         timeout_s=150)  # fmt: skip
    logs = [(tmp_path / "logs" / f"rank{r}.log").read_text(errors="replace") for r in range(2)]
    assert "syncasync-fault: rank 1 cut at step 20" in logs[1], logs[1][-3000:]
    return report, logs


@needs_root
@pytest.mark.netns
@pytest.mark.timeout(200)
def test_a_short_link_cut_is_survived(tmp_path):
    report, logs = _run_cut(tmp_path, seconds=2, max_steps=60)
    assert report.exit_codes == [0, 0], [log[-2000:] for log in logs]
    assert not any("PeerLostError" in log for log in logs)


# 22 s; -m slow since issue 67's suite ran at 900 s on 2 cores. A short cut survived and a lost rank named by the
# peer timeout (killed and hung workers, above and below) stay in the default run.
@pytest.mark.slow
@needs_root
@pytest.mark.netns
@pytest.mark.timeout(200)
def test_a_long_link_cut_ends_the_job_naming_the_other_side(tmp_path):
    report, logs = _run_cut(tmp_path, seconds=40, max_steps=100_000)
    stamp = float(re.search(r"syncasync-fault: rank 1 cut at step 20 \(t=([\d.]+)\)", logs[1])[1])
    assert all(c not in (0, None, -15, -9) for c in report.exit_codes), report.exit_codes
    # Each side names the other: node 0 sees rank 1's heartbeat stop, rank 1 loses the store on node 0 (rank 0).
    assert re.search(r"PeerLostError.*rank 1 is lost", logs[0]), logs[0][-2000:]
    assert re.search(r"PeerLostError.*rank 0 .*is lost", logs[1]), logs[1][-2000:]
    detect = max(report.exit_times) - stamp
    print(f"\nFAULT-TIMING ddp link cut 40s: both sides exited {detect:.1f}s after the cut "
          f"(timeout {CUT_TIMEOUT_S:g}s)")  # fmt: skip
    assert detect <= CUT_TIMEOUT_S + 1 + 10
    # The shell that would bring the link back went with its rank's process group; the namespaces are gone.
    assert subprocess.run(["pgrep", "-f", "sleep 40; ip link"], capture_output=True).returncode == 1
    assert "syncasync" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout

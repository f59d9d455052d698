"""syncasync-emulate: real namespaces, links and cgroups (root), torchrun-style environment, clean teardown."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _commands import CommandFailed, run_main

from lightning_syncasync._cores import ranks_on_host, usable_cores
from lightning_syncasync.emulate import EmulatedCluster, EmulatedNetwork, EmulationUnavailable
from lightning_syncasync.emulate import network as network_mod
from lightning_syncasync.emulate.__main__ import main as emulate_main
from lightning_syncasync.emulate.cgroups import cgroup_cpu_root

EMULATE = [sys.executable, "-m", "lightning_syncasync.emulate"]
needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None, reason="network namespaces need root and iproute2"
)

# Prints what a rank sees, as JSON on one line.
SHOW_ENV = (
    "import json, os, pathlib; "
    "cg = [x for x in pathlib.Path('/proc/self/cgroup').read_text().splitlines() "
    "if ':cpu' in x or x.startswith('0::')]; "
    "keys = ['RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'GROUP_RANK', 'NODE_RANK', 'LOCAL_WORLD_SIZE', 'MASTER_ADDR', "
    "'GLOO_SOCKET_IFNAME', 'SYNCASYNC_JITTER', 'SYNCASYNC_STRAGGLER_SEED']; "
    "print('ENV ' + json.dumps({**{k: os.environ.get(k) for k in keys}, 'cgroup': cg}))"
)


def _leftovers() -> tuple[str, list[str]]:
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    root = cgroup_cpu_root()
    groups = [p.name for p in root[0].iterdir() if p.name.startswith("syncasync-")] if root else []
    return ns, groups


def _rank_envs(log_dir: Path, world: int) -> list[dict]:
    envs = []
    for r in range(world):
        line = next(ln for ln in (log_dir / f"rank{r}.log").read_text().splitlines() if ln.startswith("ENV "))
        envs.append(json.loads(line[4:]))
    return envs


@needs_root
@pytest.mark.netns
@pytest.mark.timeout(120)
def test_ranks_start_like_torchrun_inside_their_node_and_everything_is_removed(tmp_path):
    before_ns, before_cg = _leftovers()
    proc = subprocess.run(
        [*EMULATE, "--nodes", "2", "--procs-per-node", "2", "--link-mbit", "50", "--straggler", "3:2",
         "--jitter", "0.1:4", "--seed", "7", "--log-dir", str(tmp_path), "--", sys.executable, "-c", SHOW_ENV],
        capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    envs = _rank_envs(tmp_path, 4)
    assert [e["RANK"] for e in envs] == ["0", "1", "2", "3"]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "0", "1"]
    assert [e["GROUP_RANK"] for e in envs] == ["0", "0", "1", "1"] == [e["NODE_RANK"] for e in envs]
    assert {e["WORLD_SIZE"] for e in envs} == {"4"} and {e["LOCAL_WORLD_SIZE"] for e in envs} == {"2"}
    # Each node has its own interface; every rank reaches the master at node 0's address.
    assert envs[0]["GLOO_SOCKET_IFNAME"] == envs[1]["GLOO_SOCKET_IFNAME"] != envs[2]["GLOO_SOCKET_IFNAME"]
    assert len({e["MASTER_ADDR"] for e in envs}) == 1 and envs[0]["MASTER_ADDR"].endswith(".1")
    assert {e["SYNCASYNC_JITTER"] for e in envs} == {"0.1:4"} and {e["SYNCASYNC_STRAGGLER_SEED"] for e in envs} == {"7"}
    # Each rank sits in its own CPU cgroup; the straggler's quota is half the others'.
    report = json.loads((tmp_path / "emulation.json").read_text())
    assert report["cpu_mode"] == "cgroup" and report["exit_codes"] == [0, 0, 0, 0]
    shares = report["cores_per_rank"]
    assert shares[3] == pytest.approx(shares[0] / 2) and sum(shares) <= usable_cores()
    assert len({tuple(e["cgroup"]) for e in envs}) == 4
    assert _leftovers() == (before_ns, before_cg)


def _allreduce_seconds(rank: int, world: int, nbytes: int) -> float:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.ones(nbytes // 4)
    dist.all_reduce(t)  # connect
    start = time.perf_counter()
    dist.all_reduce(t)
    seconds = time.perf_counter() - start
    dist.destroy_process_group()
    return seconds


@needs_root
@pytest.mark.netns
@pytest.mark.timeout(120)
def test_inter_node_link_is_rate_limited(tmp_path):
    # 2 nodes x 1 rank at 16 Mbit/s (2 MB/s): a 2 MB all-reduce moves >= 1 MB each way, so >= 0.5 s by physics.
    here = str(Path(__file__).parent)
    script = (
        # tests/ too: test_emulate imports the shared helpers (_commands) from there.
        f"import os, sys; sys.path[:0] = [{here!r}, {str(Path(here).parent)!r}]; "
        "from test_emulate import _allreduce_seconds; "
        "print('SECONDS', _allreduce_seconds(int(os.environ['RANK']), 2, 2_000_000))"
    )
    cluster = EmulatedCluster(nodes=2, procs_per_node=1, link_mbit=16, log_dir=tmp_path, echo_rank0=False)
    report = cluster.run([sys.executable, "-c", script], timeout_s=100)
    assert report.exit_codes == [0, 0]
    seconds = [float(ln.split()[1]) for r in range(2) for ln in (tmp_path / f"rank{r}.log").read_text().splitlines()
               if ln.startswith("SECONDS")]  # fmt: skip
    assert min(seconds) >= 0.4, seconds


def _rerated_job() -> None:
    """Rank 0 asks for 8 Mbit/s through the emulator's control file between two timed 2 MB all-reduces."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.ones(500_000)
    dist.all_reduce(t)  # connect

    def timed() -> float:
        start = time.perf_counter()
        dist.all_reduce(t)
        return time.perf_counter() - start

    fast = timed()
    if dist.get_rank() == 0:
        Path(os.environ["SYNCASYNC_LINK_CONTROL"]).write_text("8\n")
    time.sleep(1.0)  # the emulator polls the file every 50 ms
    slow = timed()
    dist.destroy_process_group()
    print("SECONDS", fast, slow)


@needs_root
@pytest.mark.netns
@pytest.mark.timeout(120)
def test_the_link_is_rerated_while_the_job_runs_when_rank_0_asks(tmp_path):
    # 2 nodes at 1 Gbit/s, then 8 Mbit/s (1 MB/s): a 2 MB all-reduce moves >= 1 MB each way, so >= 1 s by physics.
    here = str(Path(__file__).parent)
    script = (
        f"import os, sys; sys.path[:0] = [{here!r}, {str(Path(here).parent)!r}]; "
        "from test_emulate import _rerated_job; _rerated_job()"
    )
    cluster = EmulatedCluster(nodes=2, procs_per_node=1, link_mbit=1000, log_dir=tmp_path, echo_rank0=False,
                              link_schedule="8@0.5-1")  # fmt: skip
    report = cluster.run([sys.executable, "-c", script], timeout_s=100)
    assert report.exit_codes == [0, 0], [(tmp_path / f"rank{r}.log").read_text()[-2000:] for r in range(2)]
    times = [[float(x) for x in ln.split()[1:]] for r in range(2)
             for ln in (tmp_path / f"rank{r}.log").read_text().splitlines() if ln.startswith("SECONDS")]  # fmt: skip
    for fast, slow in times:
        assert slow >= 0.8 and fast < 0.5 * slow, times
    assert [mbit for _, mbit in report.link_changes] == [1000, 8.0], report.link_changes
    assert report.link_schedule == "8@0.5-1"


@needs_root
@pytest.mark.netns
@pytest.mark.timeout(120)
def test_a_failing_rank_stops_the_others_and_cleans_up(tmp_path):
    before = _leftovers()
    script = (
        "import os, sys, time; r = int(os.environ['RANK']); time.sleep(0.5); sys.exit(3) if r == 1 else time.sleep(300)"
    )
    start = time.monotonic()
    proc = subprocess.run(
        [*EMULATE, "--nodes", "2", "--procs-per-node", "2", "--grace", "1", "--log-dir", str(tmp_path), "--",
         sys.executable, "-c", script],
        capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    assert proc.returncode == 3
    assert time.monotonic() - start < 60
    assert "rank 1 exited with 3" in proc.stderr
    report = json.loads((tmp_path / "emulation.json").read_text())
    assert report["failed_rank"] == 1 and report["exit_codes"][1] == 3
    assert _leftovers() == before
    assert subprocess.run(["pgrep", "-f", "time.sleep\\(300\\)"], capture_output=True).returncode == 1


@needs_root
@pytest.mark.netns
@pytest.mark.timeout(120)
def test_ctrl_c_kills_every_rank_and_cleans_up(tmp_path):
    before = _leftovers()
    proc = subprocess.Popen(
        [*EMULATE, "--nodes", "2", "--procs-per-node", "1", "--link-mbit", "100", "--log-dir", str(tmp_path), "--",
         sys.executable, "-c", "import time; print('up', flush=True); time.sleep(301)"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout.readline().strip() == "up"  # rank 0 is running, so the namespaces exist
    assert _leftovers() != before
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 130
    assert _leftovers() == before
    assert subprocess.run(["pgrep", "-f", "time.sleep\\(301\\)"], capture_output=True).returncode == 1


@pytest.mark.timeout(60)
def test_no_netns_mode_uses_loopback(tmp_path):
    cluster = EmulatedCluster(nodes=2, procs_per_node=1, netns=False, cgroups=False, log_dir=tmp_path,
                              echo_rank0=False)  # fmt: skip
    report = cluster.run([sys.executable, "-c", SHOW_ENV], timeout_s=50)
    assert report.exit_codes == [0, 0] and report.cpu_mode == "sleep"
    envs = _rank_envs(tmp_path, 2)
    assert {e["MASTER_ADDR"] for e in envs} == {"127.0.0.1"} and {e["GLOO_SOCKET_IFNAME"] for e in envs} == {None}


@pytest.mark.timeout(60)
def test_when_only_stopped_ranks_are_left_they_are_ended_without_waiting_out_the_grace(tmp_path):
    # Rank 1 stops itself (a hung rank: SIGSTOP), rank 0 then fails; rank 2 fails a little later, within the grace.
    script = 'case "$RANK" in 1) kill -STOP $$; echo continued ;; 0) sleep 0.5; exit 3 ;; *) sleep 1.5; exit 4 ;; esac'
    cluster = EmulatedCluster(nodes=3, procs_per_node=1, netns=False, cgroups=False, log_dir=tmp_path,
                              grace_s=30.0, echo_rank0=False)  # fmt: skip
    start = time.monotonic()
    report = cluster.run(["sh", "-c", script], timeout_s=50)
    took = time.monotonic() - start
    # Rank 2 still had its grace and ended by itself; rank 1 was ended by the clean-up (SIGTERM after SIGCONT: its
    # shell does not run the echo), well before the 30 s grace ran out.
    assert report.exit_codes == [3, -signal.SIGTERM, 4], report.exit_codes
    assert report.failed_rank == 0 and not report.interrupted
    assert took < 15, took
    assert "continued" not in (tmp_path / "rank1.log").read_text()


def test_independent_mode_gives_every_rank_a_world_of_one(tmp_path):
    cluster = EmulatedCluster(nodes=2, procs_per_node=2, netns=False, cgroups=False, independent=True,
                              schedule="3:2@0.3-0.6", log_dir=tmp_path, echo_rank0=False)  # fmt: skip
    env3 = cluster.rank_env(3, port=1234)
    assert (env3["WORLD_SIZE"], env3["RANK"], env3["SYNCASYNC_SLOWDOWN_SCHEDULE"]) == ("1", "0", "0:2.0@0.3-0.6")
    assert "SYNCASYNC_SLOWDOWN_SCHEDULE" in cluster.rank_env(0, 1234) and cluster.rank_env(0, 1234)[
        "SYNCASYNC_SLOWDOWN_SCHEDULE"] == ""  # fmt: skip


def test_every_rank_is_told_how_many_ranks_share_the_machine(tmp_path, monkeypatch):
    # Two emulated nodes of two ranks: LOCAL_WORLD_SIZE is 2, but all 4 ranks share this machine's RAM, which is what
    # the advisor's probe divides (ranks_on_host). A value left in the caller's environment is replaced.
    monkeypatch.setenv("SYNCASYNC_HOST_RANKS", "99")
    cluster = EmulatedCluster(nodes=2, procs_per_node=2, netns=False, cgroups=False, log_dir=tmp_path,
                              echo_rank0=False)  # fmt: skip
    env = cluster.rank_env(3, port=1234)
    assert (env["LOCAL_WORLD_SIZE"], env["SYNCASYNC_HOST_RANKS"]) == ("2", "4")
    monkeypatch.setenv("SYNCASYNC_HOST_RANKS", env["SYNCASYNC_HOST_RANKS"])
    assert ranks_on_host(int(env["LOCAL_WORLD_SIZE"])) == 4
    monkeypatch.delenv("SYNCASYNC_HOST_RANKS")  # a real node: its own ranks share its memory
    assert ranks_on_host(int(env["LOCAL_WORLD_SIZE"])) == 2


def test_without_root_the_error_says_what_to_do(monkeypatch):
    monkeypatch.setattr(network_mod.os, "geteuid", lambda: 1000)
    with pytest.raises(EmulationUnavailable, match="--no-netns"):
        EmulatedNetwork(num_nodes=2).setup()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--straggler", "4:1.5"], "outside the world"),
        (["--straggler", "1:0.5"], "factor must be >= 1"),
        (["--straggler", "x"], "RANK:FACTOR"),
        (["--jitter", "2:4"], "jitter probability"),
        (["--straggler-schedule", "1:2@0.7-0.2"], "START-END"),
        (["--cpu-budget", "1000"], "--cpu-budget"),
        (["--no-netns", "--link-mbit", "100"], "--link-mbit needs network namespaces"),
        (["--link-schedule", "10@0.6-0.2"], "START-END"),
        (["--no-netns", "--link-schedule", "10@0.2-0.6"], "needs network namespaces"),
        ([], "no training command"),
    ],
)
def test_bad_input_is_rejected_before_anything_starts(args, message):
    tail = [] if not args or args == [] else ["--", "true"]
    with pytest.raises(CommandFailed) as failed:
        run_main(emulate_main, ["--nodes", "2", "--procs-per-node", "2", *args, *tail])
    assert failed.value.code == 2
    assert message in str(failed.value)


@pytest.mark.timeout(60)
def test_a_node_kill_takes_processes_in_sessions_of_their_own_and_the_clock_starts_at_the_origin(tmp_path):
    # Each node's job starts a child in a new session (as torchrun starts its workers) that records its pid and
    # sleeps; node 1 is killed 0.5 s after the origin, which the job itself sets (a file node 0 writes once up).
    from lightning_syncasync.emulate.replica_groups import ReplicaGroupCluster

    job = (
        "import os, subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'], start_new_session=True)\n"
        "open(sys.argv[1], 'w').write(str(child.pid))\n"
        "if sys.argv[2] == '1': time.sleep(1.0); open(sys.argv[3], 'w').write(str(time.time()))\n"
        "time.sleep(30 if sys.argv[2] == '1' else 2)\n"
    )
    origin_file = tmp_path / "origin"

    def origin():
        return float(origin_file.read_text()) if origin_file.exists() else None

    cluster = ReplicaGroupCluster(
        nodes=2, procs_per_node=1, lighthouse=False, faults="kill:0@0.5", origin=origin, log_dir=tmp_path / "logs",
        echo=False, env={"WHO": "{node}"},
    )  # fmt: skip
    report = cluster.run([sys.executable, "-c", job, str(tmp_path / "child{node}"), "{is_node0}", str(origin_file)],
                         timeout_s=30)  # fmt: skip
    killed = [r for r in report.runs if r.killed]
    assert [r.node for r in killed] == [0] and report.origin_s is not None
    assert killed[0].ended_at == pytest.approx(report.origin_s + 0.5, abs=0.3)  # counted from the origin
    child = int((tmp_path / "child0").read_text())
    # The whole tree went, the child of its own session too (gone, or a zombie nobody reaped yet).
    stat = Path(f"/proc/{child}/stat")
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"
    assert json.loads((tmp_path / "logs" / "emulation.json").read_text())["origin_s"] == report.origin_s
    os.kill(int((tmp_path / "child1").read_text()), 9)  # node 1 ended by itself, leaving its child (not ours to kill)


@pytest.mark.timeout(60)
def test_nodes_that_end_before_the_clock_starts_end_the_run_with_the_faults_counted_as_not_applied(tmp_path):
    # A job that fails at start-up never reports its first step: the run must end when its nodes have, not wait
    # for a clock that will not start (it looped until its timeout before).
    from lightning_syncasync.emulate.replica_groups import ReplicaGroupCluster, first_step_clock

    env, origin = first_step_clock(tmp_path, 2)
    cluster = ReplicaGroupCluster(
        nodes=2, procs_per_node=1, lighthouse=False, faults="kill:1@1,start:1@2", origin=origin,
        log_dir=tmp_path / "logs", echo=False, env=env,
    )  # fmt: skip
    report = cluster.run([sys.executable, "-c", "raise SystemExit(3)"], timeout_s=30)
    assert not report.interrupted and report.origin_s is None
    assert report.faults_not_applied == 2 and [r.exit_code for r in report.runs] == [3, 3]
    assert env["SYNCASYNC_TIMELINE"] == str(tmp_path / "timeline.node{node}.jsonl")


@pytest.mark.timeout(60)
def test_a_restart_due_after_every_node_finished_is_not_started_and_is_reported(tmp_path, caplog):
    # The one-machine demo (issue 65): node 1 killed, and its restart due when node 0 had already finished. Started,
    # it would train alone from scratch and overwrite node 1's results; it is counted as not applied, with a warning.
    from lightning_syncasync.emulate.replica_groups import ReplicaGroupCluster

    cluster = ReplicaGroupCluster(
        nodes=2, procs_per_node=1, lighthouse=False, faults="kill:1@0.3,start:1@3", log_dir=tmp_path / "logs",
        echo=False,
    )  # fmt: skip
    with caplog.at_level("WARNING"):
        report = cluster.run([sys.executable, "-c", "import time; time.sleep(1.0)"], timeout_s=30)
    assert [(r.node, r.killed) for r in report.runs] == [(0, False), (1, True)]  # no third run
    assert report.faults_not_applied == 1 and "start:1@3" in report.not_applied[0]
    assert "fault not applied" in caplog.text
    saved = json.loads((tmp_path / "logs" / "emulation.json").read_text())
    assert saved["faults_not_applied"] == 1 and saved["not_applied"] == report.not_applied

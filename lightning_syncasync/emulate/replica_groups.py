"""Run a fault-tolerant job on one machine: a torchft Lighthouse and one job per emulated node, with a schedule of
node faults (a node's whole job SIGKILLed at a chosen time and started again later, or a node that joins late).

This is the launch of ``docs/fault_tolerance.md`` on one machine: every node is its own job (the command runs once
per node; Lightning's launcher starts the node's ranks, ``trainer.devices`` of them), with ``REPLICA_GROUP_ID``,
``NUM_REPLICA_GROUPS`` and ``TORCHFT_LIGHTHOUSE`` set, as a scheduler would set them on real nodes. With network
namespaces (``netns=True``, root) each node sits behind its own rate-limited link (:class:`EmulatedNetwork`), the
Lighthouse runs in node 0's namespace (its own process: killing node 0's job leaves it up). A node is given only
what the docs tell a user to set (the Lighthouse's address, its group id, the number of groups): its launcher picks
``MASTER_ADDR``, and it finds the address the others reach it at itself, as on separate hosts.

Fault schedule: ``kill:1@10,start:1@25`` SIGKILLs node 1's job (every process of it) 10 s after the start and starts
it again at 25 s; ``term:1@10`` sends it SIGTERM instead (a preemption notice: the node stops at its next step and
leaves); ``start:2@15`` alone starts node 2 at 15 s instead of at once (scale-out). Times are seconds from the start
of the emulation, or from the moment ``origin`` first returns a time (the benchmark: the first training step, so
that start-up time does not shift a fault that is placed at a fraction of the training).

A node's job is every process it started, including those in sessions of their own (torchrun starts its workers
with ``start_new_session``): a kill takes the whole process tree, as losing the machine would.

Without a Lighthouse (``lighthouse=False``) the same cluster runs any per-node job with the same faults, e.g.
``torchrun --nnodes=1:2 --rdzv-endpoint={host0}:PORT`` whose elastic agent restarts the job from its last checkpoint
(``{host0}`` in the command is node 0's address, ``{host}`` the node's own, ``{is_node0}`` 1 on node 0 and 0
elsewhere: torchrun's ``--local-addr`` and ``--rdzv-conf is_host=``, as its own guesses from the host name cannot
tell namespaces apart). ``cores_per_node`` caps each node's CPU with a cgroup (every
process of the node shares it, as the ranks of one machine share its cores).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO

from lightning_syncasync.algorithms.averaging.ft_host import FT_HOST_ENV
from lightning_syncasync.emulate.cgroups import CpuShares, cgroup_cpu_root
from lightning_syncasync.emulate.cluster import _tee, free_port
from lightning_syncasync.emulate.network import EmulatedNetwork

log = logging.getLogger(__name__)

# Set in every node's job started here: the front ends (syncasync-train ft=N, syncasync-cli --ft N) then run the job
# itself instead of starting nodes again, and check that its strategy is a fault-tolerant one.
FT_NODE_ENV = "SYNCASYNC_FT_NODE"
_LIGHTHOUSE = (
    "import sys, time\n"
    "from torchft._torchft import LighthouseServer\n"
    "server = LighthouseServer(bind=sys.argv[1], min_replicas=int(sys.argv[2]), join_timeout_ms=int(sys.argv[3]),\n"
    "                          quorum_tick_ms=50, heartbeat_timeout_ms=int(sys.argv[4]))\n"
    "print(server.address(), flush=True)\n"
    "while True:\n"
    "    time.sleep(3600)\n"
)
TIMELINE_FILE = "timeline.node{node}.jsonl"  # each node's SyncMonitor timeline, under first_step_clock()
_EVENT = re.compile(r"^(kill|term|start):(\d+)@(\d+(?:\.\d+)?)$")


@dataclass(frozen=True)
class NodeEvent:
    """``kind`` (``kill``, ``term`` or ``start``) of node ``node``, ``at_s`` seconds after the start."""

    kind: str
    node: int
    at_s: float


def parse_node_faults(spec: str, nodes: int, setting: str = "--node-faults") -> list[NodeEvent]:
    """``kill:1@10,start:1@25`` -> events in time order; errors name the item and the fix."""
    events = []
    for item in filter(None, (s.strip() for s in re.split(r"[,; ]", spec))):
        m = _EVENT.match(item)
        if m is None:
            raise ValueError(
                f"{setting} item {item!r} is not KIND:NODE@SECONDS; HINT: kill:1@10 (SIGKILL node 1's job at "
                "10 s), term:1@10 (SIGTERM), start:1@25 (start it again, or for the first time, at 25 s)"
            )
        kind, node, at = m.group(1), int(m.group(2)), float(m.group(3))
        if not 0 <= node < nodes:
            raise ValueError(f"{setting} {item!r}: node {node} is outside 0..{nodes - 1}")
        events.append(NodeEvent(kind, node, at))
    events.sort(key=lambda e: e.at_s)
    alive = {n: True for n in range(nodes)}
    for n in {e.node for e in events}:
        first = next(e for e in events if e.node == n)
        alive[n] = first.kind != "start"  # a node whose first event is a start joins late
    for e in events:
        if (e.kind != "start") != alive[e.node]:
            state = "running" if alive[e.node] else "not running"
            raise ValueError(f"{setting}: {e.kind}:{e.node}@{e.at_s:g} but node {e.node} is {state} then")
        alive[e.node] = e.kind == "start"
    return events


@dataclass
class NodeRun:
    """One start of one node's job."""

    node: int
    started_at: float  # seconds from the emulation's start
    exit_code: int | None = None
    ended_at: float | None = None
    killed: bool = False  # SIGKILLed by the schedule
    terminated: bool = False  # sent SIGTERM by the schedule (Lightning then ends the node's fit with SIGTERMException)
    log: str = ""


@dataclass
class ReplicaGroupsReport:
    """What ran (written as ``emulation.json`` in the log folder)."""

    nodes: int
    procs_per_node: int
    link_mbit: float | None
    netns: bool
    faults: list[dict[str, object]]
    lighthouse: str = ""
    started_at: float = 0.0  # time.time() of the emulation's start (the fault schedule's origin)
    runs: list[NodeRun] = field(default_factory=list)
    wall_s: float = 0.0
    interrupted: bool = False
    origin_s: float | None = None  # seconds from the start at which the fault schedule's clock started
    faults_not_applied: int = 0  # events not applied: every node ended first, or the node was not running / alone
    not_applied: list[str] = field(default_factory=list)  # each of them, and why
    cpu_mode: str = "shared"  # "cgroup" when cores_per_node capped each node
    cores_per_node: float | None = None

    @property
    def failed(self) -> list[NodeRun]:
        """Runs that ended badly on their own (not killed by the schedule)."""
        return [r for r in self.runs if not (r.killed or r.terminated) and r.exit_code not in (0, None)]


class ReplicaGroupCluster:
    """A Lighthouse and ``nodes`` jobs of ``procs_per_node`` ranks each, with node faults on a schedule.

    Args:
        nodes: emulated nodes (replica groups).
        procs_per_node: ranks per node (the command must ask for as many: ``trainer.devices``).
        link_mbit: each node's link rate (needs ``netns``).
        netns: one network namespace per node (root); ``False``: loopback.
        faults: the node fault schedule (module docstring).
        min_replicas: the Lighthouse's quorum minimum.
        join_timeout_ms: how long the Lighthouse waits for a node that heartbeats but has not asked to join a
            round (validation, a checkpoint save) before forming the round without it.
        heartbeat_timeout_ms: how long after its last heartbeat a node counts as dead.
        log_dir: ``node{n}.log`` (``node{n}.{k}.log`` for its k-th restart), ``lighthouse.log``, ``emulation.json``.
        echo: copy every node's output to this process's stdout, each line prefixed with ``[node N]`` (``[node
            N.k]`` for its k-th restart), as torchrun's ``--tee`` does for its ranks; the logs keep it unprefixed.
        faults_setting: how the front end names the schedule in its errors (``--ft-faults``, ``ft_faults``).
        lighthouse: start a torchft Lighthouse and set the torchft variables (``False``: any per-node job).
        cores_per_node: cap each node's processes at this many cores (cgroups; root), ``None``: no cap.
        origin: the fault schedule's clock starts when this first returns a time (``time.time()``); ``None``: at
            the start of the emulation.
        env: more environment variables for every node (``{node}`` in a value is replaced by the node's id).

    Example::

        cluster = ReplicaGroupCluster(nodes=2, procs_per_node=2, faults="kill:1@10,start:1@20")
        report = cluster.run(["syncasync-train", "strategy=hier_sync_ft", "trainer.devices=2"])
    """

    def __init__(
        self,
        nodes: int = 2,
        procs_per_node: int = 2,
        link_mbit: float | None = None,
        netns: bool = False,
        faults: str = "",
        min_replicas: int = 1,
        join_timeout_ms: int = 10_000,
        heartbeat_timeout_ms: int = 2_000,
        log_dir: str | Path | None = None,
        echo: bool = True,
        faults_setting: str = "--node-faults",
        lighthouse: bool = True,
        cores_per_node: float | None = None,
        origin: Callable[[], float | None] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        if nodes < 1:
            raise ValueError(f"--nodes must be >= 1, got {nodes}; HINT: e.g. --nodes 2")
        if procs_per_node < 1:
            raise ValueError(f"--procs-per-node must be >= 1, got {procs_per_node}")
        if link_mbit is not None and not netns:
            raise ValueError("--link-mbit needs network namespaces; HINT: drop --no-netns, or drop --link-mbit")
        if not 1 <= min_replicas <= nodes:
            raise ValueError(
                f"min_replicas={min_replicas} must be between 1 and the {nodes} node(s) that can exist; HINT: 1 lets "
                "a lone survivor train on"
            )
        if cores_per_node is not None and not cores_per_node > 0:
            raise ValueError(f"cores_per_node must be > 0, got {cores_per_node}")
        if lighthouse and importlib.util.find_spec("torchft") is None:
            from lightning_syncasync.algorithms.averaging.elastic import FT_HINT

            raise ValueError(f"the fault-tolerant emulation needs torchft (its Lighthouse), not installed. {FT_HINT}")
        self.nodes, self.procs_per_node, self.link_mbit, self.netns = nodes, procs_per_node, link_mbit, netns
        self.events = parse_node_faults(faults, nodes, faults_setting)
        self.min_replicas, self.join_timeout_ms, self.heartbeat_timeout_ms = (
            min_replicas, join_timeout_ms, heartbeat_timeout_ms,
        )  # fmt: skip
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.echo = echo
        self.lighthouse, self.origin, self.extra_env = lighthouse, origin, dict(env or {})
        self.cores_per_node = cores_per_node
        if cores_per_node is not None and cgroup_cpu_root() is None:
            log.warning("cgroup cpu controller unavailable: nodes are not capped at %g cores", cores_per_node)
            self.cores_per_node = None
        self.shares: CpuShares | None = None
        self.network: EmulatedNetwork | None = None
        self._procs: dict[int, subprocess.Popen] = {}
        self._runs: dict[int, NodeRun] = {}
        self._stop = False

    def run(self, command: Sequence[str], timeout_s: float | None = None) -> ReplicaGroupsReport:
        """Run ``command`` once per node (``{node}`` in its arguments is replaced by the node's id) until every
        node's last run has ended and no start is left in the schedule."""
        report = ReplicaGroupsReport(
            nodes=self.nodes, procs_per_node=self.procs_per_node, link_mbit=self.link_mbit, netns=self.netns,
            faults=[asdict(e) for e in self.events],
        )  # fmt: skip
        log_dir = self.log_dir or Path(tempfile.mkdtemp(prefix="syncasync-ft-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir = log_dir
        files: list[IO[bytes]] = []
        lighthouse: subprocess.Popen | None = None
        previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        start = time.monotonic()
        report.started_at = time.time()
        try:
            for s in previous:
                signal.signal(s, self._on_signal)
            if self.netns:
                self.network = EmulatedNetwork(self.nodes, self.link_mbit)
                self.network.setup()
            if self.cores_per_node is not None:
                self.shares = CpuShares()
                for node in range(self.nodes):
                    self.shares.create(f"node{node}", self.cores_per_node)
                report.cpu_mode, report.cores_per_node = "cgroup", self.cores_per_node
            if self.lighthouse:
                lighthouse, report.lighthouse = self._start_lighthouse(log_dir, files)
            late = {e.node for e in self.events if e.kind == "start"} - {
                e.node for e in self.events if e.kind != "start"
            }
            for node in range(self.nodes):
                if node not in late:
                    report.runs.append(self._start_node(node, command, report, log_dir, files, start))
            pending = [e for e in self.events]
            origin = 0.0 if self.origin is None else None
            while not self._stop:
                now = time.monotonic() - start
                if origin is None:
                    at = self.origin() if self.origin is not None else None
                    if at is not None:
                        origin = max(0.0, now - (time.time() - at))
                        report.origin_s = origin
                        log.info("fault clock starts at %.1f s", origin)
                while origin is not None and pending and origin + pending[0].at_s <= now:
                    event = pending.pop(0)
                    why = self._cannot_apply(event, report)
                    if why:
                        self._skip(report, event, why)
                    elif event.kind == "kill":
                        self._kill_node(event.node, start)
                    elif event.kind == "term":
                        self._terminate_node(event.node, start)
                    else:
                        report.runs.append(self._start_node(event.node, command, report, log_dir, files, start))
                for node, proc in list(self._procs.items()):
                    code = proc.poll()
                    if code is not None:
                        run = self._runs[node]
                        run.exit_code, run.ended_at = code, time.monotonic() - start
                        del self._procs[node]
                if not self._procs and pending and origin is not None and report.runs:
                    # Every node has ended: what is left of the schedule would only start nodes that train alone
                    # from scratch (and overwrite their results), so none of it runs.
                    for event in pending:
                        self._skip(report, event, "every node had already finished")
                    pending = []
                if not self._procs and not pending:
                    break
                if not self._procs and origin is None:
                    # Every node ended before the clock's origin came (a job that failed at start-up, or one that
                    # never reports its first step): the schedule cannot start, and waiting for it would hang.
                    log.warning("every node ended before the fault clock started: %d fault(s) not applied",
                                len(pending))  # fmt: skip
                    for event in pending:
                        report.not_applied.append(f"{event.kind}:{event.node}@{event.at_s:g}: the clock never started")
                    report.faults_not_applied = len(report.not_applied)
                    break
                if timeout_s is not None and now > timeout_s:
                    log.error("timeout after %.0f s: stopping every node", timeout_s)
                    report.interrupted = True
                    break
                time.sleep(0.05)
            report.interrupted |= self._stop
        finally:
            for node in list(self._procs):
                self._kill_node(node, start, scheduled=False)
            if lighthouse is not None:
                lighthouse.terminate()
                try:
                    lighthouse.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    lighthouse.kill()
            for f in files:
                f.close()
            if self.shares is not None:
                self.shares.teardown()
            if self.network is not None:
                self.network.teardown()
            for s, handler in previous.items():
                signal.signal(s, handler)
            report.wall_s = time.monotonic() - start
            (log_dir / "emulation.json").write_text(json.dumps(asdict(report), indent=2))
        return report

    # -- internals ---------------------------------------------------------------------------------------------

    def _cannot_apply(self, event: NodeEvent, report: ReplicaGroupsReport) -> str:
        """Why ``event`` cannot do what it says now ('' when it can)."""
        if event.kind != "start":
            return "" if event.node in self._procs else f"node {event.node} had already finished"
        if report.runs and not self._procs:
            return "every node had already finished (it would train alone from scratch and overwrite its results)"
        return ""

    def _skip(self, report: ReplicaGroupsReport, event: NodeEvent, why: str) -> None:
        text = f"{event.kind}:{event.node}@{event.at_s:g}: {why}"
        log.warning("fault not applied: %s. HINT: a longer job (trainer.max_epochs), or earlier fault times", text)
        report.not_applied.append(text)
        report.faults_not_applied = len(report.not_applied)

    def _start_lighthouse(self, log_dir: Path, files: list[IO[bytes]]) -> tuple[subprocess.Popen, str]:
        port = free_port()
        host = self.network.address(0) if self.network is not None else "127.0.0.1"
        # torchft's Lighthouse server (what its torchft_lighthouse script runs), started from this interpreter: the
        # script's folder need not be on PATH (a virtual environment used without activating it).
        cmd = [sys.executable, "-c", _LIGHTHOUSE, f"[::]:{port}", str(self.min_replicas), str(self.join_timeout_ms),
               str(self.heartbeat_timeout_ms)]  # fmt: skip
        if self.network is not None:
            cmd = self.network.exec_prefix(0) + cmd
        out = open(log_dir / "lighthouse.log", "wb")  # noqa: SIM115 - closed by run()
        files.append(out)
        env = dict(os.environ, RUST_LOG=os.environ.get("RUST_LOG", "warn"))
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        address = f"http://{host}:{port}"
        deadline = time.monotonic() + 10
        import socket

        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"torchft_lighthouse exited with {proc.returncode}; see {log_dir / 'lighthouse.log'}"
                )
            try:
                probe = self.network.exec_prefix(0) if self.network is not None else []
                if probe:
                    check = f"import socket; socket.create_connection(('{host}', {port}), 1)"
                    ok = subprocess.run([*probe, sys.executable, "-c", check], capture_output=True).returncode == 0
                else:
                    socket.create_connection((host, port), 1).close()
                    ok = True
                if ok:
                    log.info("lighthouse at %s (min_replicas %d)", address, self.min_replicas)
                    return proc, address
            except OSError:
                pass
            time.sleep(0.1)
        proc.kill()
        raise RuntimeError(f"torchft_lighthouse did not listen at {address} within 10 s")

    def node_env(self, node: int, lighthouse: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update({k: v.replace("{node}", str(node)) for k, v in self.extra_env.items()})
        for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR",
                    "TORCHELASTIC_RUN_ID", "GLOO_SOCKET_IFNAME", "MASTER_PORT", FT_HOST_ENV):  # fmt: skip
            env.pop(var, None)
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("RUST_LOG", "warn")
        if self.lighthouse:
            # Only what docs/fault_tolerance.md tells a user to set on a node (and our marker that the front ends
            # read): the node's launcher (torchrun --standalone, Lightning's) picks MASTER_ADDR/MASTER_PORT, and the
            # node finds the address the others reach it at by itself (advertised_host), as on real hosts.
            env.update(
                TORCHFT_LIGHTHOUSE=lighthouse, REPLICA_GROUP_ID=str(node), NUM_REPLICA_GROUPS=str(self.nodes),
                **{FT_NODE_ENV: str(node)},
            )  # fmt: skip
        elif self.network is not None:
            # Any per-node job (torchrun across nodes with --local-addr): gloo's default device is the hostname's
            # address, loopback in every namespace here, so name the node's interface as reliability.md says.
            env["GLOO_SOCKET_IFNAME"] = self.network.interface(node)
        return env

    def _start_node(self, node: int, command: Sequence[str], report: ReplicaGroupsReport, log_dir: Path,
                    files: list[IO[bytes]], start: float) -> NodeRun:  # fmt: skip
        attempt = sum(1 for r in report.runs if r.node == node)
        name = f"node{node}.log" if attempt == 0 else f"node{node}.{attempt}.log"
        host0 = self.network.address(0) if self.network is not None else "127.0.0.1"
        host = self.network.address(node) if self.network is not None else "127.0.0.1"
        fields = {"{node}": str(node), "{host0}": host0, "{host}": host, "{is_node0}": str(int(node == 0))}
        cmd = list(command)
        for key, value in fields.items():
            cmd = [a.replace(key, value) for a in cmd]
        if self.network is not None:
            cmd = self.network.exec_prefix(node) + cmd
        out = open(log_dir / name, "wb")  # noqa: SIM115 - closed by run()
        files.append(out)
        echo = self.echo
        shares = self.shares
        proc = subprocess.Popen(
            cmd, env=self.node_env(node, report.lighthouse), stdout=subprocess.PIPE if echo else out,
            stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=(lambda: shares.join(f"node{node}")) if shares is not None else None,
        )  # fmt: skip
        if echo:
            prefix = f"[node {node}] " if attempt == 0 else f"[node {node}.{attempt}] "
            threading.Thread(target=_tee, args=(proc.stdout, out, prefix.encode()), daemon=True).start()
        self._procs[node] = proc
        run = NodeRun(node=node, started_at=time.monotonic() - start, log=str(log_dir / name))
        self._runs[node] = run
        log.info("node %d started (run %d) at %.1f s", node, attempt, run.started_at)
        return run

    def _kill_node(self, node: int, start: float, scheduled: bool = True) -> None:
        proc = self._procs.pop(node, None)
        if proc is None:
            return
        # The node's whole job: Lightning's launcher and its ranks, or torchrun's agent and its workers (each in a
        # session of its own, so the process group alone would leave them running).
        for pid in [proc.pid, *_descendants(proc.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        run = self._runs[node]
        run.exit_code, run.ended_at, run.killed = proc.returncode, time.monotonic() - start, scheduled
        if scheduled:
            log.info("node %d killed at %.1f s", node, run.ended_at)

    def _terminate_node(self, node: int, start: float) -> None:
        """SIGTERM to the node's job (every process: SLURM and torchrun signal every task); it ends by itself."""
        proc = self._procs.get(node)
        if proc is None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        self._runs[node].terminated = True
        log.info("node %d sent SIGTERM at %.1f s", node, time.monotonic() - start)

    def _on_signal(self, signum: int, frame: object) -> None:
        self._stop = True


def node_command(procs_per_node: int, module: str, args: Sequence[str]) -> list[str]:
    """One node's job as docs/fault_tolerance.md launches it on a real node: ``torchrun --standalone`` with the
    node's ranks, running ``python -m module args``. Its ``MASTER_ADDR`` is the launcher's loopback address, as on a
    real host, so the emulation runs what a user's launch runs (issue 65: a launch that only worked because the
    emulator set the node's address itself)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs_per_node}",
            "-m", module, *args]  # fmt: skip


def first_step_clock(folder: Path, nodes: int) -> tuple[dict[str, str], Callable[[], float | None]]:
    """A fault clock that starts at the job's first training step instead of its launch: the environment that makes
    every node's ``SyncMonitor`` write its timeline to ``folder/timeline.node{n}.jsonl``, and the ``origin`` for
    :class:`ReplicaGroupCluster` that returns the earliest first line of those files.

    Why: start-up (imports, rendezvous) takes 8 s here and three times that on a loaded machine, so a fault placed at
    a time from the launch may hit a node that has not trained yet, or a restart may find the others done. A job
    without ``SyncMonitor`` writes no timeline; give it the launch clock (``origin=None``) instead."""
    from lightning_syncasync.callbacks._timeline import ENV_TIMELINE, read_timeline

    timelines = [Path(folder) / TIMELINE_FILE.format(node=n) for n in range(nodes)]

    def origin() -> float | None:
        starts = [line["t"] for p in timelines for line in read_timeline(p)[:1]]
        return min(starts) if starts else None

    return {ENV_TIMELINE: str(Path(folder) / TIMELINE_FILE)}, origin


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (read from /proc before anything is killed, so none is reparented yet)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out

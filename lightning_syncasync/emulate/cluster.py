"""Run a training command as a multi-node job on one machine, started the way torchrun starts ranks.

Every rank is its own process with torchrun's environment (``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``,
``RANK``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``/``NODE_RANK``), so Lightning picks its
``TorchElasticEnvironment`` exactly as under torchrun on real nodes and checks that ``num_nodes x devices`` matches
the world size. With network namespaces each rank runs inside its node's namespace with ``GLOO_SOCKET_IFNAME`` set
to the node's interface; with cgroups each rank gets a fixed CPU share. Nothing in the strategies knows it is
emulated: the only package-specific variables are the straggler specs that ``StragglerEmulator`` reads.

Failure handling: when a rank exits non-zero, the others get ``grace_s`` seconds and are then killed (at once when
every rank left is stopped by a signal, as a hung rank of ``--fault stop`` is: it cannot end by itself); Ctrl-C and
SIGTERM kill every rank. In all cases namespaces, links and cgroups are removed before :meth:`EmulatedCluster.run`
returns (or re-raises).
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO

from lightning_syncasync._cores import ENV_HOST_RANKS, usable_cores
from lightning_syncasync.callbacks.faults import ENV_FAULT
from lightning_syncasync.callbacks.straggler import (
    ENV_JITTER,
    ENV_LINK_CONTROL,
    ENV_LINK_SCHEDULE,
    ENV_SCHEDULE,
    ENV_SEED,
    ENV_START_BARRIER,
    parse_jitter,
    parse_link,
    parse_schedule,
)
from lightning_syncasync.emulate.cgroups import CpuShares, cgroup_cpu_root
from lightning_syncasync.emulate.network import EmulatedNetwork

log = logging.getLogger(__name__)

Command = Sequence[str] | Callable[[int], Sequence[str]]


@dataclass
class EmulationReport:
    """What was emulated and how it ended (written as ``emulation.json`` in the log folder)."""

    nodes: int
    procs_per_node: int
    link_mbit: float | None
    netns: bool
    cpu_mode: str  # "cgroup" (fixed shares) or "sleep" (no cgroups: slowdowns injected as sleeps, confounded)
    cores_per_rank: list[float]
    stragglers: dict[int, float]
    jitter: str
    schedule: str
    seed: int
    independent: bool
    exit_codes: list[int | None] = field(default_factory=list)
    wall_s: float = 0.0
    failed_rank: int | None = None
    interrupted: bool = False
    fault: str = ""
    exit_times: list[float | None] = field(default_factory=list)  # time.time() each rank's exit was seen
    # Per node, bytes on its inter-node link and its loopback over the whole run (EmulatedNetwork.counters); empty
    # without network namespaces.
    net_bytes: list[dict[str, int]] = field(default_factory=list)
    link_schedule: str = ""
    # The link rates applied while the job ran: [seconds from the start, Mbit/s (None: no limit)], the first being
    # the emulation's own.
    link_changes: list[list[float | None]] = field(default_factory=list)


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A TCP port free now, drawn below the kernel's ephemeral range, and not handed out before by this process.

    Why below: a port the kernel picks for a bind to port 0 (torchft's servers, gloo's pairs, any client socket) comes
    from ``ip_local_port_range``, so a port probed inside that range can be taken by one of them before the caller
    binds it (a test lost a replica group to EADDRINUSE on its MASTER_PORT that way). Below the range only another
    explicit choice can collide, and this process never hands out the same port twice."""
    low = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(100):
        with socket.socket() as s:
            try:  # every address: the caller's store binds them all (port 0: a range too small to draw below)
                s.bind(("", rng.randrange(max(1024, low // 2), low) if low > 2048 else 0))
            except OSError:
                continue
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise RuntimeError(f"no free TCP port found between {max(1024, low // 2)} and {low}")


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default range starts here; other systems have no such file


class EmulatedCluster:
    """A job of ``nodes x procs_per_node`` ranks on this machine.

    Args:
        nodes: emulated nodes.
        procs_per_node: ranks per node.
        link_mbit: inter-node link rate (Mbit/s) per node; ``None`` for no limit.
        stragglers: ``{rank: factor}``: the rank's CPU share is divided by ``factor`` (1.5 = 1.5x slower).
        jitter: ``"PROB:FACTOR"`` transient pauses (injected by ``StragglerEmulator`` in the training process).
        schedule: ``"RANK:FACTOR@START-END"`` time-windowed slowdowns (idem).
        seed: seed of the jitter draws.
        cpu_budget: cores shared by all ranks (default: 75% of the cores this process may use, leaving room for the
            kernel, the launcher and I/O so that ranks do not wait for a CPU); each rank gets
            ``cpu_budget / world_size`` cores, divided by its straggler factor. Must not exceed the machine's cores,
            or the shares stop being independent.
        netns: emulate nodes with network namespaces (root); ``False``: plain loopback, no bandwidth limit.
        cgroups: cap CPU shares with cgroups; ``False`` (or unavailable): persistent slowdowns become sleeps.
        independent: start every rank as a world of one (no communication at all): the no-communication limit.
        log_dir: where ``rank{r}.log`` and ``emulation.json`` go (default: a new temporary folder).
        grace_s: how long the other ranks may run after one failed, before they are killed.
        echo_rank0: copy rank 0's output to this process's stdout.
        fault: a fault to inject, ``KIND:RANK@STEP[+SECONDS]`` (``kill``, ``stop``, ``raise``, ``cut``; see
            :mod:`lightning_syncasync.callbacks.faults`), passed to every rank as ``SYNCASYNC_FAULT``.
        link_schedule: ``"MBIT@START-END,..."``: the inter-node link's rate in windows of the planned steps
            (``StragglerEmulator`` on global rank 0 asks for each change through a file this process watches, and the
            change is applied to every node's link with ``tc``); ``link_mbit`` outside them.

    Example::

        cluster = EmulatedCluster(nodes=2, procs_per_node=2, link_mbit=100, stragglers={3: 1.5})
        report = cluster.run(["syncasync-train", "strategy=hier_sync", "trainer.num_nodes=2", "trainer.devices=2"])
    """

    def __init__(
        self,
        nodes: int = 2,
        procs_per_node: int = 2,
        link_mbit: float | None = None,
        stragglers: dict[int, float] | None = None,
        jitter: str = "",
        schedule: str = "",
        seed: int = 0,
        cpu_budget: float | None = None,
        netns: bool = True,
        cgroups: bool = True,
        independent: bool = False,
        log_dir: str | Path | None = None,
        grace_s: float = 30.0,
        echo_rank0: bool = True,
        fault: str = "",
        link_schedule: str = "",
    ) -> None:
        if nodes < 1:
            raise ValueError(f"--nodes must be >= 1, got {nodes}; HINT: e.g. --nodes 2")
        if procs_per_node < 1:
            raise ValueError(f"--procs-per-node must be >= 1, got {procs_per_node}; HINT: e.g. --procs-per-node 2")
        self.world_size = nodes * procs_per_node
        self.stragglers = dict(stragglers or {})
        for rank, factor in self.stragglers.items():
            if not 0 <= rank < self.world_size:
                raise ValueError(
                    f"--straggler rank {rank} is outside the world of {self.world_size} ranks; HINT: ranks are "
                    f"0..{self.world_size - 1}"
                )
            if factor < 1:
                raise ValueError(
                    f"--straggler factor must be >= 1 (1.5 = 1.5x slower), got {rank}:{factor}; HINT: e.g. 3:1.5"
                )
        parse_jitter(jitter)  # validate early, with the spec's own error messages
        try:
            parse_link(link_schedule)
        except ValueError as err:
            raise ValueError(f"--link-schedule: {err}") from None
        if link_schedule and not netns:
            raise ValueError(
                "--link-schedule re-rates the nodes' links: it needs network namespaces; HINT: drop --no-netns"
            )
        for w in parse_schedule(schedule):
            if not 0 <= w.rank < self.world_size:
                raise ValueError(
                    f"--straggler-schedule rank {w.rank} is outside the world of {self.world_size} ranks; HINT: ranks "
                    f"are 0..{self.world_size - 1}"
                )
        cores = usable_cores()
        budget = 0.75 * cores if cpu_budget is None else cpu_budget
        if not 0 < budget <= cores:
            raise ValueError(
                f"--cpu-budget must be in (0, {cores:g}] (the cores this process may use), got {budget}; above it the "
                "ranks compete for CPU and stop behaving like separate machines"
            )
        if grace_s < 0:
            raise ValueError(
                f"grace_s must be >= 0, got {grace_s}; HINT: 30 lets the others report before they are killed"
            )
        if fault:
            from lightning_syncasync.callbacks.faults import parse_fault

            spec = parse_fault(fault)
            if spec.rank >= self.world_size:
                raise ValueError(
                    f"--fault rank {spec.rank} is outside the world of {self.world_size} ranks; HINT: a rank below "
                    f"{self.world_size}"
                )
            if spec.kind == "cut" and not netns:
                raise ValueError(
                    "--fault cut:... takes a node's link down: it needs network namespaces; HINT: drop --no-netns"
                )
        self.fault = fault
        self.link_schedule = link_schedule
        self.nodes, self.procs_per_node = nodes, procs_per_node
        self.link_mbit = link_mbit
        self.jitter, self.schedule, self.seed = jitter, schedule, seed
        self.cpu_budget = budget
        self.netns = netns
        self.use_cgroups = cgroups and cgroup_cpu_root() is not None
        if cgroups and not self.use_cgroups:
            log.warning("cgroup cpu controller unavailable: slowdowns fall back to sleeps (confounded by contention)")
        self.independent = independent
        self.log_dir = Path(log_dir) if log_dir else None
        self.grace_s = grace_s
        self.echo_rank0 = echo_rank0
        self.network: EmulatedNetwork | None = None
        self.shares: CpuShares | None = None
        self.procs: list[subprocess.Popen] = []
        self._stop = threading.Event()
        self._barrier_port: int | None = None
        self._barrier_store: object | None = None
        self._exit_times: dict[int, float] = {}
        self._link_control: Path | None = None
        # Extra environment of every rank, set last (the benchmark names its timeline file here).
        self.env: dict[str, str] = {}

    def cores_per_rank(self) -> list[float]:
        base = self.cpu_budget / self.world_size
        return [base / self.stragglers.get(r, 1.0) for r in range(self.world_size)]

    def rank_env(self, rank: int, port: int) -> dict[str, str]:
        node, local = divmod(rank, self.procs_per_node)
        env = dict(os.environ)
        # One intra-op thread per rank: each emulated machine owns its share of one core, not the whole box.
        env.setdefault("OMP_NUM_THREADS", "1")
        for var in ("GLOO_SOCKET_IFNAME", "TORCHELASTIC_RUN_ID", ENV_JITTER, ENV_SCHEDULE, ENV_SEED, ENV_START_BARRIER,
                    ENV_FAULT, ENV_HOST_RANKS, ENV_LINK_SCHEDULE, ENV_LINK_CONTROL):  # fmt: skip
            env.pop(var, None)
        if self.independent:
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="1", RANK="0",
                       LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GROUP_RANK="0", NODE_RANK="0")  # fmt: skip
            if self._barrier_port is not None:
                env[ENV_START_BARRIER] = f"127.0.0.1:{self._barrier_port}:{self.world_size}"
        else:
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(self.world_size),
                       RANK=str(rank), LOCAL_RANK=str(local), LOCAL_WORLD_SIZE=str(self.procs_per_node),
                       GROUP_RANK=str(node), NODE_RANK=str(node))  # fmt: skip
            if self.network is not None:
                env.update(self.network.node_env(node))
        env[ENV_SEED] = str(self.seed)
        # Every emulated node runs on this machine: the probe's memory per rank divides RAM by all of them.
        env[ENV_HOST_RANKS] = str(self.world_size)
        if self.fault:
            env[ENV_FAULT] = self.fault
        env.update(self.env)
        if self.jitter:
            env[ENV_JITTER] = self.jitter
        if self.link_schedule and not self.independent and self._link_control is not None:
            env[ENV_LINK_SCHEDULE] = self.link_schedule
            env[ENV_LINK_CONTROL] = str(self._link_control)
        if self.schedule:
            # Windowed slowdowns are about global ranks; an independent rank is rank 0 of its own world, so the
            # schedule is rewritten to address it.
            env[ENV_SCHEDULE] = self._schedule_for(rank) if self.independent else self.schedule
        if not self.use_cgroups and rank in self.stragglers:
            from lightning_syncasync.callbacks.straggler import ENV_SLOWDOWN

            env[ENV_SLOWDOWN] = f"{0 if self.independent else rank}:{self.stragglers[rank]}"
        return env

    def _schedule_for(self, rank: int) -> str:
        items = [w for w in parse_schedule(self.schedule) if w.rank == rank]
        return ",".join(f"0:{w.factor}@{w.start}-{w.end}" for w in items)

    def run(self, command: Command, timeout_s: float | None = None) -> EmulationReport:
        """Run ``command`` (or ``command(rank)``) on every rank; ``{rank}`` in arguments is replaced by the rank."""
        report = EmulationReport(
            nodes=self.nodes, procs_per_node=self.procs_per_node,
            link_mbit=None if self.independent else self.link_mbit, netns=self.netns and not self.independent,
            cpu_mode="cgroup" if self.use_cgroups else "sleep", cores_per_rank=self.cores_per_rank(),
            stragglers=self.stragglers, jitter=self.jitter, schedule=self.schedule, seed=self.seed,
            independent=self.independent, fault=self.fault,
            link_schedule="" if self.independent else self.link_schedule,
        )  # fmt: skip
        log_dir = self.log_dir or Path(__import__("tempfile").mkdtemp(prefix="syncasync-emulate-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        files: list[IO[bytes]] = []
        threads: list[threading.Thread] = []
        ended = threading.Event()  # the ranks are gone: the link steering stops
        try:
            if threading.current_thread() is threading.main_thread():
                for s in previous:
                    signal.signal(s, self._on_signal)
            if self.independent:
                # Ranks that do not communicate need no network, but they should train at the same time: they meet
                # at a start barrier served from here (see StragglerEmulator).
                import datetime

                import torch.distributed as dist

                self._barrier_port = free_port()
                self._barrier_store = dist.TCPStore(
                    "127.0.0.1", self._barrier_port, self.world_size + 1, is_master=True,
                    timeout=datetime.timedelta(seconds=600), wait_for_workers=False,
                )  # fmt: skip
            elif self.netns:
                self.network = EmulatedNetwork(self.nodes, self.link_mbit)
                self.network.setup()
                if self.link_schedule:
                    self._link_control = log_dir / "link_control"
                    self._link_control.unlink(missing_ok=True)
                    report.link_changes.append([0.0, self.link_mbit])
                    t = threading.Thread(
                        target=self._steer_link, args=(self.network, report, start, ended), daemon=True
                    )
                    t.start()
                    threads.append(t)
            if self.use_cgroups:
                self.shares = CpuShares()
                for r, cores in enumerate(self.cores_per_rank()):
                    self.shares.create(f"rank{r}", cores)
            port = free_port()
            for rank in range(self.world_size):
                cmd = [a.replace("{rank}", str(rank)) for a in (command(rank) if callable(command) else command)]
                if self.network is not None:
                    cmd = self.network.exec_prefix(rank // self.procs_per_node) + cmd
                out = open(log_dir / f"rank{rank}.log", "wb")  # noqa: SIM115 - closed in finally
                files.append(out)
                proc = self._start(rank, cmd, self.rank_env(rank, port), out)
                self.procs.append(proc)
                if proc.stdout is not None:
                    t = threading.Thread(target=_tee, args=(proc.stdout, out), daemon=True)
                    t.start()
                    threads.append(t)
            self._wait(report, timeout_s)
        finally:
            self._kill_all()
            ended.set()
            for t in threads:
                t.join(timeout=5)
            for f in files:
                f.close()
            if self.shares is not None:
                self.shares.teardown()
            if self.network is not None:
                try:
                    # Counters start at 0 in the namespaces made for this run: the whole run's traffic.
                    report.net_bytes = self.network.counters()
                finally:
                    self.network.teardown()
            for s, handler in previous.items():
                if threading.current_thread() is threading.main_thread():
                    signal.signal(s, handler)
            self._barrier_store = None
            report.exit_codes = [p.returncode for p in self.procs]
            report.exit_times = [self._exit_times.get(r) for r in range(len(self.procs))]
            report.wall_s = time.monotonic() - start
            (log_dir / "emulation.json").write_text(json.dumps(asdict(report), indent=2))
            self.log_dir = log_dir
        return report

    def _steer_link(
        self, network: EmulatedNetwork, report: EmulationReport, start: float, ended: threading.Event
    ) -> None:
        """Apply the rate rank 0 asks for (``link_schedule``) until the run ends: ``0`` is the emulation's own."""
        assert self._link_control is not None
        applied: str | None = None
        while not ended.is_set():
            try:
                wanted = self._link_control.read_text().strip()
            except OSError:
                wanted = None
            if wanted and wanted != applied:
                mbit = float(wanted) or self.link_mbit
                network.set_link(mbit)
                applied = wanted
                report.link_changes.append([round(time.monotonic() - start, 3), mbit])
                log.info("link rate now %s", f"{mbit:g} Mbit/s" if mbit else "unlimited")
            ended.wait(0.05)

    def _start(self, rank: int, cmd: list[str], env: dict[str, str], out: IO[bytes]) -> subprocess.Popen:
        """Start one rank. What the rest of the emulator needs of the process: ``pid`` (the leader of a process
        group of its own), ``poll``, ``wait(timeout)``, ``returncode`` and, for rank 0 echoed, ``stdout``."""
        return subprocess.Popen(
            cmd,
            env=env,
            stdout=subprocess.PIPE if (rank == 0 and self.echo_rank0) else out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: killed as a whole, children included
            preexec_fn=self._joiner(rank),
        )

    def _joiner(self, rank: int) -> Callable[[], None] | None:
        if self.shares is None:
            return None
        shares, name = self.shares, f"rank{rank}"
        cpus = sorted(os.sched_getaffinity(0))
        cpu = cpus[rank % len(cpus)]

        def join() -> None:
            shares.join(name)
            # A fixed CPU per rank: a process that migrates between CPUs (or shares one with a different neighbour
            # each time) gets a different amount of work out of the same CPU share; pinned, a rank's speed is its
            # share. Quotas are chosen so that the ranks on one CPU fit in it.
            os.sched_setaffinity(0, {cpu})

        return join

    def _on_signal(self, signum: int, frame: object) -> None:
        self._stop.set()

    def _wait(self, report: EmulationReport, timeout_s: float | None) -> None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        failed_at: float | None = None
        while True:
            codes = [p.poll() for p in self.procs]
            for r, c in enumerate(codes):
                if c is not None:
                    self._exit_times.setdefault(r, time.time())
            if all(c is not None for c in codes):
                return
            if self._stop.is_set():
                report.interrupted = True
                log.warning("interrupted: stopping all ranks")
                return
            if failed_at is None:
                bad = [r for r, c in enumerate(codes) if c not in (None, 0)]
                if bad:
                    report.failed_rank = bad[0]
                    failed_at = time.monotonic()
                    log.error(
                        "rank %d exited with %d; stopping the others in %.0fs", bad[0], codes[bad[0]], self.grace_s
                    )
            elif time.monotonic() - failed_at > self.grace_s:
                return
            elif all(_stopped(p.pid) for p, c in zip(self.procs, codes, strict=True) if c is None):
                # Only stopped ranks are left: nothing can end them but the clean-up, so the grace (there for
                # ranks still reporting their error) has nothing left to wait for.
                log.info("every rank left is stopped (SIGSTOP): stopping them now")
                return
            if deadline is not None and time.monotonic() > deadline:
                report.interrupted = True
                log.error("timeout after %.0fs: stopping all ranks", timeout_s)
                return
            time.sleep(0.1)

    def _kill_all(self) -> None:
        # Signal every rank's process group, also of ranks that exited: children they left behind (a dataloader
        # worker, a launcher's subprocess) are in the same group.
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGTERM)
                os.killpg(p.pid, signal.SIGCONT)  # a stopped (hung) rank handles SIGTERM only once continued
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + 10
        for p in self.procs:
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()


def _stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped by a signal (state ``T`` in ``/proc/PID/stat``; ``t``, traced, is a debugger's
    and is left alone). False where it cannot be read (gone, no procfs): then the grace applies as usual."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    # The state follows the command name, which is in parentheses and may itself hold spaces or parentheses.
    return stat[stat.rfind(")") + 2 : stat.rfind(")") + 3] == "T"


def _tee(src: IO[bytes], dst: IO[bytes], prefix: bytes = b"") -> None:
    for line in iter(src.readline, b""):
        dst.write(line)
        dst.flush()
        sys.stdout.buffer.write(prefix + line)
        sys.stdout.flush()

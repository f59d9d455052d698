"""Fixed CPU shares per process through the cgroup ``cpu`` controller, so emulated nodes have fixed speeds.

On separate machines a process's speed does not depend on what the other machines do. On one shared machine it
does: when one process sleeps, the others get its CPU (FINDINGS: a rank slowed 1.5x by sleeping measured only
1.07-1.28x slower with 4 processes on 2 cores). Capping each process at a CFS quota (``cpu.cfs_quota_us`` over
``cpu.cfs_period_us``, cgroup v1; ``cpu.max`` on cgroup v2) restores independence as long as the quotas sum to less
than the machine's cores: a 0.25-core quota slowed a busy loop exactly 4x here.
"""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path

log = logging.getLogger(__name__)

V1_ROOT = Path("/sys/fs/cgroup/cpu")
V2_ROOT = Path("/sys/fs/cgroup")
PERIOD_US = 10_000


def cgroup_cpu_root() -> tuple[Path, int] | None:
    """``(root, version)`` of a writable cgroup cpu controller, or ``None``."""
    if (V1_ROOT / "cpu.cfs_quota_us").exists() and os.access(V1_ROOT, os.W_OK):
        return V1_ROOT, 1
    controllers = V2_ROOT / "cgroup.controllers"
    if controllers.exists() and "cpu" in controllers.read_text().split() and os.access(V2_ROOT, os.W_OK):
        return V2_ROOT, 2
    return None


class CpuShares:
    """One cgroup per emulated process, each capped at a number of cores.

    Args:
        tag: name of the parent group (default: random).

    Example::

        shares = CpuShares()
        path = shares.create("rank0", cores=0.45)
        proc = subprocess.Popen(cmd, preexec_fn=lambda: shares.join("rank0"))
        ...
        shares.teardown()
    """

    def __init__(self, tag: str | None = None) -> None:
        found = cgroup_cpu_root()
        if found is None:
            raise RuntimeError(
                "no writable cgroup cpu controller (need root and /sys/fs/cgroup/cpu or cgroup v2 with cpu enabled)"
            )
        self.root, self.version = found
        self.parent = self.root / f"syncasync-{tag or uuid.uuid4().hex[:8]}"
        self.groups: dict[str, Path] = {}

    def create(self, name: str, cores: float) -> Path:
        if cores <= 0:
            raise ValueError(f"cores must be > 0, got {cores}")
        self.parent.mkdir(exist_ok=True)
        if self.version == 2:
            # v2 needs the controller enabled for the children of the parent.
            (self.parent / "cgroup.subtree_control").write_text("+cpu")
        path = self.parent / name
        path.mkdir(exist_ok=True)
        quota = max(int(cores * PERIOD_US), 1000)
        if self.version == 1:
            (path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (path / "cpu.cfs_quota_us").write_text(str(quota))
        else:
            (path / "cpu.max").write_text(f"{quota} {PERIOD_US}")
        self.groups[name] = path
        return path

    def join(self, name: str, pid: int = 0) -> None:
        """Move ``pid`` (0: the calling process, e.g. from ``preexec_fn``) into group ``name``; children inherit it."""
        (self.groups[name] / "cgroup.procs").write_text(str(pid or os.getpid()))

    def set_cores(self, name: str, cores: float) -> None:
        """Change a running group's cap (e.g. a straggler that appears mid-run)."""
        quota = max(int(cores * PERIOD_US), 1000)
        path = self.groups[name]
        if self.version == 1:
            (path / "cpu.cfs_quota_us").write_text(str(quota))
        else:
            (path / "cpu.max").write_text(f"{quota} {PERIOD_US}")

    def teardown(self) -> None:
        """Move stray processes back to the root group and remove the groups. Idempotent."""
        for path in list(self.groups.values()):
            procs = path / "cgroup.procs"
            if procs.exists():
                for pid in procs.read_text().split():
                    try:
                        (self.root / "cgroup.procs").write_text(pid)
                    except OSError:
                        pass  # the process is gone
            try:
                path.rmdir()
            except OSError as err:
                log.warning("could not remove cgroup %s: %s", path, err)
        self.groups.clear()
        if self.parent.exists():
            try:
                self.parent.rmdir()
            except OSError as err:
                log.warning("could not remove cgroup %s: %s", self.parent, err)

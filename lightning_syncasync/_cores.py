"""How many CPU cores this process may actually use, and how many ranks share its machine.

``os.cpu_count()`` counts the machine's cores, not the ones a container or a scheduler lends: a CI job pinned to 2
cores of a 64-core host (CPU affinity) or capped by a cgroup CPU quota would be told 64. Decisions that size work
to the machine (how many CPU processes are sensible, an emulator's CPU budget) read this instead.
"""

from __future__ import annotations

import os
from pathlib import Path

# Set by ``syncasync-emulate``: every emulated node is a network namespace on this one machine, so the ranks sharing
# its RAM are all the emulated ranks, not LOCAL_WORLD_SIZE (the ranks of one emulated node).
ENV_HOST_RANKS = "SYNCASYNC_HOST_RANKS"

# cgroup v2's limit, then v1's quota and period (microseconds per period); "max" / -1 mean no limit.
_CGROUP_V2 = Path("/sys/fs/cgroup/cpu.max")
_CGROUP_V1 = Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us")


def usable_cores() -> float:
    """The cores this process may use: the CPU affinity's count, lowered by a cgroup CPU quota when one is set."""
    try:
        cores = float(len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        cores = float(os.cpu_count() or 1)
    quota = _cgroup_quota()
    return min(cores, quota) if quota is not None else cores


def _cgroup_quota() -> float | None:
    try:
        if _CGROUP_V2.is_file():
            limit, period = _CGROUP_V2.read_text().split()[:2]
            return None if limit == "max" else int(limit) / int(period)
        quota_file, period_file = _CGROUP_V1
        if quota_file.is_file() and period_file.is_file():
            quota = int(quota_file.read_text())
            return None if quota <= 0 else quota / int(period_file.read_text())
    except (OSError, ValueError):
        return None
    return None


def ranks_on_host(local_world: int) -> int:
    """The ranks that share this machine's memory: ``local_world`` (LOCAL_WORLD_SIZE), or more under the emulator."""
    try:
        emulated = int(os.environ.get(ENV_HOST_RANKS, "0"))
    except ValueError:
        emulated = 0
    return max(1, local_world, emulated)

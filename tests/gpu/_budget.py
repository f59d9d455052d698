"""scripts/gpu_check.sh's test time, shared out over the files of tests/gpu (``conftest.py`` calls this).

The script gives the test stage a hard limit and sets ``SYNCASYNC_GPU_CHECK_DEADLINE`` (epoch seconds) a little
before it. Without a share per file, one slow file (the shared-GPU matrix: 23 cases of rank jobs that each compile
the codec) could use up the limit and leave the files after it never run, which tells less than every file run in
part. So when a file's first test starts, the file gets the time left times its share of the tests left; a test of
it that would start past that is skipped, saying why, and the time a file leaves unused goes to the files after it.
A plain ``pytest -m gpu`` (no deadline set) runs everything.
"""

from __future__ import annotations

import os
import time

import pytest

DEADLINE_ENV = "SYNCASYNC_GPU_CHECK_DEADLINE"
_ENDS = pytest.StashKey[dict[str, float]]()  # the session's: each file's end, set when its first test starts


def file_deadline(now: float, deadline: float, tests_in_file: int, tests_left: int) -> float:
    """When a file whose first test starts ``now`` must stop starting tests: its share of the time left, in
    proportion to its tests among ``tests_left`` (its own included)."""
    return now + max(deadline - now, 0.0) * tests_in_file / max(tests_left, 1)


def _file_of(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def skip_past_share(item: pytest.Item) -> None:
    """Skip ``item`` when its file's share of the time (``file_deadline``) ran out; nothing without the deadline."""
    raw = os.environ.get(DEADLINE_ENV)
    if not raw:
        return
    name = _file_of(item)
    ends = item.session.stash.setdefault(_ENDS, {})
    if name not in ends:
        items = item.session.items
        left = items[items.index(item) :]
        mine = sum(1 for i in left if _file_of(i) == name)
        ends[name] = file_deadline(time.time(), float(raw), mine, len(left))
    if time.time() >= ends[name]:
        pytest.skip(
            f"not run: {DEADLINE_ENV} shares the GPU check's test time out per file, and {name}'s share ran out "
            "(raise GPU_CHECK_TESTS_TIMEOUT_S, or run this file alone)"
        )

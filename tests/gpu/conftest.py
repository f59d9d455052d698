"""GPU tests only, for ``scripts/gpu_check.sh``: its test time shared out over the files (``_budget.py``), and its
time limit's stop. That stop (SIGINT) landing inside an in-process ``Trainer.fit`` is caught by Lightning, which shuts
the fit down and raises ``SystemExit`` from its ``KeyboardInterrupt`` handler. pytest would record one failure and go
on until the SIGKILL 10 s later, losing its summary and JUnit file; after such a test the session stops instead, with
both written."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from _budget import skip_past_share


# An old-style wrapper: the GPU machine's pytest may predate pytest 8's ``wrapper=True``.
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: Any) -> Iterator[None]:
    yield
    err = call.excinfo.value if call.excinfo is not None else None
    if isinstance(err, SystemExit) and isinstance(err.__context__, KeyboardInterrupt):
        item.session.shouldstop = "interrupted inside a Lightning fit (scripts/gpu_check.sh's time limit?)"


def pytest_runtest_setup(item: pytest.Item) -> None:
    skip_past_share(item)  # scripts/gpu_check.sh's time budget, shared out over the test files (_budget.py)

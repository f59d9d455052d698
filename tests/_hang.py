"""A hung rank for the fault tests of the algorithms: it stays alive without taking part, as a stuck process does,
until the rank under test has seen the fault (then its sockets closing cannot be what that rank saw), or at most
``at_most_s``. A fixed sleep long enough for slow machines cost every machine its full length."""

from __future__ import annotations

import time
from pathlib import Path


def stay_hung_until(flag: str, at_most_s: float) -> None:
    deadline = time.monotonic() + at_most_s
    while not Path(flag).exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def fault_seen(flag: str) -> None:
    """Called by the rank under test once it has raised: the hung rank may go."""
    Path(flag).touch()

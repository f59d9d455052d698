"""A job's progress against wall-clock time, appended to a file across restarts: what a benchmark of node faults
plots (participants, throughput and the validation metric against time) and what its goodput is counted from.

``SyncMonitor`` writes it on the job's global rank 0 when ``SYNCASYNC_TIMELINE`` names a file (the benchmark sets
it per emulated node). One JSON object per line, appended and flushed at once, so a job killed by SIGKILL loses at
most the line it was writing and a restarted job (torchrun's agent, a replaced node) continues the same file:

* ``{"t", "event": "start", "step", "nodes", "world"}``: training starts (``step``: where it resumes);
* ``{"t", "step", "samples", "participants"[, "committed_steps"]}``: after every training step; ``samples``: the
  job's samples trained by this run (every rank of its world), ``participants``: the nodes that trained the last
  update (the job's nodes, or the nodes of a fault-tolerant strategy's last committed round),
  ``committed_steps``: a fault-tolerant node's steps that entered committed rounds;
* ``{"t", "step", "val": {name: value}}``: after a validation;
* ``{"t", "event": "end", "step"}``: the end of fit.

``t`` is ``time.time()``: lines from several processes (the nodes of a fault-tolerant job) share one clock on one
machine; across machines they are as good as the machines' clock synchronisation.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import IO, Any

ENV_TIMELINE = "SYNCASYNC_TIMELINE"


class Timeline:
    """Appends lines to ``path`` (module docstring)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] | None = open(self.path, "a", buffering=1)  # noqa: SIM115 - closed by close()
        self.samples = 0

    @classmethod
    def from_env(cls) -> Timeline | None:
        path = os.environ.get(ENV_TIMELINE)
        return cls(path) if path else None

    def write(self, **fields: Any) -> None:
        if self._file is None:
            return
        self._file.write(json.dumps({"t": time.time(), **fields}) + "\n")
        self._file.flush()

    def step(self, step: int, samples: int, participants: int, committed_steps: int | None = None) -> None:
        self.samples += samples
        extra = {} if committed_steps is None else {"committed_steps": committed_steps}
        self.write(step=step, samples=self.samples, participants=participants, **extra)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_timeline(path: str | Path) -> list[dict[str, Any]]:
    """The lines of a timeline file (a last line cut by a kill is skipped)."""
    out = []
    p = Path(path)
    if not p.exists():
        return out
    for line in p.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out

"""Start the ranks of ``tests/_rank_job.py`` as torchrun would (environment variables), wait for them (bounded),
and return what each wrote. Used on the CPU by the default suite and on one shared GPU by ``tests/gpu``.

A rank on the CPU (or on the emulated device) is forked from a fork server that has imported torch, Lightning and
the pack once (``tests/_forked.py``); a rank on CUDA keeps a new interpreter of its own (``subprocess``), the way the
GPU check has always run it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from _forked import ForkedProcess

from lightning_syncasync.emulate.cluster import free_port

JOB = Path(__file__).with_name("_rank_job.py")
REPO = Path(__file__).resolve().parents[1]


class RankJob:
    """The ranks of one job, started; :meth:`wait` collects them. Several jobs can run at once (a GPU run and its
    CPU reference side by side)."""

    def __init__(
        self,
        out: Path,
        strategy: str,
        accelerator: str = "cpu",
        options: dict[str, Any] | None = None,
        steps: int = 12,
        ranks: int = 2,
        env: dict[str, str] | None = None,
        deterministic: bool = False,
        timeout_s: float = 120.0,
        adaptive_batch: bool = False,
        save: Path | None = None,
        save_step: int | None = None,
        resume: Path | None = None,
        epoch_steps: int | None = None,
        nan_at: int | None = None,
        sigterm_at: int | None = None,
        manual: bool = False,
    ) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.out, self.strategy, self.accelerator, self.ranks = out, strategy, accelerator, ranks
        self.deadline = time.monotonic() + timeout_s
        self.timeout_s = timeout_s
        port = free_port()  # free now, never handed to another job of this process
        self.procs: list[subprocess.Popen[bytes] | ForkedProcess] = []
        self.logs = []
        for rank in range(ranks):
            rank_env = {
                **os.environ,
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "WORLD_SIZE": str(ranks),
                "NODE_RANK": str(rank),
                "LOCAL_RANK": "0",
                "OMP_NUM_THREADS": "1",
                "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
                **(env or {}),
            }
            cmd = ["--accelerator", accelerator, "--strategy", strategy]
            cmd += ["--options", json.dumps(options or {}), "--steps", str(steps), "--out", str(out)]
            cmd += ["--ranks", str(ranks)] + (["--deterministic"] if deterministic else [])
            cmd += ["--adaptive-batch"] if adaptive_batch else []
            cmd += ["--save", str(save), "--save-step", str(save_step)] if save is not None else []
            cmd += ["--resume", str(resume)] if resume is not None else []
            cmd += ["--epoch-steps", str(epoch_steps)] if epoch_steps is not None else []
            cmd += ["--nan-at", str(nan_at)] if nan_at is not None else []
            cmd += ["--sigterm-at", str(sigterm_at)] if sigterm_at is not None else []
            cmd += ["--manual"] if manual else []
            if accelerator in ("cpu", "emugpu"):
                self.procs.append(ForkedProcess(JOB, cmd, rank_env, out / f"rank{rank}.log"))
                continue
            log = open(out / f"rank{rank}.log", "w")  # noqa: SIM115 - closed in wait()
            self.logs.append(log)
            self.procs.append(subprocess.Popen([sys.executable, str(JOB), *cmd], env=rank_env, stdout=log,
                                               stderr=subprocess.STDOUT))  # fmt: skip

    def wait(self) -> list[dict[str, Any]]:
        """Each rank's record, in rank order. Raises with every rank's log when a rank fails or the job outlives its
        ``timeout_s``."""
        procs = self.procs
        try:
            while any(p.poll() is None for p in procs) and time.monotonic() < self.deadline:
                if any(p.poll() not in (None, 0) for p in procs):
                    # Let the other ranks fail too (up to 5 s), then report them all.
                    grace = time.monotonic() + 5.0
                    while any(p.poll() is None for p in procs) and time.monotonic() < grace:
                        time.sleep(0.1)
                    break
                time.sleep(0.2)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            for log in self.logs:
                log.close()
        if any(p.returncode != 0 for p in procs):
            text = "\n".join(
                f"--- rank {r} (exit {p.returncode}):\n{(self.out / f'rank{r}.log').read_text()[-6000:]}"
                for r, p in enumerate(procs)
            )
            raise AssertionError(
                f"{self.strategy} on {self.accelerator} failed or timed out after {self.timeout_s:g}s:\n{text}"
            )
        return [torch.load(self.out / f"rank{r}.pt", weights_only=False) for r in range(self.ranks)]


def run_ranks(out: Path, strategy: str, accelerator: str = "cpu", *args: Any, **kwargs: Any) -> list[dict[str, Any]]:
    """Run the job on ``ranks`` ranks (nodes of 1) and return each rank's record, in rank order (:class:`RankJob`)."""
    return RankJob(out, strategy, accelerator, *args, **kwargs).wait()

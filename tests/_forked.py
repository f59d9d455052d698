"""Python scripts started as fresh processes without paying for an interpreter's imports again.

An interpreter that imports torch, Lightning and the pack costs about 6 s of CPU on 2 cores, and the multi-process
tests paid it once per rank of every job: a 3-rank fault job spent more time importing than training. Here a fork
server (``multiprocessing``'s, started once per test session) imports them, and every rank is a fork of it. The
fork server has only imported: it has no thread, no process group, no autograd engine and no device backend, so a
forked rank starts as fresh as a new interpreter would. It takes its own environment (torchrun's variables), its log
as stdout and stderr, the script's argv, the script's folder first on ``sys.path``, and runs the script as
``__main__``; its exit status is the script's (``sys.exit``, 1 on an exception, minus the signal that killed it).

What differs from a new interpreter: the command line ``pgrep`` sees is the fork server's (find the ranks by pid),
and ``atexit`` handlers do not run (a multiprocessing child ends in ``os._exit``, after joining its threads).
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
import subprocess
import sys
from pathlib import Path
from typing import IO

from lightning_syncasync.emulate.cluster import EmulatedCluster

# What every forked script imports before its first line runs. The fork server starts with the first fork, with
# this process's environment (OMP_NUM_THREADS=1 from conftest, which OpenMP reads when torch loads).
_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(
    ["torch", "torch.distributed", "lightning.pytorch", "lightning_syncasync", "lightning_syncasync.strategies"]
)


def _run_script(script: str, argv: list[str], env: dict[str, str], log: str, new_session: bool) -> None:
    """The body of a forked process: ``python SCRIPT ARGV`` with ``env``, writing to ``log``."""
    if new_session:
        os.setsid()  # a process group of its own, as Popen(start_new_session=True) gives
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    sys.path[0] = str(Path(script).parent)  # a script's folder comes first on its path
    sys.path[1:1] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    sys.argv = [script, *argv]
    runpy.run_path(script, run_name="__main__")


class ForkedProcess:
    """``python SCRIPT ARGV`` forked from the fork server, behind the part of ``subprocess.Popen`` the tests use:
    ``pid``, ``poll``, ``wait``, ``kill``, ``returncode`` (``stdout`` is None: the output goes to ``log``)."""

    stdout = None

    def __init__(
        self, script: str | Path, argv: list[str], env: dict[str, str], log: str | Path, new_session: bool = False
    ) -> None:
        args = (str(script), list(argv), dict(env), str(log), new_session)
        self.process = _CONTEXT.Process(target=_run_script, args=args, name=f"{Path(script).stem}:{Path(log).stem}")
        self.process.start()
        self.pid = self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode

    def poll(self) -> int | None:
        return self.process.exitcode

    def kill(self) -> None:
        self.process.kill()

    def wait(self, timeout: float | None = None) -> int | None:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(self.process.name, timeout or 0.0)
        return self.process.exitcode


class ForkedCluster(EmulatedCluster):
    """:class:`EmulatedCluster` whose ranks are forked from the fork server, for jobs that run ``python SCRIPT``
    with no network namespaces and no CPU shares (both need a command line to wrap): the emulator's environment,
    fault, grace period, stopped-rank detection and clean-up of each rank's process group are its own."""

    def _start(self, rank: int, cmd: list[str], env: dict[str, str], out: IO[bytes]) -> subprocess.Popen:
        if self.network is not None or self.shares is not None or (rank == 0 and self.echo_rank0):
            raise ValueError("ForkedCluster runs ranks without namespaces, CPU shares or an echoed rank 0")
        if cmd[0] != sys.executable or not cmd[1].endswith(".py"):
            raise ValueError(f"ForkedCluster runs `{sys.executable} SCRIPT.py ARGS`, not {cmd}")
        return ForkedProcess(cmd[1], cmd[2:], env, out.name, new_session=True)  # type: ignore[return-value]

"""A small harness for multi-process tests of torch-only algorithms on gloo.

``run_distributed(fn, world_size)`` spawns ``world_size`` processes, initialises a gloo process group in each (a
file rendezvous in a private temporary folder: no ports to collide between tests), calls ``fn(rank, world_size,
*args)`` and returns the per-rank results in rank order. A failure on any rank is re-raised in the caller with that
rank's traceback, and the whole run is bounded by ``timeout_s`` so a deadlocked collective fails the test instead of
hanging it. ``fn`` must be a module-level function (spawn pickles it).
"""

from __future__ import annotations

import os
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(
    rank: int,
    world_size: int,
    init_file: str,
    out_dir: str,
    timeout_s: float,
    fn: Callable[..., Any],
    args: tuple,
    hard_exit: bool = False,
) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    try:
        result: Any = ("ok", fn(rank, world_size, *args))
    except BaseException:  # noqa: BLE001 - the traceback is handed to the parent process
        result = ("error", traceback.format_exc())
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    if hard_exit:
        # Fault-injection tests leave background collectives stuck on purpose: skip the orderly shutdown.
        os._exit(0)
    if result[0] == "ok":
        dist.barrier()
    dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 60.0,
    start_method: str = "fork",
    hard_exit: bool = False,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes and return the results by rank.

    Args:
        fn: module-level function; its return value must be picklable (tensors are fine).
        world_size: number of processes (2-4 on a 2-core machine).
        args: extra positional arguments for ``fn`` (picklable).
        timeout_s: bound on every collective (the process-group timeout) and on the whole run.
        start_method: ``"fork"`` (default: the children skip re-importing torch, about 4 s each on 2 cores, so a
            suite of short multi-process tests runs several times faster) or ``"spawn"`` (what Lightning's
            ``ddp_spawn`` uses; needed once the caller has started threads or CUDA).
        hard_exit: end each process right after it saved its result (no barrier, no process-group teardown), for
            tests that leave a collective stuck on purpose (a hung peer); a rank that exits with status 0 and no
            result (killed on purpose) gets ``None``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    with tempfile.TemporaryDirectory(prefix="syncasync-dist-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        ctx = mp.start_processes(
            _worker,
            args=(world_size, init_file, tmp, timeout_s, fn, args, hard_exit),
            nprocs=world_size,
            join=False,
            start_method=start_method,
        )
        # Process start-up (imports) is not covered by the collective timeout, hence the margin.
        deadline = time.monotonic() + timeout_s * 2 + 30
        try:
            while not ctx.join(timeout=max(deadline - time.monotonic(), 0.0)):
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"ranks still running after {timeout_s * 2 + 30:.0f}s; killed them")
        except mp.ProcessRaisedException:
            pass  # the per-rank result files carry the traceback
        except mp.ProcessExitedException as err:
            raise RuntimeError(f"a rank exited abnormally: {err}") from err
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        results: list[Any] = []
        for rank in range(world_size):
            path = os.path.join(tmp, f"rank{rank}.pt")
            if not os.path.exists(path):
                if hard_exit:
                    results.append(None)  # a rank the test killed on purpose
                    continue
                raise RuntimeError(f"rank {rank} left no result (timed out after {timeout_s}s or crashed)")
            status, value = torch.load(path, weights_only=False)
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results.append(value)
        return results

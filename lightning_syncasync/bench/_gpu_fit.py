"""The training half of the GPU check (:mod:`lightning_syncasync.bench.gpu`): steps per second of one fit per strategy
at ``devices=1`` on the transformer demo, timed from the end of the warm-up to the last timed step, next to plain
Lightning, interleaved over rounds (``scripts/host_overhead.py`` times its own tiny model with the same fit)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from lightning_syncasync.bench._gpu_device import error_text, free_memory, synchronize

log = logging.getLogger(__name__)

BASELINE = "auto"
# Plain Lightning with SyncMonitor: what the monitor's synchronisation at each step's end costs (cuda_sync). A row of
# its own, outside the strategies' target.
MONITORED = "auto+sync_monitor"
# Registered names left out of the default (each can still be given to --strategies): the first three refuse a single
# rank at setup, with a ValueError saying so.
EXCLUDED_AT_WORLD_SIZE_1: dict[str, str] = {
    "hier_sync_virtual": "splits each machine's ranks into 2 virtual nodes: needs an even number of ranks, 2 or more",
    "hier_sync_sharded": "FSDP2 shards inside each node: needs 2 or more ranks per node",
    "async_ssp_sharded": "FSDP2 shards inside each node: needs 2 or more ranks per node",
    # It does run at one rank (on CPU); on CUDA it is Lightning's DeepSpeedStrategy unchanged, and DeepSpeed's start
    # (an optional dependency that may build CUDA ops) does not fit the check's time budget.
    "deepspeed_cpu": "on CUDA it is Lightning's own DeepSpeedStrategy unchanged; needs the optional deepspeed package",
    "hier_sync_ft": "one job per node joined through a torchft Lighthouse: needs a Lighthouse (syncasync-train ft=N)",
    "async_ssp_ft": "one job per node joined through a torchft Lighthouse: needs a Lighthouse (syncasync-train ft=N)",
}
# The transformer demo at its Hydra defaults (conf/model/transformer_lm.yaml, conf/data/text.yaml): ~3 M parameters.
MODEL_KWARGS: dict[str, Any] = {
    "vocab_size": 256,
    "d_model": 256,
    "n_layers": 4,
    "n_heads": 4,
    "seq_len": 64,
    "lr": 1e-3,
}
DATA_KWARGS: dict[str, Any] = {"seq_len": 64, "batch_size": 32}


def default_strategies() -> list[str]:
    """This package's registered names that make sense at ``devices=1`` on one GPU, in table order."""
    from lightning_syncasync.strategies import pack_strategy_names

    return [n for n in pack_strategy_names() if not n.endswith("_spawn") and n not in EXCLUDED_AT_WORLD_SIZE_1]


def _step_timer(warmup: int, steps: int, device: torch.device) -> Any:
    from lightning.pytorch import Callback

    class StepTimer(Callback):
        """Clock from the end of the warm-up's last batch to the end of the last timed one, the device synchronised
        at both ends, so neither start-up costs nor kernels still queued at the end count."""

        def __init__(self) -> None:
            self.start: tuple[int, float] | None = None
            self.end: tuple[int, float] | None = None

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            # global_step counts optimizer steps, as max_steps does.
            step = trainer.global_step
            if self.start is None and step >= warmup:
                synchronize(device)
                self.start = (step, time.perf_counter())
            elif self.start is not None and self.end is None and step >= warmup + steps:
                synchronize(device)
                self.end = (step, time.perf_counter())

        def steps_per_s(self) -> float:
            if self.start is None or self.end is None:
                raise RuntimeError(
                    f"the fit stopped before the timed window closed (started: {self.start is not None}); HINT: the "
                    "strategy ends fits early or does not count optimizer steps in trainer.global_step"
                )
            return (self.end[0] - self.start[0]) / (self.end[1] - self.start[1])

    return StepTimer()


@contextlib.contextmanager
def _quiet_lightning(verbose: bool) -> Iterator[None]:
    """Lightning announces its accelerator and process group on every fit; 2 x 10 lines per round bury the table."""
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric", "lightning_syncasync")]
    levels = [lg.level for lg in loggers]
    if not verbose:
        for lg in loggers:
            lg.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def fit_steps_per_s(
    strategy: str,
    device: torch.device,
    warmup: int,
    steps: int,
    seed: int,
    verbose: bool,
    fit: Callable[[Any], None] | None = None,
) -> tuple[float, str]:
    """Steps/s of one fit with ``strategy`` at ``devices=1``, and the strategy's class. ``fit(trainer)`` runs the
    fit (default: the transformer demo; ``scripts/host_overhead.py`` passes a model too small to compute)."""
    import lightning as L

    timer = _step_timer(warmup, steps, device)
    callbacks: list[Any] = [timer]
    if strategy == MONITORED:
        from lightning_syncasync.callbacks import SyncMonitor

        strategy = BASELINE
        callbacks.append(SyncMonitor(progress_bar=False, print_summary=False))
    # Lightning writes MASTER_PORT (and friends) into os.environ on the first distributed fit and reuses them; each
    # fit gets the environment it started with back, so the next one picks a free port of its own.
    environ = dict(os.environ)
    try:
        with _quiet_lightning(verbose):
            torch.manual_seed(seed)  # the same initial weights for every contender
            trainer = L.Trainer(
                accelerator=device.type,
                devices=[device.index] if device.type == "cuda" else 1,
                strategy=strategy,
                max_steps=warmup + steps,
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                num_sanity_val_steps=0,
                limit_val_batches=0,
                callbacks=callbacks,
            )
            if fit is None:
                from lightning_syncasync.demo import TextDataModule, TransformerLM

                trainer.fit(TransformerLM(**MODEL_KWARGS), datamodule=TextDataModule(**DATA_KWARGS))
            else:
                fit(trainer)
        return timer.steps_per_s(), type(trainer.strategy).__name__
    finally:
        # At devices=1 every DDP-based strategy still initialises a (one-rank) default process group and leaves it
        # behind, also after a successful fit; the next fit would silently reuse it (another strategy's backend and
        # subgroups), so each fit tears it down.
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(environ)
        free_memory(device)


def measure_strategies(
    names: list[str], device: torch.device, args: argparse.Namespace, on_fit: Any = None
) -> dict[str, dict[str, Any]]:
    """Plain Lightning and ``names``, interleaved over ``args.rounds`` rounds (drift hits all alike); medians.

    A strategy that raises is recorded with its error and not run again; the others go on. ``on_fit(results)``
    after every fit: a check stopped by its time limit keeps every figure it read."""
    contenders = [BASELINE, MONITORED, *names]
    results: dict[str, dict[str, Any]] = {
        n: {"median": None, "runs": [], "ratio_to_plain": None, "strategy_class": None, "error": None}
        for n in contenders
    }
    for r in range(args.rounds):
        for name in contenders:
            rec = results[name]
            if rec["error"] is not None:
                continue
            t0 = time.perf_counter()
            try:
                rate, cls = fit_steps_per_s(name, device, args.warmup_steps, args.steps, args.seed, args.verbose)
            except Exception as err:  # one failing strategy must not hide the others' numbers
                log.warning("round %d: %s failed", r + 1, name, exc_info=True)
                rec["error"] = error_text(err)
            else:
                rec["runs"].append(rate)
                rec["strategy_class"] = cls
                log.info("round %d/%d: %s %.2f steps/s (fit %.1f s)", r + 1, args.rounds, name, rate,
                         time.perf_counter() - t0)  # fmt: skip
            if on_fit is not None:
                on_fit(_with_medians(results))
    return _with_medians(results)


def _with_medians(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    for rec in results.values():
        rec["median"] = statistics.median(rec["runs"]) if rec["runs"] else None
    plain = results[BASELINE]["median"]
    for rec in results.values():
        rec["ratio_to_plain"] = rec["median"] / plain if plain and rec["median"] is not None else None
    return results

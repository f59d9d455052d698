"""``syncasync-train``: the Hydra app that trains any configured model with any strategy.

With no arguments it runs the default job (``conf/train.yaml``): a digits classifier trained by 2 CPU processes over
gloo with ``SyncMonitor``, ending with the summary table and the validation accuracy. Every piece is a config group
(``strategy``, ``model``, ``data``, ``trainer``, ``callbacks``, ``logger``, ``experiment``, ``hparams_search``), and
``-m`` sweeps them::

    syncasync-train                                   # the default job
    syncasync-train experiment=lm                     # transformer LM on pydoc text
    syncasync-train -m strategy=ddp,ddp_spawn trainer.max_epochs=1

Multirun note: Lightning's ``ddp`` launcher starts the other ranks by re-running ``sys.argv``, which inside a Hydra
sweep would re-run the whole sweep (FINDINGS.md). Each multirun job is therefore run as a single Hydra run in a child
process (same overrides, the job's own output folder), which also keeps jobs from sharing a process group.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from lightning_syncasync._cores import usable_cores
from lightning_syncasync._quiet import quiet_third_party_noise
from lightning_syncasync.configs import register_configs

log = logging.getLogger(__name__)

# Set in the child process of a multirun job so it does not re-launch itself.
ENV_MULTIRUN_CHILD = "SYNCASYNC_MULTIRUN_CHILD"

register_configs()
quiet_third_party_noise()


def validate_config(cfg: DictConfig) -> None:
    """Reject settings that would only fail (or hang) after processes start, naming the setting and the fix."""
    trainer = cfg.trainer
    devices = trainer.get("devices", "auto")
    accelerator = str(trainer.get("accelerator", "auto"))
    if (isinstance(devices, int) and (devices == 0 or devices < -1)) or devices in ("0", "", []):
        raise ValueError(
            f"trainer.devices={devices!r} is impossible; HINT: use a positive count (trainer.devices=2), -1 or 'auto'"
        )
    if accelerator == "cpu" and isinstance(devices, int) and devices > 0:
        cores = max(math.ceil(usable_cores()), 1)
        # More processes than a few per core only measures contention, and hundreds would exhaust the machine.
        if devices > 4 * cores:
            raise ValueError(
                f"trainer.devices={devices} CPU processes on a machine with {cores} cores; "
                f"HINT: use at most {4 * cores} (trainer.devices={cores} is the sensible choice) or run on more nodes"
            )
    num_nodes = trainer.get("num_nodes", 1)
    if not isinstance(num_nodes, int) or num_nodes < 1:
        raise ValueError(f"trainer.num_nodes={num_nodes!r} is impossible; HINT: use trainer.num_nodes=1 or more")
    if cfg.get("ft", 0):
        _check_ft(cfg)
    order = cfg.get("data_order", 0)
    if not isinstance(order, int) or isinstance(order, bool) or order < 0:
        raise ValueError(f"data_order={order!r} is not a draw number; HINT: data_order=1 (0: the seed's own order)")
    if order and cfg.get("seed") is None:
        raise ValueError(
            f"data_order={order} reseeds from the run's seed, but seed=null; HINT: set seed=42 (or data_order=0)"
        )
    strategy = trainer.get("strategy", "auto")
    if isinstance(strategy, str):
        from lightning_syncasync.strategies import check_strategy_name

        # "did you mean hier_sync?" and this package's names (a config group, strategy=hier_sync, also works).
        check_strategy_name(strategy, setting="trainer.strategy")


def _check_ft(cfg: DictConfig) -> None:
    """``ft=N``: a fault-tolerant strategy, one node per job, at least one node."""
    nodes = cfg.ft
    if not isinstance(nodes, int) or isinstance(nodes, bool) or nodes < 0:
        raise ValueError(f"ft={nodes!r} is not a number of nodes; HINT: ft=2 runs 2 emulated nodes, ft=0 one job")
    from lightning_syncasync.strategies import is_fault_tolerant

    strategy = cfg.get("strategy")
    target = strategy.get("_target_", "") if isinstance(strategy, DictConfig) else str(cfg.trainer.get("strategy"))
    if not is_fault_tolerant(target):
        raise ValueError(
            f"ft={nodes} runs one job per node joined through a Lighthouse, which only the fault-tolerant strategies "
            f"do; the strategy is {target!r}. HINT: add strategy=hier_sync_ft (or strategy=async_ssp_ft)"
        )
    if cfg.trainer.get("num_nodes", 1) != 1:
        raise ValueError(f"ft={nodes} makes one job per node itself; HINT: drop trainer.num_nodes (keep it 1)")


def _instantiate(cfg: Any, **kwargs: Any) -> Any:
    # `_convert_="all"`: constructors validate plain lists/dicts, not OmegaConf containers, and hyperparameters saved
    # in checkpoints stay plain Python.
    return hydra.utils.instantiate(cfg, _convert_="all", **kwargs)


def _instantiate_dict(group: DictConfig | None) -> list[Any]:
    return [_instantiate(c) for c in (group or {}).values() if c is not None and "_target_" in c]


def _rank() -> int:
    for var in ("RANK", "LOCAL_RANK"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


def warn_if_restarts_will_fail(environ: dict[str, str] | None = None) -> str | None:
    """torch 2.13's torchrun shares its rendezvous store with the workers; a restarted worker then reads the previous
    attempt's gloo addresses and fails with ``Connection refused`` (pytorch/pytorch#135712). Say so up front."""
    env = os.environ if environ is None else environ
    if int(env.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > 0 and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        msg = (
            "torchrun --max-restarts is set but its rendezvous store is shared with the workers: a restart will fail "
            "to reconnect; HINT: export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 before torchrun"
        )
        log.warning(msg)
        return msg
    return None


def reseed_after_init(seed: int, data_order: int) -> int:
    """Reseed everything random with ``seed + 1000 x data_order``, after the model was initialised: Lightning seeds the
    ``DistributedSampler`` it injects from ``PL_GLOBAL_SEED`` when ``fit`` builds the loaders (and a single process's
    shuffling draws from torch's RNG), so the batches come in another order while the initial weights stay the
    seed's. Returns the new seed."""
    import lightning.pytorch as pl

    return pl.seed_everything(seed + 1000 * data_order, workers=True, verbose=False)


def run(cfg: DictConfig) -> dict[str, Any]:
    """Fit (and optionally test) the configured job; return its results (also written to ``cfg.results_file``)."""
    import lightning.pytorch as pl

    validate_config(cfg)
    warn_if_restarts_will_fail()
    if cfg.seed is not None:
        pl.seed_everything(cfg.seed, workers=True)
    output_dir = Path(HydraConfig.get().runtime.output_dir)
    datamodule = _instantiate(cfg.data)
    model = _instantiate(cfg.model)
    if cfg.get("data_order", 0):
        reseed_after_init(cfg.seed, cfg.data_order)
    callbacks = _instantiate_dict(cfg.callbacks)
    from lightning_syncasync.callbacks.straggler import StragglerEmulator

    straggler = StragglerEmulator.from_env()  # set by syncasync-emulate --jitter/--straggler-schedule
    if straggler is not None:
        callbacks.append(straggler)  # after SyncMonitor, so the injected pause falls inside the measured step
    from lightning_syncasync.callbacks.faults import FaultInjector

    fault = FaultInjector.from_env()  # set by syncasync-emulate --fault (reliability tests)
    if fault is not None:
        callbacks.append(fault)
    loggers = _instantiate_dict(cfg.logger)
    from lightning_syncasync._progress_bar import resolve_enable_progress_bar

    # trainer.enable_progress_bar=null (the default): a bar only when stdout is a terminal. Ranks started by the
    # `ddp` launcher inherit this stdout, so they resolve the same value.
    enable_progress_bar = resolve_enable_progress_bar(cfg.trainer, callbacks)
    trainer: pl.Trainer = _instantiate(
        cfg.trainer, callbacks=callbacks, logger=loggers or False, enable_progress_bar=enable_progress_bar
    )

    start = time.perf_counter()
    trainer.fit(model, datamodule=datamodule, ckpt_path=cfg.ckpt_path)
    fit_s = time.perf_counter() - start
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
    if cfg.test:
        for result in trainer.test(
            model, datamodule=datamodule, ckpt_path="best" if trainer.checkpoint_callback else None
        ):
            metrics.update({k: float(v) for k, v in result.items()})

    from lightning_syncasync.callbacks import SyncMonitor

    monitor = next((c for c in trainer.callbacks if isinstance(c, SyncMonitor)), None)
    summary: dict[str, Any] = monitor.summary if monitor is not None else {}
    if monitor is not None and not summary and monitor.summary_file and Path(monitor.summary_file).exists():
        # spawn start method: the monitor ran in the child processes and left its figures in a file.
        summary = json.loads(Path(monitor.summary_file).read_text())
    steps = trainer.global_step or max((r["steps"] for r in summary.get("ranks", [])), default=0)
    results = {
        "task_name": cfg.task_name,
        "strategy": type(trainer.strategy).__name__,
        "world_size": trainer.world_size,
        "global_step": steps,
        "fit_wall_s": fit_s,
        "metrics": metrics,
        "sync_summary": summary,
        "config": OmegaConf.to_container(cfg, resolve=True),
    }
    if trainer.lightning_module is not None:
        results["state_digest"] = state_digest(trainer.lightning_module)
    elastic = getattr(trainer.strategy, "elastic_stats", None)
    if elastic is not None:  # fault-tolerant strategies: rounds, participants, heals (rank 0's view)
        results["elastic"] = dataclasses.asdict(elastic)
    if trainer.is_global_zero:
        path = output_dir / cfg.results_file
        path.write_text(json.dumps(results, indent=2, default=str))
        metric = cfg.optimized_metric
        value = metrics.get(metric)
        shown = f"{metric}={value:.4f}" if value is not None else f"{metric} not logged"
        log.info("done: %s after %d steps in %.1f s; results in %s", shown, steps, fit_s, path)
    return results


def state_digest(module: Any) -> dict[str, str]:
    """SHA-256 of the module's parameters and of its buffers (this rank's, at the end of fit; its shard of a sharded
    model), so that runs, ranks and nodes can be checked to end with bitwise the same model (the fault-tolerant
    strategies' claim)."""
    import hashlib

    import torch

    digests = {}
    for kind, named in (("parameters", module.named_parameters()), ("buffers", module.named_buffers())):
        h = hashlib.sha256()
        for name, tensor in named:
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a sharded model: this rank's shard
            h.update(name.encode())
            h.update(local.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        digests[kind] = h.hexdigest()
    return digests


def _searchpath_overrides(hc: Any) -> list[str]:
    """The ``hydra.searchpath=[...]`` overrides of this job. They are Hydra overrides, not task overrides, so a child
    given only the task overrides would not find the options of a user's own config folder (``experiment=mine``)."""
    return [o for o in hc.overrides.hydra if o.split("=", 1)[0].lstrip("+~") == "hydra.searchpath"]


def _run_multirun_job_in_child(cfg: DictConfig) -> dict[str, Any]:
    hc = HydraConfig.get()
    output_dir = Path(hc.runtime.output_dir)
    cmd = [sys.executable, "-m", "lightning_syncasync.train", *_searchpath_overrides(hc), *hc.overrides.task]
    # hydra.mode=RUN: a sweeper passes every command-line override on to each job, `hparams_search=optuna` included,
    # whose `hydra.mode: MULTIRUN` would otherwise make the child start a sweep of its own.
    cmd += [f"hydra.run.dir={output_dir}", f"hydra.job.name={hc.job.name}", "hydra.mode=RUN"]
    env = dict(os.environ, **{ENV_MULTIRUN_CHILD: "1"})
    # Fresh rendezvous port per job: a previous job's sockets may still be in TIME_WAIT.
    env.pop("MASTER_PORT", None)
    log.info("multirun job %s: %s", hc.job.num, " ".join(cmd))
    proc = subprocess.run(cmd, env=env, cwd=hydra.utils.get_original_cwd())
    if proc.returncode != 0:
        raise RuntimeError(f"multirun job {hc.job.num} ({' '.join(hc.overrides.task)}) failed: exit {proc.returncode}")
    return json.loads((output_dir / cfg.results_file).read_text())


def _run_fault_tolerant_job(cfg: DictConfig) -> dict[str, Any]:
    """``ft=N``: a torchft Lighthouse and N jobs of this app, one per emulated node (each its own output folder
    ``node{n}``), with ``ft_faults``; the results are node 0's last run's, with every run's exit listed."""
    from lightning_syncasync.emulate.replica_groups import ReplicaGroupCluster, first_step_clock, node_command

    validate_config(cfg)
    hc = HydraConfig.get()
    output_dir = Path(hc.runtime.output_dir)
    devices = cfg.trainer.get("devices", 1)
    # ft_faults' times count from the first training step, so that a slow start-up (three times longer on a loaded
    # machine) neither kills a node before it trained nor restarts it after the others finished; a job without
    # SyncMonitor reports no first step and keeps the launch's clock.
    monitored = any(str(c.get("_target_", "")).endswith("SyncMonitor")
                    for c in (cfg.get("callbacks") or {}).values() if isinstance(c, DictConfig))  # fmt: skip
    env, origin = first_step_clock(output_dir, int(cfg.ft)) if monitored else ({}, None)
    if cfg.ft_faults and not monitored:
        log.info("ft_faults: no SyncMonitor in the callbacks, so the fault times count from the launch")
    procs = devices if isinstance(devices, int) and devices > 0 else 1
    cluster = ReplicaGroupCluster(
        nodes=int(cfg.ft), procs_per_node=procs, faults=str(cfg.ft_faults or ""), log_dir=output_dir,
        faults_setting="ft_faults", origin=origin, env=env,
    )  # fmt: skip
    task = [o for o in hc.overrides.task if o.split("=", 1)[0].lstrip("+~") not in ("ft", "ft_faults")]
    cmd = node_command(procs, "lightning_syncasync.train", [*_searchpath_overrides(hc), *task,
                       f"hydra.run.dir={output_dir}/node{{node}}", "hydra.mode=RUN"])  # fmt: skip
    report = cluster.run(cmd)
    if report.interrupted or report.failed:
        bad = ", ".join(f"node {r.node} exit {r.exit_code} ({r.log})" for r in report.failed) or "interrupted"
        raise RuntimeError(f"the fault-tolerant job did not end cleanly: {bad}")
    results = json.loads((output_dir / "node0" / cfg.results_file).read_text())
    results["ft"] = {"nodes": int(cfg.ft), "faults": str(cfg.ft_faults or ""), "runs": [vars(r) for r in report.runs],
                     "not_applied": report.not_applied}  # fmt: skip
    if report.not_applied:
        log.warning("ft_faults: %d fault(s) not applied: %s", len(report.not_applied), "; ".join(report.not_applied))
    (output_dir / cfg.results_file).write_text(json.dumps(results, indent=2, default=str))
    return results


@hydra.main(version_base="1.3", config_path="pkg://lightning_syncasync.conf", config_name="train")
def hydra_main(cfg: DictConfig) -> float | None:
    """The Hydra app. Returns ``cfg.optimized_metric`` for Hydra sweepers."""
    if cfg.get("ft", 0) and not os.environ.get("SYNCASYNC_FT_NODE"):
        results = _run_fault_tolerant_job(cfg)
    elif HydraConfig.get().mode == RunMode.MULTIRUN and not os.environ.get(ENV_MULTIRUN_CHILD):
        results = _run_multirun_job_in_child(cfg)
    else:
        results = run(cfg)
    value = results["metrics"].get(cfg.optimized_metric)
    return None if value is None else float(value)


def check_group_choice(argv: list[str], group: str = "strategy") -> None:
    """``strategy=NAME`` (or a sweep ``strategy=a,b``) naming no config of the group: our message with a "did you
    mean" instead of Hydra's "Could not find 'strategy/NAME'". Left to Hydra when ``hydra.searchpath`` may add
    configs of the user's own."""
    import difflib
    from importlib.resources import files

    if any(a.split("=", 1)[0].lstrip("+") == "hydra.searchpath" for a in argv):
        return
    options = sorted(p.name.removesuffix(".yaml") for p in (files("lightning_syncasync") / "conf" / group).iterdir()
                     if p.name.endswith(".yaml"))  # fmt: skip
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep or key.lstrip("+~") != group or value.startswith(("$", "[", "{")) or not value:
            continue
        for name in value.split(","):
            if name in options or name == "null":
                continue
            close = difflib.get_close_matches(name, options, n=1, cutoff=0.6)
            hint = f"did you mean {group}={close[0]}? " if close else ""
            raise ValueError(
                f"{group}={name} is not one of the {group} configs; HINT: {hint}the configs: {', '.join(options)}. "
                f"A strategy name registered in Python (Trainer(strategy=...)) also works as trainer.strategy=NAME."
            )


def main() -> float | None:
    """Entry point of ``syncasync-train``: the Hydra app, after the checks Hydra's own messages are vague about."""
    try:
        check_group_choice(sys.argv[1:])
    except ValueError as err:
        print(f"syncasync-train: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    return hydra_main()


if __name__ == "__main__":
    main()

"""The end-of-fit summary of :class:`~lightning_syncasync.callbacks.monitor.SyncMonitor`: what it gathers, what it
prints.

Each rank's figures are one vector in the order of :data:`FIELDS` (the step aggregates, then what the rank holds in
memory at the end of fit, :func:`memory_mb`); ``SyncMonitor`` gathers the vectors and :func:`summarise` turns them
into the summary dict (per rank, and the job's figures). :func:`print_summary_table` prints that dict on rank 0 as a
rich table; its title (strategy, mode, compression, topology, then the ``NOTE:`` lines) is the summary header, and
the policies' events follow the table.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_only

from lightning_syncasync.callbacks._events import event_lines

# Order of the per-rank vector gathered for the summary table.
FIELDS = (
    "steps",
    "samples",
    "wall_s",
    "compute_s",
    "wait_s",
    "bytes_intra",
    "bytes_inter",
    "staleness_mean",
    "staleness_max",
    # Memory at the end of fit (not aggregated over steps): peak resident set size, peak CUDA allocation, and the
    # bytes of optimizer state this rank holds (what ZeRO shards).
    "peak_rss_mb",
    "cuda_peak_mb",
    "optimizer_state_mb",
    # Bytes of parameters and gradients this rank holds at the end of fit (its shards under FSDP2).
    "param_mb",
    "grad_mb",
    # Seconds at the sync points of asynchronous training (StatsRecorder.sync_point_s): 0 for synchronous modes.
    "sync_point_s",
    # Seconds spent saving checkpoints (StatsRecorder.checkpoint_s): outside the steps, like validation.
    "checkpoint_s",
)


def memory_mb(trainer: pl.Trainer) -> dict[str, float]:
    """What this rank holds in memory at the end of fit, in MiB: the memory fields of :data:`FIELDS`."""
    mib = 1024.0 * 1024.0
    try:
        import resource  # POSIX only

        # ru_maxrss is in KiB on Linux.
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    except ImportError:
        rss = 0.0
    cuda = torch.cuda.max_memory_allocated() / mib if torch.cuda.is_available() and torch.cuda.is_initialized() else 0.0
    state = sum(_optimizer_state_bytes(opt) for opt in trainer.optimizers) / mib
    params = list(trainer.lightning_module.parameters()) if trainer.lightning_module is not None else []
    return {
        "peak_rss_mb": rss,
        "cuda_peak_mb": cuda,
        "optimizer_state_mb": state,
        "param_mb": sum(_local_bytes(p) for p in params) / mib,
        "grad_mb": sum(_local_bytes(p.grad) for p in params if p.grad is not None) / mib,
    }


def _local_bytes(t: torch.Tensor) -> int:
    """Bytes this rank holds of ``t``: its local shard when ``t`` is a DTensor (FSDP2), whose ``numel`` is the
    global tensor's."""
    local = getattr(t, "_local_tensor", None)  # DTensor.to_local() without the autograd wrapper
    t = local if isinstance(local, torch.Tensor) else t
    return t.numel() * t.element_size()


def _optimizer_state_bytes(optimizer: Any) -> int:
    """Bytes of the tensors in an optimizer's per-parameter state (Adam's moments...), unwrapping wrappers.

    Wrappers (Lightning's, DeepSpeed's ZeRO optimizers) hold the torch optimizer that owns the state as
    ``.optimizer``; under ZeRO its parameters are this rank's flat partitions, so the figure is what the rank holds.
    """
    seen: set[int] = set()
    while hasattr(optimizer, "optimizer") and id(optimizer) not in seen:
        seen.add(id(optimizer))
        optimizer = optimizer.optimizer
    state = getattr(optimizer, "state", None)
    if not isinstance(state, dict):
        return 0
    # Local bytes: under FSDP2 the moments are DTensors, of which this rank holds a shard.
    return sum(
        _local_bytes(v)
        for per_param in state.values()
        if isinstance(per_param, dict)
        for v in per_param.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )


def _topology(trainer: pl.Trainer) -> dict[str, Any]:
    """The nodes the strategy works with: its (possibly virtual) ``topology`` when it has one (the public attribute
    of hier_sync, auto_sync, ddp_measured), else the cluster's; and the machines the ranks run on."""
    topology = getattr(trainer.strategy, "topology", None)
    machines = trainer.num_nodes
    if topology is None:
        return {"num_nodes": machines, "node_size": trainer.world_size // max(machines, 1), "machines": machines}
    return {"num_nodes": topology.num_nodes, "node_size": topology.node_size, "machines": machines}


def per_update(hist: dict[int, int]) -> dict[str, float]:
    """Mean and max staleness over the updates of a ``{staleness: count}`` histogram (0/0 with none)."""
    count = sum(hist.values())
    if not count:
        return {"staleness_mean": 0.0, "staleness_max": 0.0}
    return {"staleness_mean": sum(v * c for v, c in hist.items()) / count, "staleness_max": float(max(hist))}


def _codec(strategy: Any) -> str | None:
    """The strategy's compression codec and its options (``int8``, ``topk(ratio=0.01)``), ``None`` when off."""
    name = getattr(strategy, "compression", None)
    if not isinstance(name, str) or name == "none":
        return None
    options = getattr(strategy, "compression_options", None) or {}
    return name + (f"({', '.join(f'{k}={v}' for k, v in sorted(options.items()))})" if options else "")


def _topology_text(summary: dict[str, Any]) -> str:
    nodes, machines = summary["num_nodes"], summary.get("machines", summary["num_nodes"])
    if "participants_max" in summary:  # one node of a fault-tolerant job
        return (
            f"{summary['world_size']} rank(s) of node {summary['ft_node']} in a fault-tolerant job "
            f"({summary['participants_min']}-{summary['participants_max']} node(s) per round)"
        )
    if nodes == machines:
        return f"{summary['world_size']} rank(s) on {nodes} node(s)"
    return (
        f"{summary['world_size']} rank(s) as {nodes} virtual node(s) of {summary['node_size']} on {machines} machine(s)"
    )


def _share(part: float, whole: float) -> float:
    return part / whole if whole > 0 else 0.0


def summarise(gathered: torch.Tensor, trainer: pl.Trainer, mode: str) -> dict[str, Any]:
    ranks = []
    for i, row in enumerate(gathered.tolist()):
        r = dict(zip(FIELDS, row, strict=True))
        steps = max(r["steps"], 1.0)
        ranks.append(
            {
                "rank": i,
                "steps": int(r["steps"]),
                "samples_per_s": r["samples"] / r["wall_s"] if r["wall_s"] > 0 else 0.0,
                "compute_s_per_step": r["compute_s"] / steps,
                "wait_s_per_step": r["wait_s"] / steps,
                "wait_frac": r["wait_s"] / r["wall_s"] if r["wall_s"] > 0 else 0.0,
                "bytes_intra_per_step": r["bytes_intra"] / steps,
                "bytes_inter_per_step": r["bytes_inter"] / steps,
                "staleness_mean": 0.0 if math.isnan(r["staleness_mean"]) else r["staleness_mean"],
                "staleness_max": 0.0 if math.isinf(r["staleness_max"]) else r["staleness_max"],
                "peak_rss_mb": r["peak_rss_mb"],
                "cuda_peak_mb": r["cuda_peak_mb"],
                "optimizer_state_mb": r["optimizer_state_mb"],
                "param_mb": r["param_mb"],
                "grad_mb": r["grad_mb"],
                # What the rank holds of the model's training state: parameters + gradients + optimizer state.
                "model_state_mb": r["param_mb"] + r["grad_mb"] + r["optimizer_state_mb"],
                "sync_point_s": r["sync_point_s"],
                # A share of the rank's time: its steps' wall time does not hold the sync points (they are outside
                # the steps), so both are the whole. A fast rank that waits at an epoch end for a slow one can spend
                # longer there than in its steps.
                "sync_point_frac": _share(r["sync_point_s"], r["wall_s"] + r["sync_point_s"]),
                "checkpoint_s": r["checkpoint_s"],
            }
        )
    n = len(ranks)

    def mean(key: str) -> float:
        return sum(r[key] for r in ranks) / n

    elastic = getattr(trainer.strategy, "elastic_stats", None)
    present = list(getattr(elastic, "participants", None) or [])
    nodes_present = (
        {"ft_node": trainer.strategy.replica_group, "participants_min": min(present), "participants_max": max(present)}  # type: ignore[attr-defined]
        if present
        else {}
    )
    return {
        **nodes_present,
        "strategy": type(trainer.strategy).__name__,
        "compression": _codec(trainer.strategy),
        "notes": list(getattr(trainer.strategy, "summary_notes", list)()),
        "mode": mode,
        "world_size": trainer.world_size,
        **_topology(trainer),
        # Every rank processes its own samples, so the job's throughput is the sum of the ranks' rates.
        "global_samples_per_s": sum(r["samples_per_s"] for r in ranks),
        "compute_s_per_step": mean("compute_s_per_step"),
        "wait_s_per_step": mean("wait_s_per_step"),
        "wait_frac": mean("wait_frac"),
        "bytes_intra_per_step": mean("bytes_intra_per_step"),
        "bytes_inter_per_step": mean("bytes_inter_per_step"),
        "bytes_per_step": mean("bytes_intra_per_step") + mean("bytes_inter_per_step"),
        "staleness_mean": mean("staleness_mean"),
        "staleness_max": max(r["staleness_max"] for r in ranks),
        "peak_rss_mb": max(r["peak_rss_mb"] for r in ranks),
        "cuda_peak_mb": max(r["cuda_peak_mb"] for r in ranks),
        "optimizer_state_mb": max(r["optimizer_state_mb"] for r in ranks),
        "model_state_mb": max(r["model_state_mb"] for r in ranks),
        "sync_point_frac": mean("sync_point_frac"),
        "checkpoint_s": max(r["checkpoint_s"] for r in ranks),
        "ranks": ranks,
    }


@rank_zero_only
def print_summary_table(summary: dict[str, Any], summary_file: str | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    codec = f", compression {summary['compression']}" if summary.get("compression") else ""
    title = f"syncasync summary: {summary['strategy']} (mode {summary['mode']}{codec}), {_topology_text(summary)}"
    # Notes go in the header, where users look (a one-node hier_sync run is plain DDP; an async step budget).
    table = Table(title="\n".join([title, *(f"NOTE: {n}" for n in summary.get("notes", []))]))
    for col in (
        "rank",
        "steps",
        "samples/s",
        "compute ms/step",
        "wait ms/step",
        "wait %",
        "intra KB/step",
        "inter KB/step",
        "staleness mean/max",  # per applied update (class docstring)
    ):
        table.add_column(col, justify="right")

    def row(name: str, r: dict[str, Any]) -> list[str]:
        return [
            name,
            str(r.get("steps", "")),
            f"{r['samples_per_s']:.1f}",
            f"{1e3 * r['compute_s_per_step']:.2f}",
            f"{1e3 * r['wait_s_per_step']:.2f}",
            f"{100 * r['wait_frac']:.1f}",
            f"{r['bytes_intra_per_step'] / 1024:.1f}",
            f"{r['bytes_inter_per_step'] / 1024:.1f}",
            f"{r['staleness_mean']:.2f}/{r['staleness_max']:.0f}",
        ]

    for r in summary["ranks"]:
        table.add_row(*row(str(r["rank"]), r))
    total = dict(summary, samples_per_s=summary["global_samples_per_s"])
    table.add_row(*row("all", total), style="bold")
    # A log file or CI console is not a terminal: give the table room instead of rich's 80-column default.
    console = Console(width=None if sys.stdout.isatty() else 132)
    console.print(table)
    # Policies' decisions (mode switches, rollbacks, batch rebalances): counts, every switch with its reason, the
    # last split; the full log is the summary's "events" (callbacks/_events.py).
    for line in event_lines(summary.get("events", []), width=console.width or 132, where=summary_file):
        console.print(line, markup=False, overflow="ignore", crop=False)

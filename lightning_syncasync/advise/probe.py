"""The advisor's measurements, one process per rank: compute speed on the user's workload, link latency and
bandwidth inside and across nodes, pauses; everything gathered to rank 0 with tensor collectives.

Compute is timed on each rank alone (forward, backward and optimizer step of the model and data that
``syncasync-train`` would build from the same overrides), so a rank's speed is its own and not the pace of the
slowest: that is what tells persistent stragglers from jitter. Under ``syncasync-emulate`` the probe applies the
emulator's time-dependent slowdowns (``--jitter``, ``--straggler-schedule``) the way ``StragglerEmulator`` does in
training; CPU-share stragglers apply by themselves.

Links are measured with all-reduces of a small message (latency: ``t = 2 (k-1) alpha``) and of the model's gradient
size (bandwidth, inverting the ring formula of ``algorithms/costmodel.py``) on the node groups and on the cross-node
groups of ``algorithms/topology.py``; the cross-node groups all run at once with ``B / m`` each, as a hierarchical
all-reduce loads a node's link.
"""

from __future__ import annotations

import datetime
import logging
import os
import random
import statistics
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist

from lightning_syncasync._cores import ranks_on_host
from lightning_syncasync.advise.measurements import Measurements
from lightning_syncasync.algorithms.compression.compressor import Compressor
from lightning_syncasync.algorithms.streams import wait_for_device
from lightning_syncasync.algorithms.topology import Topology

log = logging.getLogger(__name__)

SMALL_BYTES = 4096
# A step slower than (1 + PAUSE_THRESHOLD) x the rank's median counts as a pause (jitter), not as noise.
PAUSE_THRESHOLD = 1.0
# Per-rank figures gathered to rank 0, in this order (one float64 vector per rank).
_LINK_FIELDS = ("t_intra_small", "t_intra_big", "t_cross_small", "t_cross_big", "t_world_big", "cpu_cross_big")
_FIELDS = ("median", "cv", "pause_p", "pause_f", "steps", "cpu_share", "codec_s_per_byte", *_LINK_FIELDS,
           "state_bytes", "device_bytes")  # fmt: skip


def compose_config(overrides: list[str]) -> Any:
    """The ``syncasync-train`` config for ``overrides``, composed the same way (``pkg://lightning_syncasync.conf``)."""
    from hydra import compose, initialize_config_module

    import lightning_syncasync.train  # noqa: F401  (registers the config schemas, as the app does at import)

    with initialize_config_module(config_module="lightning_syncasync.conf", version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def build_workload(overrides: list[str]) -> tuple[torch.nn.Module, Any, int]:
    """(LightningModule, its training dataloader, batch size) of the composed config."""
    import hydra

    cfg = compose_config(overrides)
    datamodule = hydra.utils.instantiate(cfg.data, _convert_="all")
    model = hydra.utils.instantiate(cfg.model, _convert_="all")
    datamodule.prepare_data()
    datamodule.setup("fit")
    return model, datamodule.train_dataloader(), int(cfg.data.batch_size)


def _optimizer(model: Any) -> torch.optim.Optimizer:
    try:
        opt = model.configure_optimizers()
    except RuntimeError as err:
        if "not attached to a `Trainer`" not in str(err):
            raise
        # A module whose configure_optimizers reads its Trainer (a schedule over trainer.estimated_stepping_batches,
        # a common pattern) cannot build its optimizer in the probe, which times steps without a Trainer. An Adam
        # step stands in: it costs what the usual optimizers cost per parameter, and only its time is measured.
        log.warning("syncasync-advise: %s's configure_optimizers needs a Trainer (%s); timing an Adam step instead",
                    type(model).__name__, err)  # fmt: skip
        return torch.optim.Adam(model.parameters())
    if isinstance(opt, dict):
        opt = opt["optimizer"]
    if isinstance(opt, (list, tuple)):
        opt = opt[0][0] if isinstance(opt[0], (list, tuple)) else opt[0]
        if isinstance(opt, dict):
            opt = opt["optimizer"]
    return opt


class _EmulatedSlowdown:
    """The emulator's time-dependent slowdowns, applied like ``StragglerEmulator`` (sleep = extra x compute)."""

    def __init__(self, rank: int, planned_s: float) -> None:
        from lightning_syncasync.callbacks.straggler import (
            ENV_JITTER,
            ENV_SCHEDULE,
            ENV_SEED,
            ENV_SLOWDOWN,
            parse_jitter,
            parse_schedule,
            parse_slowdown,
        )

        self.windows = [
            w
            for w in parse_slowdown(os.environ.get(ENV_SLOWDOWN, "")) + parse_schedule(os.environ.get(ENV_SCHEDULE, ""))
            if w.rank == rank
        ]
        self.p, self.f = parse_jitter(os.environ.get(ENV_JITTER, ""))
        self.rng = random.Random(int(os.environ.get(ENV_SEED, "0")) * 1_000_003 + rank)
        self.planned_s = planned_s

    def pause(self, compute_s: float, elapsed_s: float) -> None:
        progress = elapsed_s / self.planned_s
        factor = 1.0
        for w in self.windows:
            if w.start <= progress < w.end:
                factor *= w.factor
        sleep = (factor - 1.0) * compute_s
        if self.p > 0 and self.rng.random() < self.p:
            sleep += self.f * compute_s
        if sleep > 0:
            time.sleep(sleep)


def time_compute(
    model: Any,
    loader: Any,
    seconds: float,
    rank: int,
    device: torch.device,
    cpu: list[float] | None = None,
    state: list[float] | None = None,
) -> list[float]:
    """Per-step wall times of forward + backward + optimizer step for about ``seconds`` (2 warm-up steps left out).
    ``cpu``, when given, receives ``[process CPU seconds, wall seconds]`` of the compute alone (pauses left out);
    ``state`` receives ``[bytes]`` of the replicated training state (:func:`training_state_bytes`)."""
    model.to(device).train()
    opt = _optimizer(model)
    slowdown = _EmulatedSlowdown(rank, seconds)
    times: list[float] = []
    cpu_s = wall_s = 0.0
    start = time.perf_counter()
    it, i = iter(loader), 0
    with warnings.catch_warnings():
        # training_step's self.log() outside a Trainer only warns; the probe needs the loss, not the logging.
        warnings.simplefilter("ignore")
        while True:
            try:
                batch = next(it)
            except StopIteration:
                it = iter(loader)
                batch = next(it)
            batch = _to(batch, device)
            t0, c0 = time.perf_counter(), time.process_time()
            out = model.training_step(batch, i)
            loss = out["loss"] if isinstance(out, dict) else out
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            wait_for_device(device)
            computed = time.perf_counter() - t0
            if i >= 2:
                cpu_s += time.process_time() - c0
                wall_s += computed
            slowdown.pause(computed, time.perf_counter() - start)
            if i >= 2:
                times.append(time.perf_counter() - t0)
            i += 1
            if (time.perf_counter() - start >= seconds and len(times) >= 5) or len(times) >= 10_000:
                if cpu is not None:
                    cpu[:] = [cpu_s, wall_s]
                if state is not None:
                    state[:] = [training_state_bytes(model, opt)]
                return times


def training_state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> float:
    """What a replicated rank holds for training: the trainable parameters, a gradient of each, and the optimizer's
    state after its steps (Adam: two moments per parameter)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    params = sum(p.numel() * p.element_size() for p in trainable)
    moments = sum(
        t.numel() * t.element_size() for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor)
    )
    return float(2 * params + moments)


def device_memory_bytes(device: torch.device, ranks_on_machine: int) -> float:
    """Memory one rank can use: its GPU's, or the machine's RAM shared by the ranks on it (0 when unknown)."""
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX system
        return 0.0
    return float(total) / max(1, ranks_on_machine)


def _to(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: _to(v, device) for k, v in batch.items()}
    return batch


def step_statistics(times: list[float]) -> dict[str, float]:
    """Median step, coefficient of variation, and the two-point pause fit (probability, mean extra / median)."""
    med = statistics.median(times)
    mean = statistics.fmean(times)
    cv = statistics.pstdev(times) / mean if len(times) > 1 else 0.0
    pauses = [t for t in times if t > (1 + PAUSE_THRESHOLD) * med]
    p = len(pauses) / len(times)
    f = statistics.fmean((t - med) / med for t in pauses) if pauses else 0.0
    return {"median": med, "cv": cv, "pause_p": p, "pause_f": f, "steps": float(len(times))}


def _timed_all_reduce(nbytes: float, group: Any, device: torch.device, reps: int) -> tuple[float, float]:
    """Median wall seconds and median process CPU seconds of an all-reduce of ``nbytes`` on ``group`` (every rank of
    the world takes part in timing). The CPU time includes the backend's own threads (gloo works in them)."""
    t = torch.ones(max(1, int(nbytes) // 4), dtype=torch.float32, device=device)
    dist.all_reduce(t, group=group)  # warm-up: connection set-up is not bandwidth
    out, cpu = [], []
    for _ in range(reps):
        dist.barrier()
        wait_for_device(device)
        t0, c0 = time.perf_counter(), time.process_time()
        dist.all_reduce(t, group=group)
        wait_for_device(device)
        out.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(out), statistics.median(cpu)


def measure_links(topo: Topology, grad_bytes: float, device: torch.device, reps: int) -> dict[str, float]:
    """All-reduce times on this rank's node group, cross-node group (all groups at once) and the whole world."""
    out = dict.fromkeys(_LINK_FIELDS, 0.0)
    if topo.node_size > 1:
        intra, _ = dist.new_subgroups_by_enumeration(topo.all_nodes())
        out["t_intra_small"] = _timed_all_reduce(SMALL_BYTES, intra, device, reps)[0]
        out["t_intra_big"] = _timed_all_reduce(grad_bytes, intra, device, reps)[0]
    if topo.num_nodes > 1:
        cross, _ = dist.new_subgroups_by_enumeration(topo.all_cross_node())
        out["t_cross_small"] = _timed_all_reduce(SMALL_BYTES, cross, device, reps)[0]
        out["t_cross_big"], out["cpu_cross_big"] = _timed_all_reduce(grad_bytes / topo.node_size, cross, device, reps)
    if topo.world_size > 1:
        out["t_world_big"] = _timed_all_reduce(grad_bytes, None, device, reps)[0]
    return out


def comm_cpu_s_per_byte(cpu_s: list[float], cpu_share: list[float], shard_bytes: float, nodes: int) -> float:
    """What a background inter-node all-reduce costs a rank's compute, per byte in the cost model's convention
    (``2 (n-1)`` shards sent per round: ``ScalingModel._hier_round_s``), in *wall* seconds of that rank.

    The collective's process CPU time is converted to the wall time it takes from compute through the CPU share the
    rank's compute got (CPU seconds per wall second while computing): on a rank capped at 0.375 of a core, one CPU
    second of gloo work costs 2.7 s of compute. The median over ranks. Why measured and not fitted: ``--calibrate``
    fitted 0 on 2-node runs, where the exchange is small. Measured on the emulated LM clusters: 0.5 s per GB at 4
    nodes x 1 and 1.6 s per GB at 2 x 2, 1-4% of a step at ``inter_period=4`` (README, simulator accuracy).
    """
    sent = 2 * (nodes - 1) * shard_bytes
    if nodes < 2 or sent <= 0:
        return 0.0
    per_rank = [c / share / sent for c, share in zip(cpu_s, cpu_share, strict=True) if share > 0]
    return statistics.median(per_rank) if per_rank else 0.0


def codec_s_per_byte(grad_bytes: float, device: torch.device, reps: int) -> float:
    """Wall seconds per gradient byte of one int8 encode or decode on this rank (the mean of the two), the cost
    model's ``codec_s_per_byte``.

    Why measured: compressed exchanges encode and decode inside the step, on the rank's own CPU share. On the
    emulated 4-node LM (ranks capped at 0.375 cores) the uncalibrated model, which charged nothing for it, predicted
    two-phase int8 at 53.5 samples/s where 21.7 were measured: about 1.8 s of codec work per step. int8 stands in for
    the chunked codecs (int4 and sign do about the same passes over the tensor).
    """
    numel = max(1, int(grad_bytes) // 4)
    enc, dec = Compressor("int8").time_codec(numel, reps=reps, device=device)
    return (enc + dec) / 2 / grad_bytes


def _link(t_small: float, t_big: float, k: int, nbytes: float) -> tuple[float, float]:
    """(alpha, beta) from ring all-reduce times over ``k`` ranks; ``nbytes`` is what the link carries."""
    alpha = t_small / (2 * (k - 1))
    wire = 2 * (k - 1) / k * nbytes
    # A time at or under the latency term says the link is faster than we can time: bound it by the message.
    beta = wire / max(t_big - 2 * (k - 1) * alpha, t_big * 0.05, 1e-9)
    return alpha, beta


def run_probe(overrides: list[str], seconds: float, workload: str, reps: int = 3) -> Measurements | None:
    """Measure on this rank; returns the gathered :class:`Measurements` on rank 0 and ``None`` elsewhere."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    if world % local_world:
        raise ValueError(
            f"WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local_world}; HINT: launch the same "
            "number of ranks on every node (torchrun --nproc-per-node)"
        )
    topo = Topology(world_size=world, node_size=local_world)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    backend = "nccl" if cuda else "gloo"
    distributed = world > 1
    if cuda:
        # The rank's own GPU for this thread's kernels and for NCCL: without it (and device_id below) NCCL's first
        # barrier guesses GPU rank % GPUs per node, another GPU than LOCAL_RANK's whenever a node runs fewer ranks
        # than it has GPUs.
        torch.cuda.set_device(device)
    if distributed:
        timeout = datetime.timedelta(seconds=max(120.0, 10 * seconds))
        dist.init_process_group(backend, timeout=timeout, device_id=device if cuda else None)
    try:
        model, loader, batch = build_workload(overrides)
        params = sum(p.numel() for p in model.parameters() if p.requires_grad)
        grad_bytes = float(sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad))
        if distributed:
            dist.barrier()  # every rank computes at the same time, as in training
        cpu: list[float] = [0.0, 0.0]
        state: list[float] = [0.0]
        stats = step_statistics(time_compute(model, loader, seconds, rank, device, cpu, state))
        stats["cpu_share"] = cpu[0] / cpu[1] if cpu[1] > 0 else 0.0
        stats["state_bytes"] = state[0]
        stats["device_bytes"] = device_memory_bytes(device, ranks_on_host(local_world))
        if distributed:
            dist.barrier()  # every rank encodes at once, as in a compressed exchange
        stats["codec_s_per_byte"] = codec_s_per_byte(grad_bytes, device, reps)
        if distributed:
            stats.update(measure_links(topo, grad_bytes, device, reps))
        else:
            stats.update(dict.fromkeys(_LINK_FIELDS, 0.0))
        mine = torch.tensor([stats[k] for k in _FIELDS], dtype=torch.float64, device=device)
        if distributed:
            rows = [torch.zeros_like(mine) for _ in range(world)]
            dist.all_gather(rows, mine)
            table = torch.stack(rows).cpu()
        else:
            table = mine.cpu().unsqueeze(0)
    finally:
        if distributed:
            dist.barrier()
            dist.destroy_process_group()
    if rank != 0:
        return None
    col = {k: table[:, i].tolist() for i, k in enumerate(_FIELDS)}
    m, n = topo.node_size, topo.num_nodes
    meas = Measurements(
        world_size=world, nodes=n, procs_per_node=m, batch_size=batch, grad_bytes=grad_bytes,
        median_step_s=col["median"], step_cv=col["cv"], pause_p=col["pause_p"], pause_f=col["pause_f"],
        steps=[int(s) for s in col["steps"]], workload=workload, params=params, backend=backend,
        overrides=list(overrides),
    )  # fmt: skip
    # A collective is as slow as its slowest member: the link figures use the maximum over ranks.
    if m > 1:
        meas.intra_alpha_s, meas.intra_bytes_per_s = _link(
            max(col["t_intra_small"]), max(col["t_intra_big"]), m, grad_bytes
        )
    if n > 1:
        # m cross-node groups ran at once with B/m each: the node's link carried 2(n-1)/n x B.
        meas.inter_alpha_s, meas.inter_bytes_per_s = _link(
            max(col["t_cross_small"]), max(col["t_cross_big"]), n, grad_bytes
        )
    if world > 1:
        meas.flat_all_reduce_s = max(col["t_world_big"])
    if n > 1 and not cuda:
        # On GPUs the copy engines and NCCL's kernels do this work, not the rank's CPU: left at 0 there.
        meas.comm_cpu_s_per_byte = comm_cpu_s_per_byte(col["cpu_cross_big"], col["cpu_share"], grad_bytes / m, n)
    # A compressed collective waits for its slowest encoder: the maximum over ranks.
    meas.codec_s_per_byte = max(col["codec_s_per_byte"])
    # The rank with the least memory decides whether the model fits.
    meas.state_bytes, meas.device_bytes = max(col["state_bytes"]), min(col["device_bytes"])
    return meas

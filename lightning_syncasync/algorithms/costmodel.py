"""A cost model of data-parallel training: predicted throughput of each strategy on clusters we cannot run here.

``ScalingModel`` turns a few measured numbers (each rank's compute time per sample, the gradient size, the latency
``alpha`` and bandwidth ``beta`` of the intra-node and inter-node links, how often and how long ranks pause) into
the step time, samples/s and efficiency of every strategy of this package, for 1 to a million nodes. It is what
``syncasync-advise`` prints and plots, and it is calibrated against ``syncasync-bench`` runs inside
``syncasync-emulate`` (2-4 emulated nodes) with :meth:`ScalingModel.calibrate`, which also reports its error there.

Notation: ``n`` nodes of ``m`` ranks (``R = n m``), ``b`` samples per rank and step, ``c_r`` rank ``r``'s compute
seconds per sample (``T_r = b c_r`` per step), ``B`` gradient bytes, a link ``(alpha, beta)``.

Communication (alpha-beta model, Hockney 1994; ring algorithms as in Thakur, Rabenseifner & Gropp 2005)::

    ring all-reduce over k ranks:  2 (k-1)/k * B / beta + 2 (k-1) alpha       (reduce-scatter + all-gather)
    ring all-gather over k ranks:  (k-1) * B_payload / beta + (k-1) alpha     (int8/sign payloads cannot be summed)

A flat all-reduce over nodes runs at the slowest link on the ring: the inter-node one when ``n > 1``. In a node-major
ring one edge per node leaves the node, so the node's link carries what every ring edge carries.

Strategies (``DDP`` = flat synchronous all-reduce every step)::

    ddp:        step = E[max_r X_r] + comm - min(overlap * comm, mean_r E[X_r]) + k_coll * o
                X_r = T_r (1 + f J_r), J_r ~ Bernoulli(p): a pause of f x compute with probability p per step;
                for identical ranks E[max] = T (1 + f (1 - (1-p)^R)), the two-point order statistic
    ddp_adaptive_batch: T_r -> G / sum_r(1/c_r) for every rank (shares proportional to speed, global batch G = R b
                fixed): persistent stragglers cost nothing, jitter is not helped
    hier_sync:  node step s_loc = E[max over the node's ranks] + intra all-reduce (exposed as in DDP), nodes paced by
                the slowest node; every P = inter_period steps one inter-node round of
                t_round = hierarchical all-reduce (reduce-scatter inside the node, all-reduce of the B/m shards across
                nodes, all-gather inside; the node link carries m shards = B) runs in the background and may take
                up to D = max_delay *steps* after its launch (``DelayedAverager`` applies a round D steps after
                launching it, whatever P is):  step = max(s_loc, t_round / P, s_loc + (t_round - D s_loc) / P)
    async_ssp:  rounds (``local_steps`` H > 1, the default): every rank at its own mean rate (rounds of wall-clock
                length; fast ranks take more local steps and claim more batches), t_r = b c_r + cpu_round / H; a
                round lasts T = H mean_r(t_r); its exchange (the model, all-reduced, in the background) takes t_x:
                with staleness s >= 1 rounds come no faster than the exchange thread finishes them,
                round = max(T, t_x); with s = 0 every round waits for its exchange, round = T + t_x; samples/s =
                sum_r (b / t_r) T / round.
                per step (H = 1): no per-step wait. With staleness s a rank waits only for ranks more than s clocks
                behind: the pace is E[max_r of its mean step over a window of s+1 steps] (K_r ~ Binomial(s+1, p)
                pauses), which is the two-point order statistic at s = 0 and each rank's mean as s grows (jitter
                absorbed); a persistent straggler paces everyone once the slack is used. ASP (s = None): each rank at
                its own rate. The update exchange (an all-reduce every step, in the background) caps the step at its
                duration.
    compression: the payload is ``ratio x B``, all-reduced (powersgd, fp16), exchanged in two phases (int8, int4,
                sign: all-to-all of shards, then all-gather of the averaged shards, which moves what a ring
                all-reduce of the payload moves: 2 (k-1)/k ratio B) or, with ``collective="allgather"``, all-gathered
                (every rank receives k-1 payloads); for DDP across nodes of several ranks (all but powersgd)
                hierarchical: one fp32 all-reduce inside the node, the B/m shards compressed across nodes sharing
                the node link, as hier_sync's round; plus an encode/decode CPU cost per gradient byte
                (``codec_s_per_byte``: two-phase encodes and decodes about 3 B, all-gather decodes k-1 payloads).
    auto_sync:  the best of ddp_adaptive_batch / hier_sync at their default settings (SyncSwitcher's defaults:
                batch rebalancing on, async off): an upper bound for a switcher that settles in the right mode
                (switching costs are not modelled).

Sharded strategies (FSDP2: parameters, gradients and optimizer state split over a group of k ranks), for models
that do not fit one device. FSDP2 all-gathers the parameters for forward and again for backward (it reshards after
forward by default) and reduce-scatters the gradients: three ring passes, ``3 (k-1)/k * B / beta``::

    fsdp:       sharded over every rank (Lightning's ModelParallelStrategy): as ddp, with the three passes over all
                R ranks (through the inter-node link when n > 1) in place of the all-reduce
    hsdp:       sharded inside each node, replicated across nodes: the three passes over the node's m ranks on the
                intra link, then the gradient shards all-reduced across nodes every step (B/m per rank, the m
                shards sharing the node link: hier_sync's cross-node hop, blocking)
    hier_sync_sharded: hier_sync over the shards: the three passes inside the node every step; every P steps each
                rank averages its own shard across nodes in the background (hier_sync's round without the
                node-internal reduce-scatter and all-gather: the shards are already split)

Efficiency = samples/s over the no-communication limit: every rank at its own mean rate, ``sum_r b / E[X_r]``
(what ``syncasync-bench`` measures as *ideal*: same ranks, same stragglers, no communication).

Assumptions and limits: ring algorithms only (trees and NCCL's double binary trees have ``log k`` latency terms
that matter at thousands of nodes, so the latency term here is pessimistic there); no congestion, no oversubscribed
switches (a fat tree at full bisection); pauses are independent across ranks and steps; persistent slowdowns are
constant in time (a mid-run straggler is approximated by its time average); hier_sync is assumed to absorb
jitter across nodes within its delay window and not within a node; the background exchanges of hier_sync and
async_ssp cost CPU time on the rank (``comm_cpu_s_per_byte``, large on the CPU-capped emulated ranks, near zero on
GPUs with their own copy engines); learning per sample (the effect of staleness or compression on accuracy) is
not modelled: this is throughput, not time to accuracy.

Example::

    model = ScalingModel(compute_s_per_sample=2e-3, batch_size=32, grad_bytes=100e6, procs_per_node=8,
                         intra_link=(5e-6, 100e9), inter_link=(20e-6, 1.25e9))
    model.predict("hier_sync", nodes=64, inter_period=4).samples_per_s
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from lightning_syncasync.algorithms._costmodel_fit import DEFAULT_PARAMS, _Calibration
from lightning_syncasync.algorithms._costmodel_links import COMPRESSION, _Collectives
from lightning_syncasync.algorithms._costmodel_ranks import _expected_max, _mean, _RankTimes

# COMPRESSION and DEFAULT_PARAMS were defined here: still importable from here.
__all__ = [
    "COLLECTIVES",
    "COMPRESSION",
    "DEFAULT_PARAMS",
    "EMULATED_ALPHA_S",
    "STRATEGIES",
    "Prediction",
    "ScalingModel",
]

# Chunked codes may travel by the older all-gather layout instead (``Compressor(collective="allgather")``).
COLLECTIVES = ("two_phase", "allgather")
# Base strategies and the named variants the advisor and the benchmarks use.
_BASE = ("ddp", "ddp_adaptive_batch", "hier_sync", "async_ssp", "auto_sync", "fsdp", "hsdp", "hier_sync_sharded")
_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "ddp_int8": ("ddp", {"compression": "int8"}),
    "ddp_int4": ("ddp", {"compression": "int4"}),
    "ddp_int8_allgather": ("ddp", {"compression": "int8", "collective": "allgather"}),
    "ddp_powersgd": ("ddp", {"compression": "powersgd"}),
    "ddp_fp16": ("ddp", {"compression": "fp16"}),
    "hier_sync_int8": ("hier_sync", {"compression": "int8"}),
    "hier_sync_int8_allgather": ("hier_sync", {"compression": "int8", "collective": "allgather"}),
    "async_asp": ("async_ssp", {"staleness": None, "local_steps": 1}),
    "async_ssp_per_step": ("async_ssp", {"local_steps": 1}),
    "async_ssp_int8": ("async_ssp", {"compression": "int8"}),
    "hier_sync_sharded_int8": ("hier_sync_sharded", {"compression": "int8"}),
}
STRATEGIES: tuple[str, ...] = _BASE + tuple(_VARIANTS)
_SETTINGS: dict[str, frozenset[str]] = {
    "ddp": frozenset({"compression", "compression_ratio", "collective"}),
    "ddp_adaptive_batch": frozenset({"compression", "compression_ratio", "collective"}),
    "hier_sync": frozenset({"inter_period", "max_delay", "compression", "compression_ratio", "collective"}),
    "async_ssp": frozenset({"staleness", "local_steps", "compression", "compression_ratio", "collective"}),
    "auto_sync": frozenset({"inter_period", "max_delay"}),
    "fsdp": frozenset(),
    "hsdp": frozenset(),
    "hier_sync_sharded": frozenset({"inter_period", "max_delay", "compression", "compression_ratio", "collective"}),
}
# auto_sync's own names for the modes it switches between (conf/strategy/auto_sync.yaml: `mode`).
_AUTO_MODES = {"ddp": "sync", "ddp_adaptive_batch": "sync", "hier_sync": "hier", "async_ssp": "async"}
# Link latency assumed for emulated links (veth and loopback without netem): not measurable from bench records.
EMULATED_ALPHA_S = 50e-6
_MAX_WINDOW = 4096  # staleness windows beyond this are treated as fully absorbing (ASP-like) pacing


@dataclass
class Prediction:
    """One predicted operating point. Times are seconds per step (per rank clock for ``async_ssp``)."""

    strategy: str
    nodes: int
    ranks: int
    step_s: float
    compute_s: float
    comm_s: float
    wait_s: float
    samples_per_s: float
    ideal_samples_per_s: float
    efficiency: float
    bottleneck: str
    settings: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class ScalingModel(_RankTimes, _Collectives, _Calibration):
    """Predicts step time, samples/s and efficiency of each strategy at any node count (see the module docstring).

    Args:
        compute_s_per_sample: each rank's compute seconds per sample (forward, backward, optimizer step), as
            measured on ``len(list)`` ranks; a larger world repeats the list (rank ``r`` gets ``list[r % len]``), so
            the fraction and placement of slow ranks is kept. Or one value for every rank, with
            ``straggler_fraction``/``straggler_factor`` for slow ones.
        batch_size: samples per rank and step.
        grad_bytes: gradient bytes exchanged per step (4 x parameters in fp32).
        procs_per_node: ranks per node (``m``).
        intra_link: ``(alpha_s, bytes_per_s)`` of the links between ranks of one node.
        inter_link: ``(alpha_s, bytes_per_s)`` of each node's link to the others.
        straggler_fraction: fraction of ranks (the last ones, node-major) that are persistently slower; at least one
            rank when > 0. Only with a single ``compute_s_per_sample``.
        straggler_factor: how much slower they are (1.5 = 1.5x the compute time).
        jitter_p: probability, per rank and step, of a pause.
        jitter_factor: a pause lasts ``jitter_factor x`` the rank's compute time of that step.
        overlap: fraction of a synchronous all-reduce hidden behind backward (calibrated; 0 = none).
        collective_overhead_s: fixed CPU/launch cost of one collective call on a rank (calibrated).
        comm_cpu_s_per_byte: CPU seconds a rank spends per byte it sends in a *background* exchange (hier_sync,
            async_ssp), taken from its compute (calibrated; near 0 with GPU copy engines).
        codec_s_per_byte: encode/decode CPU seconds per gradient byte of compression (calibrated).

    Example::

        # 4 ranks per node, 0.02 s of compute per sample, 13 MB of gradients, 100 Mbit/s between nodes
        model = ScalingModel(0.02, batch_size=16, grad_bytes=13e6, procs_per_node=4, inter_link=(1e-4, 12.5e6))
        model.predict("hier_sync_int8", nodes=64).samples_per_s
    """

    def __init__(
        self,
        compute_s_per_sample: float | Sequence[float],
        batch_size: int,
        grad_bytes: float,
        procs_per_node: int = 1,
        intra_link: tuple[float, float] = (EMULATED_ALPHA_S, 1e9),
        inter_link: tuple[float, float] = (EMULATED_ALPHA_S, 1e9),
        straggler_fraction: float = 0.0,
        straggler_factor: float = 1.0,
        jitter_p: float = 0.0,
        jitter_factor: float = 0.0,
        overlap: float = 0.0,
        collective_overhead_s: float = 0.0,
        comm_cpu_s_per_byte: float = 0.0,
        codec_s_per_byte: float = 0.0,
    ) -> None:
        if isinstance(compute_s_per_sample, (int, float)):
            compute = [float(compute_s_per_sample)]
        else:
            compute = [float(c) for c in compute_s_per_sample]
            if not compute:
                raise ValueError("compute_s_per_sample is empty; HINT: give one value per measured rank, or one value")
            if straggler_fraction > 0:
                raise ValueError(
                    f"straggler_fraction={straggler_fraction} with a per-rank compute_s_per_sample list; HINT: the "
                    "list already says which ranks are slow: put the slowdown in the list or give a single value"
                )
        for c in compute:
            if not (c > 0 and math.isfinite(c)):
                raise ValueError(
                    f"compute_s_per_sample must be > 0 and finite, got {c}; HINT: seconds of forward+backward+step "
                    "per sample, e.g. 0.002"
                )
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}; HINT: samples per rank and step")
        if not (grad_bytes >= 0 and math.isfinite(grad_bytes)):
            raise ValueError(f"grad_bytes must be >= 0, got {grad_bytes}; HINT: 4 x the number of fp32 parameters")
        if not isinstance(procs_per_node, int) or procs_per_node < 1:
            raise ValueError(f"procs_per_node must be an integer >= 1, got {procs_per_node!r}; HINT: ranks per node")
        for name, link in (("intra_link", intra_link), ("inter_link", inter_link)):
            if len(link) != 2 or not (link[0] >= 0 and link[1] > 0 and math.isfinite(link[0])):
                raise ValueError(
                    f"{name}={link!r} is not (alpha_s >= 0, bytes_per_s > 0); HINT: e.g. (2e-5, 1.25e9) for 10 GbE"
                )
        if not 0 <= straggler_fraction <= 1:
            raise ValueError(f"straggler_fraction must be in [0, 1], got {straggler_fraction}; HINT: e.g. 0.25")
        if straggler_factor < 1:
            raise ValueError(
                f"straggler_factor must be >= 1 (1.5 = 1.5x slower), got {straggler_factor}; HINT: 1 is no straggler"
            )
        if not 0 <= jitter_p <= 1:
            raise ValueError(
                f"jitter_p must be in [0, 1], got {jitter_p}; HINT: probability per rank and step, e.g. 0.1"
            )
        if jitter_factor < 0:
            raise ValueError(f"jitter_factor must be >= 0, got {jitter_factor}; HINT: pause = factor x compute, e.g. 4")
        if not 0 <= overlap <= 1:
            raise ValueError(f"overlap must be in [0, 1], got {overlap}; HINT: fraction of the all-reduce hidden")
        for name, value in (
            ("collective_overhead_s", collective_overhead_s),
            ("comm_cpu_s_per_byte", comm_cpu_s_per_byte),
            ("codec_s_per_byte", codec_s_per_byte),
        ):
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be >= 0 and finite, got {value}; HINT: 0 disables it")
        self.compute = compute
        self.batch_size = batch_size
        self.grad_bytes = float(grad_bytes)
        self.procs_per_node = procs_per_node
        self.intra_link = (float(intra_link[0]), float(intra_link[1]))
        self.inter_link = (float(inter_link[0]), float(inter_link[1]))
        self.straggler_fraction = float(straggler_fraction)
        self.straggler_factor = float(straggler_factor)
        self.jitter_p = float(jitter_p)
        self.jitter_factor = float(jitter_factor)
        self.overlap = float(overlap)
        self.collective_overhead_s = float(collective_overhead_s)
        self.comm_cpu_s_per_byte = float(comm_cpu_s_per_byte)
        self.codec_s_per_byte = float(codec_s_per_byte)

    # -------------------------------------------------------------------------------------------- strategies
    def predict(self, strategy: str, nodes: int, **settings: Any) -> Prediction:
        """Predicted operating point of ``strategy`` on ``nodes`` nodes of ``procs_per_node`` ranks.

        Settings: ``compression`` (one of ``COMPRESSION``) and ``compression_ratio`` (bytes vs fp32) for ddp,
        ddp_adaptive_batch, hier_sync, hier_sync_sharded and async_ssp; ``inter_period`` (4) and ``max_delay`` (1)
        for hier_sync and hier_sync_sharded; ``staleness`` (1; ``None`` = ASP with ``local_steps=1``) and
        ``local_steps`` (8; 1 = per-step exchange) for async_ssp; none for fsdp and hsdp.
        """
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {strategy!r}; HINT: one of {', '.join(STRATEGIES)}")
        if not isinstance(nodes, int) or isinstance(nodes, bool) or nodes < 1:
            raise ValueError(f"nodes must be an integer >= 1, got {nodes!r}; HINT: e.g. nodes=8")
        base, fixed = _VARIANTS.get(strategy, (strategy, {}))
        unknown = set(settings) - _SETTINGS[base]
        if unknown:
            raise ValueError(
                f"{strategy} has no setting(s) {sorted(unknown)}; HINT: it takes {sorted(_SETTINGS[base]) or 'none'}"
            )
        opts = {**settings, **fixed}
        compression = opts.get("compression", "none")
        if compression not in COMPRESSION:
            raise ValueError(f"compression={compression!r} is unknown; HINT: one of {', '.join(COMPRESSION)}")
        ratio = float(opts.get("compression_ratio", COMPRESSION[compression][0]))
        if not 0 < ratio <= 1:
            raise ValueError(f"compression_ratio must be in (0, 1], got {ratio}; HINT: bytes sent / fp32 bytes")
        collective = opts.get("collective", "two_phase")
        if collective not in COLLECTIVES:
            raise ValueError(f"collective={collective!r} is unknown; HINT: one of {', '.join(COLLECTIVES)}")
        if collective == "allgather" and COMPRESSION[compression][1] == "two_phase":
            compression = f"{compression}@allgather"
        if base == "auto_sync":
            pred = self._auto_sync(nodes, opts)
        elif base in ("ddp", "ddp_adaptive_batch"):
            pred = self._ddp(nodes, compression, ratio, adaptive=base == "ddp_adaptive_batch")
        elif base in ("fsdp", "hsdp"):
            pred = self._sharded_sync(nodes, hsdp=base == "hsdp")
        elif base in ("hier_sync", "hier_sync_sharded"):
            period, delay = opts.get("inter_period", 4), opts.get("max_delay", 1)
            if not isinstance(period, int) or period < 1:
                raise ValueError(f"inter_period must be an integer >= 1, got {period!r}; HINT: e.g. inter_period=4")
            if not isinstance(delay, int) or delay < 0:
                raise ValueError(f"max_delay must be an integer >= 0, got {delay!r}; HINT: e.g. max_delay=1")
            pred = self._hier_sync(nodes, period, delay, compression, ratio, sharded=base == "hier_sync_sharded")
        else:
            staleness, local_steps = opts.get("staleness", 1), opts.get("local_steps", 8)
            if not isinstance(local_steps, int) or local_steps < 1:
                raise ValueError(f"local_steps must be an integer >= 1, got {local_steps!r}; HINT: 8 (1: per step)")
            if local_steps > 1 and (not isinstance(staleness, int) or staleness < 0):
                raise ValueError(f"staleness must be an integer >= 0 with local_steps > 1, got {staleness!r}; HINT: 1")
            if staleness is not None and (not isinstance(staleness, int) or staleness < 0):
                raise ValueError(f"staleness must be an integer >= 0 or None (ASP), got {staleness!r}; HINT: e.g. 1")
            if local_steps > 1:
                assert staleness is not None  # checked above: rounds need a bound
                pred = self._rounds(nodes, local_steps, staleness, compression, ratio)
            else:
                pred = self._async(nodes, staleness, compression, ratio)
        if base != "auto_sync":  # auto_sync reports the mode it settled in
            pred.settings = {k: v for k, v in opts.items() if k != "compression" or v != "none"}
        pred.strategy = strategy
        return pred

    def _finish(
        self, nodes: int, step: float, compute: float, comm: float, wait: float, samples: float, settings: dict
    ) -> Prediction:
        ideal = self.ideal_samples_per_s(nodes)
        parts = {"compute": compute, "communication": comm, "straggler wait": wait}
        return Prediction(
            strategy="", nodes=nodes, ranks=self._ranks(nodes), step_s=step, compute_s=compute, comm_s=comm,
            wait_s=wait, samples_per_s=samples, ideal_samples_per_s=ideal, efficiency=samples / ideal,
            bottleneck=max(parts, key=lambda k: parts[k]), settings=settings,
        )  # fmt: skip

    def _sync_comm(self, nodes: int, compression: str, ratio: float) -> float:
        ranks, m = self._ranks(nodes), self.procs_per_node
        if compression not in ("none", "powersgd") and nodes > 1 and m > 1:
            # Compressed DDP across nodes is hierarchical (algorithms/compression/compressed_hook.py), the same
            # shape as a hier_sync round: blocking here, and its encode/decode on the critical path.
            comm = self._hier_round_s(nodes, compression, ratio)[0]
            comm += self._codec_s(nodes, self.grad_bytes / m, compression)
        else:
            comm = self._collective(ranks, self.grad_bytes, self._link(nodes), compression, ratio)
            comm += self._codec_s(ranks, self.grad_bytes, compression)
        if ranks > 1:
            comm += self._collectives_per_step(self.grad_bytes) * self.collective_overhead_s
        return comm

    def _ddp(self, nodes: int, compression: str, ratio: float, adaptive: bool) -> Prediction:
        ranks, b = self._ranks(nodes), self.batch_size
        groups = self._rank_groups(ranks)
        if adaptive:
            # Shares proportional to speed: every rank needs G / sum(1/c) seconds for its part of the global batch.
            balanced = ranks * b / sum(k / c for k, c in groups)
            groups = [(ranks, balanced / b)]
        dists = [(k, self._step_dist(b * c)) for k, c in groups]
        slowest = _expected_max(dists)
        mean_compute = sum(k * _mean(d) for k, d in dists) / ranks
        comm = self._sync_comm(nodes, compression, ratio)
        exposed = comm - min(self.overlap * comm, mean_compute)
        step = slowest + exposed
        return self._finish(nodes, step, mean_compute, exposed, slowest - mean_compute, ranks * b / step, {})

    def _fsdp_s(self, k: int, link: tuple[float, float]) -> float:
        """FSDP2's traffic per step over ``k`` ranks: the parameters all-gathered for forward and again for backward,
        the gradients reduce-scattered (three ring passes of ``(k-1)/k B``), one collective per unit and pass."""
        if k <= 1:
            return 0.0
        passes = 3 * self.ring_all_gather_s(k, self.grad_bytes / k, link)
        return passes + 3 * self._collectives_per_step(self.grad_bytes) * self.collective_overhead_s

    def _sharded_sync(self, nodes: int, hsdp: bool) -> Prediction:
        ranks, b, m = self._ranks(nodes), self.batch_size, self.procs_per_node
        dists = [(k, self._step_dist(b * c)) for k, c in self._rank_groups(ranks)]
        slowest = _expected_max(dists)
        mean_compute = sum(k * _mean(d) for k, d in dists) / ranks
        if hsdp and nodes > 1:
            # Sharded inside the node; the gradient shards all-reduced across nodes every step, blocking.
            comm = self._fsdp_s(m, self.intra_link) + self._hier_round_s(nodes, "none", 1.0, inside=False)[0]
        else:
            comm = self._fsdp_s(ranks, self._link(nodes))
        exposed = comm - min(self.overlap * comm, mean_compute)
        step = slowest + exposed
        return self._finish(nodes, step, mean_compute, exposed, slowest - mean_compute, ranks * b / step, {})

    def _hier_round_s(self, nodes: int, compression: str, ratio: float, inside: bool = True) -> tuple[float, float]:
        """(duration of one inter-node round, CPU seconds it costs a rank). ``inside=False``: the ranks of a node
        hold different shards already (sharded strategies), so nothing is reduced or gathered inside the node."""
        m, nbytes = self.procs_per_node, self.grad_bytes
        if nodes <= 1:
            return 0.0, 0.0
        # Reduce-scatter + all-gather inside the node cost one intra all-reduce; across nodes each local rank
        # all-reduces its B/m shard, and the m shards share the node's link: the link carries B.
        inside_s = self.ring_all_reduce_s(m, nbytes, self.intra_link) if inside else 0.0
        shard = nbytes / m
        link = (self.inter_link[0], self.inter_link[1] / m)
        across = self._collective(nodes, shard, link, compression, ratio)
        sent = self._sent(nodes, ratio * shard, compression)
        cpu = self.comm_cpu_s_per_byte * sent + self._codec_s(nodes, shard, compression)
        cpu += (3 if inside else 1) * self.collective_overhead_s
        return inside_s + across, cpu

    def _hier_sync(
        self, nodes: int, period: int, delay: int, compression: str, ratio: float, sharded: bool = False
    ) -> Prediction:
        ranks, b, m = self._ranks(nodes), self.batch_size, self.procs_per_node
        t_round, cpu_round = self._hier_round_s(nodes, compression, ratio, inside=not sharded)
        if sharded:
            intra = self._fsdp_s(m, self.intra_link)  # FSDP2 inside the node every step
        else:
            intra = self.ring_all_reduce_s(m, self.grad_bytes, self.intra_link)
            if m > 1:
                intra += self._collectives_per_step(self.grad_bytes) * self.collective_overhead_s
        cpu = cpu_round / period
        patterns = self._node_patterns(nodes)
        if delay >= 1:
            # Nodes run free within the delay window: the slowest node's mean step paces the others.
            slowest = max(_expected_max([(1, self._step_dist(b * c + cpu)) for c in p]) for _, p in patterns)
        else:
            slowest = _expected_max([(k, self._step_dist(b * c + cpu)) for k, c in self._rank_groups(ranks)])
        mean_compute = sum(k * b * c * self._mean_factor() for k, c in self._rank_groups(ranks)) / ranks
        exposed_intra = intra - min(self.overlap * intra, mean_compute)
        local = slowest + exposed_intra
        # A round must be back `delay` steps after its launch (not `delay` periods: an earlier version of this model
        # said periods and predicted hier_sync 51% too fast at 4 nodes x 1, where a round takes ~2 steps).
        step = max(local, t_round / period, local + (t_round - delay * local) / period)
        comm = step - slowest
        return self._finish(nodes, step, mean_compute, comm, slowest - mean_compute, ranks * b / step, {})

    def _async(self, nodes: int, staleness: int | None, compression: str, ratio: float) -> Prediction:
        ranks, b = self._ranks(nodes), self.batch_size
        groups = self._rank_groups(ranks)
        exchange = self._collective(ranks, self.grad_bytes, self._link(nodes), compression, ratio)
        sent = self._sent(ranks, ratio * self.grad_bytes, compression)
        cpu = 0.0
        if ranks > 1:
            cpu = self.comm_cpu_s_per_byte * sent + self._codec_s(ranks, self.grad_bytes, compression)
            cpu += self.collective_overhead_s
        means = [(k, (b * c + cpu) * self._mean_factor()) for k, c in groups]
        mean_compute = sum(k * t for k, t in means) / ranks
        if staleness is None:
            # ASP: every rank at its own rate, each capped by how fast its updates can leave.
            samples = sum(k * b / max(t, exchange) for k, t in means)
            step = ranks * b / samples
            return self._finish(nodes, step, mean_compute, step - mean_compute, 0.0, samples, {})
        window = staleness + 1
        if window > _MAX_WINDOW:
            pace = max(t for _, t in means)
        else:
            pace = _expected_max([(k, self._window_dist(b * c + cpu, window)) for k, c in groups])
            pace = max(pace, max(t for _, t in means))
        step = max(pace, exchange)
        return self._finish(nodes, step, mean_compute, step - pace, pace - mean_compute, ranks * b / step, {})

    def _rounds(self, nodes: int, local_steps: int, staleness: int, compression: str, ratio: float) -> Prediction:
        ranks, b = self._ranks(nodes), self.batch_size
        groups = self._rank_groups(ranks)
        exchange = self._collective(ranks, self.grad_bytes, self._link(nodes), compression, ratio)
        cpu = 0.0
        if ranks > 1:
            sent = self._sent(ranks, ratio * self.grad_bytes, compression)
            cpu = self.comm_cpu_s_per_byte * sent + self._codec_s(ranks, self.grad_bytes, compression)
            cpu += 2 * self.collective_overhead_s  # the metadata, then the pseudo-gradients
        means = [(k, (b * c + cpu / local_steps) * self._mean_factor()) for k, c in groups]
        mean_compute = sum(k * t for k, t in means) / ranks
        length = local_steps * mean_compute
        if ranks == 1:
            exchange = 0.0
        period = length + exchange if staleness == 0 else max(length, exchange)
        samples = sum(k * b / t for k, t in means) * length / period
        step = ranks * b / samples
        return self._finish(nodes, step, mean_compute, step - mean_compute, 0.0, samples, {})

    def _auto_sync(self, nodes: int, opts: dict[str, Any]) -> Prediction:
        # SyncSwitcher's defaults: its sync mode rebalances batches. Its async mode (allow_async, on one node) is
        # chosen only under jitter above jitter_high, which the probe's pause fit does not map onto: the prediction
        # is the synchronous modes', a lower bound where the switcher goes async.
        modes = [self.predict("ddp_adaptive_batch", nodes)]
        hier = {k: opts[k] for k in ("inter_period", "max_delay") if k in opts}
        modes.append(self.predict("hier_sync", nodes, **hier))
        best = max(modes, key=lambda p: p.samples_per_s)
        best.settings = {"mode": _AUTO_MODES[best.strategy], **best.settings}
        return best

    def table(self, strategies: Sequence[str], nodes_list: Sequence[int], **settings: Any) -> list[Prediction]:
        """``predict`` for every strategy at every node count (settings a strategy does not take are left out)."""
        out = []
        for nodes in nodes_list:
            for s in strategies:
                base = _VARIANTS.get(s, (s, {}))[0]
                own = {k: v for k, v in settings.items() if k in _SETTINGS.get(base, frozenset())}
                out.append(self.predict(s, nodes, **own))
        return out

    # ------------------------------------------------------------------------------------------- calibration
    @classmethod
    def from_record(cls, record: Mapping[str, Any], params: Mapping[str, float] | None = None) -> ScalingModel:
        """The model of one benchmark record (the format :meth:`calibrate` documents) under ``params``."""
        p = {**DEFAULT_PARAMS, **(params or {})}
        jp, jf = record.get("jitter") or (0.0, 0.0)
        rates = [float(r) for r in record["ideal_per_rank_samples_per_s"]]
        if not rates or min(rates) <= 0:
            raise ValueError(f"record {record.get('scenario')}/{record.get('strategy')}: no positive ideal rates")
        # The ideal run includes the pauses: its rate is 1 / (c (1 + p f)).
        compute = [1.0 / (r * (1.0 + jp * jf)) for r in rates]
        unlimited = (EMULATED_ALPHA_S, p["unlimited_bytes_per_s"])
        link_mbit = record.get("link_mbit")
        inter = unlimited if link_mbit is None else (EMULATED_ALPHA_S, min(link_mbit * 1e6 / 8, unlimited[1]))
        return cls(
            compute_s_per_sample=compute, batch_size=int(record["batch_size"]), grad_bytes=float(record["grad_bytes"]),
            procs_per_node=int(record["procs_per_node"]), intra_link=unlimited, inter_link=inter,
            jitter_p=jp, jitter_factor=jf, overlap=p["overlap"], collective_overhead_s=p["collective_overhead_s"],
            comm_cpu_s_per_byte=p["comm_cpu_s_per_byte"], codec_s_per_byte=p["codec_s_per_byte"],
        )  # fmt: skip

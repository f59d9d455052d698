"""What the advisor decides from: the numbers ``syncasync-advise``'s probe measured on a cluster
(:mod:`lightning_syncasync.advise.probe`), or a test made up, with the few figures the decision reads off them."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Measurements:
    """What the probe measured (or a test made up). Times in seconds, sizes in bytes, bandwidths in bytes/s.

    ``*_alpha_s``/``*_bytes_per_s`` are ``None`` where there is no such link (one rank per node, one node);
    ``links_assumed`` says they came from command-line assumptions instead of a measurement.
    """

    world_size: int
    nodes: int
    procs_per_node: int
    batch_size: int
    grad_bytes: float
    median_step_s: list[float]
    step_cv: list[float]
    pause_p: list[float]
    pause_f: list[float]
    steps: list[int] = field(default_factory=list)
    intra_alpha_s: float | None = None
    intra_bytes_per_s: float | None = None
    inter_alpha_s: float | None = None
    inter_bytes_per_s: float | None = None
    flat_all_reduce_s: float | None = None
    comm_cpu_s_per_byte: float | None = None  # what a background inter-node exchange takes from compute, per byte
    codec_s_per_byte: float | None = None  # wall seconds per gradient byte of an int8 encode/decode on the slowest rank
    links_assumed: bool = False
    # Replicated training state per rank (parameters, gradients, optimizer state) and the memory one rank has (the
    # GPU's, or the machine's RAM over its ranks); 0 = not measured.
    state_bytes: float = 0.0
    device_bytes: float = 0.0
    workload: str = ""
    params: int = 0
    backend: str = "gloo"
    overrides: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.world_size != self.nodes * self.procs_per_node:
            raise ValueError(
                f"world_size={self.world_size} is not nodes x procs_per_node = {self.nodes} x {self.procs_per_node}; "
                "HINT: set LOCAL_WORLD_SIZE to the ranks per node"
            )
        for name in ("median_step_s", "step_cv", "pause_p", "pause_f"):
            if len(getattr(self, name)) != self.world_size:
                raise ValueError(f"{name} has {len(getattr(self, name))} values for {self.world_size} ranks")
        if min(self.median_step_s) <= 0:
            raise ValueError(f"median_step_s must be > 0, got {self.median_step_s}")

    @property
    def straggler_ratio(self) -> float:
        """Slowest rank's median step over the median rank's: persistent heterogeneity (pauses leave medians)."""
        return max(self.median_step_s) / statistics.median(self.median_step_s)

    @property
    def jitter(self) -> tuple[float, float]:
        """Pooled pause probability and mean pause length (in units of the rank's median step)."""
        p = statistics.fmean(self.pause_p)
        weights = sum(self.pause_p)
        f = sum(pp * ff for pp, ff in zip(self.pause_p, self.pause_f, strict=True)) / weights if weights > 0 else 0.0
        return p, f

    @property
    def bandwidth_ratio(self) -> float | None:
        if self.inter_bytes_per_s is None or self.intra_bytes_per_s is None:
            return None
        return self.inter_bytes_per_s / self.intra_bytes_per_s

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

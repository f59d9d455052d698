"""The benchmark scenarios: cluster shape, workload, sample budget and target, fixed per scenario.

Each scenario pins everything a comparison depends on, so two strategies are only ever compared on the same
cluster, the same data and the same number of samples. Targets are validation-metric thresholds that Lightning's
``ddp`` reaches within the budget (chosen once from measured ``ddp`` runs and kept fixed, not tuned per contender).

Workloads and what they mirror:

* ``slow_link`` / ``homogeneous``: the transformer LM demo (3.2 M parameters, 12.7 MB of fp32 gradients per step)
  on 2 nodes x 2 ranks of 0.45 cores each. At 100 Mbit/s a flat all-reduce takes a few times the step's compute:
  the ratio of a GPU cluster training a few-hundred-million-parameter model over 10 GbE.
* ``straggler`` / ``jitter`` / ``mid_run_straggler``: a small convnet (75 k parameters) on the digits upsampled to
  32x32, batch 128 per rank: much compute per byte, so without stragglers DDP runs near the no-communication limit
  (measured 96.7%), as data-parallel convnets do on a fast network; what remains is the cost of waiting for the
  slowest rank. The persistent straggler is a pause of 0.5x the rank's own compute time every step, on the same
  CPU share as the others: a CPU share divided by 1.5 made rank 3 1.43x slower when every rank trained alone but only
  1.2x slower inside DDP (0.554 vs 0.46 s of compute per step), because ranks that wait leave memory bandwidth to
  the one that computes; a pause scaled by the rank's own compute is 1.5x in both. (At 16x16, as first chosen, DDP
  ran at only 74.7% of the limit without any straggler: gloo's all-reduce costs CPU time on the capped ranks, and
  that is not the regime these scenarios stand for.)
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class Scenario:
    """A benchmark scenario (see the module docstring).

    Attributes:
        name: CLI value of ``--scenario``.
        description: one line for the report.
        nodes, procs_per_node: the emulated cluster.
        link_mbit: inter-node link rate, ``None`` for no limit.
        stragglers: ``{rank: factor}`` persistent slowdowns (CPU shares).
        jitter: ``"PROB:FACTOR"`` transient pauses.
        schedule: ``"RANK:FACTOR@START-END"`` windowed slowdowns.
        overrides: Hydra overrides of ``syncasync-train`` that fix the workload.
        steps, quick_steps: optimizer steps per rank (the sample budget is steps x global batch).
        ideal_s, quick_ideal_s: length of the no-communication measurement (all ranks train for this long).
        metric, target, mode: the validation metric, its threshold and whether higher (``max``) is better.
        netns: needs network namespaces (root); the smoke scenario runs on plain loopback.
        mirrors: what compute-to-communication ratio the scenario resembles.
    """

    name: str
    description: str
    nodes: int
    procs_per_node: int
    overrides: tuple[str, ...]
    steps: int
    quick_steps: int
    target: float
    quick_target: float
    metric: str = "val_acc"
    mode: str = "max"
    link_mbit: float | None = None
    stragglers: dict[int, float] = field(default_factory=dict)
    jitter: str = ""
    schedule: str = ""
    netns: bool = True
    mirrors: str = ""
    ideal_s: float = 40.0
    quick_ideal_s: float = 15.0

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node

    def with_link(self, mbit: float) -> Scenario:
        """The same scenario with another inter-node link rate, under its own name (``slow_link_25mbit``), so its
        results never mix with the original's in an output folder. Targets and budgets stay the same."""
        if self.nodes < 2:
            raise ValueError(
                f"--link-mbit needs a scenario with several nodes; {self.name!r} has {self.nodes}. HINT: use it with "
                "slow_link or homogeneous"
            )
        if not mbit > 0:
            raise ValueError(f"--link-mbit must be > 0, got {mbit:g}; HINT: e.g. --link-mbit 25")
        return replace(
            self,
            name=f"{self.name}_{mbit:g}mbit".replace(".", "p"),
            description=f"{self.description}; link rate changed to {mbit:g} Mbit/s",
            link_mbit=mbit,
        )

    def reached(self, value: float, quick: bool) -> bool:
        target = self.quick_target if quick else self.target
        return value >= target if self.mode == "max" else value <= target


_LM = (
    "data=text",
    "model=transformer_lm",
    "data.batch_size=16",
    "data.seq_len=64",
    "model.lr=0.003",
    "model.warmup_steps=10",
    "trainer.val_check_interval=5",
    "trainer.limit_val_batches=4",
)
_CONVNET = (
    "data=digits",
    "data.resize=32",
    "data.batch_size=128",
    "model=convnet",
    "model.input_shape=[1,32,32]",
    "model.channels=64",
    "model.depth=3",
    "model.lr=0.003",
    "trainer.check_val_every_n_epoch=2",
)
_LM_MIRRORS = "a GPU cluster training a few-hundred-million-parameter model over 10 GbE (communication > compute)"
_CONV_MIRRORS = "data-parallel convnet training on a fast network (compute >> communication)"

SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario(
            name="homogeneous",
            description="2 nodes x 2 ranks, no link limit, no stragglers (overhead check)",
            nodes=2, procs_per_node=2, overrides=_LM, steps=150, quick_steps=40, target=0.34, quick_target=0.27,
            mirrors=_LM_MIRRORS,
        ),
        Scenario(
            name="slow_link",
            description="2 nodes x 2 ranks, 100 Mbit/s between nodes, transformer LM",
            nodes=2, procs_per_node=2, link_mbit=100.0, overrides=_LM, steps=150, quick_steps=40, target=0.34,
            quick_target=0.27, mirrors=_LM_MIRRORS,
        ),
        Scenario(
            name="straggler",
            description="4 ranks on one node, rank 3 persistently 1.5x slower (pauses 0.5x its compute each step)",
            nodes=1, procs_per_node=4, schedule="3:1.5@0-1", overrides=_CONVNET, steps=400, quick_steps=120,
            target=0.95, quick_target=0.90, mirrors=_CONV_MIRRORS,
        ),
        Scenario(
            name="jitter",
            description="4 ranks on one node, each step each rank pauses 4x its compute time with p=0.1",
            nodes=1, procs_per_node=4, jitter="0.1:4", overrides=_CONVNET, steps=400, quick_steps=120, target=0.95,
            quick_target=0.90, mirrors=_CONV_MIRRORS,
        ),
        Scenario(
            name="mid_run_straggler",
            description="4 ranks on one node, rank 3 2x slower from 1/3 to 2/3 of training",
            nodes=1, procs_per_node=4, schedule="3:2@0.333-0.667", overrides=_CONVNET, steps=400, quick_steps=120,
            target=0.95, quick_target=0.90, mirrors=_CONV_MIRRORS,
        ),
        Scenario(
            name="smoke",
            description="CI smoke test: 2 ranks on loopback, digits MLP, a few steps (not a measurement)",
            nodes=1, procs_per_node=2, netns=False,
            overrides=("data=digits", "model=digits_mlp", "trainer.val_check_interval=5"),
            steps=10, quick_steps=10, target=0.3, quick_target=0.3, ideal_s=4, quick_ideal_s=4,
        ),
    )
}  # fmt: skip


def lookup(name: str) -> Scenario | None:
    """The scenario a results folder names: a built-in one, or one made by :meth:`Scenario.with_link`."""
    if name in SCENARIOS:
        return SCENARIOS[name]
    base, _, rate = name.rpartition("_")
    if base in SCENARIOS and rate.endswith("mbit"):
        try:
            return SCENARIOS[base].with_link(float(rate[: -len("mbit")].replace("p", ".")))
        except ValueError:
            return None
    return None

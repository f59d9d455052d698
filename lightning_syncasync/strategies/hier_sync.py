"""``HierSyncStrategy`` (``hier_sync``): full sync inside a node, bounded-delay averaging across nodes.

Flat DDP all-reduces every gradient over the slowest link every step. Here torch's ``DistributedDataParallel`` runs
on the node's process group only (bucketing and overlap with backward kept, all on the fast intra-node links), and
the node replicas are averaged across nodes by :class:`~lightning_syncasync.algorithms.averaging.DelayedAverager`
every ``inter_period`` steps, in the background, its result applied ``max_delay`` steps later as an additive
correction. See that module for the algorithm and the papers.

Checkpoints are taken at a consistent cut (one extra, exact cross-node average applied at once, which also flushes
the compression residuals), so resuming is exact and the saved model is the merged one.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_syncasync.algorithms._comm import broadcast_, destroy_groups, exchange_backend, new_subgroups
from lightning_syncasync.algorithms.averaging.delayed import DelayedAverager, check_settings
from lightning_syncasync.algorithms.comm_hooks import MeasuredAllReduce
from lightning_syncasync.algorithms.compression.compressor import Compressor
from lightning_syncasync.algorithms.stats import Scope, StatsRecorder
from lightning_syncasync.algorithms.topology import Topology
from lightning_syncasync.strategies._checks import check_common, check_node_size
from lightning_syncasync.strategies._merge import MergesBeforeUserHooks
from lightning_syncasync.strategies._one_rank import UnwrappedAtOneRank
from lightning_syncasync.strategies._round_length import RoundLengthReport, round_length
from lightning_syncasync.strategies._sigterm import SigtermScope, node_stop_groups
from lightning_syncasync.strategies._state import CheckpointedAlgorithm, SavesNodeOptimizers
from lightning_syncasync.strategies._validation import AveragesNodes
from lightning_syncasync.strategies._watch import WatchedStrategy
from lightning_syncasync.strategies.options import HierSyncOptions, adopt, resolve_options

log = logging.getLogger(__name__)


class HierSyncStrategy(
    WatchedStrategy,
    AveragesNodes,
    SavesNodeOptimizers,
    CheckpointedAlgorithm,
    MergesBeforeUserHooks,
    UnwrappedAtOneRank,
    DDPStrategy,
):
    """Hierarchical synchronisation for any LightningModule.

    Args:
        inter_period: steps between two cross-node averagings (>= 1). ``None`` (default): decided from what the
            averaging measures, the shortest period whose exchange hides behind the compute of the steps until it
            is applied, with a 1.5x margin, re-decided when the link or the step time drifts
            (:class:`~lightning_syncasync.algorithms.averaging.RoundLength`; logged at setup and at each change, in
            ``SyncMonitor``'s summary). An integer pins it; a pinned period the link cannot hide is warned about
            once, with the numbers (docs/benchmarks.md#self-tuned-round-length-issue-64).
        max_delay: steps a cross-node average may lag before it is applied (>= 0; 0 = synchronous). ``None``
            (default): the shortest delay that hides the measured exchange, at most a period (1 until measured).
        node_size: ranks per node; default from the cluster (``world_size // num_nodes``). A smaller value forms
            virtual nodes, so one machine can exercise the hierarchy (4 processes as 2 nodes of 2).
        virtual_nodes: split each node's ranks into this many virtual nodes instead of giving ``node_size``
            (``virtual_nodes=2`` on one machine of 4 processes: 2 nodes of 2). The registered name
            ``hier_sync_virtual`` sets it to 2, so the string form reaches virtual nodes too.
        compression: compression of the inter-node hop: ``none``, ``fp16``, ``bf16``, ``int8``, ``int4``, ``int2``,
            ``sign`` or ``powersgd`` (with error feedback; see ``algorithms/compression/compressor.py``).
        warmup_steps: steps of flat DDP (gradients all-reduced over every rank) before hierarchical averaging starts,
            as in post-local SGD (Lin et al., 2020): the first steps decide where training goes and are the ones
            local progress hurts most. Default 0: on the full slow_link benchmark 3 and 6 warm-up steps did not
            reliably reach the target sooner (docs/strategies.md, hier_sync's settings).
        options: the expert settings (:class:`~lightning_syncasync.strategies.options.HierSyncOptions`: the outer
            optimizer, compressor arguments, the peer timeout), an instance or a dict; each also works as a keyword.
        **kwargs: everything ``DDPStrategy`` takes (``start_method``, ``find_unused_parameters``, ``timeout``, ...).

    Example::

        Trainer(strategy="hier_sync", accelerator="cpu", devices=4)  # 1 node: plain DDP semantics (it says so)
        Trainer(strategy="hier_sync_virtual", accelerator="cpu", devices=4)  # 2 virtual nodes of 2
        Trainer(strategy=HierSyncStrategy(node_size=2, max_delay=1), accelerator="cpu", devices=4)
    """

    strategy_name = "hier_sync"
    _ckpt_key = "hier_sync"

    def __init__(
        self,
        inter_period: int | None = None,
        max_delay: int | None = None,
        node_size: int | None = None,
        compression: str = "none",
        warmup_steps: int = 0,
        virtual_nodes: int | None = None,
        options: HierSyncOptions | None = None,
        **kwargs: Any,
    ) -> None:
        opts = resolve_options(HierSyncOptions, options, kwargs, "hier_sync")
        check_settings(inter_period, max_delay, opts.outer, opts.outer_lr, opts.outer_momentum, warmup_steps)
        check_common("hier_sync does its own cross-node averaging", compression, opts.compression_options,
                     opts.peer_timeout_s, kwargs, type(self), wraps_ddp=True)  # fmt: skip
        check_node_size(node_size, virtual_nodes)
        super().__init__(**kwargs)
        adopt(self, opts)
        self.inter_period = inter_period
        self.max_delay = max_delay
        self.node_size = node_size
        self.compression = compression
        self.warmup_steps = warmup_steps
        self.virtual_nodes = virtual_nodes
        self.sync_stats = StatsRecorder(mode="hier")
        self.topology: Topology | None = None
        self.averager: DelayedAverager | None = None
        self._node_group: dist.ProcessGroup | None = None
        self._world_grad_group: dist.ProcessGroup | None = None
        self._avg_node_group: dist.ProcessGroup | None = None
        self._cross_group: dist.ProcessGroup | None = None
        self._eval_cross_group: dist.ProcessGroup | None = None
        self._stop_group: dist.ProcessGroup | None = None
        self._sigterm = SigtermScope()
        self._restored: dict[str, Any] | None = None
        self._averager_state: dict[str, Any] | None = None
        self._length_report: RoundLengthReport | None = None

    @override
    def setup_distributed(self) -> None:
        super().setup_distributed()
        # Checks that node_size divides the world (or virtual_nodes each node's ranks).
        topo = Topology.from_cluster(self.world_size, self.num_nodes, self.node_size, self.virtual_nodes)
        self.topology = topo
        if self.world_size == 1:
            rank_zero_warn(
                "hier_sync: one rank, so there is nothing to average and this run trains as plain Lightning at one "
                "device (no DDP wrapper). HINT: with 2 or more devices, node_size=1 (or any divisor of the ranks) "
                "forms virtual nodes on one machine; as a name, strategy='hier_sync_virtual' splits it into 2"
            )
        elif topo.num_nodes == 1:
            # One node: nothing to average across, so every step is plain DDP. A user trying hier_sync on one box
            # would otherwise see DDP's numbers and not know why.
            rank_zero_warn(
                f"hier_sync: all {self.world_size} rank(s) are on one node, so this run is plain DDP (no cross-node "
                "averaging). HINT: node_size=1 (or any divisor of the ranks) forms virtual nodes on one machine; as a "
                "name, strategy='hier_sync_virtual' splits the machine into 2 virtual nodes"
            )
        # Every rank creates every group, in the same order (torch requires it). DDP and the averager get separate
        # node groups so that their collectives never interleave on one group.
        self._node_group = new_subgroups(topo.all_nodes())
        if self.warmup_steps > 0:
            self._world_grad_group = dist.new_group()  # DDP's hook during warm-up: gradients over every rank
        timeout = timedelta(seconds=self.peer_timeout_s)
        # The averager's groups: its compressed rounds run on a thread (exchange_backend).
        backend = exchange_backend()
        self._avg_node_group = new_subgroups(topo.all_nodes(), timeout=timeout, backend=backend)
        self._cross_group = new_subgroups(topo.all_cross_node(), timeout=timeout, backend=backend)
        # Validation's mean of the node replicas: its own group, since compressed rounds use _cross_group from a
        # thread at any time.
        self._eval_cross_group = new_subgroups(topo.all_cross_node(), timeout=timeout)
        # Lightning's per-step SIGTERM broadcast over the world would put the nodes back in lockstep: the node
        # stops together instead (strategies/_sigterm.py).
        self._stop_group = node_stop_groups(topo, timeout)

    @override
    def _setup_model(self, model: Module) -> Module:
        if self._unwrap_at_one_rank("hier_sync"):
            return model
        device_ids = self.determine_ddp_device_ids()
        return DistributedDataParallel(
            module=model, device_ids=device_ids, process_group=self._node_group, **self._ddp_kwargs
        )

    @override
    def _register_ddp_hooks(self) -> None:
        # Measure DDP's intra-node gradient all-reduce (registered on every device type, unlike Lightning's hooks).
        if not isinstance(self.model, DistributedDataParallel):
            return  # one rank: no DDP, nothing to measure
        if self.warmup_steps == 0:
            MeasuredAllReduce(self.sync_stats, scope="intra", process_group=self._node_group).register(self.model)
            return
        # With a warm-up, the hook all-reduces over every rank until the averager says it is over (torch's
        # post_localSGD_hook, the other way round: DDP is built on the node group, the hook widens it).
        assert self.topology is not None
        spans, alone = self.topology.num_nodes > 1, self.topology.node_size == 1

        def scope() -> Scope | None:
            if self._in_warmup():
                return "inter" if spans else "intra"
            return None if alone else "intra"  # a one-rank node's all-reduce moves nothing

        MeasuredAllReduce(
            self.sync_stats, scope=scope, process_group=self._node_group, inner_hook=_warmup_hook, inner_state=self
        ).register(self.model)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return  # not fitting: nothing to average
        assert self.topology is not None and self.lightning_module is not None
        module = self.lightning_module
        tensors = [p for p in module.parameters()] + [b for b in module.buffers() if b.is_floating_point()]
        # DDP broadcasts the initial weights inside the node group only; the nodes must start from one model too.
        with torch.no_grad():
            for t in tensors:
                broadcast_(t.data, 0)
        self.averager = DelayedAverager(
            tensors,
            cross_group=self._cross_group,
            node_group=self._avg_node_group,
            local_rank=self.topology.local_rank_of(self.global_rank),
            node_size=self.topology.node_size,
            num_nodes=self.topology.num_nodes,
            inter_period=self.inter_period,
            max_delay=self.max_delay,
            outer=self.outer,
            outer_lr=self.outer_lr,
            outer_momentum=self.outer_momentum,
            recorder=self.sync_stats,
            compressor=Compressor(self.compression, seed=self.global_rank, **self.compression_options),  # type: ignore[arg-type]
            timeout_s=self.peer_timeout_s,
            warmup_steps=self.warmup_steps,
            length=round_length(self.inter_period, 1.0, min_steps=1),
        )
        if self._restored is not None:
            self.averager.load_state_dict(self._restored)  # after the broadcast: the weights are the checkpoint's
            self._restored = None
        if self.topology.num_nodes > 1:
            self._length_report = RoundLengthReport(self.averager.length, "hier_sync")
        self._sigterm.install(trainer, self._stop_group)

    def _nodes_apart(self) -> bool:
        return self.averager is not None

    def _node_cross_group(self) -> dist.ProcessGroup | None:
        return self._eval_cross_group  # validation's; the averager's own may have a compressed round's thread on it

    def _algorithm(self) -> Any | None:
        return self.averager

    def _in_warmup(self) -> bool:
        # Before the averager exists (DDP's first forward/backward happens after setup) it is step 0.
        return self.warmup_steps > 0 and (self.averager is None or self.averager.in_warmup)

    @override
    def summary_notes(self) -> list[str]:
        """What SyncMonitor's summary header should say about this run (a one-node run is plain DDP)."""
        topo = self.topology
        if topo is None or topo.num_nodes > 1:
            return [self._length_report.note()] if self._length_report is not None else []
        what = "plain Lightning at one device" if self.world_size == 1 else "plain DDP"
        return [
            f"one node: every step was {what}, nothing was averaged across nodes. HINT: on one machine with 2 or "
            "more devices, strategy=hier_sync_virtual (or node_size=N) splits the ranks into virtual nodes"
        ]

    def teardown(self) -> None:
        # Wait for in-flight communication before the process groups go away.
        try:
            if self.averager is not None:
                self.averager.close()
        finally:
            self.averager = None
            self._sigterm.undo()
        super().teardown()
        destroy_groups(
            self._node_group, self._world_grad_group, self._avg_node_group, self._cross_group, self._eval_cross_group,
            self._stop_group,
        )  # fmt: skip
        self._node_group = self._world_grad_group = self._avg_node_group = None
        self._cross_group = self._eval_cross_group = self._stop_group = None


def _warmup_hook(strategy: HierSyncStrategy, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the mean gradient over every rank during the warm-up, over the node after it."""
    group = strategy._world_grad_group if strategy._in_warmup() else strategy._node_group
    return allreduce_hook(group, bucket)

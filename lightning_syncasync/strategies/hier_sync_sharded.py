"""``ShardedHierSyncStrategy`` (``hier_sync_sharded``): FSDP2 inside a node, bounded-delay averaging across nodes.

``hier_sync`` keeps a full replica of the model, its gradients and its optimizer state on every rank. A model that
does not fit one device is sharded inside the node instead, with FSDP2 (``torch.distributed.fsdp.fully_shard``) over
the node's ranks through Lightning's own FSDP2 path (``ModelParallelStrategy``: the LightningModule shards itself
in ``configure_model``, checkpoints are distributed). The nodes then train apart between averagings as in
``hier_sync``: every ``inter_period`` steps :class:`~lightning_syncasync.algorithms.averaging.DelayedAverager`
averages the node models across nodes, applied ``max_delay`` steps later, with the same outer optimizers and
compression.

Why the averager needs nothing new: FSDP2 shards every parameter along its first dimension over the node's ranks,
in the same layout on every node, so local rank ``i`` of every node holds the same slices of the model. Averaging
the node models is then averaging each local rank's shard with the same local rank's shard on the other nodes: the
averager's cross-node exchange of ``hier_sync``, given this rank's local shards as its whole model (``node_size=1``
from its point of view: there is no replica inside the node to all-gather the result to). With
``inter_period=1``, ``max_delay=0`` and plain averaging this equals FSDP over all ranks step by step
(``tests/strategies/test_hier_sync_sharded.py``).

The LightningModule's ``configure_model`` shards over ``self.device_mesh["data_parallel"]``, the node's ranks here
(over every rank under Lightning's ``ModelParallelStrategy``), so one module runs under both. The mesh also has a
``"replicate"`` dimension across nodes (what HSDP would all-reduce every step; this strategy averages across it
itself) and a ``"tensor_parallel"`` dimension of size 1.

Checkpoints are Lightning's distributed checkpoints (a folder, every rank writing its shards), taken at a
consistent cut as in ``hier_sync``; each rank's averager state (outer momentum of its shard, compression state)
is written beside them as ``syncasync_averager_rank{R}.pt``, so a resume on the same layout is exact.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_syncasync.algorithms._comm import destroy_groups, new_subgroups
from lightning_syncasync.algorithms.averaging.delayed import DelayedAverager, check_settings
from lightning_syncasync.algorithms.compression.compressor import Compressor
from lightning_syncasync.algorithms.fsdp_comm import measure_fsdp_collectives
from lightning_syncasync.algorithms.stats import StatsRecorder
from lightning_syncasync.algorithms.topology import Topology
from lightning_syncasync.strategies._checks import check_common, check_no_kwargs, check_node_size
from lightning_syncasync.strategies._merge import MergesBeforeUserHooks
from lightning_syncasync.strategies._optim import local_part, unwrap_optimizer
from lightning_syncasync.strategies._sharded import ShardsInsideNodes, check_sharded_settings
from lightning_syncasync.strategies._sigterm import SigtermScope, node_stop_groups
from lightning_syncasync.strategies._validation import AveragesNodes
from lightning_syncasync.strategies._watch import WatchedStrategy
from lightning_syncasync.strategies.options import HierSyncOptions, adopt, resolve_options


class ShardedHierSyncStrategy(
    ShardsInsideNodes, WatchedStrategy, AveragesNodes, MergesBeforeUserHooks, ModelParallelStrategy
):
    """Hierarchical synchronisation of a model sharded inside each node (module docstring).

    Args:
        inter_period, max_delay, node_size, virtual_nodes, compression, options: as
            :class:`~lightning_syncasync.strategies.HierSyncStrategy` (each option also works as a keyword).
            A node here must hold at least 2 ranks (a node of one rank has nothing to shard over).
        start_method: ``"popen"`` (Lightning's default for ``ModelParallelStrategy``: the script is run again once
            per rank), ``"fork"`` or ``"spawn"`` (the processes are started from this one, as ``ddp_spawn`` does;
            the main process gets the merged model back after ``fit``). Ignored under torchrun or SLURM, which
            start the processes themselves.
        hsdp: the synchronous baseline instead of averaging: FSDP2's own HSDP, sharded inside the node and
            replicated across nodes with an all-reduce of the gradient shards every step (no averager). The
            module shards over ``self.device_mesh[self.trainer.strategy.shard_dims]`` (the demos do), which is
            ``("replicate", "data_parallel")`` here.
        process_group_backend, timeout: as ``ModelParallelStrategy``.

    Example::

        class LM(LightningModule):
            def configure_model(self):
                for block in self.blocks:
                    fully_shard(block, mesh=self.device_mesh["data_parallel"])
                fully_shard(self, mesh=self.device_mesh["data_parallel"])

        Trainer(strategy=ShardedHierSyncStrategy(inter_period=4), accelerator="cpu", devices=2, num_nodes=2)
    """

    strategy_name = "hier_sync_sharded"
    _ckpt_key = "hier_sync_sharded"
    _rank_state_prefix = "syncasync_averager"

    def __init__(
        self,
        inter_period: int = 4,
        max_delay: int = 1,
        node_size: int | None = None,
        virtual_nodes: int | None = None,
        compression: str = "none",
        hsdp: bool = False,
        start_method: Literal["popen", "fork", "spawn"] = "popen",
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        options: HierSyncOptions | None = None,
        **kwargs: Any,
    ) -> None:
        opts = resolve_options(HierSyncOptions, options, kwargs, "hier_sync_sharded")
        check_no_kwargs(type(self), kwargs)
        check_settings(inter_period, max_delay, opts.outer, opts.outer_lr, opts.outer_momentum)
        check_common("hier_sync_sharded does its own cross-node averaging", compression, opts.compression_options,
                     opts.peer_timeout_s, {}, type(self), wraps_ddp=False)  # fmt: skip
        check_node_size(node_size, virtual_nodes)
        check_sharded_settings(node_size, start_method)
        if hsdp and compression != "none":
            raise ValueError(
                f"compression={compression!r} with hsdp=True: HSDP all-reduces the gradient shards with FSDP2's own "
                "collective, which this strategy does not compress; HINT: drop hsdp to average compressed node models "
                "every inter_period steps, or drop compression"
            )
        super().__init__(process_group_backend=process_group_backend, timeout=timeout)
        adopt(self, opts)
        self.inter_period = inter_period
        self.max_delay = max_delay
        self.node_size = node_size
        self.virtual_nodes = virtual_nodes
        self.compression = compression
        self.start_method = start_method
        self.hsdp = hsdp
        self.sync_stats = StatsRecorder(mode="sync" if hsdp else "hier")
        self.topology: Topology | None = None
        self.averager: DelayedAverager | None = None
        self._cross_group: dist.ProcessGroup | None = None
        self._eval_cross_group: dist.ProcessGroup | None = None  # validation's, apart from the averager's
        self._stop_group: dist.ProcessGroup | None = None  # the node's SIGTERM check (strategies/_sigterm.py)
        self._sigterm = SigtermScope()

    # -- groups -------------------------------------------------------------------------------------------------

    @override
    def _make_groups(self, topo: Topology, timeout: timedelta) -> None:
        super()._make_groups(topo, timeout)
        self._eval_cross_group = new_subgroups(topo.all_cross_node(), timeout=timeout)
        self._stop_group = None if self.hsdp else node_stop_groups(topo, timeout)

    @property
    @override
    def shard_dims(self) -> tuple[str, ...]:
        """The mesh dimensions a module shards over: the node's ranks, or with ``hsdp`` the 2-D (replicate, shard)
        mesh of FSDP2's HSDP."""
        return ("replicate", "data_parallel") if self.hsdp else ("data_parallel",)

    # -- training ----------------------------------------------------------------------------------------------

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        assert self.lightning_module is not None
        # FSDP's own traffic inside the node (parameter all-gathers, gradient reduce-scatters), in the same record
        # as the averager's cross-node rounds.
        measure_fsdp_collectives(self.lightning_module, self.sync_stats, scope="intra", hsdp=self.hsdp)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        if self.hsdp:
            self._check_sharded(self.device_mesh[self.shard_dims])  # FSDP2 itself keeps the nodes in step
            return
        assert self.topology is not None
        self.averager = DelayedAverager(
            self._local_shards(),
            cross_group=self._cross_group,
            node_group=None,  # no replica inside the node: each rank averages its own shard (module docstring)
            local_rank=0,
            node_size=1,
            num_nodes=self.topology.num_nodes,
            inter_period=self.inter_period,
            max_delay=self.max_delay,
            outer=self.outer,
            outer_lr=self.outer_lr,
            outer_momentum=self.outer_momentum,
            recorder=self.sync_stats,
            compressor=Compressor(self.compression, seed=self.global_rank, **self.compression_options),  # type: ignore[arg-type]
            timeout_s=self.peer_timeout_s,
        )
        # The nodes run apart between averages; Lightning's per-step SIGTERM broadcast would put them back in lockstep
        # (with hsdp, FSDP2's cross-node all-reduce does that anyway, and Lightning's check stays).
        self._sigterm.install(trainer, self._stop_group)

    # -- checkpoints -------------------------------------------------------------------------------------------

    @override
    def _rank_state(self) -> dict[str, Any] | None:
        if self.averager is None:
            return None
        state = self.averager.state_dict()  # after the cut of lightning_module_state_dict: nothing in flight
        state["optimizers"] = [_local_optimizer_state(unwrap_optimizer(o)) for o in self.optimizers]
        return state

    @override
    def _restore_rank_state(self, state: dict[str, Any]) -> None:
        if self.averager is None:
            return
        # The weights were loaded into the shards by now; take them afresh, in case loading replaced a tensor.
        self.averager.tensors = self._local_shards_unchecked()
        self.averager.load_state_dict(state)
        for optimizer, saved in zip(self.optimizers, state.get("optimizers", []), strict=False):
            _load_local_optimizer_state(unwrap_optimizer(optimizer), saved)

    @override
    def teardown(self) -> None:
        try:
            if self.averager is not None:
                self.averager.close()
        finally:
            self.averager = None
            self._sigterm.undo()
        super().teardown()
        destroy_groups(self._eval_cross_group, self._stop_group)
        self._eval_cross_group = self._stop_group = None


def _local_optimizer_state(optimizer: Optimizer) -> list[dict[str, torch.Tensor]]:
    """This rank's shards of ``optimizer``'s per-parameter state, in parameter order.

    The nodes train apart between averagings, each with its own optimizer (Adam's moments differ from node to node).
    The distributed checkpoint cannot hold that: it takes the shards at the same place of every node for copies of
    one another and writes one. Measured before this: a resume from it restarted every node with node 0's moments
    (Adam's ``exp_avg`` norm 0.0463 against the run's 0.0502), and the resumed run left the uninterrupted one by 0.04
    at its first step. So each rank keeps its own shards beside the checkpoint."""
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            out.append(
                {k: local_part(v).detach().clone() for k, v in optimizer.state.get(p, {}).items() if torch.is_tensor(v)}
            )
    return out


@torch.no_grad()
def _load_local_optimizer_state(optimizer: Optimizer, saved: list[dict[str, torch.Tensor]]) -> None:
    """Put this rank's saved shards (:func:`_local_optimizer_state`) into ``optimizer``'s state, which the
    distributed checkpoint has already filled with node 0's (same shapes: the layout was checked)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if len(params) != len(saved):
        raise ValueError(
            f"the checkpoint holds optimizer state for {len(saved)} parameters, this optimizer has {len(params)}; "
            "HINT: resume with the same model and optimizer"
        )
    for p, values in zip(params, saved, strict=True):
        state = optimizer.state.get(p, {})
        for k, v in values.items():
            if k not in state:
                raise ValueError(f"optimizer state {k!r} is missing after loading; HINT: resume with the same one")
            local_part(state[k]).copy_(v)

"""``ShardedAsyncSSPStrategy`` (``async_ssp_sharded``): round-level async training of a model sharded inside each node.

``async_ssp``'s rounds (async local SGD, :class:`~lightning_syncasync.algorithms.averaging.RoundExchange`) with a node
as the learner instead of a rank: FSDP2 shards the model, its gradients and its optimizer state over the node's ranks
(Lightning's ``ModelParallelStrategy`` path: the LightningModule shards itself in ``configure_model`` over
``self.device_mesh["data_parallel"]``), the node takes its local steps together, and every round each rank sends the
pseudo-gradient of its shard to the same shard on the other nodes, in the background, at most ``staleness`` rounds late.
So the nodes never train in lockstep across the slow link, and a slow node takes fewer local steps per round
instead of pacing the others (dynamic local steps, as in ``async_ssp``).

What it takes from the sharding (``strategies/_sharded.py``): FSDP2 lays every parameter out the same way on every
node, so a round's arithmetic on each rank's local shards, over the group of the same local rank on every node, is
the round of the whole node models. What it adds to ``RoundExchange``: a node's ranks must end each round at the same
step (each of their FSDP collectives needs all of them), so each round-end decision is agreed inside the node (one
all-reduce MAX of a flag per step over a group of the node's ranks).

At a consistent cut (validation, checkpoints, the end of fit) every round is delivered, the shards are made node 0's
(over each shard's group) and so is the optimizer state, shard by shard: every node then holds the same model and
state, which is what Lightning's distributed checkpoint writes (the same shard of every node, once). Each rank's
round state (counters, the outer optimizer's momentum of its shard, compression residuals) goes beside it as
``syncasync_rounds_rank{R}.pt``, so a resume on the same layout is exact.

Not here: the per-step mode of ``async_ssp`` (``local_steps=1``; a node's gradients are FSDP's reduce-scattered
shards, exchanged inside the node every step), and ``claim_batches`` (a node's ranks must take the same batches count,
which per-rank claiming would break): every rank reads its share of each epoch, and epoch ends are cuts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
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
from lightning_syncasync.algorithms.averaging.outer import OuterOptimizer, check_outer
from lightning_syncasync.algorithms.averaging.rounds import RoundExchange, check_rounds
from lightning_syncasync.algorithms.compression.compressor import Compressor
from lightning_syncasync.algorithms.fsdp_comm import measure_fsdp_collectives
from lightning_syncasync.algorithms.stats import StatsRecorder
from lightning_syncasync.algorithms.topology import Topology
from lightning_syncasync.strategies._async_cuts import CutsAtLightningHooks, LocalReduceWhileAsync
from lightning_syncasync.strategies._async_step import (
    as_divergence,
    check_async_fit,
    finite_closure,
    what_is_checked,
)
from lightning_syncasync.strategies._checks import check_common, check_no_kwargs, check_node_size
from lightning_syncasync.strategies._merge import MergesBeforeUserHooks
from lightning_syncasync.strategies._optim import broadcast_optimizer_state
from lightning_syncasync.strategies._round_length import round_length
from lightning_syncasync.strategies._sharded import ShardsInsideNodes, check_sharded_settings
from lightning_syncasync.strategies._sigterm import SigtermScope, node_stop_groups
from lightning_syncasync.strategies._watch import WatchedStrategy
from lightning_syncasync.strategies.options import (
    AsyncSSPOptions,
    adopt,
    resolve_options,
    unused_fields,
)

_PER_STEP = ("compensation", "lam", "round_interval_s", "exchange_every")  # AsyncSSPOptions of per-step mode

log = logging.getLogger(__name__)


class ShardedAsyncSSPStrategy(
    ShardsInsideNodes,
    WatchedStrategy,
    LocalReduceWhileAsync,
    CutsAtLightningHooks,
    MergesBeforeUserHooks,
    ModelParallelStrategy,
):
    """Round-level asynchronous training of a model sharded inside each node (module docstring).

    Args:
        staleness, local_steps, compression: as :class:`~lightning_syncasync.strategies.AsyncSSPStrategy` in its
            round mode; ``local_steps`` must be 2 or more (rounds), and a round's local steps are the node's.
        node_size, virtual_nodes: ranks per node, or virtual nodes per machine, as ``hier_sync``; a node must hold at
            least 2 ranks (a node of one rank has nothing to shard over).
        start_method: ``"popen"`` (Lightning's default for ``ModelParallelStrategy``), ``"fork"`` or ``"spawn"`` (the
            main process gets the merged model back), as ``hier_sync_sharded``.
        process_group_backend, timeout: as ``ModelParallelStrategy``.
        options: the expert settings of the rounds (:class:`~lightning_syncasync.strategies.options.AsyncSSPOptions`
            less its per-step fields), an instance or a dict; each also works as a keyword.

    Example::

        Trainer(strategy=ShardedAsyncSSPStrategy(local_steps=8, compression="int8"), accelerator="cpu", devices=2,
                num_nodes=2)
    """

    strategy_name = "async_ssp_sharded"
    _ckpt_key = "async_ssp_sharded"
    _rank_state_prefix = "syncasync_rounds"

    def __init__(
        self,
        staleness: int = 1,
        local_steps: int | None = None,
        compression: str = "none",
        node_size: int | None = None,
        virtual_nodes: int | None = None,
        start_method: Literal["popen", "fork", "spawn"] = "popen",
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        options: AsyncSSPOptions | None = None,
        **kwargs: Any,
    ) -> None:
        opts = resolve_options(AsyncSSPOptions, options, kwargs, "async_ssp_sharded")
        check_no_kwargs(type(self), kwargs)
        unused_fields(
            opts, _PER_STEP, "async_ssp_sharded", "they set async_ssp's per-step mode, and this trains in rounds"
        )
        check_rounds(local_steps, staleness, opts.round_s)
        if local_steps == 1:  # None: decided from the measured link, 2 or more
            raise ValueError(
                "local_steps=1 is async_ssp's per-step mode (every gradient exchanged), which async_ssp_sharded does "
                "not run: a node's gradients are FSDP's shards, reduced inside the node at every step; HINT: "
                "local_steps=2 or more (rounds), or async_ssp with replicas for per-step exchange"
            )
        check_outer(opts.outer, opts.outer_lr, opts.outer_momentum, opts.outer_momentum_every)
        check_common("async_ssp_sharded does its own cross-node exchange", compression, opts.compression_options,
                     opts.peer_timeout_s, {}, type(self), wraps_ddp=False)  # fmt: skip
        check_node_size(node_size, virtual_nodes)
        check_sharded_settings(node_size, start_method)
        super().__init__(process_group_backend=process_group_backend, timeout=timeout)
        adopt(self, opts)
        self.staleness = staleness
        self.local_steps = local_steps
        self.compression = compression
        self.node_size = node_size
        self.virtual_nodes = virtual_nodes
        self.start_method = start_method
        self.sync_stats = StatsRecorder(mode="async")
        self.topology: Topology | None = None
        self.exchange = None  # LocalReduceWhileAsync's per-step exchange: never here
        self.rounds: RoundExchange | None = None
        self._optimizer: Optimizer | None = None
        self._params: list[torch.Tensor] = []
        self._sigterm = SigtermScope()
        self._cross_group: dist.ProcessGroup | None = None
        self._node_group: dist.ProcessGroup | None = None
        self._stop_group: dist.ProcessGroup | None = None

    @override
    def _make_groups(self, topo: Topology, timeout: timedelta) -> None:
        super()._make_groups(topo, timeout)
        # The node's ranks, for the round-end agreement only (FSDP's own collectives run on the mesh's groups). On
        # gloo whatever the default backend: the agreement is one host flag per step, and over NCCL it would put a
        # kernel on the GPU and a host sync (reading the flag back) into every step.
        self._node_group = new_subgroups(topo.all_nodes(), timeout=timeout, backend="gloo")
        # The node's SIGTERM check (strategies/_sigterm.py): its ranks run FSDP2's collectives together at every
        # step, so they stop together; a group of its own, as the rounds use theirs from their thread.
        self._stop_group = node_stop_groups(topo, timeout)

    # -- training ----------------------------------------------------------------------------------------------

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        module = self.lightning_module
        assert module is not None
        # FSDP's own traffic inside the node, in the same record as the rounds across it.
        measure_fsdp_collectives(module, self.sync_stats, scope="intra", hsdp=False)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        assert self.topology is not None
        self._optimizer = check_async_fit(self.optimizers, self.precision_plugin, self.strategy_name)
        self._params = [p for p in module.parameters() if p.requires_grad]  # manual optimization's check
        self._sigterm.install(trainer, self._stop_group)
        self.rounds = RoundExchange(
            self._local_shards(),
            self._cross_group,
            staleness=self.staleness,
            round_s=self.round_s,
            dynamic=self.dynamic_local_steps,
            outer=OuterOptimizer(self.outer, self.outer_lr, self.outer_momentum, self.outer_momentum_every),  # type: ignore[arg-type]
            compressor=Compressor(self.compression, seed=self.global_rank, **self.compression_options),  # type: ignore[arg-type]
            recorder=self.sync_stats,
            scope="inter",
            timeout_s=self.peer_timeout_s,
            buffers=[b for b in module.buffers() if b.is_floating_point()],
            node_group=self._node_group,
            length=round_length(self.local_steps, self.staleness, min_steps=2),
            should_stop=self._sigterm.requested,
        )
        self.rounds.start()

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        if self.rounds is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        # A local step of the node (FSDP inside it) on fresh gradients; then the round's bookkeeping.
        checked = finite_closure(
            closure, self.global_rank, self.rounds, self._params, what_is_checked(self.lightning_module)
        )
        out = super().optimizer_step(optimizer, checked, model, **kwargs)
        with as_divergence(self.global_rank):
            self.rounds.after_step()
        return out

    # -- consistent cuts (CutsAtLightningHooks) ---------------------------------------------------------------

    @override
    def _equal_optimizer_states(self) -> None:
        if self._optimizer is not None:
            assert self._cross_group is not None
            broadcast_optimizer_state([self._optimizer], dist.get_global_rank(self._cross_group, 0), self._cross_group)

    # -- checkpoints -------------------------------------------------------------------------------------------

    @override
    def _rank_state(self) -> dict[str, Any] | None:
        return self.rounds.state_dict() if self.rounds is not None else None  # after the cut: nothing in flight

    @override
    def _restore_rank_state(self, state: dict[str, Any]) -> None:
        if self.rounds is None:
            return
        # The weights were loaded into the shards by now; take them afresh, in case loading replaced a tensor.
        self.rounds.tensors = self._local_shards_unchecked()
        self.rounds.load_state_dict(state)

    @override
    def teardown(self) -> None:
        try:
            if self.rounds is not None:
                self.rounds.close()
        finally:
            self.rounds = None
            self._sigterm.undo()
        super().teardown()
        destroy_groups(self._node_group, self._stop_group)
        self._node_group = self._stop_group = None

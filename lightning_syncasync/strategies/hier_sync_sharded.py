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

import os
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_syncasync.algorithms._comm import check_same_on_every_rank, destroy_groups
from lightning_syncasync.algorithms.averaging import DelayedAverager, check_settings
from lightning_syncasync.algorithms.compression import Compressor
from lightning_syncasync.algorithms.fsdp_comm import measure_fsdp_collectives
from lightning_syncasync.algorithms.stats import StatsRecorder
from lightning_syncasync.algorithms.topology import Topology
from lightning_syncasync.strategies._checks import check_common, check_node_size
from lightning_syncasync.strategies._merge import MergesBeforeUserHooks
from lightning_syncasync.strategies._optim import unwrap_optimizer
from lightning_syncasync.strategies._validation import AveragesNodes
from lightning_syncasync.strategies._watch import WatchedStrategy

START_METHODS = ("popen", "fork", "spawn")


def averager_file(rank: int) -> str:
    """The file of rank ``rank``'s averager state inside a distributed checkpoint's folder."""
    return f"syncasync_averager_rank{rank}.pt"


class ShardedHierSyncStrategy(WatchedStrategy, AveragesNodes, MergesBeforeUserHooks, ModelParallelStrategy):
    """Hierarchical synchronisation of a model sharded inside each node (module docstring).

    Args:
        inter_period, max_delay, node_size, virtual_nodes, outer, outer_lr, outer_momentum, compression,
            compression_options, peer_timeout_s: as :class:`~lightning_syncasync.strategies.HierSyncStrategy`.
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

    def __init__(
        self,
        inter_period: int = 4,
        max_delay: int = 1,
        node_size: int | None = None,
        outer: Literal["average", "nesterov", "delayed_nesterov"] = "average",
        outer_lr: float = 1.0,
        outer_momentum: float = 0.9,
        compression: str = "none",
        compression_options: dict[str, Any] | None = None,
        peer_timeout_s: float = 60.0,
        virtual_nodes: int | None = None,
        start_method: Literal["popen", "fork", "spawn"] = "popen",
        hsdp: bool = False,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        check_settings(inter_period, max_delay, outer, outer_lr, outer_momentum)
        check_common("hier_sync_sharded does its own cross-node averaging", compression, compression_options,
                     peer_timeout_s, {}, type(self), wraps_ddp=False)  # fmt: skip
        check_node_size(node_size, virtual_nodes)
        if node_size == 1:
            raise ValueError(
                "node_size=1 leaves one rank per node, with nothing to shard over; HINT: use hier_sync (replicas) "
                "for one rank per node, or give each node 2 or more ranks"
            )
        if hsdp and compression != "none":
            raise ValueError(
                f"compression={compression!r} with hsdp=True: HSDP all-reduces the gradient shards with FSDP2's own "
                "collective, which this strategy does not compress; HINT: drop hsdp to average compressed node models "
                "every inter_period steps, or drop compression"
            )
        if start_method not in START_METHODS:
            raise ValueError(f"start_method must be one of {START_METHODS}, got {start_method!r}; HINT: 'fork'")
        super().__init__(process_group_backend=process_group_backend, timeout=timeout)
        self.inter_period = inter_period
        self.max_delay = max_delay
        self.node_size = node_size
        self.virtual_nodes = virtual_nodes
        self.outer = outer
        self.outer_lr = outer_lr
        self.outer_momentum = outer_momentum
        self.compression = compression
        self.compression_options = dict(compression_options or {})
        self.peer_timeout_s = peer_timeout_s
        self.start_method = start_method
        self.hsdp = hsdp
        self.sync_stats = StatsRecorder(mode="sync" if hsdp else "hier")
        self.topology: Topology | None = None
        self.averager: DelayedAverager | None = None
        self._cross_group: dist.ProcessGroup | None = None
        self._eval_cross_group: dist.ProcessGroup | None = None

    # -- processes, mesh and groups ------------------------------------------------------------------------------

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self.start_method == "popen" or self.cluster_environment.creates_processes_externally:
            super()._configure_launcher()
            return
        self._launcher = _MergedWeightsLauncher(self, start_method=self.start_method)

    @override
    def setup_environment(self) -> None:
        # Lightning's own mesh first ("auto": data_parallel over the nodes, tensor_parallel over a node's ranks),
        # then ours in its place: Lightning offers no hook between the process group and its mesh.
        super().setup_environment()
        check_same_on_every_rank(self.strategy_name, self.consistent_settings())
        topo = Topology.from_cluster(self.world_size, self.num_nodes, self.node_size, self.virtual_nodes)
        if topo.node_size == 1:
            raise ValueError(
                f"hier_sync_sharded: {self.world_size} rank(s) on {topo.num_nodes} node(s) is one rank per node, with "
                "nothing to shard over; HINT: use hier_sync (replicas) for one rank per node, or give each node 2 or "
                "more ranks (devices=2 or more, or virtual_nodes/node_size on one machine)"
            )
        if topo.num_nodes == 1:
            rank_zero_warn(
                f"hier_sync_sharded: all {self.world_size} rank(s) are on one node, so this run is plain FSDP (no "
                "cross-node averaging). HINT: virtual_nodes=2 splits the machine into 2 virtual nodes"
            )
        self.topology = topo
        from torch.distributed.device_mesh import init_device_mesh

        # Node-major, as Topology: node i holds ranks i*node_size .. (i+1)*node_size - 1.
        self._device_mesh = init_device_mesh(
            self.root_device.type,
            (topo.num_nodes, topo.node_size, 1),
            mesh_dim_names=("replicate", "data_parallel", "tensor_parallel"),
        )
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh
        # The averager's cross-node groups, used by nothing else (compressed rounds run on a thread of their own),
        # and validation's, apart from them; with the peer timeout, so a lost node fails a round by name.
        timeout = timedelta(seconds=self.peer_timeout_s)
        self._cross_group, _ = dist.new_subgroups_by_enumeration(topo.all_cross_node(), timeout=timeout)
        self._eval_cross_group, _ = dist.new_subgroups_by_enumeration(topo.all_cross_node(), timeout=timeout)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Every rank reads its own data: the nodes train on different samples, and so do a node's ranks (FSDP is
        # data parallel inside the node). Lightning's default would split the data over the data_parallel mesh
        # dimension only, which here is one node, so the nodes would read the same samples.
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @property
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

    def _local_shards(self) -> list[torch.Tensor]:
        """This rank's shards of every parameter, after checking that ``configure_model`` sharded each one over the
        node; the nodes are made to start from node 0's model."""
        assert self._cross_group is not None
        named = self._check_sharded(self.device_mesh["data_parallel"])
        with torch.no_grad():
            shards = [_local(p) for _, p in named]  # views of FSDP's sharded storage: updated in place
            src = dist.get_global_rank(self._cross_group, 0)
            for shard in shards:
                dist.broadcast(shard, src=src, group=self._cross_group)
        return shards

    def _check_sharded(self, mesh: Any) -> list[tuple[str, torch.nn.Parameter]]:
        """The module's named parameters, each checked to be sharded by FSDP2 over ``mesh``."""
        from torch.distributed.tensor import DTensor

        assert self.lightning_module is not None
        named = list(self.lightning_module.named_parameters())
        if not named:
            raise ValueError(
                f"{type(self.lightning_module).__name__} has no parameters to shard; HINT: build the layers in "
                "__init__ or configure_model"
            )
        dims = self.shard_dims if len(self.shard_dims) > 1 else self.shard_dims[0]
        wrong = [n for n, p in named if not isinstance(p, DTensor) or p.device_mesh != mesh]
        if wrong:
            raise ValueError(
                f"hier_sync_sharded: parameter(s) {wrong[:3]}{' ...' if len(wrong) > 3 else ''} are not sharded over "
                f"self.device_mesh[{dims!r}]; HINT: in configure_model call fully_shard(layer, "
                f"mesh=self.device_mesh[{dims!r}]) on each layer and then on the module (the demos read the dims "
                "from self.trainer.strategy.shard_dims)"
            )
        return named

    # -- checkpoints -------------------------------------------------------------------------------------------

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        state = None
        if self.averager is not None:
            assert self.topology is not None
            state = self.averager.state_dict()  # after the cut of lightning_module_state_dict: nothing in flight
            state["optimizers"] = [_local_optimizer_state(unwrap_optimizer(o)) for o in self.optimizers]
            checkpoint[self._ckpt_key] = {"world_size": self.world_size, "node_size": self.topology.node_size}
        super().save_checkpoint(checkpoint, filepath, storage_options)
        if state is not None:
            # Beside the shards, one file per rank (the outer momentum of this rank's shard differs per rank).
            _save_atomic(state, Path(self.broadcast(filepath)) / averager_file(self.global_rank))

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        # Lightning's distributed checkpoint loads the weights and optimizer states into the shards and returns the
        # rest, without "state_dict": WatchedStrategy's check that a file is a Lightning checkpoint does not apply
        # (Lightning's own loader has already refused a folder that is not one).
        checkpoint = ModelParallelStrategy.load_checkpoint(self, checkpoint_path, weights_only)
        layout = checkpoint.get(self._ckpt_key)
        if layout is None or self.averager is None:
            return checkpoint
        assert self.topology is not None
        here = {"world_size": self.world_size, "node_size": self.topology.node_size}
        if layout != here:
            raise ValueError(
                f"the checkpoint's shards are for {layout}, this run has {here}; HINT: resume on the same number of "
                "ranks and nodes"
            )
        path = Path(self.broadcast(checkpoint_path)) / averager_file(self.global_rank)
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} is missing: this rank's averager state; HINT: copy the whole checkpoint folder, every file"
            )
        # The weights were loaded into the shards by now; take them afresh, in case loading replaced a tensor.
        self.averager.tensors = self._local_shards_unchecked()
        state = torch.load(path, weights_only=True)
        self.averager.load_state_dict(state)
        for optimizer, saved in zip(self.optimizers, state.get("optimizers", []), strict=False):
            _load_local_optimizer_state(unwrap_optimizer(optimizer), saved)
        return checkpoint

    def _local_shards_unchecked(self) -> list[torch.Tensor]:
        assert self.lightning_module is not None
        with torch.no_grad():
            return [_local(p) for p in self.lightning_module.parameters()]

    @override
    def teardown(self) -> None:
        if self.averager is not None:
            try:
                self.averager.close()
            finally:
                self.averager = None
        super().teardown()
        destroy_groups(self._cross_group, self._eval_cross_group)
        self._cross_group = self._eval_cross_group = None


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
                {k: _local(v).detach().clone() for k, v in optimizer.state.get(p, {}).items() if torch.is_tensor(v)}
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
            _local(state[k]).copy_(v)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: the local shard of a DTensor (a view of its storage), else ``t``."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def _save_atomic(obj: Any, path: Path) -> None:
    """``torch.save`` to a temporary file in the same folder, then an atomic rename: complete or absent."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class _MergedWeightsLauncher(_MultiProcessingLauncher):
    """Lightning's fork/spawn launcher, returning the whole merged model to the main process.

    Lightning's launcher sends ``lightning_module.state_dict()`` of rank 0 back, which here holds DTensor shards of
    a mesh the main process does not have. The full state dict is assembled from the shards instead (a collective:
    every rank takes part), after the final merge, so the main process's module holds the trained model."""

    @override
    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> _WorkerOutput | None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        strategy = trainer.strategy
        assert strategy.model is not None
        full = get_model_state_dict(strategy.model, options=StateDictOptions(full_state_dict=True))
        if trainer.local_rank != 0:
            return None
        callback = trainer.checkpoint_callback
        best = getattr(callback, "best_model_path", None) if callback else None
        weights_path = None
        if trainer.state.fn == TrainerFn.FITTING:
            weights_path = os.path.join(tempfile.mkdtemp(), ".temp.ckpt")
            torch.save({k: v.detach().cpu() for k, v in full.items() if isinstance(v, torch.Tensor)}, weights_path)
        return _WorkerOutput(best, weights_path, trainer.state, results, self.get_extra_results(trainer))

    @override
    def _recover_results_in_main_process(self, worker_output: _WorkerOutput, trainer: pl.Trainer) -> None:
        # Lightning's version loads through checkpoint_io, which a distributed checkpoint does not use.
        if worker_output.weights_path is not None:
            state = torch.load(worker_output.weights_path, weights_only=True)
            trainer.lightning_module.load_state_dict(state)
            Path(worker_output.weights_path).unlink(missing_ok=True)
            worker_output = worker_output._replace(weights_path=None)
        super()._recover_results_in_main_process(worker_output, trainer)

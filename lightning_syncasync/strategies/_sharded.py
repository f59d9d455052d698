"""What the strategies that shard the model inside each node share (``hier_sync_sharded``, ``async_ssp_sharded``):
processes, the (replicate, data_parallel, tensor_parallel) device mesh, the cross-node groups of each shard, the check
that ``configure_model`` sharded every parameter over the node, each rank's local shards, and per-rank state files
beside Lightning's distributed checkpoints.

Why one shard group per local rank is all the cross-node algorithms need: FSDP2 shards every parameter along its first
dimension over the node's ranks, in the same layout on every node, so local rank ``i`` of every node holds the same
slices of the model. Anything that combines the node models (an average, a round's pseudo-gradients) is then the same
operation on each local rank's shards, over the group of the same local rank on every node.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_syncasync.algorithms._comm import (
    broadcast_,
    check_same_on_every_rank,
    destroy_groups,
    exchange_backend,
    hide_unsplittable_bound_device,
    new_subgroups,
)
from lightning_syncasync.algorithms.compression.compressor import Compressor
from lightning_syncasync.algorithms.topology import Topology
from lightning_syncasync.strategies._optim import local_part
from lightning_syncasync.strategies._state import mean_state

START_METHODS = ("popen", "fork", "spawn")


def check_sharded_settings(node_size: int | None, start_method: str) -> None:
    """Construction-time checks of the sharded strategies' layout settings."""
    if node_size == 1:
        raise ValueError(
            "node_size=1 leaves one rank per node, with nothing to shard over; HINT: use hier_sync (replicas) "
            "for one rank per node, or give each node 2 or more ranks"
        )
    if start_method not in START_METHODS:
        raise ValueError(f"start_method must be one of {START_METHODS}, got {start_method!r}; HINT: 'fork'")


class ShardsInsideNodes:
    """Mixin (first in the bases, before ``WatchedStrategy``) for a strategy whose nodes each shard the model with
    FSDP2 over their ranks, and whose own algorithm combines the node models across nodes, shard by shard (module
    docstring).

    The subclass sets ``start_method``, ``node_size``, ``virtual_nodes`` and ``peer_timeout_s`` in its constructor,
    names its per-rank state file with ``_rank_state_prefix``, says what goes in it (:meth:`_rank_state`,
    :meth:`_restore_rank_state`), and may add process groups in :meth:`_make_groups`.
    """

    strategy_name: str
    _ckpt_key: str
    _rank_state_prefix: str
    start_method: str
    node_size: int | None
    virtual_nodes: int | None
    peer_timeout_s: float
    topology: Topology | None = None
    _cross_group: dist.ProcessGroup | None = None
    _device_mesh: Any  # set here, read by ModelParallelStrategy
    _restore_bound_device: Callable[[], None]  # undoes _setup_distributed's hiding (setup_environment calls it)
    _launcher: Any

    # -- processes, mesh and groups ------------------------------------------------------------------------------

    def _configure_launcher(self) -> None:
        env = self.cluster_environment  # type: ignore[attr-defined]
        assert env is not None
        if self.start_method == "popen" or env.creates_processes_externally:
            super()._configure_launcher()  # type: ignore[misc]
            return
        self._launcher = _MergedWeightsLauncher(self, start_method=self.start_method)  # type: ignore[arg-type]

    def _setup_distributed(self) -> None:
        super()._setup_distributed()  # type: ignore[misc]
        # A gloo job bound to an accelerator (process_group_backend="gloo" on GPUs) cannot give init_device_mesh the
        # split it asks for: hidden until this rank's groups exist (setup_environment puts it back).
        self._restore_bound_device = hide_unsplittable_bound_device()

    def setup_environment(self) -> None:
        # Lightning's own mesh first ("auto": data_parallel over the nodes, tensor_parallel over a node's ranks),
        # then ours in its place: Lightning offers no hook between the process group and its mesh.
        self._restore_bound_device = lambda: None
        try:
            self._setup_meshes_and_groups()
        finally:
            self._restore_bound_device()

    def _setup_meshes_and_groups(self) -> None:
        super().setup_environment()  # type: ignore[misc]
        check_same_on_every_rank(self.strategy_name, self.consistent_settings())  # type: ignore[attr-defined]
        world, num_nodes = self.world_size, self.num_nodes  # type: ignore[attr-defined]
        topo = Topology.from_cluster(world, num_nodes, self.node_size, self.virtual_nodes)
        if topo.node_size == 1:
            raise ValueError(
                f"{self.strategy_name}: {world} rank(s) on {topo.num_nodes} node(s) is one rank per node, with "
                "nothing to shard over; HINT: use hier_sync (replicas) for one rank per node, or give each node 2 or "
                "more ranks (devices=2 or more, or virtual_nodes/node_size on one machine)"
            )
        if topo.num_nodes == 1:
            rank_zero_warn(
                f"{self.strategy_name}: all {world} rank(s) are on one node, so this run is plain FSDP (no cross-node "
                "exchange). HINT: virtual_nodes=2 splits the machine into 2 virtual nodes"
            )
        self.topology = topo
        from torch.distributed.device_mesh import init_device_mesh

        # Node-major, as Topology: node i holds ranks i*node_size .. (i+1)*node_size - 1.
        self._device_mesh = init_device_mesh(
            self.root_device.type,  # type: ignore[attr-defined]
            (topo.num_nodes, topo.node_size, 1),
            mesh_dim_names=("replicate", "data_parallel", "tensor_parallel"),
        )
        module = self.lightning_module  # type: ignore[attr-defined]
        assert module is not None
        module._device_mesh = self._device_mesh
        # Each shard's cross-node group (the same local rank on every node), used by the algorithm only (its rounds
        # run on a thread of their own), with the peer timeout, so a lost node fails a round by name.
        self._make_groups(topo, timedelta(seconds=self.peer_timeout_s))

    def _make_groups(self, topo: Topology, timeout: timedelta) -> None:
        self._cross_group = new_subgroups(topo.all_cross_node(), timeout=timeout, backend=exchange_backend())

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Every rank reads its own data: the nodes train on different samples, and so do a node's ranks (FSDP is
        # data parallel inside the node). Lightning's default would split the data over the data_parallel mesh
        # dimension only, which here is one node, so the nodes would read the same samples.
        return {"num_replicas": self.world_size, "rank": self.global_rank}  # type: ignore[attr-defined]

    @property
    def shard_dims(self) -> tuple[str, ...]:
        """The mesh dimensions a module shards over (the demos read it): the node's ranks."""
        return ("data_parallel",)

    # -- the shards ----------------------------------------------------------------------------------------------

    def _local_shards(self) -> list[torch.Tensor]:
        """This rank's shards of every parameter, after checking that ``configure_model`` sharded each one over the
        node; the nodes are made to start from node 0's model."""
        assert self._cross_group is not None
        named = self._check_sharded(self.device_mesh["data_parallel"])  # type: ignore[attr-defined]
        with torch.no_grad():
            shards = [local_part(p) for _, p in named]  # views of FSDP's sharded storage: updated in place
            src = dist.get_global_rank(self._cross_group, 0)
            for shard in shards:
                broadcast_(shard, src, self._cross_group)
        return shards

    def _local_shards_unchecked(self) -> list[torch.Tensor]:
        module = self.lightning_module  # type: ignore[attr-defined]
        with torch.no_grad():
            return [local_part(p) for p in module.parameters()]

    def _check_sharded(self, mesh: Any) -> list[tuple[str, torch.nn.Parameter]]:
        """The module's named parameters, each checked to be sharded by FSDP2 over ``mesh``."""
        from torch.distributed.tensor import DTensor

        module = self.lightning_module  # type: ignore[attr-defined]
        assert module is not None
        named = list(module.named_parameters())
        if not named:
            raise ValueError(
                f"{type(module).__name__} has no parameters to shard; HINT: build the layers in __init__ or "
                "configure_model"
            )
        dims = self.shard_dims if len(self.shard_dims) > 1 else self.shard_dims[0]
        wrong = [n for n, p in named if not isinstance(p, DTensor) or p.device_mesh != mesh]
        if wrong:
            raise ValueError(
                f"{self.strategy_name}: parameter(s) {wrong[:3]}{' ...' if len(wrong) > 3 else ''} are not sharded "
                f"over self.device_mesh[{dims!r}]; HINT: in configure_model call fully_shard(layer, "
                f"mesh=self.device_mesh[{dims!r}]) on each layer and then on the module (the demos read the dims "
                "from self.trainer.strategy.shard_dims)"
            )
        return named

    # -- per-rank state beside the distributed checkpoint ----------------------------------------------------------

    def rank_state_file(self, rank: int) -> str:
        """The file of rank ``rank``'s algorithm state inside a distributed checkpoint's folder."""
        return f"{self._rank_state_prefix}_rank{rank}.pt"

    def _layout(self) -> dict[str, int]:
        assert self.topology is not None
        return {"world_size": self.world_size, "node_size": self.topology.node_size}  # type: ignore[attr-defined]

    def _rank_state(self) -> dict[str, Any] | None:
        """What this rank writes beside the checkpoint (``None``: nothing, e.g. outside fit)."""
        raise NotImplementedError

    def _restore_rank_state(self, state: dict[str, Any]) -> None:
        """Load what :meth:`_rank_state` wrote, after the shards were loaded (Lightning restores a
        ``ModelParallelStrategy``'s checkpoint after ``setup``, so the algorithm exists by then)."""
        raise NotImplementedError

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        # Lightning's distributed save (every rank writes its shards), then one file per rank beside it: what
        # differs per shard (an outer momentum, compression residuals, a node's optimizer shards), which the
        # distributed checkpoint cannot hold, since it writes the same shard of every node once.
        state = self._rank_state()  # after the cut of lightning_module_state_dict: nothing in flight
        if state is not None:
            checkpoint[self._ckpt_key] = self._layout()
        super().save_checkpoint(checkpoint, filepath, storage_options)  # type: ignore[misc]
        if state is not None:
            folder = Path(self.broadcast(filepath))  # type: ignore[attr-defined]
            _save_atomic(state, folder / self.rank_state_file(self.global_rank))  # type: ignore[attr-defined]

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        from lightning.pytorch.strategies import ModelParallelStrategy

        # Lightning's distributed load puts the weights and optimizer states into the shards and returns the rest,
        # without "state_dict": WatchedStrategy's check that a file is a Lightning checkpoint does not apply
        # (Lightning's own loader has already refused a folder that is not one), hence the direct call.
        checkpoint = ModelParallelStrategy.load_checkpoint(self, checkpoint_path, weights_only)  # type: ignore[arg-type]
        layout = checkpoint.get(self._ckpt_key)
        if layout is None:
            return checkpoint
        here = self._layout()
        if layout["node_size"] != here["node_size"]:
            # Each rank's file holds state cut to its shards of this node size (its node's optimizer shards, an
            # outer momentum, residuals), which another node size cannot take as they are; the weights can: a
            # checkpoint is a consistent cut, so the folder holds the merged model.
            raise ValueError(
                f"the checkpoint's shards are for {layout}, this run has {here}; HINT: resume with "
                f"{layout['node_size']} ranks per node (any number of nodes), or start a new fit from its weights: "
                "torch.distributed.checkpoint.format_utils.dcp_to_torch_save(CKPT_DIR, 'weights.pt'), then "
                "model.load_state_dict(torch.load('weights.pt')['state_dict']) before fit, without ckpt_path (the "
                "optimizer and the step count start afresh)"
            )
        folder = Path(self.broadcast(checkpoint_path))  # type: ignore[attr-defined]
        if layout == here:
            self._restore_rank_state(_load_rank_state(self._rank_state_path(folder, self.global_rank)))
            return checkpoint
        # Another number of nodes of the same size: a rank's shards are where the same local rank's were, on every
        # saved node. It takes their mean (the nodes' optimizer states; the outer momentum, the same on every node)
        # and what compression held back across those nodes, folded so nothing is dropped.
        k = here["node_size"]
        saved_nodes = layout["world_size"] // k
        local = self.global_rank % k  # type: ignore[attr-defined]
        rank_zero_warn(
            f"{self.strategy_name}: the checkpoint is of {saved_nodes} node(s) of {k} ranks, this run has "
            f"{here['world_size'] // k}; each rank starts from the mean of the saved nodes' state for its shards (the "
            "trajectory is no longer the uninterrupted one step for step)"
        )
        states = [_load_rank_state(self._rank_state_path(folder, node * k + local)) for node in range(saved_nodes)]
        self._restore_rank_state(_mean_rank_states(states))
        return checkpoint

    def _rank_state_path(self, folder: Path, rank: int) -> Path:
        path = folder / self.rank_state_file(rank)
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} is missing: rank {rank}'s algorithm state; HINT: copy the whole checkpoint folder, every file"
            )
        return path

    def teardown(self) -> None:
        super().teardown()  # type: ignore[misc]
        destroy_groups(self._cross_group)
        self._cross_group = None


def _mean_rank_states(states: list[dict[str, Any]]) -> dict[str, Any]:
    """The state of the same shards on several saved nodes (node order), for a rank of a run with another number of
    nodes: the mean of everything (:func:`mean_state`), except compression, whose residuals over those nodes (the
    shard's cross-node group) are folded and averaged by :meth:`Compressor.resized_state`."""
    merged = mean_state([{k: v for k, v in s.items() if k != "compression"} for s in states])
    compression = [s["compression"] for s in states if s.get("compression") is not None]
    if compression:
        merged["compression"] = Compressor.resized_state(compression)
    return merged


def _load_rank_state(path: Path) -> dict[str, Any]:
    """A rank's state file, onto the CPU, as Lightning loads a checkpoint: saved from a GPU, its tensors would
    otherwise come back on the saving rank's device index (absent on a smaller machine), allocated on the training
    loop's stream, and the exchange thread that takes a residual from them and drops it would free it under its
    side stream's queued work (the caching allocator knows only the allocating stream). From the CPU, each value is
    copied to the device where it is used: the weights' shards in place, a residual on the exchange's stream."""
    return torch.load(path, map_location="cpu", weights_only=True)


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
        # On one node (the usual spawn job) only rank 0 keeps the full state, gathered a tensor at a time onto the
        # CPU (cpu_offload): without it every rank would assemble the whole model on its device at the end of fit,
        # which a model sharded because it does not fit one device cannot afford. On several nodes each node's
        # main process needs a copy from its local rank 0.
        one_node = trainer.num_nodes == 1
        options = StateDictOptions(full_state_dict=True, cpu_offload=one_node)
        full = get_model_state_dict(strategy.model, options=options)
        if (trainer.global_rank if one_node else trainer.local_rank) != 0:
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

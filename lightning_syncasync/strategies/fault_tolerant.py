"""``FaultTolerantStrategy`` (``hier_sync_ft``, ``async_ssp_ft``): nodes that leave and join a running job.

Each node is its own Lightning job (torchrun or a SLURM step on that node, synchronous DDP inside it) and a torchft
replica group; the groups meet through a Lighthouse (``torchft_lighthouse``) at every round and exchange their
pseudo-gradients over torchft's process group, which is rebuilt whenever the membership changes
(:class:`~lightning_syncasync.algorithms.averaging.elastic.ElasticRounds`: the round, the carried progress of a round
that did not commit, the heal). A node that dies is left out of the next quorum and the others go on without a
restart or a checkpoint reload; a node that starts (restarted by its scheduler, or new) takes the live job's state
from a peer (the weights, the outer optimizer, its inner optimizer and LR schedulers, the step and epoch) and joins
the next round.

Two registered names, one class, because they differ in one setting and both run the same layout:

* ``hier_sync_ft``: rounds of ``local_steps`` steps (hier_sync's ``inter_period``), each round's exchange overlapped
  with the next round's steps (``staleness=1``) or not (``0``).
* ``async_ssp_ft``: rounds of wall-clock length (``local_steps x`` the nodes' mean step time, measured), so a slow
  node takes fewer local steps and reaches each round with the others (async_ssp's dynamic local steps).

Names rather than a ``fault_tolerant=True`` setting on ``hier_sync``/``async_ssp``: the layout differs (here
Lightning's world is one node, and the nodes meet through the Lighthouse; there one world spans every node), so
settings of one (``node_size``, ``batches``, ``min_replicas``, the Lighthouse's address) would be
meaningless in the other, and the launch differs (one job per node, see ``docs/fault_tolerance.md``).

Data: each node reads its own shard of the training set (``REPLICA_GROUP_ID`` of ``NUM_REPLICA_GROUPS``, as
torchft's ``DistributedSampler`` splits it), validation the whole validation set (split over the node's ranks), so
every node validates the same global model on the same data.
"""

from __future__ import annotations

import copy
import logging
import os
import time
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import BatchSampler
from typing_extensions import override

from lightning_syncasync.algorithms._comm import all_reduce_, broadcast_object, destroy_groups
from lightning_syncasync.algorithms.averaging.elastic import (
    LIGHTHOUSE_ENV,
    ElasticRounds,
    ElasticStats,
    check_elastic,
    make_manager,
    require_torchft,
)
from lightning_syncasync.algorithms.averaging.outer import OuterOptimizer, check_outer
from lightning_syncasync.algorithms.comm_hooks import MeasuredAllReduce
from lightning_syncasync.algorithms.compression.summable import SUMMABLE
from lightning_syncasync.algorithms.stats import StatsRecorder
from lightning_syncasync.strategies._checks import check_kwargs
from lightning_syncasync.strategies._ft_launch import (
    NUM_REPLICA_GROUPS_ENV,
    REPLICA_GROUP_ENV,
    _env_int,
    _NamesLighthouse,
    _SkipsOnce,
    check_reachable,
    quiet_torchft_logs,
)
from lightning_syncasync.strategies._merge import MergesBeforeUserHooks
from lightning_syncasync.strategies._optim import unwrap_optimizer
from lightning_syncasync.strategies._sigterm import SigtermScope
from lightning_syncasync.strategies._state import CheckpointedAlgorithm
from lightning_syncasync.strategies._watch import WatchedStrategy
from lightning_syncasync.strategies.options import FaultTolerantOptions, adopt, resolve_options

log = logging.getLogger(__name__)

__all__ = ["FaultTolerantStrategy", "check_reachable"]


class FaultTolerantStrategy(WatchedStrategy, CheckpointedAlgorithm, MergesBeforeUserHooks, DDPStrategy):
    """Round-level averaging across nodes that may leave and join, on torchft (``pip install -e
    ".[ft]"`` in a clone). Launch one job per node (``docs/fault_tolerance.md``); inside a node it is DDP.

    Args:
        local_steps: steps per round (``dynamic_local_steps``: at the nodes' mean speed). Default 4 (hier_sync's
            former fixed ``inter_period``); ``async_ssp_ft`` uses 8. Fixed: the fault-tolerant forms do not yet take
            their length from the measured link as ``hier_sync`` and ``async_ssp`` do (``RoundLength``).
        staleness: ``1`` (default) overlaps each round's exchange with the next round's local steps; ``0`` exchanges
            at the round's end and every node then holds the same model.
        dynamic_local_steps: rounds of wall-clock length, so each node's local steps follow its speed (the
            ``async_ssp_ft`` name sets it).
        min_replicas: the fewest nodes a round may commit with (1: a lone survivor trains on).
        max_replicas: the most nodes there can be (default ``NUM_REPLICA_GROUPS``, else 1 + this node's group id):
            the number of training-data shards.
        replica_group: this node's group id, ``0 .. max_replicas - 1`` (default ``REPLICA_GROUP_ID``, else 0): its
            shard of the training data, and its name at the Lighthouse (a restarted node keeps its id).
        lighthouse: the Lighthouse's address (default ``TORCHFT_LIGHTHOUSE``).
        compression: ``"none"`` (fp32), ``"int8"`` or ``"int4"``: each round's body as codes an all-reduce can sum
            (29% and 17% of fp32's bytes on 2 nodes), with error feedback per node; consistent cuts are exact
            (``ElasticRounds``).
        exchange: ``"elastic"`` (the pack's rounds, above) or ``"torchft_diloco"``: torchft's own
            ``torchft.local_sgd.DiLoCo`` as it is (one fragment, the whole module; outer SGD with Nesterov momentum at
            ``outer_lr``/``outer_momentum``; every ``local_steps`` steps), on the same launch, as the anchor the
            benchmarks compare with. It has no consistent cuts (each node validates its own weights), does not heal
            the inner optimizer or the loop's counters, and ``staleness``/``outer``/``dynamic_local_steps`` do not
            apply to it.
        options: the expert settings (:class:`~lightning_syncasync.strategies.options.FaultTolerantOptions`: the
            outer optimizer, torchft's timeouts, the watchdog's bound inside the node), an instance or a dict; each
            also works as a keyword. ``options.timeout_s`` with the Lighthouse's heartbeat timeout bounds the pause a
            lost node causes: the survivors commit again within ``max(timeout_s, heartbeat) + one round``.
        **kwargs: what ``DDPStrategy`` takes.

    Example::

        # on every node, with TORCHFT_LIGHTHOUSE, REPLICA_GROUP_ID and NUM_REPLICA_GROUPS set:
        Trainer(strategy="hier_sync_ft", accelerator="cpu", devices=2)
        Trainer(strategy=FaultTolerantStrategy(local_steps=8, min_replicas=2), devices=2)
    """

    strategy_name = "hier_sync_ft"
    _ckpt_key = "syncasync_ft"

    def __init__(
        self,
        local_steps: int = 4,
        staleness: int = 1,
        dynamic_local_steps: bool = False,
        min_replicas: int = 1,
        max_replicas: int | None = None,
        replica_group: int | None = None,
        lighthouse: str | None = None,
        compression: Literal["none", "int8", "int4"] = "none",
        exchange: Literal["elastic", "torchft_diloco"] = "elastic",
        options: FaultTolerantOptions | None = None,
        **kwargs: Any,
    ) -> None:
        name = "async_ssp_ft" if dynamic_local_steps else "hier_sync_ft"
        opts = resolve_options(FaultTolerantOptions, options, kwargs, name)
        outer, outer_lr, outer_momentum = opts.outer, opts.outer_lr, opts.outer_momentum
        timeout_s, quorum_timeout_s, connect_timeout_s = opts.timeout_s, opts.quorum_timeout_s, opts.connect_timeout_s
        peer_timeout_s = opts.peer_timeout_s
        require_torchft(name)
        if max_replicas is None and os.environ.get(NUM_REPLICA_GROUPS_ENV):
            max_replicas = _env_int(NUM_REPLICA_GROUPS_ENV, "max_replicas")
        if replica_group is None:
            replica_group = _env_int(REPLICA_GROUP_ENV, "replica_group") if os.environ.get(REPLICA_GROUP_ENV) else 0
        check_elastic(local_steps, staleness, min_replicas, max_replicas)
        check_outer(outer, outer_lr, outer_momentum)
        if not isinstance(replica_group, int) or replica_group < 0:
            raise ValueError(
                f"replica_group must be an integer >= 0, got {replica_group!r}; HINT: 0 for the first node"
            )
        if max_replicas is not None and replica_group >= max_replicas:
            raise ValueError(
                f"replica_group={replica_group} is not below max_replicas={max_replicas} ({NUM_REPLICA_GROUPS_ENV}); "
                f"HINT: number the nodes 0 .. {max_replicas - 1}, or raise max_replicas to the most nodes there can be"
            )
        for setting, value in (("timeout_s", timeout_s), ("quorum_timeout_s", quorum_timeout_s),
                               ("connect_timeout_s", connect_timeout_s),
                               ("peer_timeout_s", peer_timeout_s)):  # fmt: skip
            if not value > 0:
                raise ValueError(f"{setting} must be > 0 seconds, got {value!r}")
        if compression not in ("none", *SUMMABLE):
            raise ValueError(
                f"{name} exchanges its rounds over torchft's process group, whose one managed collective is an "
                f"all-reduce: compression={compression!r} (an all-to-all and an all-gather, or factors) cannot cross "
                f"it; HINT: compression='int8' or 'int4' (summable codes with error feedback per node), 'none' (fp32), "
                "or hier_sync/async_ssp (one world over every node) for every codec"
            )
        for key in ("ddp_comm_hook", "model_averaging_period"):
            if kwargs.get(key):
                raise ValueError(f"{name} does its own cross-node averaging; HINT: drop {key}")
        check_kwargs(type(self), kwargs, wraps_ddp=True)
        super().__init__(**kwargs)
        self.strategy_name = name
        adopt(self, opts)
        self.local_steps, self.staleness, self.dynamic_local_steps = local_steps, staleness, dynamic_local_steps
        self.min_replicas, self.max_replicas, self.replica_group = min_replicas, max_replicas, replica_group
        self.lighthouse = lighthouse
        self.compression = compression
        if exchange not in ("elastic", "torchft_diloco"):
            raise ValueError(
                f"exchange must be 'elastic' or 'torchft_diloco', got {exchange!r}; HINT: 'elastic' is this pack's "
                "rounds, 'torchft_diloco' torchft's own DiLoCo (the benchmarks' anchor)"
            )
        self.exchange = exchange
        self._diloco: Any = None
        self._diloco_healed: dict[str, Any] | None = None  # a live node's counters, taken by a DiLoCo heal
        self.sync_stats = StatsRecorder(mode="hier")
        self.rounds: ElasticRounds | None = None
        self.elastic_stats: ElasticStats | None = None  # the last fit's rounds (kept after teardown)
        self.manager: Any = None
        self._group: dist.ProcessGroup | None = None
        self._sigterm = SigtermScope()
        self._restored: dict[str, Any] | None = None
        self._joined = False
        self._skip_batches = 0
        self._train_samplers: list[_SkipsOnce] = []

    # -- layout ------------------------------------------------------------------------------------------------

    @override
    def setup_environment(self) -> None:
        if self.num_nodes > 1:
            raise ValueError(
                f"{self.strategy_name} runs one job per node, joined through the Lighthouse, but this job spans "
                f"num_nodes={self.num_nodes} in one world (a lost node would end it). HINT: start the same script "
                "on every node with Trainer(num_nodes=1) and REPLICA_GROUP_ID=0,1,..., or use hier_sync/async_ssp "
                "for one world over every node (docs/fault_tolerance.md)"
            )
        super().setup_environment()

    @property
    def num_groups(self) -> int:
        """The training data's shards over nodes: ``max_replicas``, else enough for this node's id."""
        return self.max_replicas if self.max_replicas is not None else self.replica_group + 1

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        module = self.lightning_module
        training = module is not None and module._trainer is not None and module.trainer.training
        if not training:
            # Validation, test, predict: the whole set over this node's ranks, so every node evaluates the same
            # global model on the same data.
            return {"num_replicas": self.world_size, "rank": self.global_rank}
        # Training: this node's shard (torchft's DistributedSampler: rank + ranks_per_node x group id).
        return {
            "num_replicas": self.world_size * self.num_groups,
            "rank": self.global_rank + self.world_size * self.replica_group,
        }

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        dataloader = super().process_dataloader(dataloader)
        module = self.lightning_module
        training = module is not None and module._trainer is not None and module.trainer.training
        batches = getattr(dataloader, "batch_sampler", None)
        if training and isinstance(batches, BatchSampler) and not isinstance(batches.sampler, _SkipsOnce):
            # A joiner starts mid-epoch: its sampler can skip the batches the live nodes have passed (_healed).
            batches.sampler = _SkipsOnce(batches.sampler, batches.batch_size)
            self._train_samplers.append(batches.sampler)
        return dataloader

    # -- setup ---------------------------------------------------------------------------------------------------

    @override
    def _register_ddp_hooks(self) -> None:
        # Measure DDP's gradient all-reduce inside the node (Lightning registers comm hooks on CUDA only).
        if isinstance(self.model, DistributedDataParallel):
            MeasuredAllReduce(self.sync_stats, scope="intra", process_group=None).register(self.model)

    @override
    def setup_distributed(self) -> None:
        super().setup_distributed()
        # The node's own group for the rounds' all-gather of shards (DDP keeps the default group).
        self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.peer_timeout_s))

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        module = self.lightning_module
        assert module is not None
        address = self.lighthouse or os.environ.get(LIGHTHOUSE_ENV)
        if not address:
            raise ValueError(
                f"{self.strategy_name} needs a Lighthouse: lighthouse= is not set and {LIGHTHOUSE_ENV} is empty. "
                f"HINT: start `torchft_lighthouse --min_replicas 1` on one host and set "
                f"{LIGHTHOUSE_ENV}=http://HOST:29510 "
                "on every node (syncasync-train ft=2 starts one, and 2 nodes, on this machine)"
            )
        check_reachable(address, self.connect_timeout_s, self.strategy_name)
        quiet_torchft_logs()
        self._address = address
        self.manager = make_manager(
            self.strategy_name, self.global_rank, self.world_size, f"syncasync_{self.replica_group}", address,
            self.min_replicas, self.timeout_s, self.quorum_timeout_s, self.connect_timeout_s,
        )  # fmt: skip
        if self.exchange == "torchft_diloco":
            self._sigterm.install(trainer, self._group if self.world_size > 1 else None)
            return  # torchft's DiLoCo is built at the start of training (it needs the optimizer)
        named = [(n, p) for n, p in module.named_parameters()]
        named += [(n, b) for n, b in module.named_buffers() if b.is_floating_point()]
        self.rounds = ElasticRounds(
            [t for _, t in named],
            self.manager,
            names=[n for n, _ in named],
            node_group=self._group,
            local_rank=self.global_rank,
            node_size=self.world_size,
            local_steps=self.local_steps,
            staleness=self.staleness,
            outer=OuterOptimizer(self.outer, self.outer_lr, self.outer_momentum),
            dynamic=self.dynamic_local_steps,
            recorder=self.sync_stats,
            extra_state=(self._save_extra, self._load_extra),
            on_heal=self._healed,
            cut_timeout_s=self.quorum_timeout_s,
            counters=[b for b in module.buffers() if not b.is_floating_point()],
            compression=self.compression,
        )
        self.elastic_stats = self.rounds.stats
        if self._restored is not None:  # a checkpoint read before setup (Lightning's order for some loaders)
            _Checkpointed(self).load_state_dict(self._restored)
            self._restored = None
        self._joined = False
        stop = self._group if self.world_size > 1 else None
        self._sigterm.install(trainer, stop)  # the node stops together; the other nodes go on without it

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        # After a checkpoint was restored (Lightning restores after setup): a live job's state wins over it.
        if self.exchange == "torchft_diloco" and self.manager is not None and self._diloco is None:
            self._start_diloco()
        if self.rounds is not None and not self._joined:
            self._joined = True
            with self._named_errors():
                self.rounds.join()
            present = self.rounds.last_participants
            rank_zero_info(
                f"{self.strategy_name}: node {self.replica_group} joined the job at round "
                f"{self.manager.current_step()} with {present} node(s) present"
                + (" (healed from a live node)" if self.rounds.stats.heals else "")
            )

    def _start_diloco(self) -> None:
        """torchft's DiLoCo as it is: its hooks on the inner optimizer run the quorum and the outer step every
        ``local_steps`` steps, and it registers its own heal state (the backup weights, the outer optimizer)."""
        from torchft.local_sgd import DiLoCo

        module = self.lightning_module
        assert module is not None and len(self.optimizers) == 1, "torchft_diloco: one optimizer"
        inner = unwrap_optimizer(self.optimizers[0])
        outer = torch.optim.SGD(module.parameters(), lr=self.outer_lr, momentum=self.outer_momentum, nesterov=True)
        self._diloco = DiLoCo(
            self.manager, [module], inner, outer, sync_every=self.local_steps, pin_memory=False,
        )  # fmt: skip
        self._diloco.__enter__()
        # A node that joins (or restarts) heals inside DiLoCo's sync. DiLoCo loads the live node's backup weights and
        # outer optimizer, but its sync had already put this node's own stale backup into the model before the
        # heal, so the outer step would land on the wrong weights. Registered after DiLoCo's fragments (torchft loads
        # them in that order), this load puts the healed backup into the model first: the outer step then gives the
        # live node's model bitwise. The inner optimizer and the loop's counters follow in optimizer_step, as local
        # rank 0 took them (each local rank heals from its own peer; the node's ranks must agree).
        self.manager.register_state_dict_fn("syncasync_diloco", self._diloco_load, self._save_extra)
        rank_zero_info(f"{self.strategy_name}: node {self.replica_group} runs torchft's DiLoCo (the anchor)")

    def _diloco_load(self, state: dict[str, Any]) -> None:
        """torchft's call inside DiLoCo's ``should_commit`` when this node heals (after the fragments' loads)."""
        with torch.no_grad():
            for fragment in self._diloco._fragments:
                for name, p in fragment._model_fragment.named_parameters():
                    p.data.copy_(fragment.original_parameters[name])
        self._diloco_healed = state

    def _diloco_after_step(self) -> None:
        """After a DiLoCo sync that healed this node: the inner optimizer, schedulers and counters of local rank
        0 on every rank of the node. torchft decides the heal per local rank: a joiner's ranks all heal, but at step
        0 (every node new, init_sync) each local rank takes its state from a different node, so some ranks of a node
        heal and the others are the source. As in ElasticRounds, the node agrees first (one flag, at syncs only), and
        a source rank's own state stands for the healed one."""
        if self._diloco._local_step != 0:  # not a sync step: no heal can have happened
            return
        self.sync_stats.record_participants(self.manager.num_participants())  # SyncMonitor's timeline shows it
        state, self._diloco_healed = self._diloco_healed, None
        if self.world_size > 1 and self._group is not None:
            flag = torch.tensor([0 if state is None else 1], dtype=torch.int32, device="cpu")  # a host-side flag
            all_reduce_(flag, self._group, dist.ReduceOp.MAX)
            if not int(flag.item()):
                return
            state = broadcast_object(
                state if state is not None else self._save_extra(), dist.get_global_rank(self._group, 0), self._group
            )
        if state is None:
            return
        self._load_extra(state)
        # The node is mid-epoch (it healed at its first sync, not before its first batch): its shard's order for
        # this epoch is already running, so nothing is skipped.
        self._skip_batches = 0
        rank_zero_info(
            f"{self.strategy_name}: node {self.replica_group} healed from a live node at step {state['global_step']}"
        )

    # -- the training step ---------------------------------------------------------------------------------------

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        rounds = self.rounds
        if rounds is None:
            out = super().optimizer_step(optimizer, closure, model, **kwargs)
            if self._diloco is not None:
                self._diloco_after_step()
            return out
        rounds.before_step()
        try:
            out = super().optimizer_step(optimizer, closure, model, **kwargs)
        finally:
            rounds.manager.allow_state_dict_read()
        if not self.optimizers or optimizer is unwrap_optimizer(self.optimizers[-1]):
            with self._named_errors():
                rounds.after_step(samples=1)
            self.sync_stats.record_participants(rounds.last_participants)
        return out

    # -- consistent cuts -----------------------------------------------------------------------------------------

    def _cut(self, stop: bool = False, flush: bool = True) -> None:
        if self.rounds is None or not self._joined:
            return
        start = time.perf_counter()
        with self._named_errors():
            self.rounds.cut(stop=stop, flush=flush)
        self.sync_stats.record_sync_point(time.perf_counter() - start)

    @override
    def on_validation_start(self) -> None:
        module = self.lightning_module
        if module is not None and module.trainer.state.fn == TrainerFn.FITTING:
            # Every node present validates the global model. Compression residuals stay owed (the model is the same
            # on every node with or without them): a validation costs no exact fp32 round.
            self._cut(flush=False)
        super().on_validation_start()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if not self._replicas_merged:
            # A checkpoint is the global model, nothing in flight. Compression residuals stay owed and are not in it
            # (each rank's own shard of one round's rounding): a job resumed from it starts with none, as a joiner.
            self._cut(flush=False)
        return super().lightning_module_state_dict()

    def _merge_replicas(self) -> None:
        self._cut(stop=True)
        if self.rounds is not None:
            st = self.rounds.stats
            present = st.participants or [0]
            rank_zero_info(
                f"{self.strategy_name}: node {self.replica_group}: {st.committed} round(s) committed, {st.failed} not "
                f"(their progress carried into the next), {st.heals} heal(s), {min(present)}-{max(present)} node(s) "
                f"per round, {st.samples_discarded} step(s) discarded by a heal"
            )

    def _algorithm(self) -> Any | None:
        return _Checkpointed(self) if self.rounds is not None else None

    # -- what a joiner takes from a live node --------------------------------------------------------------------

    def _save_extra(self) -> dict[str, Any]:
        """Read by torchft's thread between two optimizer steps: copies, since the training loop goes on."""
        trainer = self.lightning_module.trainer  # type: ignore[union-attr]
        return copy.deepcopy(
            {
                "optimizers": [unwrap_optimizer(o).state_dict() for o in self.optimizers],
                "schedulers": [c.scheduler.state_dict() for c in self.lr_scheduler_configs],
                "global_step": trainer.global_step,
                "epoch": trainer.current_epoch,
                # Batches this node has taken of the current epoch (its own shard): a joiner skips as many of its.
                "batch": trainer.fit_loop.epoch_loop.batch_progress.current.completed,
            }
        )

    def _load_extra(self, state: dict[str, Any]) -> None:
        if len(state["optimizers"]) != len(self.optimizers):
            raise ValueError(
                f"the live node has {len(state['optimizers'])} optimizer(s), this node {len(self.optimizers)}; HINT: "
                "start the node with the same LightningModule and configure_optimizers as the others"
            )
        for opt, saved in zip(self.optimizers, state["optimizers"], strict=True):
            try:
                unwrap_optimizer(opt).load_state_dict(saved)
            except (ValueError, KeyError) as err:
                raise ValueError(
                    f"the live node's optimizer state does not fit this node's optimizer ({err}); HINT: start the "
                    "node with the same configure_optimizers as the others"
                ) from err
        for config, saved in zip(self.lr_scheduler_configs, state["schedulers"], strict=True):
            config.scheduler.load_state_dict(saved)
        self._set_progress(int(state["global_step"]), int(state["epoch"]))
        self._skip_batches = int(state.get("batch", 0))

    def _healed(self, behind: int) -> None:
        trainer = self.lightning_module.trainer  # type: ignore[union-attr]
        if behind:
            self._set_progress(trainer.global_step + behind, trainer.current_epoch)
            self._skip_batches += behind
        # The epoch's first batches of this node's shard are the ones the live nodes' epoch has passed: skipped, so
        # this node's epoch ends with theirs (and nothing of its shard is read twice in the epoch).
        for sampler in self._train_samplers:
            sampler.skip_batches(self._skip_batches)
        self._skip_batches = 0

    def _set_progress(self, global_step: int, epoch: int) -> None:
        """The loop's step and epoch counters, as a live node's: the step decides max_steps and schedulers, the
        epoch the shuffling of the node's shard and max_epochs."""
        loop = self.lightning_module.trainer.fit_loop  # type: ignore[union-attr]
        epoch_loop = loop.epoch_loop
        if self.lightning_module.automatic_optimization:  # type: ignore[union-attr]
            progress = epoch_loop.automatic_optimization.optim_progress.optimizer.step.total
        else:
            progress = epoch_loop.manual_optimization.optim_step_progress.total
        progress.ready = progress.completed = global_step
        epoch_loop._batches_that_stepped = global_step
        ep = loop.epoch_progress
        ep.current.ready = ep.current.started = ep.current.processed = ep.current.completed = epoch
        ep.total.ready = ep.total.started = ep.total.processed = ep.total.completed = epoch

    # -- errors ----------------------------------------------------------------------------------------------------

    def _named_errors(self) -> Any:
        return _NamesLighthouse(getattr(self, "_address", self.lighthouse or ""))

    # -- preemption ------------------------------------------------------------------------------------------------

    @override
    def on_exception(self, exception: BaseException) -> None:
        # SIGTERM (a preemption notice; term:N@S in the emulators): Lightning stopped every rank of this node at the
        # same step (the signal check is agreed inside the node). The node finishes the round in flight and sends
        # its last steps in one exact round, then leaves: the others lose none of its steps, and see no failed
        # collective, only the Lighthouse's heartbeat timeout before a quorum forms without it. It does not wait
        # for the others' end of fit (what a node that ran out of steps does).
        if isinstance(exception, SIGTERMException) and self.rounds is not None and self._joined:
            start = time.perf_counter()
            try:
                with self._named_errors():
                    self.rounds.cut(stop=True, leave=True)
                rank_zero_info(
                    f"{self.strategy_name}: node {self.replica_group} left after SIGTERM with its last steps "
                    f"committed ({time.perf_counter() - start:.2f} s)"
                )
            except Exception as err:  # noqa: BLE001 - leaving anyway; the signal's exception is the one to raise
                log.warning("%s: node %d could not commit its last round before leaving: %s", self.strategy_name,
                            self.replica_group, err)  # fmt: skip
        super().on_exception(exception)

    # -- teardown --------------------------------------------------------------------------------------------------

    @override
    def teardown(self) -> None:
        if self._diloco is not None:
            self._diloco.__exit__(None, None, None)
            self._diloco = None
        try:
            if self.rounds is not None:
                self.rounds.close()
        finally:
            self.rounds = None
            self._sigterm.undo()
            if self.manager is not None:
                self.manager.shutdown(wait=False)
                self.manager = None
        super().teardown()
        destroy_groups(self._group)
        self._group = None


class _Checkpointed:
    """What a checkpoint holds of the rounds (after the cut of ``lightning_module_state_dict``) and of torchft's
    manager (its step, so that a resumed job is on the same round clock)."""

    def __init__(self, strategy: FaultTolerantStrategy) -> None:
        self.strategy = strategy

    def state_dict(self) -> dict[str, Any]:
        s = self.strategy
        assert s.rounds is not None and s.manager is not None
        return {"rounds": s.rounds.state_dict(), "manager": s.manager.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        s = self.strategy
        assert s.rounds is not None and s.manager is not None
        s.rounds.load_state_dict(state["rounds"])
        s.manager.load_state_dict(state["manager"])

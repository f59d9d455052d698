"""``AutoSyncStrategy`` (``auto_sync``): one strategy whose sync mode can change at a step boundary.

Modes:

* ``sync``: DDP's semantics, every gradient all-reduced over all ranks every step.
* ``hier``: ``hier_sync``'s, gradients all-reduced inside the node and node replicas averaged across nodes by
  :class:`~lightning_syncasync.algorithms.averaging.DelayedAverager` (``inter_period``, ``max_delay``).
* ``async``: ``async_ssp``'s: by default round-level async (``local_steps > 1``): every rank steps its own replica
  with its own optimizer and its local progress travels every round through
  :class:`~lightning_syncasync.algorithms.averaging.RoundExchange` under the bound ``staleness`` (in rounds), each
  round ``local_steps`` steps long on every rank (not ``async_ssp``'s rounds of wall-clock length, which deadlock
  with the switcher's gathers at step boundaries: see ``_enter``); with
  ``local_steps=1`` local gradients are exchanged in the background by
  :class:`~lightning_syncasync.algorithms.ssp.SSPExchange` and applied on every replica as the same server updates.

How: the model is wrapped once in torch DDP over all ranks, with one comm hook that reads the mode for each bucket:
all-reduce over all ranks (sync), over the node (hier), or nothing (async). Switching never rebuilds DDP, and sync
and hier keep DDP's bucketing and its overlap with backward. DDP's per-forward buffer broadcast is off (it would be
a collective over all ranks at every forward, putting async ranks back in lockstep); buffers follow the mode
instead: averaged with the parameters in hier; rank 0's made everyone's at switches, validation and the end of fit
in sync and async (DDP's rule: rank 0's buffers are the model's).

A switch (:meth:`AutoSyncStrategy.switch_mode`, called by every rank after the same step, normally by
:class:`~lightning_syncasync.callbacks.SyncSwitcher`) leaves the current mode at a consistent cut (hier:
``DelayedAverager.synchronize``; async: the exchange's ``cut(stop=True)``; sync: nothing is in flight after a step),
so every update made so far is in every replica and the replicas are equal; the optimizer states (moments that
hier and async rounds let drift apart) are made rank 0's; then the next mode's algorithm starts from that one model.

What Lightning's collectives mean: as in the mode that runs (``hier_sync``'s and ``async_ssp``'s docs); in async
mode ``self.log(sync_dist=True)`` inside ``training_step`` logs the rank's own value.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_syncasync.algorithms._comm import broadcast_, destroy_groups, exchange_backend, new_subgroups
from lightning_syncasync.algorithms.averaging.delayed import DelayedAverager, check_settings
from lightning_syncasync.algorithms.averaging.round_length import RoundLength
from lightning_syncasync.algorithms.averaging.rounds import RoundExchange, check_rounds
from lightning_syncasync.algorithms.comm_hooks import MeasuredAllReduce
from lightning_syncasync.algorithms.compression.compressor import Compressor
from lightning_syncasync.algorithms.ssp.compensation import StaleGradientCompensation
from lightning_syncasync.algorithms.ssp.exchange import ApplyFn, SSPExchange
from lightning_syncasync.algorithms.stats import Scope, StatsRecorder
from lightning_syncasync.algorithms.switch_policy import MODES, ModeUnavailableError
from lightning_syncasync.algorithms.topology import Topology
from lightning_syncasync.strategies._async_cuts import LocalReduceWhileAsync
from lightning_syncasync.strategies._async_step import (
    check_async_fit,
    learning_rates,
    report_nonfinite,
    server_update,
    ssp_optimizer_step,
    what_is_checked,
)
from lightning_syncasync.strategies._checks import check_async, check_common, check_node_size
from lightning_syncasync.strategies._held_back import HoldsBackNonFinite
from lightning_syncasync.strategies._merge import MergesBeforeUserHooks
from lightning_syncasync.strategies._one_rank import UnwrappedAtOneRank
from lightning_syncasync.strategies._optim import broadcast_optimizer_state, unwrap_optimizer
from lightning_syncasync.strategies._round_length import RoundLengthReport, round_length
from lightning_syncasync.strategies._sigterm import SigtermScope, node_stop_groups
from lightning_syncasync.strategies._state import CheckpointedAlgorithm, SavesNodeOptimizers, drop_added_callback_states
from lightning_syncasync.strategies._validation import ValidatesNodeMean
from lightning_syncasync.strategies._watch import WatchedStrategy
from lightning_syncasync.strategies.options import AutoSyncOptions, adopt, resolve_options

log = logging.getLogger(__name__)

Mode = Literal["sync", "hier", "async"]
_DDP_PARAMS = inspect.signature(DistributedDataParallel.__init__).parameters


class AutoSyncStrategy(
    HoldsBackNonFinite,
    WatchedStrategy,
    LocalReduceWhileAsync,
    ValidatesNodeMean,
    SavesNodeOptimizers,
    CheckpointedAlgorithm,
    MergesBeforeUserHooks,
    UnwrappedAtOneRank,
    DDPStrategy,
):
    """Sync, hierarchical or asynchronous training, switchable at step boundaries, for any LightningModule.

    Args:
        mode: the mode training starts in (``sync`` unless told otherwise; the switcher warms up synchronously).
        switcher: add a :class:`~lightning_syncasync.callbacks.SyncSwitcher` with its defaults when the Trainer has
            none (``Trainer(strategy="auto_sync")`` is then the whole feature; at one rank none is added, as there
            is nothing to switch between); ``False`` keeps the mode fixed unless a callback calls
            :meth:`switch_mode`.
        node_size: ranks per node (default from the cluster); a smaller value forms virtual nodes for ``hier``.
        inter_period, max_delay: ``hier`` mode's cross-node averaging (see ``HierSyncStrategy``; ``None``, the
            default: decided from the measured step and exchange times).
        staleness, local_steps: ``async`` mode's bound and local steps per round (see ``AsyncSSPStrategy``: rounds by
            default, ``None`` decided from the measured step and exchange times; ``local_steps=1`` exchanges gradients
            every step, where ``staleness=None`` is ASP). Each mode keeps its length's measurements across switches.
        compression: compression of hier's inter-node hop and of async's update exchange.
        options: the expert settings (:class:`~lightning_syncasync.strategies.options.AutoSyncOptions`: the
            stale-gradient compensation of ``local_steps=1``, compressor arguments, the peer timeout), an instance or
            a dict; each also works as a keyword.
        **kwargs: what ``DDPStrategy`` takes (``start_method``, ``find_unused_parameters``, ``timeout``, ...).

    Example::

        Trainer(strategy="auto_sync", accelerator="cpu", devices=4)
        Trainer(strategy=AutoSyncStrategy(node_size=2, staleness=2), devices=4, callbacks=[SyncSwitcher(window=20)])
    """

    strategy_name = "auto_sync"
    _ckpt_key = "auto_sync"

    def __init__(
        self,
        mode: Mode = "sync",
        switcher: bool = True,
        node_size: int | None = None,
        inter_period: int | None = None,
        max_delay: int | None = None,
        staleness: int | None = 1,
        local_steps: int | None = None,
        compression: str = "none",
        options: AutoSyncOptions | None = None,
        **kwargs: Any,
    ) -> None:
        opts = resolve_options(AutoSyncOptions, options, kwargs, "auto_sync")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}; HINT: 'sync' (the default start)")
        check_settings(inter_period, max_delay, "average", 1.0, 0.9)
        check_async(staleness, opts.compensation, opts.lam)
        rounds = local_steps is None or (isinstance(local_steps, int) and local_steps > 1)
        check_rounds(local_steps, staleness if rounds else 0, None)
        check_common("auto_sync registers its own comm hook", compression, opts.compression_options,
                     opts.peer_timeout_s, kwargs, type(self), wraps_ddp=True)  # fmt: skip
        check_node_size(node_size)
        super().__init__(**kwargs)
        adopt(self, opts)
        self.mode: str = mode
        self.switcher = switcher
        self.node_size = node_size
        self.inter_period, self.max_delay = inter_period, max_delay
        self.staleness = staleness
        self.local_steps = local_steps
        self._lengths: dict[str, RoundLength] = {}  # per mode, kept across switches (the link does not change)
        self._length_reports: dict[str, RoundLengthReport] = {}
        self.compression = compression
        self.sync_stats = StatsRecorder(mode=mode)
        self.topology: Topology | None = None
        self.averager: DelayedAverager | None = None
        self.exchange: SSPExchange | None = None
        self.rounds: RoundExchange | None = None
        self._async_optimizer: Optimizer | None = None
        self._sigterm = SigtermScope()  # hier/async modes: Lightning's per-step broadcast is off
        self._apply: ApplyFn | None = None  # async mode: how this replica applies a server update
        self._diverged: float | None = None  # a non-finite loss held back in async mode (the switcher reads it)
        # Async rounds on an accelerator: this step's loss is finite (over its micro-batches), and the steps whose
        # gradients were zeroed for a non-finite one since the switcher last read ``diverged``; both on the device.
        self._step_ok: torch.Tensor | None = None
        self._zeroed_steps: torch.Tensor | None = None
        self.switches: list[tuple[int, str, str]] = []  # (step, from, to)
        self._groups: dict[str, Any] = {}
        self._compensator: StaleGradientCompensation | None = None
        self._restored: dict[str, Any] | None = None
        self._in_training_step = False
        self._step = 0
        self._params: list[torch.Tensor] = []
        self._tensors: list[torch.Tensor] | None = None  # set when fitting: the parameters and float buffers

    # -- set-up --------------------------------------------------------------------------------------------------

    @property
    def available_modes(self) -> tuple[str, ...]:
        """The modes this run can use: ``hier`` needs more than one node (real or virtual)."""
        many = self.topology is not None and self.topology.num_nodes > 1
        return ("sync", "hier", "async") if many else ("sync", "async")

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        if not self.switcher or self.lightning_module is None:
            return
        if self.world_size == 1:
            # Nothing to switch between at one rank (every mode trains the one replica alone), and the switcher's
            # SyncMonitor would cost host time every step.
            log.info("auto_sync: one rank, so no SyncSwitcher is added (there is no communication to judge)")
        else:
            from lightning_syncasync.callbacks.switcher import SyncSwitcher  # callbacks sit above strategies

            trainer = self.lightning_module.trainer
            if not any(isinstance(c, SyncSwitcher) for c in trainer.callbacks):
                trainer.callbacks.append(SyncSwitcher())

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only)
        if self.switcher and self.world_size == 1 and self.lightning_module is not None:
            # The SyncSwitcher this strategy adds at more ranks, and the AdaptiveBatchSize the switcher adds.
            drop_added_callback_states(checkpoint, self.lightning_module.trainer.callbacks,
                                       ("SyncSwitcher", "AdaptiveBatchSize"), "auto_sync", log)  # fmt: skip
        return checkpoint

    @override
    def setup_distributed(self) -> None:
        super().setup_distributed()
        topo = Topology.from_cluster(self.world_size, self.num_nodes, self.node_size)
        self.topology = topo
        if self.mode == "hier" and topo.num_nodes < 2:
            raise ModeUnavailableError(_no_hier(self.world_size))
        timeout = timedelta(seconds=self.peer_timeout_s)
        # Every rank creates every group in the same order. Each user of a group is alone on it: DDP's hook (all
        # ranks / the node), the averager (node, cross-node) and the SSP thread never share one.
        self._groups["grad"] = dist.new_group(timeout=timeout)
        self._groups["grad_node"] = new_subgroups(topo.all_nodes(), timeout=timeout)
        backend = exchange_backend()  # the averager's, the rounds' and the SSP thread's groups
        self._groups["avg_node"] = new_subgroups(topo.all_nodes(), timeout=timeout, backend=backend)
        self._groups["cross"] = new_subgroups(topo.all_cross_node(), timeout=timeout, backend=backend)
        self._groups["eval_cross"] = new_subgroups(topo.all_cross_node(), timeout=timeout)
        self._groups["ssp"] = dist.new_group(timeout=timeout, backend=backend)
        self._groups["stop_node"] = node_stop_groups(topo, timeout)  # hier mode's SIGTERM check (_sigterm.py)

    @override
    def _setup_model(self, model: Module) -> Module:
        if self._unwrap_at_one_rank("auto_sync"):
            return model
        kwargs = dict(self._ddp_kwargs)
        if kwargs.pop("broadcast_buffers", None) or kwargs.pop("forward_sync_buffers", None):
            log.info("auto_sync: per-forward buffer sync is off (buffers follow the mode; see the module docstring)")
        # forward_sync_buffers (torch >= 2.13, where broadcast_buffers warns) keeps the sync at construction only.
        key = "forward_sync_buffers" if "forward_sync_buffers" in _DDP_PARAMS else "broadcast_buffers"
        kwargs[key] = False
        return DistributedDataParallel(module=model, device_ids=self.determine_ddp_device_ids(), **kwargs)

    @override
    def _register_ddp_hooks(self) -> None:
        if not isinstance(self.model, DistributedDataParallel):
            return  # one rank: no DDP, nothing to measure
        MeasuredAllReduce(self.sync_stats, scope=self._hook_scope, inner_hook=_mode_hook, inner_state=self).register(
            self.model
        )

    def _hook_scope(self) -> Scope | None:
        if self.mode == "async":
            return None  # no collective: nothing to measure
        if self.mode == "hier" and self.topology is not None and self.topology.node_size == 1:
            return None  # a one-rank node's all-reduce moves nothing
        spans = self.mode == "sync" and self.topology is not None and self.topology.num_nodes > 1
        return "inter" if spans else "intra"

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn != "fit":
            return
        module = self.lightning_module
        assert module is not None
        self._params = list(module.parameters())
        self._tensors = self._params + [b for b in module.buffers() if b.is_floating_point()]
        self._compensator = StaleGradientCompensation(self.compensation, self.lam)  # type: ignore[arg-type]
        restored, self._restored = self._restored, None
        if restored is not None:
            self.mode = str(restored["mode"])
            self._step = int(restored.get("step", 0))
        self._enter(self.mode, restored)

    # -- switching -----------------------------------------------------------------------------------------------

    def switch_mode(self, mode: str, step: int | None = None) -> bool:
        """Continue in ``mode`` from the next step. Every rank must call it after the same step. Returns whether the
        mode changed. Raises :class:`ModeUnavailableError` (nothing changed) when this run cannot use ``mode``."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}; HINT: 'sync' (the default start)")
        if mode not in self.available_modes:
            raise ModeUnavailableError(_no_hier(self.world_size))
        if mode == self.mode:
            return False
        if mode == "async":
            try:
                check_async_fit(self.optimizers, self.precision_plugin, "auto_sync's async mode")
            except ValueError as err:
                raise ModeUnavailableError(str(err)) from err
        old = self.mode
        self._leave(old)
        self.mode = mode
        self._enter(mode)
        at = self._step if step is None else step
        self.switches.append((at, old, mode))
        log.info("auto_sync: %s -> %s at step %d", old, mode, at)
        return True

    def _round_mode(self) -> bool:
        """Whether async mode runs in rounds (``local_steps`` unset or > 1) rather than per-step exchange."""
        return self.local_steps is None or self.local_steps > 1

    def _length(self, mode: str) -> RoundLength:
        """The round length of ``hier`` or ``async`` mode: made at the first entry, kept across switches."""
        if mode not in self._lengths:
            if mode == "hier":
                self._lengths[mode] = round_length(self.inter_period, 1.0, min_steps=1)
            else:
                self._lengths[mode] = round_length(self.local_steps, self.staleness or 1, min_steps=2)
            self._length_reports[mode] = RoundLengthReport(self._lengths[mode], f"auto_sync ({mode} mode)")
        return self._lengths[mode]

    def _leave(self, mode: str) -> None:
        if mode == "hier" and self.averager is not None:
            self.averager.synchronize()
            self.averager.close()
            self.averager = None
        elif mode == "async" and (self.exchange is not None or self.rounds is not None):
            if self.exchange is not None:
                self._cut_exchange(stop=True)
            if self.rounds is not None:
                self.rounds.cut(stop=True)
            self.exchange = self.rounds = self._apply = None
        self._sigterm.undo()
        self._step_ok = None  # a step's flag never carries into the next mode
        self._broadcast_buffers()
        if mode == "hier" or (mode == "async" and self._round_mode()):
            self._equal_optimizer_states()  # hier and async rounds let the moments drift apart

    def _enter(self, mode: str, restored: dict[str, Any] | None = None) -> None:
        self.sync_stats.mode = mode
        assert self.topology is not None and self._tensors is not None
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if mode != "sync" and trainer is not None:
            # Lightning's per-step SIGTERM broadcast over the world (strategies/_sigterm.py) is the lockstep sync mode
            # has anyway; hier mode's nodes stop together, async mode's ranks each on their own.
            self._sigterm.install(trainer, self._groups["stop_node"] if mode == "hier" else None)
        if mode == "hier":
            self.averager = DelayedAverager(
                self._tensors,
                cross_group=self._groups["cross"],
                node_group=self._groups["avg_node"],
                local_rank=self.topology.local_rank_of(self.global_rank),
                node_size=self.topology.node_size,
                num_nodes=self.topology.num_nodes,
                inter_period=self.inter_period,
                max_delay=self.max_delay,
                recorder=self.sync_stats,
                compressor=self._compressor(),
                timeout_s=self.peer_timeout_s,
                length=self._length("hier"),
            )
            if restored and restored.get("hier") is not None:
                self.averager.load_state_dict(restored["hier"])
        elif mode == "async":
            optimizer = check_async_fit(self.optimizers, self.precision_plugin, "auto_sync's async mode")
            assert self.lightning_module is not None
            trained = [p for p in self._params if p.requires_grad]
            self._apply = server_update(optimizer, trained, self.lightning_module)
            if self._round_mode():
                assert self.staleness is not None  # checked at construction
                self.rounds = RoundExchange(
                    trained,
                    self._groups["ssp"],
                    length=self._length("async"),
                    staleness=self.staleness,
                    # Rounds of local_steps steps, not of wall-clock length: SyncSwitcher and AdaptiveBatchSize
                    # gather every rank's window at the same step, so a fast rank waits there for a slow one, and
                    # wall-clock rounds kept ending on the slow rank meanwhile (past their deadlines, with no new
                    # step) until its staleness bound needed a round the blocked rank had not launched: a deadlock
                    # (jitter_long, 5 runs of 5; test_async_rounds_and_the_switchers_window_collective_do_not_
                    # deadlock). Rounds counted in steps meet the step-indexed gathers in the same order everywhere.
                    dynamic=False,
                    compressor=self._compressor(),
                    recorder=self.sync_stats,
                    scope="inter" if self.topology.num_nodes > 1 else "intra",
                    timeout_s=self.peer_timeout_s,
                    buffers=self._tensors[len(self._params) :],
                    should_stop=self._sigterm.requested,
                )
                if restored and restored.get("async") is not None:
                    self.rounds.load_state_dict(restored["async"])
                self.rounds.start()
                return
            self.exchange = SSPExchange(
                trained,
                self._groups["ssp"],
                staleness=self.staleness,
                timeout_s=self.peer_timeout_s,
                compressor=self._compressor(),
                recorder=self.sync_stats,
                buffers=self._tensors[len(self._params) :],
                num_lrs=len(learning_rates(optimizer)),
            )
            if restored and restored.get("async") is not None:
                self.exchange.load_state_dict(restored["async"])
            self.exchange.start()

    def _compressor(self) -> Compressor:
        return Compressor(self.compression, seed=self.global_rank, **self.compression_options)  # type: ignore[arg-type]

    @torch.no_grad()
    def _broadcast_buffers(self) -> None:
        module = self.lightning_module
        if module is None:
            return
        for b in module.buffers():
            broadcast_(b.data, 0)

    def _nodes_apart(self) -> bool:
        return self.averager is not None  # hier mode; async rounds make the states rank 0's at their cut

    def _node_cross_group(self) -> Any:
        return self._groups.get("eval_cross")

    @override
    def _equal_optimizer_states(self) -> None:
        broadcast_optimizer_state(self.optimizers, src=0)

    # -- the training step ---------------------------------------------------------------------------------------

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        last = not self.optimizers or unwrap_optimizer(optimizer) is unwrap_optimizer(self.optimizers[-1])
        if self.mode == "async" and self.rounds is not None:
            out = super().optimizer_step(optimizer, self._finite_or_held_back(closure), model, **kwargs)
            if self._step_ok is not None:  # on an accelerator: counted on the device (training_step, wrapped)
                bad = (~self._step_ok).int()
                self._zeroed_steps = bad if self._zeroed_steps is None else self._zeroed_steps + bad
                self._step_ok = None
            self.rounds.after_step()  # a dropped step changed nothing, and the round counts it all the same
        elif self.mode == "async" and self.exchange is not None:
            assert self._compensator is not None and self._apply is not None
            out = ssp_optimizer_step(
                self.exchange, self._compensator, self._apply, optimizer, self.global_rank, closure,
                lambda wrapped: super(AutoSyncStrategy, self).optimizer_step(optimizer, wrapped, model, **kwargs),
                on_nonfinite=self._on_nonfinite(), what=what_is_checked(self.lightning_module),
            )  # fmt: skip
        else:
            out = super().optimizer_step(optimizer, closure, model, **kwargs)
            if self.averager is not None and last:
                self.averager.after_step()
        if last:
            self._step += 1
            if self.mode in self._length_reports:
                self._length_reports[self.mode].poll()
        return out

    @override
    def _cut_exchange(self, stop: bool = False) -> None:
        assert self.exchange is not None and self._apply is not None
        self.exchange.cut(self._apply, stop=stop)
        report_nonfinite(self.exchange, self.global_rank, self._held_back)  # found by its thread (an accelerator's)

    # -- consistent cuts -----------------------------------------------------------------------------------------

    @override
    def on_validation_start(self) -> None:
        module = self.lightning_module
        # Validation inside fit (Lightning has left the training stage when this hook runs: `trainer.training` is
        # already False here).
        if module is not None and module.trainer.state.fn == "fit":
            if self.exchange is not None:
                self._cut_exchange()  # validate the merged model (async_ssp's rule)
            elif self.rounds is not None:
                self._cut_rounds()
            elif self.averager is not None:
                self.averager.swap_in_mean(self._groups["eval_cross"])  # hier_sync's rule; swapped back at the end
            elif self.mode == "sync" and self.model is not None:
                self._broadcast_buffers()
        super().on_validation_start()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        # All ranks save together: a consistent cut, so the checkpoint holds the one merged model. (A checkpoint
        # saved during validation starts from the training state: synchronize() first puts the replica back.)
        if self.averager is not None:
            self.averager.synchronize()
        elif self.exchange is not None and self.exchange._thread is not None:
            self._cut_exchange()
        elif self.rounds is not None and self.rounds._thread is not None:
            self._cut_rounds()
        return super().lightning_module_state_dict()

    def _algorithm(self) -> Any | None:
        return _ModeState(self) if self._tensors is not None else None

    @override
    def _merge_replicas(self) -> None:
        # The model fit() leaves behind (and on_train_end hooks see) is the merged one, whatever the mode; the mode's
        # threads stop here.
        if self._tensors is not None:
            self._leave(self.mode)
            self._tensors = None

    @override
    def teardown(self) -> None:
        try:
            if self.averager is not None:
                self.averager.close()
            if self.exchange is not None:
                self.exchange.close()
            if self.rounds is not None:
                self.rounds.close()
        finally:
            self.averager = self.exchange = self.rounds = self._apply = None
            self._sigterm.undo()
            super().teardown()
            destroy_groups(*self._groups.values())
            self._groups = {}


class _ModeState:
    """What a checkpoint holds for auto_sync (taken after the cut of ``lightning_module_state_dict``)."""

    def __init__(self, strategy: AutoSyncStrategy) -> None:
        self.strategy = strategy

    def state_dict(self) -> dict[str, Any]:
        s = self.strategy
        return {
            "mode": s.mode,
            "step": s._step,
            "hier": s.averager.state_dict() if s.averager is not None else None,
            "async": s.exchange.state_dict()
            if s.exchange is not None
            else s.rounds.state_dict()
            if s.rounds is not None
            else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        s = self.strategy
        if state["mode"] not in s.available_modes:
            raise ModeUnavailableError(_no_hier(s.world_size))
        s._leave(s.mode)
        s.mode = str(state["mode"])
        s._step = int(state.get("step", 0))
        s._enter(s.mode, state)


def _mode_hook(strategy: AutoSyncStrategy, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the gradient all-reduce of the current mode (over all ranks, over the node, or none)."""
    if strategy.mode == "async":
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        buffer = bucket.buffer()
        if strategy._step_ok is not None:  # async rounds on an accelerator: a non-finite step's gradients zeroed
            buffer.masked_fill_(~strategy._step_ok, 0.0)
        fut.set_result(buffer)  # local gradients: the update exchange carries the rest
        return fut
    group = strategy._groups["grad" if strategy.mode == "sync" else "grad_node"]
    return allreduce_hook(group, bucket)


def _no_hier(world_size: int) -> str:
    return (
        f"mode 'hier' needs more than one node, and this run has one node of {world_size} ranks. HINT: set "
        f"node_size (e.g. node_size={max(world_size // 2, 1)}) to form virtual nodes, or use mode 'sync'/'async'"
    )

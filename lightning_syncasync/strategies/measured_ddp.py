"""``MeasuredDDPStrategy``: Lightning's DDP with comm hooks that run on CPU too, measured, plus torch's averagers.

Lightning's ``DDPStrategy`` registers ``ddp_comm_hook`` only on CUDA and, with ``model_averaging_period``, runs
torch's ``PeriodicModelAverager`` on top of a full all-reduce on CPU (FINDINGS.md). That makes the two anchors a user
would otherwise pick, post-local SGD (Lin et al., "Don't Use Large Mini-Batches, Use Local SGD", ICLR 2020) and torch's
``HierarchicalModelAverager``, impossible to run or measure on CPU clusters. This strategy registers the hook itself
on every device type, wraps it in :class:`~lightning_syncasync.algorithms.comm_hooks.MeasuredAllReduce` and times the
averager, so ``SyncMonitor`` sees every byte either one moves.

Modes (``local_sgd``):

* ``None``: plain DDP (a flat all-reduce every step), measured.
* ``"post_local_sgd"``: full DDP for ``warmup_steps``, then gradients are all-reduced only inside each node every step
  (torch's ``post_localSGD_hook`` with the node as subgroup) and the parameters of all ranks are averaged every
  ``averaging_period`` steps (``PeriodicModelAverager``). This is Lightning's ``model_averaging_period`` recipe, made
  to actually run on CPU.
* ``"hierarchical"``: full DDP for ``warmup_steps``, then no gradient communication; parameters are averaged inside
  each node every step and across all ranks every ``averaging_period`` steps (``HierarchicalModelAverager`` with
  ``{1: node_size, averaging_period: world_size}``).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Literal

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
from torch.distributed.algorithms.model_averaging.averagers import ModelAverager, PeriodicModelAverager
from torch.distributed.algorithms.model_averaging.hierarchical_model_averager import HierarchicalModelAverager
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_syncasync.algorithms.comm_hooks import MeasuredAllReduce
from lightning_syncasync.algorithms.stats import StatsRecorder
from lightning_syncasync.algorithms.topology import Topology

log = logging.getLogger(__name__)

LocalSGD = Literal["post_local_sgd", "hierarchical"]
_MODES = (None, "post_local_sgd", "hierarchical")


class MeasuredDDPStrategy(DDPStrategy):
    """DDP whose communication is measured for ``SyncMonitor``, optionally with post-local SGD or hierarchical SGD.

    Args:
        local_sgd: ``None`` (plain DDP), ``"post_local_sgd"`` or ``"hierarchical"`` (see the module docstring).
        averaging_period: steps between global parameter averagings (``local_sgd`` modes only).
        warmup_steps: steps of plain DDP before local SGD starts.
        node_size: ranks per node; default from the cluster (``world_size // num_nodes``). A smaller value forms
            virtual nodes so that one machine can exercise the hierarchy.
        **kwargs: everything ``DDPStrategy`` takes (``start_method``, ``find_unused_parameters``, ...). A user
            ``ddp_comm_hook``/``ddp_comm_state`` is registered on every device type and measured.

    Example::

        Trainer(strategy=MeasuredDDPStrategy(local_sgd="post_local_sgd", averaging_period=8), devices=4)
    """

    def __init__(
        self,
        local_sgd: LocalSGD | None = None,
        averaging_period: int = 8,
        warmup_steps: int = 0,
        node_size: int | None = None,
        **kwargs: Any,
    ) -> None:
        if local_sgd not in _MODES:
            raise ValueError(f"local_sgd must be one of {_MODES}, got {local_sgd!r}")
        if averaging_period < 1:
            raise ValueError(f"averaging_period must be >= 1, got {averaging_period}")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        if node_size is not None and node_size < 1:
            raise ValueError(f"node_size must be >= 1 (or None for the real nodes), got {node_size}")
        if local_sgd is not None and (kwargs.get("ddp_comm_hook") or kwargs.get("model_averaging_period")):
            raise ValueError(
                "local_sgd builds its own comm hook and averager; drop ddp_comm_hook/model_averaging_period "
                "or set local_sgd=None"
            )
        super().__init__(**kwargs)
        self.local_sgd = local_sgd
        self.averaging_period = averaging_period
        self.warmup_steps = warmup_steps
        self.node_size = node_size
        self.sync_stats = StatsRecorder(mode="sync" if local_sgd is None else "hier")
        self.topology: Topology | None = None
        self._averager: ModelAverager | None = None
        self._param_bytes = 0

    @override
    def setup_distributed(self) -> None:
        super().setup_distributed()
        self.topology = Topology.from_cluster(self.world_size, self.num_nodes, self.node_size)

    @override
    def _register_ddp_hooks(self) -> None:
        # Unlike Lightning's, on every device type: gloo runs DDP comm hooks fine.
        assert isinstance(self.model, DistributedDataParallel)
        assert self.topology is not None
        topo = self.topology
        flat_scope: Literal["intra", "inter"] = "inter" if topo.spans_nodes() else "intra"
        scope: Any = flat_scope
        hook: Callable[..., Any] | None = self._ddp_comm_hook
        state: Any = self._ddp_comm_state
        if self.local_sgd is not None:
            # Node groups must be created on every rank in the same order; new_subgroups_by_enumeration does that.
            node_group, _ = dist.new_subgroups_by_enumeration(topo.all_nodes())
            state = PostLocalSGDState(
                process_group=None,
                subgroup=node_group,
                start_localSGD_iter=self.warmup_steps,
                post_local_gradient_allreduce=self.local_sgd == "post_local_sgd",
            )
            hook = post_localSGD_hook
            local_scope = "intra" if self.local_sgd == "post_local_sgd" else None

            def scope() -> Literal["intra", "inter"] | None:
                # post_localSGD_hook's own test: the global group until start_localSGD_iter, the node after.
                return flat_scope if state.iter < state.start_localSGD_iter else local_scope  # type: ignore[return-value]

        if self._ddp_comm_wrapper is not None and hook is not None:
            hook = self._ddp_comm_wrapper(hook)
        MeasuredAllReduce(
            self.sync_stats, scope=scope, process_group=None, inner_hook=hook, inner_state=state
        ).register(self.model)
        self._param_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters() if p.requires_grad)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if self.local_sgd is None:
            return
        assert self.topology is not None
        if self.local_sgd == "post_local_sgd":
            self._averager = PeriodicModelAverager(period=self.averaging_period, warmup_steps=self.warmup_steps)
        else:
            levels = OrderedDict([(1, self.topology.node_size)])
            levels[self.averaging_period] = self.world_size
            if self.averaging_period == 1 or self.topology.node_size == self.world_size:
                levels = OrderedDict([(self.averaging_period, self.world_size)])
            self._averager = HierarchicalModelAverager(levels, warmup_steps=self.warmup_steps)

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._averager is not None:
            params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            scope = self._averaging_scope()
            start = time.perf_counter()
            self._averager.average_parameters(iter(params))
            if scope is not None:
                nbytes = sum(p.numel() * p.element_size() for p in params)
                self.sync_stats.record_blocking(nbytes, scope, time.perf_counter() - start)
        return out

    def _averaging_scope(self) -> Literal["intra", "inter"] | None:
        """Which link the averager's all-reduce at this step crosses (``None``: it does not communicate)."""
        avg, topo = self._averager, self.topology
        assert avg is not None and topo is not None
        if avg.step < self.warmup_steps:
            return None
        if isinstance(avg, PeriodicModelAverager):
            due = (avg.step - self.warmup_steps) % self.averaging_period == 0
            return ("inter" if topo.spans_nodes() else "intra") if due else None
        group = avg._find_process_group()  # torch's own choice of level for this step
        if group is None:
            return None
        return "inter" if dist.get_world_size(group) > topo.node_size else "intra"

    @override
    def teardown(self) -> None:
        self._averager = None
        super().teardown()

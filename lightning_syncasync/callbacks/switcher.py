"""``SyncSwitcher``: switch ``auto_sync`` between sync, hierarchical and asynchronous modes from live metrics.

After ``first_window`` steps, then every ``window`` steps, each rank summarises its last window (compute per sample
and its variation, communication share, samples, loss, divergence) from the ``StatsRecorder`` that
:class:`SyncMonitor` fills; the numbers are all-gathered as one float tensor (no pickled objects), and every rank
runs the same :class:`~lightning_syncasync.algorithms.switch_policy.SwitchPolicy` on the same numbers, so every rank
reaches the same decision at the same step without a broadcast. In async mode nothing else makes the ranks meet, and
in hier mode nothing makes the nodes meet between their rounds, so there the gather is not waited for at once: each
window's numbers travel in the background and the decision at the next window reads them (a decision one window
late, and no barrier every ``window`` steps). A switch happens at that step boundary (before the next step's batch is
used), through the strategy's ``switch_mode``: the callback works through
:class:`~lightning_syncasync.algorithms.switch_policy.SwitchesModes`, which ``AutoSyncStrategy`` implements, and does
not import the strategy that adds it.

Rollback: at every decision taken at a consistent point (synchronous mode, or right after a switch), and when the
window was healthy, the callback keeps a CPU copy of the model and optimizer states (the same on every rank). On
divergence it switches to ``sync`` and loads that copy on every rank; the data loader is not rewound.

Every decision with its reasons goes to ``SyncMonitor`` (``summary["events"]``, kind ``switch`` when the mode
changes, ``rollback`` when a state is restored) and to :attr:`SyncSwitcher.decisions`; the mode is logged as
``syncasync/mode_id`` (0 sync, 1 hier, 2 async) and printed in the end-of-fit summary.
"""

from __future__ import annotations

import copy
import logging
import math
import statistics
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from lightning_utilities.core.apply_func import apply_to_collection
from typing_extensions import override

from lightning_syncasync.algorithms.switch_policy import (
    MODES,
    ModeUnavailableError,
    SwitchesModes,
    SwitchPolicy,
    WindowStats,
)
from lightning_syncasync.callbacks._stats_source import PendingRows, gather_rows, ranks_apart
from lightning_syncasync.callbacks._step_log import is_logging_step, write_step_values
from lightning_syncasync.callbacks.adaptive_batch import AdaptiveBatchSize
from lightning_syncasync.callbacks.monitor import SyncMonitor

log = logging.getLogger(__name__)

_FIXED = 7  # the fixed fields of a window row (``_window_values``), before its per-step numbers


class SyncSwitcher(Callback):
    """The switching policy for ``Trainer(strategy="auto_sync")`` (added with its defaults by the strategy).

    Args:
        window: steps per decision (>= 2).
        first_window: steps before the first decision (>= 2): short, so that a slow inter-node link is left for
            ``hier`` after a few steps instead of a whole window.
        warmup_steps, dwell_windows, comm_high, straggler_high, straggler_low, jitter_high, jitter_low,
            spike_factor, spike_spread, spike_floor, cooldown_windows, leave_async_windows: the policy's thresholds
            (see ``SwitchPolicy``;
            defaults measured on the benchmark scenarios, README).
        rebalance: run :class:`AdaptiveBatchSize` (added with its defaults if the Trainer has none): a persistent
            straggler is then handled synchronously by rebalancing batches, which measured faster than async.
        rollback: keep the last good state and restore it on divergence.
        allow_async: let the policy choose ``async`` (jitter, or a persistent straggler without rebalancing).
            ``None`` (default): on, on any topology. Under pauses across nodes (``jitter_slow_link``, 5 seeds) it
            went async in 5 of 5 runs, at 1488 samples/s against 1237 with async off; the rest of the evidence, one
            node included: docs/benchmarks.md#auto_sync-a-user-can-leave-on-issue-66. ``True``/``False`` decide
            for every topology.

    Example::

        Trainer(strategy="auto_sync", devices=4, callbacks=[SyncSwitcher(window=20, jitter_high=0.6)])
    """

    def __init__(
        self,
        window: int = 10,
        first_window: int = 3,
        warmup_steps: int = 20,
        dwell_windows: int = 2,
        comm_high: float = 0.35,
        straggler_high: float = 1.3,
        straggler_low: float = 1.15,
        jitter_high: float = 0.5,
        jitter_low: float = 0.3,
        spike_factor: float = 2.0,
        cooldown_windows: int = 10,
        spike_spread: float = 4.0,
        spike_floor: float = 0.1,
        leave_async_windows: int = 2,
        rebalance: bool = True,
        rollback: bool = True,
        allow_async: bool | None = None,
    ) -> None:
        if window < 2:
            raise ValueError(f"window must be >= 2 steps, got {window}; HINT: 10 decides every 10 steps")
        if first_window < 2:
            raise ValueError(f"first_window must be >= 2 steps, got {first_window}; HINT: 3 decides after 3 steps")
        if allow_async is not None and not isinstance(allow_async, bool):  # `1 in (True,)` would let 1 through
            raise ValueError(
                f"allow_async must be None, True or False, got {allow_async!r}; HINT: None (the default) allows "
                "async on any topology, True or False decides for every topology"
            )
        self.window = window
        self.first_window = first_window
        self.rebalance = rebalance
        self.rollback = rollback
        self.allow_async = allow_async
        self._policy_args: dict[str, Any] = {
            "warmup_steps": warmup_steps, "dwell_windows": dwell_windows, "comm_high": comm_high,
            "straggler_high": straggler_high, "straggler_low": straggler_low, "jitter_high": jitter_high,
            "jitter_low": jitter_low, "spike_factor": spike_factor, "cooldown_windows": cooldown_windows,
            "spike_spread": spike_spread, "spike_floor": spike_floor, "leave_async_windows": leave_async_windows,
        }  # fmt: skip
        SwitchPolicy(**self._policy_args)  # validate the thresholds now, not in every process later
        self.policy: SwitchPolicy | None = None
        self.decisions: list[dict[str, Any]] = []
        self._monitor: SyncMonitor | None = None
        self._losses: list[torch.Tensor] = []
        self._decided_at = -1
        self._good: dict[str, Any] | None = None
        self._policy_state: dict[str, Any] | None = None
        self._pending: tuple[int, PendingRows] | None = None  # (the step it was launched at, the gather)

    # -- set-up --------------------------------------------------------------------------------------------------

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if not isinstance(trainer.strategy, SwitchesModes):
            raise ValueError(
                f"SyncSwitcher switches the mode of strategy='auto_sync'; this Trainer runs "
                f"{type(trainer.strategy).__name__}. HINT: Trainer(strategy='auto_sync', ...) adds a SyncSwitcher"
            )
        self._monitor = next((c for c in trainer.callbacks if isinstance(c, SyncMonitor)), None)
        if self._monitor is None:
            # No GPU sync at each step (cuda_sync=False): the policy reads sums over a window, whose wall time is
            # right without it, and a sync per step would cost a small model's steps/s the host's lead over the GPU.
            self._monitor = SyncMonitor(progress_bar=False, print_summary=False, cuda_sync=False)
            trainer.callbacks.append(self._monitor)  # its setup runs too: Lightning iterates the live list
        if self.rebalance and not any(isinstance(c, AdaptiveBatchSize) for c in trainer.callbacks):
            trainer.callbacks.append(AdaptiveBatchSize())
            rank_zero_info("SyncSwitcher: added AdaptiveBatchSize (rebalance=True) for persistent stragglers")

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, SwitchesModes)
        allow, why = self.async_allowed(strategy.available_modes)
        rank_zero_info(f"SyncSwitcher: async mode {'allowed' if allow else 'off'} ({why})")
        available = [m for m in strategy.available_modes if m != "async" or allow]
        self.policy = SwitchPolicy(available=available, rebalance=self._rebalancing(trainer), **self._policy_args)
        if self._policy_state is not None:
            self.policy.load_state_dict(self._policy_state)
            self._policy_state = None
        self._losses = []
        self._good = None
        self._pending = None

    def async_allowed(self, available_modes: tuple[str, ...]) -> tuple[bool, str]:
        """Whether the policy may choose ``async`` on this run's topology, and why (logged once at fit start)."""
        if self.allow_async is not None:
            return self.allow_async, f"allow_async={self.allow_async}"
        if "hier" in available_modes:  # more than one node, real or virtual
            return True, ("default on several nodes: under pauses across nodes measured at 1.20x the samples/s of "
                          "async off; allow_async=False to keep sync or hier")  # fmt: skip
        return True, "default on one node: measured sooner to the target under jitter; allow_async=False to keep sync"

    # -- per step ------------------------------------------------------------------------------------------------

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            self._losses.append(loss.detach().float().reshape(-1)[:1])  # on its device: no per-step sync
        # Straight to the loggers on Lightning's logging steps only: `self.log` costs host time every step
        # (callbacks/_step_log.py says how much).
        if is_logging_step(trainer):
            write_step_values(trainer, {"syncasync/mode_id": float(MODES.index(trainer.strategy.mode))})  # type: ignore[attr-defined]

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        # A step boundary that every rank reaches at the same global step (once per step, not per micro-batch).
        step = trainer.global_step
        due = step == self.first_window or (step > self.first_window and (step - self.first_window) % self.window == 0)
        if not due or step == self._decided_at or self.policy is None:
            return
        span = self.first_window if step == self.first_window else self.window
        self._decided_at = step
        strategy = trainer.strategy
        assert isinstance(strategy, SwitchesModes)
        local = self._window_values(strategy, span)
        # Every gather launched is read, in launch order, whatever the mode is now.
        pending, self._pending = self._pending, None
        earlier = (pending[0], pending[1].rows()) if pending is not None else None
        if ranks_apart(trainer):
            # No gather that every rank waits at: this window's numbers travel while the ranks train on, and the
            # decision taken now reads the previous window's (PendingRows says why). The first window in async mode
            # has none to read: no decision until the next one.
            self._pending = (step, PendingRows(trainer, local))
            if earlier is None:
                return
            window = _window_stats(earlier[1], earlier[0])
        else:
            window = _window_stats(gather_rows(trainer, local), step)
        mode = strategy.mode
        decision = self.policy.decide(window, mode)
        record: dict[str, Any] = {"step": step, "mode": mode, "next": decision.mode, "reason": decision.reason,
                                  "signals": window.describe()}  # fmt: skip
        if window.step != step:
            record["window_step"] = window.step
        if decision.rollback:
            self._restore(trainer, pl_module, strategy, step, record)
        elif decision.mode != mode:
            try:
                strategy.switch_mode(decision.mode, step)
            except ModeUnavailableError as err:  # keep training in the current mode, say why
                record["next"], record["reason"] = mode, f"refused: {err}"
            else:
                self._event("switch", step, record)
        self.decisions.append(record)
        log.info("SyncSwitcher step %d: %s -> %s (%s; %s)", step, mode, record["next"], record["reason"],
                 record["signals"])  # fmt: skip
        consistent = strategy.mode == "sync" or record["next"] != mode
        if self.rollback and consistent and not decision.rollback and not window.nonfinite:
            self._keep_good(trainer, pl_module)

    def _window_values(self, strategy: SwitchesModes, span: int) -> list[float]:
        """This rank's summary of its last ``span`` steps, as the row every rank gathers."""
        # The first step of a fit carries one-off costs (DDP's bucket rebuild, allocator warm-up): left out.
        steps = [s for s in list(strategy.sync_stats.history)[-span:] if s.step > 1]
        per_sample = [s.compute_s / s.samples for s in steps if s.samples > 0]
        mean = sum(per_sample) / len(per_sample) if per_sample else 0.0
        var = sum((x - mean) ** 2 for x in per_sample) / len(per_sample) if per_sample else 0.0
        wall = sum(s.wall_s for s in steps)
        wait = sum(s.wait_s for s in steps)
        losses = torch.cat(self._losses).cpu() if self._losses else torch.empty(0, device="cpu")
        self._losses = []
        finite = losses[torch.isfinite(losses)]
        nonfinite = bool(finite.numel() < losses.numel()) or strategy.diverged is not None
        strategy.diverged = None
        # The rank's pace: its median step's compute per sample (a transient pause is the jitter signal's, not a
        # slower rank's); its variation: the coefficient of variation around the mean, pauses included.
        pace = statistics.median(per_sample) if per_sample else 0.0
        # compute/sample at the median step, compute/sample cv, wait share, samples, wall s, loss mean, non-finite;
        # then the window's steps (compute, wait, wall), the newest last, padded with NaN to ``span`` (every rank's
        # row has the same length): the steps of a window are the same global steps on every rank.
        per_step = [math.nan] * (3 * (span - len(steps)))
        per_step += [x for s in steps for x in (s.compute_s, s.wait_s, s.wall_s)]
        return [pace, math.sqrt(var) / mean if mean > 0 else 0.0, wait / wall if wall > 0 else 0.0,
                float(sum(s.samples for s in steps)), wall, float(finite.mean()) if finite.numel() else math.nan,
                1.0 if nonfinite else 0.0, *per_step]  # fmt: skip

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The last window launched in async mode: read, so that no rank leaves a collective behind on the default
        # group (every rank launched it at the same step). Its numbers come too late for a decision.
        pending, self._pending = self._pending, None
        if pending is not None:
            pending[1].rows()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._pending = None  # a failing run must not wait for a rank that may be gone

    # -- rollback ------------------------------------------------------------------------------------------------

    def _keep_good(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Taken where every replica holds the same model, so the copy is the same on every rank.
        self._good = {
            "model": {k: _on_cpu(v) for k, v in pl_module.state_dict().items()},
            # On the CPU too, as the model: a copy on the GPU would hold the optimizer's state twice there (Adam: 8 B
            # per parameter) for the whole fit.
            "optimizers": [_state_on_cpu(opt.state_dict()) for opt in trainer.optimizers],
        }

    def _restore(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        strategy: SwitchesModes,
        step: int,
        record: dict[str, Any],
    ) -> None:
        strategy.switch_mode("sync", step)
        if self.rollback and self._good is not None:
            pl_module.load_state_dict(self._good["model"])
            for opt, state in zip(trainer.optimizers, self._good["optimizers"], strict=True):
                opt.load_state_dict(copy.deepcopy(state))
            record["reason"] += "; restored the last good state"
        else:
            record["reason"] += "; no good state kept (rollback=False or none yet): continuing"
        self._event("rollback", step, record)

    def _event(self, kind: str, step: int, record: dict[str, Any]) -> None:
        if self._monitor is not None:
            fields = {k: v for k, v in record.items() if k != "step"}
            self._monitor.record_event(kind, step, **fields)

    @staticmethod
    def _rebalancing(trainer: pl.Trainer) -> bool:
        return any(isinstance(c, AdaptiveBatchSize) and c.adapt for c in trainer.callbacks)

    # -- checkpoints ---------------------------------------------------------------------------------------------

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"policy": self.policy.state_dict() if self.policy is not None else None, "decisions": self.decisions}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._policy_state = state_dict.get("policy")
        self.decisions = list(state_dict.get("decisions", []))


def _link_frac(rows: list[list[float]]) -> float | None:
    """The wait of each step's longest-computing rank over its step time, summed over the window's steps that every
    rank measured (``None`` if none): that rank waited for no peer, so its wait is the network's alone."""
    wait = wall = 0.0
    for i in range(_FIXED, len(rows[0]), 3):
        step = [r[i : i + 3] for r in rows]
        if any(x != x for s in step for x in s):  # a step some rank did not measure (the window's first ones)
            continue
        last = max(step, key=lambda s: s[0])
        wait, wall = wait + last[1], wall + last[2]
    return wait / wall if wall > 0 else None


def _window_stats(rows: list[list[float]], step: int) -> WindowStats:
    """Every rank's ``_window_values`` row, as the policy reads them."""
    walls = [r[4] for r in rows]
    loss_values = [r[5] for r in rows if r[5] == r[5]]
    return WindowStats(
        step=step,
        compute_per_sample=[r[0] for r in rows],
        compute_cv=[r[1] for r in rows],
        wait_frac=[r[2] for r in rows],
        samples_per_s=sum(r[3] for r in rows) / max(walls) if max(walls) > 0 else 0.0,
        loss=sum(loss_values) / len(loss_values) if loss_values else math.nan,
        nonfinite=any(r[6] > 0 for r in rows),
        link_frac=_link_frac(rows),
    )


def _state_on_cpu(state_dict: dict[str, Any]) -> dict[str, Any]:
    """An optimizer's state dict with its per-parameter state copied to the CPU, which ``Optimizer.load_state_dict``
    casts back to each parameter's device and dtype, and its ``param_groups`` deep-copied as they are: the load takes
    those unchanged, so a hyper-parameter held as a device tensor (``lr`` of a capturable or fused Adam) must stay
    there."""
    rest = copy.deepcopy({k: v for k, v in state_dict.items() if k != "state"})
    return {**rest, "state": apply_to_collection(state_dict["state"], torch.Tensor, _on_cpu)}


def _on_cpu(tensor: torch.Tensor) -> torch.Tensor:
    """A copy on the CPU, made once (``.cpu().clone()`` copies a GPU tensor twice)."""
    return tensor.detach().to("cpu", copy=True)

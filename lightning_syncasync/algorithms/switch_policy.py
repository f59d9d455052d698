"""The sync/async switching policy: the design brief's decision flow made quantitative.

The brief's flow is: homogeneous nodes -> synchronous; heterogeneous nodes with enough bandwidth -> hybrid;
otherwise asynchronous with stale-gradient compensation. Sync-Switch (Li et al., "Sync-Switch: Hybrid Parameter
Synchronization for Distributed Deep Learning", ICDCS 2021) adds what makes such a flow safe online: start
synchronous (early training is the most sensitive to staleness; here: no async before ``warmup_steps``, while
``hier``, whose cross-node delay is bounded, may start after the first window), decide per window of steps, only
switch when a signal clears a threshold with hysteresis, stay at least a minimum dwell time in a mode, and fall back
to synchronous training when the loss misbehaves.

Signals, each computed from every rank's window of steps (so every rank computes the same decision):

* communication fraction: the share of step time the *last rank to arrive* spent blocked on communication, step by
  step: in each step the rank that computed longest waited for no peer, so its wait is the network's cost alone;
  the others' wait also holds the time they waited for it. High on a slow inter-node link -> ``hier``. Read per
  step, not per window: under transient pauses the rank that pauses changes from step to step, every rank's
  window mean holds the others' pauses, and the smallest of them read 45-47% on a 100 Mbit/s link whose own cost was
  far less (``jitter_slow_link``), which chose ``hier`` where ``async_ssp`` was 1.23x sooner. Windows without the
  per-step numbers fall back to the smallest per-rank share.
* straggler ratio: max over median of the per-rank compute time *per sample*, each rank's at its median step (a
  transient pause is jitter, not a slower rank: with the mean, pauses read as a straggler ratio up to 2.2 in async
  windows of ``jitter_slow_link``). Per sample, because batch
  rebalancing equalises compute time per step while the slow rank stays slow per sample. Persistent -> stay
  ``sync`` and let :class:`~lightning_syncasync.callbacks.AdaptiveBatchSize` rebalance (when it runs; measured
  better than async on the ``straggler`` benchmark, README), else ``async``.
* jitter: the median over ranks of the coefficient of variation of per-step compute time per sample. Transient
  pauses make every rank's own step times vary while their means stay equal; a synchronous step waits for the
  worst rank of each step, an SSP step absorbs up to ``staleness`` steps of it -> ``async``.
* divergence: a non-finite loss on any rank, or a window loss of ``hier`` or ``async`` that rose above the median
  of the recent healthy windows by more than each of: ``spike_factor - 1`` times that median's size (a ratio; a
  negative loss works too), ``spike_spread`` robust spreads of those windows (1.4826 x their median absolute
  deviation), and ``spike_floor`` times the size of the run's first window loss -> back to ``sync``, restore the last
  good state, and keep the mode that diverged off for ``cooldown_windows`` windows. The ratio alone tripped on noise
  near zero: a 10-step window's mean loss late in training is a few misclassified samples, and it doubled and more
  from one window to the next (committed records: 0.1006 against a median of 0.01438 in async mode, 0.04793 against
  0.02358 in hier; 6 rollbacks in one run). The floor scales with the run's own loss, so it needs no unit.

Torch-free: the callback gathers the numbers; this module only decides.
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import median
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from lightning_syncasync.algorithms.stats import StatsRecorder

MODES = ("sync", "hier", "async")
_RECENT = 10  # healthy windows kept as the spike reference (their median and spread)


class ModeUnavailableError(ValueError):
    """A switch to a mode this run cannot use (``hier`` with a single node and no virtual ``node_size``)."""


@runtime_checkable
class SwitchesModes(Protocol):
    """What a strategy offers the switching callback (``AutoSyncStrategy`` does): its mode, the modes it can use,
    the switch itself, its step statistics and a held-back divergence. The callback works through this and never
    imports the strategy, which adds the callback (callbacks sit above strategies, not beside them)."""

    mode: str
    diverged: float | None  # a non-finite loss held back in async mode; the callback reads and clears it
    sync_stats: StatsRecorder

    @property
    def available_modes(self) -> tuple[str, ...]: ...

    def switch_mode(self, mode: str, step: int | None = None) -> bool:
        """Switch at this step boundary; ``True`` if the mode changed. Raises :class:`ModeUnavailableError`
        (nothing changed) when this run cannot use ``mode``."""
        ...


@dataclass(frozen=True)
class WindowStats:
    """One window of steps, every rank's numbers (index = rank).

    Attributes:
        step: the global step at the end of the window.
        compute_per_sample: each rank's compute seconds per sample at its median step.
        compute_cv: coefficient of variation of each rank's per-step compute time per sample.
        wait_frac: each rank's share of step time spent blocked on communication.
        samples_per_s: global throughput over the window.
        loss: the mean training loss over ranks and steps (``nan`` when no rank reported one).
        nonfinite: some rank saw a non-finite loss in the window.
        link_frac: over the window's steps, the wait of each step's longest-computing rank over its step time
            (``None``: not measured; ``comm_frac`` then reads the smallest ``wait_frac``).
    """

    step: int
    compute_per_sample: list[float]
    compute_cv: list[float]
    wait_frac: list[float]
    samples_per_s: float
    loss: float
    nonfinite: bool = False
    link_frac: float | None = None

    @property
    def straggler_ratio(self) -> float:
        mid = median(self.compute_per_sample)
        return max(self.compute_per_sample) / mid if mid > 0 else 1.0

    @property
    def jitter(self) -> float:
        return median(self.compute_cv)

    @property
    def comm_frac(self) -> float:
        return self.link_frac if self.link_frac is not None else min(self.wait_frac)

    def describe(self) -> str:
        return (
            f"comm {self.comm_frac:.0%}, straggler ratio {self.straggler_ratio:.2f}, jitter {self.jitter:.2f}, "
            f"{self.samples_per_s:.1f} samples/s, loss {self.loss:.4g}"
        )


@dataclass(frozen=True)
class Decision:
    """What to do after a window: the mode to run next, why, and whether to restore the last good state."""

    mode: str
    reason: str
    rollback: bool = False


class SwitchPolicy:
    """Decide the sync mode window by window (see the module docstring).

    Args:
        available: the modes this run can use (``hier`` needs more than one node, real or virtual).
        warmup_steps: steps before the first switch to ``async`` (early training is the most sensitive to stale
            updates); ``hier`` may start after the first window.
        dwell_windows: windows to stay in a mode after a switch before the next one (>= 1).
        comm_high: communication fraction at or above which ``hier`` is chosen (a slow inter-node link).
        straggler_high, straggler_low: straggler ratio to enter / to stay in the straggler regime.
        jitter_high, jitter_low: jitter to enter / to stay in the jitter regime (``async``).
        rebalance: batch rebalancing (``AdaptiveBatchSize``) is running: a persistent straggler stays ``sync``.
        spike_factor: a window loss of ``hier`` or ``async`` above this times the median of the recent healthy
            windows is divergence (> 1), if it also clears the two bounds below.
        spike_spread: ... and rose more than this many robust spreads (1.4826 x the median absolute deviation) of
            the recent healthy windows (>= 0; needs 3 windows).
        spike_floor: ... and rose more than this fraction of the size of the run's first window loss (>= 0): at
            0.1 a classifier starting at 2.3 must rise by 0.23, which noise near zero never did and a blow-up does.
        cooldown_windows: windows a mode that diverged stays off.
        leave_async_windows: windows in a row whose signals must call for leaving ``async`` (a divergence leaves at
            once).

    Example::

        policy = SwitchPolicy(available=("sync", "async"))
        decision = policy.decide(window, current_mode="sync")
    """

    def __init__(
        self,
        available: tuple[str, ...] | list[str] = MODES,
        warmup_steps: int = 20,
        dwell_windows: int = 2,
        comm_high: float = 0.35,
        straggler_high: float = 1.3,
        straggler_low: float = 1.15,
        jitter_high: float = 0.5,
        jitter_low: float = 0.3,
        rebalance: bool = True,
        spike_factor: float = 2.0,
        cooldown_windows: int = 10,
        spike_spread: float = 4.0,
        spike_floor: float = 0.1,
        leave_async_windows: int = 2,
    ) -> None:
        unknown = [m for m in available if m not in MODES]
        if unknown or "sync" not in available:
            raise ValueError(f"available must be a subset of {MODES} containing 'sync', got {list(available)}")
        if warmup_steps < 0:
            raise ValueError(
                f"warmup_steps must be >= 0, got {warmup_steps}; HINT: 0 allows async from the first window"
            )
        if dwell_windows < 1:
            raise ValueError(f"dwell_windows must be >= 1, got {dwell_windows}; HINT: 1 allows a switch every window")
        if not 0 < comm_high < 1:
            raise ValueError(
                f"comm_high must be in (0, 1) (a share of step time), got {comm_high}; HINT: 0.35 picks hier when "
                "communication takes 35% of a step"
            )
        if not 1 <= straggler_low <= straggler_high:
            raise ValueError(
                f"need 1 <= straggler_low <= straggler_high, got {straggler_low} and {straggler_high}; HINT: the "
                "ratio is slowest over median compute per sample, e.g. 1.15 and 1.3"
            )
        if not 0 <= jitter_low <= jitter_high:
            raise ValueError(
                f"need 0 <= jitter_low <= jitter_high, got {jitter_low} and {jitter_high}; HINT: jitter is the median "
                "coefficient of variation of step compute, e.g. 0.3 and 0.5"
            )
        if spike_factor <= 1:
            raise ValueError(f"spike_factor must be > 1, got {spike_factor}; HINT: 2.0 flags a doubled loss")
        if not spike_spread >= 0:
            raise ValueError(
                f"spike_spread must be >= 0, got {spike_spread}; HINT: 4.0 ignores a rise within 4 robust spreads "
                "of the recent windows, 0 turns that bound off"
            )
        if not spike_floor >= 0:
            raise ValueError(
                f"spike_floor must be >= 0, got {spike_floor}; HINT: 0.1 ignores a rise under 10% of the first "
                "window's loss, 0 turns that bound off"
            )
        if leave_async_windows < 1:
            raise ValueError(
                f"leave_async_windows must be >= 1, got {leave_async_windows}; HINT: 2 leaves async once two windows "
                "in a row call for it, 1 at the first"
            )
        if cooldown_windows < 0:
            raise ValueError(
                f"cooldown_windows must be >= 0, got {cooldown_windows}; HINT: 0 lets a diverged mode be chosen again "
                "at once"
            )
        self.available = tuple(available)
        self.warmup_steps = warmup_steps
        self.dwell_windows = dwell_windows
        self.comm_high = comm_high
        self.straggler_high, self.straggler_low = straggler_high, straggler_low
        self.jitter_high, self.jitter_low = jitter_high, jitter_low
        self.rebalance = rebalance
        self.spike_factor = spike_factor
        self.spike_spread = spike_spread
        self.spike_floor = spike_floor
        self.cooldown_windows = cooldown_windows
        self.first_loss: float | None = None  # the run's first window loss: the scale of spike_floor
        self.leave_async_windows = leave_async_windows
        self._leave_votes = 0  # windows in a row that called for leaving async
        self.windows_in_mode = dwell_windows  # the starting mode was not a switch: the first window may switch
        self.recent_losses: list[float] = []  # healthy windows, newest last
        self.banned: dict[str, int] = {}  # mode -> windows left

    def decide(self, window: WindowStats, mode: str) -> Decision:
        """The decision after ``window``, which ran in ``mode``."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.windows_in_mode += 1
        self.banned = {m: n - 1 for m, n in self.banned.items() if n > 1}
        # The median of the recent healthy windows, not their best: late in training a window's mean loss is small
        # and noisy, and against the best one a noisy window read as a spike (jitter_long, auto_sync in async mode:
        # 0.061 > 2 x 0.029).
        limit, why = self._spike_limit()
        # A spike is what staleness or drift can cause: only a window of hier or async is rolled back for one. A
        # synchronous window is DDP's own trajectory (rolling it back replays it), and after a rollback the
        # restored state's loss, above the limit of the windows before it, rolled back window after window.
        spiked = mode != "sync" and limit is not None and window.loss == window.loss and window.loss > limit
        if window.nonfinite or spiked:
            what = "a non-finite loss" if window.nonfinite else f"loss {window.loss:.4g} > {limit:.4g} ({why})"
            if mode != "sync" and self.cooldown_windows:
                self.banned[mode] = self.cooldown_windows
            self.windows_in_mode = 0
            self.recent_losses = []  # the restored state's windows are the new reference
            return Decision("sync", f"divergence ({what}) in {mode}: restore the last good state, synchronous", True)
        if window.loss == window.loss:  # not NaN: a window with a loss
            self.recent_losses = [*self.recent_losses, window.loss][-_RECENT:]
            if self.first_loss is None:
                self.first_loss = window.loss
        if self.windows_in_mode < self.dwell_windows:
            return Decision(mode, f"dwell ({self.windows_in_mode}/{self.dwell_windows} windows in {mode})")
        want, why = self._want(window, mode)
        if want == "async" and window.step < self.warmup_steps:
            # Early training is the most sensitive to stale updates (Sync-Switch); hier's bounded cross-node delay
            # is what hier_sync runs from step 0, so only async waits for the warm-up.
            return Decision(mode, f"{why}; but synchronous warm-up ({window.step} < {self.warmup_steps} steps)")
        if want != mode and want in self.banned:
            return Decision(mode, f"{why}; but {want} diverged recently (off for {self.banned[want]} more windows)")
        if mode == "async" and want != mode:
            # Pauses are rare events: in a 10-step window at p=0.1 a third of the ranks draw none, and one quiet
            # window read as "no jitter" took jitter_slow_link out of async for two windows (jitter 0.12 between
            # windows of 0.55-0.87). Leaving async waits for the signal to be gone in windows in a row.
            self._leave_votes += 1
            if self._leave_votes < self.leave_async_windows:
                return Decision(mode, f"{why}; but confirming ({self._leave_votes}/{self.leave_async_windows} windows)")
        self._leave_votes = 0
        if want != mode:
            self.windows_in_mode = 0
        return Decision(want, why)

    def _spike_limit(self) -> tuple[float | None, str]:
        """The loss above which a window is a spike, and the bound that set it (``None`` before any window)."""
        if not self.recent_losses:
            return None, ""
        base = median(self.recent_losses)
        # A rise of (spike_factor - 1) times the base's size above it: spike_factor x base for a positive loss, and
        # still a rise for a negative one (a log-likelihood), where `loss > spike_factor * base` held for every
        # loss that kept falling below zero (-31 > 2 x -18.5), rolled back every window and lost the updates.
        rises = [((self.spike_factor - 1) * abs(base), f"{self.spike_factor:g} x the median recent {base:.4g}")]
        if len(self.recent_losses) >= 3 and self.spike_spread > 0:
            spread = 1.4826 * median(abs(x - base) for x in self.recent_losses)
            why = f"median recent {base:.4g} + {self.spike_spread:g} robust spreads of {spread:.3g}"
            rises.append((self.spike_spread * spread, why))
        if self.first_loss is not None and self.spike_floor > 0:
            why = f"median recent {base:.4g} + {self.spike_floor:g} x the first window's {self.first_loss:.4g}"
            rises.append((self.spike_floor * abs(self.first_loss), why))
        rise, why = max(rises, key=lambda r: r[0])
        return base + rise, why

    def _want(self, w: WindowStats, mode: str) -> tuple[str, str]:
        if "hier" in self.available and mode == "hier":
            # In hier the flat all-reduce's cost cannot be observed: the link is taken as still slow. Pauses are
            # observed, and async's rounds cross the slow link as hier's do, so pauses still reach async.
            if "async" in self.available and w.jitter >= self.jitter_high:
                return "async", f"jitter {w.jitter:.2f} >= {self.jitter_high:g} on the slow link: asynchronous (SSP)"
            return "hier", "slow inter-node link (measured before switching): stay hierarchical"
        if "hier" in self.available and w.comm_frac >= self.comm_high:
            return "hier", f"communication {w.comm_frac:.0%} >= {self.comm_high:.0%} of the step: hierarchical sync"
        ratio, jitter = w.straggler_ratio, w.jitter
        in_async = mode == "async"
        if "async" in self.available and jitter >= (self.jitter_low if in_async else self.jitter_high):
            limit = self.jitter_low if in_async else self.jitter_high
            return "async", f"jitter {jitter:.2f} >= {limit:g} (transient pauses): asynchronous (SSP)"
        if "hier" in self.available and "async" not in self.available and jitter >= self.jitter_high:
            # Async off: the flat all-reduce would make every rank wait for every pause each step; hier waits only
            # for the node-mate's, and crosses the link at its period (jitter_slow_link: hier_sync's time to target
            # 23.1 s against ddp's 32.9, docs/benchmarks.md).
            return "hier", f"jitter {jitter:.2f} >= {self.jitter_high:g} and async off: hierarchical sync"
        if ratio >= (self.straggler_low if in_async else self.straggler_high):
            if self.rebalance:
                return "sync", (
                    f"persistent straggler (ratio {ratio:.2f}): synchronous with batch rebalancing (measured faster "
                    "than async under a persistent straggler)"
                )
            if "async" in self.available:
                return "async", f"persistent straggler (ratio {ratio:.2f}), no rebalancing: asynchronous"
        return "sync", f"homogeneous (ratio {ratio:.2f}, jitter {jitter:.2f}, comm {w.comm_frac:.0%}): synchronous"

    def state_dict(self) -> dict[str, Any]:
        return {"windows_in_mode": self.windows_in_mode, "recent_losses": list(self.recent_losses),
                "banned": dict(self.banned), "first_loss": self.first_loss}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.windows_in_mode = int(state["windows_in_mode"])
        self.recent_losses = [float(x) for x in state["recent_losses"]]
        self.banned = {str(k): int(v) for k, v in state["banned"].items()}
        first = state.get("first_loss")  # absent from checkpoints of before the floor: the next window sets it
        self.first_loss = None if first is None else float(first)

"""``RoundLength``: a round's length in local steps, decided from what the strategy measures on its own link.

Every round-level strategy (``async_ssp``'s rounds, ``hier_sync``'s cross-node period, their sharded forms,
``auto_sync``'s hier and async modes) asks one of these instead of carrying a constant. The rule:

    the shortest round whose exchange is hidden behind the compute of the rounds it may overlap, with a margin:
    ``H = ceil(margin x exchange_s / (overlap x step_s))``, clamped to ``[min_steps, max_steps]``.

``step_s`` is the compute time of one local step (the loop's time between two steps, not counting waits on the
exchange); ``exchange_s`` the measured duration of one round's exchange over the actual link (the collective on the
exchange thread, not the time it sat in a queue); ``overlap`` the rounds of compute an exchange may hide behind (the
staleness bound: 1 for ``async_ssp``'s default and for ``hier_sync``, whose delay follows). Then time to target
follows learning where the link allows it, and throughput where it does not (a round never waits for its exchange),
as long as shorter rounds learn more per sample: true of the MNIST scenarios with Adam (rounds of 4 needed 0.88x the
samples of 8), not of ``link_bound``'s SGD-with-momentum CNN, where rounds of 16 were soonest on both links and the
rule's choice took 1.2x their time (docs/benchmarks.md#self-tuned-round-length-issue-64). A rule that reads learning
per sample, or the CPU an exchange takes from the steps, is the known next step.

Why not a fixed period (torch's ``PeriodicModelAverager``, DiLoCo's H) or AdaComm's loss-driven period (Wang & Joshi,
2019): a fixed period is right for one ratio of compute to link only. On the 3.3 MB convnet of issue 64 at
100 Mbit/s, rounds of 4 steps (the old default) spent 3x longer in their exchange than in their compute; at
1 Gbit/s the former ``async_ssp`` default reached the target at 0.81x DDP's speed (issue 64's user), where the
self-tuned one is 1.38x [1.14-1.40] as fast.

Re-deciding (a link that slows mid-run): measurements are smoothed (a moving average), and the length changes only
when the rule's answer leaves a band around the current one: up at once when the current round no longer hides its
exchange (rounds would wait), down only when the rule asks for ``drift`` times fewer steps (so noise in the
measurements does not make rounds flap). The caller feeds measurements every rank agrees on (from a round's
metadata, after its exchange) and applies a change at the same round on every rank, so the decision itself needs no
collective.

A length the user pinned (``fixed``) is kept: :meth:`update` still reads the measurements, and :attr:`warning` says
once, with the numbers and the fix, when the pinned rounds are link-bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Defaults of the rule, measured on two links whose compute-to-communication ratios differ 10x (link_bound and
# link_fast, 5 seeds, docs/benchmarks.md#self-tuned-round-length-issue-64): 6.06x and 1.38x DDP's speed to the target
# for async_ssp, never behind DDP. Margin 1.5: an exchange measured at most 2/3 of the rounds it hides behind, since
# a step's time and a transfer's both wander by about a quarter on a shared machine.
DEFAULT_MARGIN = 1.5
DEFAULT_MAX_STEPS = 64
DEFAULT_START_STEPS = 4
DEFAULT_DRIFT = 1.5
_EMA = 0.3  # weight of a new measurement: a change of link shows within a few rounds, one slow round does not


@dataclass
class RoundDecision:
    """One decision, for logs and ``SyncMonitor``'s summary: the length and the measurements it came from."""

    steps: int
    step_s: float
    exchange_s: float
    reason: str

    def describe(self) -> str:
        return (
            f"{self.steps} steps a round ({self.reason}: exchange {self.exchange_s * 1e3:.0f} ms, "
            f"step {self.step_s * 1e3:.1f} ms)"
        )


class RoundLength:
    """The length of a round in local steps, from measured step and exchange times (module docstring).

    Args:
        fixed: a length the user set; kept whatever the measurements say (``None``: decided from them).
        min_steps: the shortest round the rule may choose (``async_ssp`` needs 2: one step is its per-step mode).
        max_steps: the longest; a link too slow for it is reported once (:attr:`warning`) and training goes on.
        margin: how much longer than its exchange the compute it hides behind must be (> 1).
        overlap: rounds of compute one exchange may hide behind (the staleness bound, >= 1).
        start: the length until the first measurement arrives.
        drift: how many times shorter the rule's answer must be before the rounds shorten (> 1).

    Example::

        policy = RoundLength(min_steps=2)
        policy.update(step_s=0.05, exchange_s=0.30)   # -> 9: nine 50 ms steps hide a 300 ms exchange, 1.5x over
    """

    def __init__(
        self,
        fixed: int | None = None,
        min_steps: int = 1,
        max_steps: int = DEFAULT_MAX_STEPS,
        margin: float = DEFAULT_MARGIN,
        overlap: float = 1.0,
        start: int = DEFAULT_START_STEPS,
        drift: float = DEFAULT_DRIFT,
    ) -> None:
        if fixed is not None and (not isinstance(fixed, int) or isinstance(fixed, bool) or fixed < 1):
            raise ValueError(f"fixed must be an integer >= 1 or None, got {fixed!r}; HINT: None decides from the link")
        if not isinstance(min_steps, int) or min_steps < 1:
            raise ValueError(f"min_steps must be an integer >= 1, got {min_steps!r}")
        if not isinstance(max_steps, int) or max_steps < min_steps:
            raise ValueError(f"max_steps must be an integer >= min_steps ({min_steps}), got {max_steps!r}")
        if not margin > 1.0:
            raise ValueError(f"margin must be > 1, got {margin!r}; HINT: {DEFAULT_MARGIN} (the exchange at 2/3)")
        if not overlap > 0:
            raise ValueError(f"overlap must be > 0 rounds, got {overlap!r}; HINT: the staleness bound, usually 1")
        if not drift > 1.0:
            raise ValueError(f"drift must be > 1, got {drift!r}; HINT: {DEFAULT_DRIFT}")
        self.fixed = fixed
        self.min_steps, self.max_steps = min_steps, max_steps
        self.margin, self.overlap, self.drift = margin, overlap, drift
        self.steps = fixed if fixed is not None else min(max(start, min_steps), max_steps)
        self.step_s: float | None = None
        self.exchange_s: float | None = None
        self.decisions: list[RoundDecision] = []  # every change (and the first measured decision)
        self.warning: str | None = None  # set once: pinned rounds that are link-bound, or a link too slow for any
        self._warned = False

    @property
    def auto(self) -> bool:
        return self.fixed is None

    def rule(self, step_s: float, exchange_s: float) -> int:
        """The rule alone: the shortest length whose exchange hides behind ``overlap`` rounds, with the margin."""
        if step_s <= 0:
            return self.max_steps
        need = math.ceil(self.margin * exchange_s / (self.overlap * step_s) - 1e-9)
        return min(max(need, self.min_steps), self.max_steps)

    def hidden(self, steps: int, step_s: float, exchange_s: float) -> bool:
        """Whether rounds of ``steps`` hide an exchange of ``exchange_s`` (no margin: does the loop wait?)."""
        return steps * step_s * self.overlap >= exchange_s

    def update(self, step_s: float, exchange_s: float) -> int | None:
        """Feed one agreed measurement (seconds per compute step, seconds per exchange); returns the new length
        when it changes, else ``None``. Every rank calls it with the same numbers at the same round."""
        if not (math.isfinite(step_s) and math.isfinite(exchange_s)) or step_s <= 0 or exchange_s < 0:
            return None  # nothing measured yet (a round with no step, the first rounds)
        first = self.step_s is None
        self.step_s = step_s if self.step_s is None else (1 - _EMA) * self.step_s + _EMA * step_s
        self.exchange_s = exchange_s if self.exchange_s is None else (1 - _EMA) * self.exchange_s + _EMA * exchange_s
        want = self.rule(self.step_s, self.exchange_s)
        self._check_limits(want)
        if self.fixed is not None:
            return None
        if want > self.steps and not self.hidden(self.steps, self.step_s, self.exchange_s):
            reason = "link-bound: longer"
        elif want > self.steps and first:
            reason = "measured"
        elif want * self.drift <= self.steps or (first and want < self.steps):
            reason = "link has room: shorter"
        else:
            return None
        self.steps = want
        self.decisions.append(RoundDecision(want, self.step_s, self.exchange_s, reason))
        return want

    def take_warning(self) -> str | None:
        """The warning, once (``None`` after it was taken, or when there is none)."""
        warning, self.warning = self.warning, None
        return warning

    def describe(self) -> str:
        """One line for logs and the summary: the current length and where it came from."""
        how = f"pinned at {self.fixed}" if self.fixed is not None else "self-tuned"
        if self.step_s is None or self.exchange_s is None:
            return f"{self.steps} steps a round ({how}; not measured yet)"
        return (
            f"{self.steps} steps a round ({how}; exchange {self.exchange_s * 1e3:.0f} ms over a step of "
            f"{self.step_s * 1e3:.1f} ms, the rule's answer {self.rule(self.step_s, self.exchange_s)})"
        )

    def _check_limits(self, want: int) -> None:
        if self._warned or self.step_s is None or self.exchange_s is None:
            return
        step_s, exchange_s = self.step_s, self.exchange_s
        if self.fixed is not None and not self.hidden(self.fixed, step_s, exchange_s):
            self.warning = (
                f"rounds pinned at {self.fixed} steps are link-bound: a round's exchange takes {exchange_s * 1e3:.0f} "
                f"ms and {self.fixed} steps compute {self.fixed * step_s * 1e3:.0f} ms, so every round waits about "
                f"{(exchange_s / self.overlap - self.fixed * step_s) * 1e3:.0f} ms for the link. HINT: leave the "
                f"length unset to let it follow the link (it would choose {want} now), or set it to {want} or more"
            )
        elif self.fixed is None and not self.hidden(self.max_steps, step_s, exchange_s):
            self.warning = (
                f"the link is too slow for even the longest round: an exchange takes {exchange_s * 1e3:.0f} ms and "
                f"{self.max_steps} steps (the longest allowed) compute {self.max_steps * step_s * 1e3:.0f} ms; "
                "training goes on with rounds of the longest length, waiting for the link. HINT: compression "
                "(int8 or int4) cuts the exchange's bytes 4-8x"
            )
        if self.warning is not None:
            self._warned = True

"""``StragglerEmulator``: make chosen ranks slow on purpose, reproducibly, to study stragglers.

Three kinds of slowness, each given as a spec string (the same syntax as ``syncasync-emulate``):

* ``slowdown="3:1.5"``: rank 3 takes 1.5x its compute time every step (persistent heterogeneity);
* ``schedule="3:2@0.33-0.67"``: rank 3 is 2x slower between 33% and 67% of the planned steps (a straggler that
  appears and recovers mid-run);
* ``jitter="0.1:4"``: each step, each rank pauses for 4x its compute time with probability 0.1 (transient noise),
  drawn from a generator seeded by ``seed`` and the rank, so runs are repeatable; ``jitter="0.1:4@0.67-1"`` only
  in the last third of the planned steps.

And one change of the network, which the emulator applies: ``link="20@0.33-0.67"``: the inter-node link runs at
20 Mbit/s between 33% and 67% of the planned steps (another job's traffic), at the emulation's own rate outside.
Global rank 0 writes the rate it wants into the file ``SYNCASYNC_LINK_CONTROL`` names, at the step the window opens
or closes, and ``syncasync-emulate`` re-rates every node's link (``tc``) when the file changes: the phases follow
the training's progress, as the slowdown windows do, so every strategy trains the same share of its steps under each
condition.

The extra time is injected as a sleep at the start of the step, so ``SyncMonitor`` counts it as compute (which is
what a slower machine costs), and it is scaled by the step's own compute time measured by ``SyncMonitor`` (without
the sleep injected before). Sleeping frees the CPU for other processes on the same machine, which makes them faster
and understates the slowdown (FINDINGS: a rank slept 1.5x slower measured only 1.07-1.28x slower with 4 processes
on 2 cores). ``syncasync-emulate`` therefore caps every rank's CPU share with cgroups, under which a sleep costs
exactly its duration; persistent slowdowns are applied there as smaller CPU shares, and this callback handles the
time-dependent parts. ``syncasync-emulate`` passes the specs through environment variables, which
:meth:`StragglerEmulator.from_env` reads; ``syncasync-train`` adds the callback when they are set.
"""

from __future__ import annotations

import logging
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_syncasync.callbacks._stats_source import stats_recorder

log = logging.getLogger(__name__)

ENV_SLOWDOWN = "SYNCASYNC_SLOWDOWN"
ENV_SCHEDULE = "SYNCASYNC_SLOWDOWN_SCHEDULE"
ENV_JITTER = "SYNCASYNC_JITTER"
ENV_SEED = "SYNCASYNC_STRAGGLER_SEED"
ENV_LINK_SCHEDULE = "SYNCASYNC_LINK_SCHEDULE"
ENV_LINK_CONTROL = "SYNCASYNC_LINK_CONTROL"  # the file the emulator watches (set by syncasync-emulate)
# "HOST:PORT:WORLD" of a TCPStore: ranks that do not communicate (the emulator's --independent runs) wait for each
# other there before training, so that they train at the same time and share the machine the way ranks of a real
# job do. Without it, ranks whose imports finish early train alone for a while, faster than they would together.
ENV_START_BARRIER = "SYNCASYNC_START_BARRIER"


@dataclass(frozen=True)
class LinkWindow:
    """The inter-node link runs at ``mbit`` Mbit/s between fractions ``start`` and ``end`` of the planned steps."""

    mbit: float
    start: float
    end: float


@dataclass(frozen=True)
class Window:
    """Rank ``rank`` is ``factor`` times slower between fractions ``start`` and ``end`` of the planned steps."""

    rank: int
    factor: float
    start: float = 0.0
    end: float = 1.0


def parse_slowdown(spec: str) -> list[Window]:
    """``"3:1.5,2:1.2"`` -> persistent windows."""
    out = []
    for item in _items(spec):
        rank, factor = _pair(item, "slowdown", "RANK:FACTOR, e.g. 3:1.5")
        out.append(Window(int(rank), _factor(factor, "slowdown", "3:1.5")))
    return out


def parse_schedule(spec: str) -> list[Window]:
    """``"3:2@0.33-0.67"`` -> time windows (fractions of the planned steps)."""
    out = []
    for item in _items(spec):
        head, _, span = item.partition("@")
        rank, factor = _pair(head, "schedule", "RANK:FACTOR@START-END, e.g. 3:2@0.33-0.67")
        lo, hi = _span(span, item, "schedule", "3:2@0.33-0.67")
        out.append(Window(int(rank), _factor(factor, "schedule", "3:2@0.33-0.67"), lo, hi))
    return out


def parse_jitter(spec: str) -> tuple[float, float]:
    """``"0.1:4"`` (or ``"0.1:4@0.67-1"``) -> (probability, factor); ``""`` -> (0, 0)."""
    if not spec.strip():
        return 0.0, 0.0
    head, _, span = spec.strip().partition("@")
    if span:
        _span(span, spec, "jitter", "0.1:4@0.67-1")
    prob, factor = _pair(head, "jitter", "PROB:FACTOR[@START-END], e.g. 0.1:4")
    p = float(prob)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"jitter probability must be in [0, 1], got {p}; e.g. jitter=0.1:4")
    f = float(factor)
    if f <= 0:
        raise ValueError(f"jitter factor must be > 0 (pause = factor x compute time), got {f}; e.g. jitter=0.1:4")
    return p, f


def parse_jitter_window(spec: str) -> tuple[float, float]:
    """The fractions of the planned steps where ``spec``'s pauses happen: ``(0, 1)`` without ``@START-END``."""
    _, _, span = spec.strip().partition("@")
    return _span(span, spec, "jitter", "0.1:4@0.67-1") if span else (0.0, 1.0)


def parse_link(spec: str) -> list[LinkWindow]:
    """``"20@0.33-0.67"`` -> link-rate windows (Mbit/s, fractions of the planned steps), which must not overlap."""
    out = []
    for item in _items(spec):
        rate, sep, span = item.partition("@")
        try:
            mbit = float(rate)
        except ValueError:
            mbit = float("nan")
        if not sep or not mbit > 0:
            raise ValueError(
                f"link item {item!r} is not of the form MBIT@START-END with MBIT > 0, e.g. 20@0.33-0.67 (the link at "
                "20 Mbit/s from 33% to 67% of the steps)"
            )
        out.append(LinkWindow(mbit, *_span(span, item, "link", "20@0.33-0.67")))
    out.sort(key=lambda w: w.start)
    for a, b in zip(out, out[1:], strict=False):
        if b.start < a.end:
            raise ValueError(f"link windows {spec!r} overlap; HINT: one rate at a time, e.g. 20@0.33-0.67,50@0.67-1")
    return out


def _span(span: str, item: str, name: str, example: str) -> tuple[float, float]:
    start, sep, end = span.partition("-")
    try:
        lo, hi = (float(start), float(end)) if sep else (float("nan"), float("nan"))
    except ValueError:
        lo = hi = float("nan")
    if not 0.0 <= lo < hi <= 1.0:
        raise ValueError(
            f"{name} item {item!r}: the window must be START-END with 0 <= START < END <= 1, e.g. {example}"
        )
    return lo, hi


def _items(spec: str) -> list[str]:
    return [s.strip() for s in spec.split(",") if s.strip()]


def _pair(item: str, name: str, form: str) -> tuple[str, str]:
    a, sep, b = item.partition(":")
    try:
        if not sep:
            raise ValueError
        float(b)
        if name != "jitter" and int(a) < 0:
            raise ValueError
        float(a)
    except ValueError:
        raise ValueError(f"{name} item {item!r} is not of the form {form}") from None
    return a, b


def _factor(value: str, name: str, example: str) -> float:
    f = float(value)
    if f < 1.0:
        raise ValueError(f"{name} factor must be >= 1 (1.5 = 1.5x slower), got {f}; e.g. {name}={example}")
    return f


class StragglerEmulator(Callback):
    """Inject reproducible slowness into chosen ranks (see the module docstring for the spec syntax).

    Args:
        slowdown: persistent per-rank slowdowns, ``"RANK:FACTOR,..."`` (sleep based; prefer the emulator's cgroup
            shares for these, which do not free CPU for the others).
        schedule: time-windowed slowdowns, ``"RANK:FACTOR@START-END,..."`` with fractions of the planned steps.
        jitter: transient pauses, ``"PROB:FACTOR"``, or ``"PROB:FACTOR@START-END"`` in a window of the steps.
        seed: seed of the jitter draws (combined with the rank).
        link: inter-node link-rate windows, ``"MBIT@START-END,..."``: global rank 0 writes the rate due into
            ``link_control`` (a file ``syncasync-emulate`` watches and applies), ``0`` outside every window (the
            emulation's own rate).
        link_control: that file (``syncasync-emulate`` sets ``SYNCASYNC_LINK_CONTROL``).

    Example::

        Trainer(callbacks=[SyncMonitor(), StragglerEmulator(jitter="0.1:4", seed=1)])
    """

    def __init__(
        self,
        slowdown: str = "",
        schedule: str = "",
        jitter: str = "",
        seed: int = 0,
        start_barrier: str = "",
        link: str = "",
        link_control: str = "",
    ) -> None:
        super().__init__()
        if start_barrier and len(start_barrier.split(":")) != 3:
            raise ValueError(
                f"start_barrier must be HOST:PORT:WORLD, got {start_barrier!r}; HINT: e.g. 127.0.0.1:29500:4, or leave "
                "it empty (syncasync-emulate --independent sets it)"
            )
        self.start_barrier = start_barrier
        self.windows = parse_slowdown(slowdown) + parse_schedule(schedule)
        self.jitter_prob, self.jitter_factor = parse_jitter(jitter)
        self.jitter_window = parse_jitter_window(jitter)
        self.link = parse_link(link)
        if self.link and not link_control:
            raise ValueError(
                f"link={link!r} needs link_control, the file the emulator watches; HINT: run under syncasync-emulate "
                "(--link-schedule), which sets SYNCASYNC_LINK_CONTROL"
            )
        self.link_control = link_control
        self.link_changes: list[tuple[int, float]] = []  # (global step, Mbit/s written; 0: the emulation's own)
        self._link_due: float | None = None
        self.seed = seed
        self.spec = {"slowdown": slowdown, "schedule": schedule, "jitter": jitter, "seed": seed, "link": link}
        self._rng = random.Random(seed)
        self._last_sleep = 0.0
        self._planned_steps = 0
        self.injected_s = 0.0
        self.events = 0
        self._step_start = 0.0
        self._own_wall: float | None = None
        self._last_seen_step: int | None = None
        self._planned_s: float | None = None
        self._train_start = 0.0

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> StragglerEmulator | None:
        """The emulator configured by ``syncasync-emulate``'s environment variables, or ``None`` if none is set.

        A bad value is rejected naming the variable, since the user never typed the callback's arguments."""
        env = os.environ if environ is None else environ
        parsers = (
            ("slowdown", ENV_SLOWDOWN, parse_slowdown),
            ("schedule", ENV_SCHEDULE, parse_schedule),
            ("jitter", ENV_JITTER, parse_jitter),
        )
        specs = {key: env.get(var, "") for key, var, _ in parsers}
        link = env.get(ENV_LINK_SCHEDULE, "")
        if not any(s.strip() for s in [*specs.values(), link]):
            return None
        try:
            parse_link(link)
        except ValueError as err:
            raise ValueError(f"{ENV_LINK_SCHEDULE}={link!r}: {err}") from None
        for key, var, parse in parsers:
            try:
                parse(specs[key])
            except ValueError as err:
                raise ValueError(f"{var}={specs[key]!r}: {err}") from None
        seed = env.get(ENV_SEED, "0")
        try:
            seed_value = int(seed)
        except ValueError:
            raise ValueError(
                f"{ENV_SEED} must be an integer, got {seed!r}; HINT: syncasync-emulate --seed sets it, e.g. --seed 0"
            ) from None
        return cls(**specs, seed=seed_value, link=link, link_control=env.get(ENV_LINK_CONTROL, ""))

    @property
    def active(self) -> bool:
        return bool(self.windows) or self.jitter_prob > 0 or bool(self.link)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Different ranks draw different jitter, and the same rank draws the same sequence in every run.
        self._rng = random.Random(self.seed * 1_000_003 + trainer.global_rank)
        # async_ssp with claim_batches turns max_steps into a budget over ranks: it says what the run planned.
        planned = getattr(trainer.strategy, "planned_steps", None) or trainer.estimated_stepping_batches
        self._planned_steps = int(planned) if planned != float("inf") else 0
        # A run bounded by time instead of steps (the benchmark's no-communication runs use max_time): windows are
        # then fractions of that time.
        from lightning.pytorch.callbacks import Timer

        timer = next((c for c in trainer.callbacks if isinstance(c, Timer)), None)
        self._planned_s = timer._duration if (timer is not None and not self._planned_steps) else None
        self._train_start = time.perf_counter()
        self._last_sleep = 0.0
        self._link_due = None
        if self.active:
            log.info("rank %d: straggler emulation %s", trainer.global_rank, self.spec)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.start_barrier:
            _wait_at_barrier(self.start_barrier)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self.active:
            return
        self._step_start = time.perf_counter()
        progress = self._progress(trainer)
        if self.link and trainer.global_rank == 0:
            self._steer_link(trainer, progress)
        last = stats_recorder(trainer).last
        if last is not None and last.step != self._last_seen_step:
            measured = last.compute_s  # SyncMonitor's figure: wall time minus communication wait
            self._last_seen_step = last.step
        elif self._own_wall is not None:
            measured = self._own_wall  # no SyncMonitor: the whole step's wall time is the best estimate
        else:
            self._last_sleep = 0.0
            return  # no measurement yet: the first step runs at native speed
        compute = max(measured - self._last_sleep, 0.0)
        factor = 1.0
        for w in self.windows:
            if w.rank == trainer.global_rank and w.start <= progress < w.end:
                factor *= w.factor
        sleep = (factor - 1.0) * compute
        lo, hi = self.jitter_window
        in_window = lo <= progress and (progress < hi or hi >= 1.0)  # a window to the end includes any overrun
        if self.jitter_prob > 0 and in_window and self._rng.random() < self.jitter_prob:
            sleep += self.jitter_factor * compute
            self.events += 1
        self._last_sleep = sleep
        if sleep > 0:
            self.injected_s += sleep
            time.sleep(sleep)

    def _progress(self, trainer: pl.Trainer) -> float:
        """The fraction of the planned steps (or time) done: the clock of every window."""
        if self._planned_steps:
            return trainer.global_step / self._planned_steps
        if self._planned_s:
            return (time.perf_counter() - self._train_start) / self._planned_s
        return 0.0

    def _steer_link(self, trainer: pl.Trainer, progress: float) -> None:
        due = next((w.mbit for w in self.link if w.start <= progress < w.end), 0.0)
        if due == self._link_due:
            return
        self._link_due = due
        # Written whole then renamed: the emulator never reads half a rate.
        path = Path(self.link_control)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(f"{due:g}\n")
        os.replace(tmp, path)
        self.link_changes.append((trainer.global_step, due))
        log.info("step %d: link rate %s", trainer.global_step, f"{due:g} Mbit/s" if due else "back to its own")

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.active:
            self._own_wall = time.perf_counter() - self._step_start


def _wait_at_barrier(spec: str, timeout_s: float = 600.0) -> None:
    import datetime

    import torch.distributed as dist

    host, port, world = spec.split(":")
    store = dist.TCPStore(host, int(port), int(world), is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
    arrived = store.add("arrived", 1)
    if arrived == int(world):
        store.set("go", "1")
    store.wait(["go"])
    log.info("start barrier passed (%s ranks)", world)

"""The expert settings of the pack's strategies, one options object per family.

A strategy's constructor is what a user reads: the settings that decide what the job does (``inter_period``,
``staleness``, ``local_steps``, ``compression``...). What only a study needs (the outer optimizer's constants, the
per-step exchange's pacing, the timeouts, a compressor's extra arguments) sits here, behind ``options=``, as
torch's DDP keeps its buckets behind keywords and Lightning passes them through. Every field keeps working and is
reachable from Hydra (``strategy.options.outer=nesterov``) and the Lightning CLI
(``--trainer.strategy.options.outer=nesterov``); the strategies also take the fields as keywords, the spelling they
had before (``AsyncSSPStrategy(outer="nesterov")``), so no script breaks.

Why each default is what it is: ``docs/strategies.md#expert-settings``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

Outer = Literal["average", "nesterov", "delayed_nesterov"]
Compensation = Literal["none", "staleness_lr", "dc_asgd", "dc_asgd_adaptive"]


@dataclass(frozen=True)
class HierSyncOptions:
    """Expert settings of ``hier_sync`` and ``hier_sync_sharded``.

    Args:
        outer: how a node applies the cross-node average: ``average`` (replace), ``nesterov`` (DiLoCo) or
            ``delayed_nesterov`` (:mod:`~lightning_syncasync.algorithms.averaging.outer`).
        outer_lr, outer_momentum: the Nesterov variants' settings (``outer_lr=1.0`` with ``average`` is the plain
            average).
        compression_options: extra :class:`~lightning_syncasync.algorithms.compression.Compressor` arguments.
        peer_timeout_s: a cross-node round that waits longer than this ends the run with an error naming the peer.
    """

    outer: Outer = "average"
    outer_lr: float = 1.0
    outer_momentum: float = 0.9
    compression_options: dict[str, Any] = field(default_factory=dict)
    peer_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        _plain_dict(self)


@dataclass(frozen=True)
class AsyncSSPOptions:
    """Expert settings of ``async_ssp`` and ``async_ssp_sharded`` (the sharded form trains in rounds only, so it
    refuses the per-step fields set away from their defaults).

    Args:
        outer: the rounds' outer optimizer: ``average``, ``nesterov`` (DiLoCo) or ``delayed_nesterov``.
        outer_lr, outer_momentum: the Nesterov variants' settings.
        outer_momentum_every: rounds per momentum update of ``delayed_nesterov``.
        dynamic_local_steps: rounds of wall-clock length, so each rank's local steps follow its speed (``False``:
            every round is ``local_steps`` steps on every rank, a repeatable trajectory).
        round_s: a fixed round length in seconds instead of ``local_steps x`` the measured mean step time.
        compensation: per-step mode (``local_steps=1``) only: the stale-gradient compensation, ``none``,
            ``staleness_lr``, ``dc_asgd`` or ``dc_asgd_adaptive``
            (:class:`~lightning_syncasync.algorithms.ssp.StaleGradientCompensation`).
        lam: DC-ASGD's ``lambda``.
        compression_options: extra ``Compressor`` arguments.
        peer_timeout_s: a gate wait, cut or exchange round longer than this ends the run with an error naming the
            lost rank.
        round_interval_s: per-step mode: the shortest a rank's exchange thread waits for a new local step before an
            idle round.
        exchange_every: per-step mode: local steps a rank accumulates before joining an exchange round.
    """

    outer: Outer = "average"
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    outer_momentum_every: int = 2
    dynamic_local_steps: bool = True
    round_s: float | None = None
    compensation: Compensation = "dc_asgd_adaptive"
    lam: float = 1.0
    compression_options: dict[str, Any] = field(default_factory=dict)
    peer_timeout_s: float = 60.0
    round_interval_s: float = 0.005
    exchange_every: int = 1

    def __post_init__(self) -> None:
        _plain_dict(self)


@dataclass(frozen=True)
class FaultTolerantOptions:
    """Expert settings of ``hier_sync_ft`` and ``async_ssp_ft``.

    Args:
        outer: the rounds' outer optimizer: ``average``, ``nesterov`` or ``delayed_nesterov``.
        outer_lr, outer_momentum: the Nesterov variants' settings.
        timeout_s: torchft's timeout of one managed collective.
        quorum_timeout_s: how long a quorum waits for ``min_replicas`` nodes.
        connect_timeout_s: how long a node waits to reach the lighthouse.
        peer_timeout_s: a round inside a node (DDP's peers) that waits longer than this ends the run naming the peer.
    """

    outer: Outer = "average"
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    timeout_s: float = 30.0
    quorum_timeout_s: float = 300.0
    connect_timeout_s: float = 10.0
    peer_timeout_s: float = 60.0


@dataclass(frozen=True)
class AutoSyncOptions:
    """Expert settings of ``auto_sync``.

    Args:
        compensation: the stale-gradient compensation of async mode at ``local_steps=1``.
        lam: DC-ASGD's ``lambda``.
        compression_options: extra ``Compressor`` arguments.
        peer_timeout_s: a round or gate wait longer than this ends the run with an error naming the lost rank.
    """

    compensation: Compensation = "dc_asgd_adaptive"
    lam: float = 1.0
    compression_options: dict[str, Any] = field(default_factory=dict)
    peer_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        _plain_dict(self)


Opts = TypeVar("Opts", HierSyncOptions, AsyncSSPOptions, FaultTolerantOptions, AutoSyncOptions)


def resolve_options(
    cls: type[Opts], options: Opts | Mapping[str, Any] | None, kwargs: dict[str, Any], owner: str
) -> Opts:
    """``options`` as a ``cls`` (an instance, a mapping of its fields such as Hydra's, or ``None`` for the
    defaults), with any of its fields given as keywords (``kwargs``, the constructor's ``**kwargs``: the spelling
    before the options object) taken out of ``kwargs`` and applied. A field given both ways is refused: which one
    would win is not obvious."""
    names = [f.name for f in dataclasses.fields(cls)]
    if options is None:
        base = cls()
    elif isinstance(options, cls):
        base = options
    elif isinstance(options, Mapping):
        unknown = [k for k in options if k not in names]
        if unknown:
            raise ValueError(
                f"{owner}(options=...) has unknown setting(s) {unknown}; HINT: {cls.__name__} takes {names}"
            )
        base = cls(**{str(k): v for k, v in options.items()})
    else:
        raise TypeError(
            f"{owner}(options={options!r}): expected a {cls.__name__} or a dict of its settings; HINT: "
            f"options={cls.__name__}(...) or options={{'{names[0]}': ...}}"
        )
    given = {k: kwargs.pop(k) for k in names if k in kwargs}
    both = [k for k in given if options is not None and getattr(base, k) != getattr(cls(), k)]
    if both:
        raise ValueError(f"{owner}: {both} given both as keyword(s) and in options=; HINT: set each once, in options=")
    return dataclasses.replace(base, **given) if given else base


def adopt(strategy: Any, options: Any) -> None:
    """``options`` as the strategy's ``options``, and each of its fields as the strategy's attribute of that name (what
    its setup reads, as when the fields were keywords); ``compression_options`` copied."""
    strategy.options = options
    for f in dataclasses.fields(options):
        value = getattr(options, f.name)
        setattr(strategy, f.name, dict(value) if isinstance(value, dict) else value)


def unused_fields(options: Any, fields: tuple[str, ...], owner: str, why: str) -> None:
    """Refuse fields of ``options`` set away from their defaults that ``owner`` does not use (``why`` says why)."""
    default = type(options)()
    changed = [f for f in fields if getattr(options, f) != getattr(default, f)]
    if changed:
        raise ValueError(f"{owner} does not use options {changed}: {why}; HINT: leave them at their defaults")


def _plain_dict(options: Any) -> None:
    """``compression_options`` as a plain dict (Hydra hands a DictConfig), so the strategy can copy and pickle it."""
    value = options.compression_options
    object.__setattr__(options, "compression_options", dict(value or {}))

"""Constructor checks shared by this package's strategies (hier_sync, async_ssp, auto_sync): one message per setting,
so a setting is rejected the same way whichever strategy takes it."""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import typing
from typing import Any

from lightning.pytorch.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel

from lightning_syncasync.algorithms.compression.compressor import Compressor
from lightning_syncasync.algorithms.ssp.compensation import METHODS as COMPENSATIONS
from lightning_syncasync.algorithms.ssp.compensation import StaleGradientCompensation


def check_common(
    owner: str,
    compression: str,
    compression_options: dict[str, Any] | None,
    peer_timeout_s: float,
    ddp_kwargs: dict[str, Any],
    cls: type,
    wraps_ddp: bool,
) -> None:
    """Compression (a ``Compressor`` is built now so that bad options fail at construction, not in every process
    later), the peer timeout, no DDP comm hook or model averaging (``owner``, e.g. "hier_sync does its own
    cross-node averaging", says why the strategy communicates by itself), and only known extra keywords
    (:func:`check_kwargs`)."""
    if peer_timeout_s <= 0:
        raise ValueError(f"peer_timeout_s must be > 0, got {peer_timeout_s}; HINT: 60 fails within a minute")
    check_compression_options(compression, compression_options)
    if ddp_kwargs.get("ddp_comm_hook") or ddp_kwargs.get("model_averaging_period"):
        raise ValueError(f"{owner}; HINT: drop ddp_comm_hook/model_averaging_period")
    check_kwargs(cls, ddp_kwargs, wraps_ddp)


def check_compression_options(compression: str, options: dict[str, Any] | None) -> None:
    """Known keys only (the strategy seeds each rank's compressor itself), then build one so bad values fail now."""
    options = dict(options or {})
    allowed = [p for p in inspect.signature(Compressor.__init__).parameters if p not in ("self", "method", "seed")]
    if "seed" in options:
        raise ValueError("compression_options['seed'] is set per rank by the strategy; HINT: drop it")
    unknown = [k for k in options if k not in allowed]
    if unknown:
        raise ValueError(f"compression_options has unknown key(s) {unknown}; HINT: use some of {allowed}")
    if options and compression in ("none", None):
        raise ValueError(
            f"compression_options={options} given with compression={compression!r}; HINT: set compression "
            "(e.g. compression='int8') or drop the options"
        )
    Compressor(compression, **options)  # type: ignore[arg-type]


_LIGHTNING_DDP = [p for p in inspect.signature(DDPStrategy.__init__).parameters if p not in ("self", "kwargs")]
_DDP_PARAMS = inspect.signature(DistributedDataParallel.__init__).parameters
_TORCH_DDP = [p for p in _DDP_PARAMS if p not in ("self", "module", "device_ids", "output_device", "process_group")]


def check_kwargs(cls: type, kwargs: dict[str, Any], wraps_ddp: bool) -> None:
    """Extra keywords must be Lightning ``DDPStrategy`` settings, or torch DDP settings when the strategy wraps the
    model in DDP: a misspelt setting (``stalenes=3``) fails here instead of being ignored or failing in every
    process at setup."""
    allowed = _LIGHTNING_DDP + (_TORCH_DDP if wraps_ddp else [])
    for key, value in kwargs.items():
        if key in allowed:
            continue
        if key in _DDP_PARAMS and value == _DDP_PARAMS[key].default:
            continue  # the Lightning CLI spells out every DDP argument at its default: harmless
        extra = "" if wraps_ddp or key not in _TORCH_DDP else " (it does not wrap the model in torch DDP)"
        _refuse(cls, key, allowed, extra)


def check_no_kwargs(cls: type, kwargs: dict[str, Any]) -> None:
    """For a strategy whose ``**kwargs`` carry only its options' fields by their old names (``resolve_options`` has
    taken those out): anything left is a typo."""
    for key in kwargs:
        _refuse(cls, key)


def _refuse(cls: type, key: str, allowed: list[str] | None = None, extra: str = "") -> None:
    """``key`` is no setting of ``cls``: its own settings and its options' fields (which work as keywords too),
    ``allowed`` besides; the closest one named."""
    own = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "kwargs", "options")]
    own += option_names(cls)
    close = difflib.get_close_matches(key, own + (allowed or []), n=1)
    hint = f"did you mean {close[0]}?" if close else f"its settings are {own}"
    name = getattr(cls, "strategy_name", cls.__name__)
    raise ValueError(f"{key} is not a setting of {name}{extra}; HINT: {hint}")


def option_names(cls: type) -> list[str]:
    """The fields of ``cls``'s options object (its ``options: XOptions | None`` parameter), if it has one."""
    hint = typing.get_type_hints(cls.__init__).get("options")
    found = [a for a in (typing.get_args(hint) or (hint,)) if dataclasses.is_dataclass(a)]
    return [f.name for f in dataclasses.fields(found[0])] if found else []


def check_node_size(node_size: int | None, virtual_nodes: int | None = None) -> None:
    """``node_size`` (ranks per node) and ``virtual_nodes`` (virtual nodes per real node): at most one of them."""
    if node_size is not None and node_size < 1:
        raise ValueError(
            f"node_size must be >= 1 (or None for the real nodes), got {node_size}; HINT: None uses the real nodes, "
            "2 makes virtual nodes of 2 ranks"
        )
    if virtual_nodes is None:
        return
    if isinstance(virtual_nodes, bool) or not isinstance(virtual_nodes, int) or virtual_nodes < 1:
        raise ValueError(
            f"virtual_nodes must be an integer >= 1 (or None), got {virtual_nodes!r}; HINT: 2 splits each node's "
            "ranks into 2 virtual nodes"
        )
    if node_size is not None:
        raise ValueError(
            f"node_size={node_size} and virtual_nodes={virtual_nodes} both set the node size; HINT: give one of them"
        )


def check_async(staleness: int | None, compensation: str, lam: float) -> None:
    """The SSP bound and the stale-gradient compensation."""
    if staleness is not None and staleness < 0:
        raise ValueError(f"staleness must be >= 0 or None (ASP), got {staleness}; HINT: 0 is synchronous")
    if compensation not in COMPENSATIONS:
        raise ValueError(
            f"compensation must be one of {COMPENSATIONS}, got {compensation!r}; HINT: 'dc_asgd_adaptive' corrects "
            "stale gradients, 'none' applies them as they are"
        )
    StaleGradientCompensation(compensation, lam)  # type: ignore[arg-type]  # validates lam

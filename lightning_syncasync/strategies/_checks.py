"""Constructor checks shared by this package's strategies (hier_sync, async_ssp, auto_sync): one message per setting,
so a setting is rejected the same way whichever strategy takes it."""

from __future__ import annotations

from typing import Any

from lightning_syncasync.algorithms.compensation import METHODS as COMPENSATIONS
from lightning_syncasync.algorithms.compensation import StaleGradientCompensation
from lightning_syncasync.algorithms.compression import Compressor


def check_common(
    owner: str,
    compression: str,
    compression_options: dict[str, Any] | None,
    peer_timeout_s: float,
    ddp_kwargs: dict[str, Any],
) -> None:
    """Compression (a ``Compressor`` is built now so that bad options fail at construction, not in every process
    later), the peer timeout, and no DDP comm hook or model averaging: ``owner`` (e.g. "hier_sync does its own
    cross-node averaging") says why the strategy communicates by itself."""
    if peer_timeout_s <= 0:
        raise ValueError(f"peer_timeout_s must be > 0, got {peer_timeout_s}; HINT: 60 fails within a minute")
    Compressor(compression, **(compression_options or {}))  # type: ignore[arg-type]
    if ddp_kwargs.get("ddp_comm_hook") or ddp_kwargs.get("model_averaging_period"):
        raise ValueError(f"{owner}; drop ddp_comm_hook/model_averaging_period")


def check_node_size(node_size: int | None) -> None:
    if node_size is not None and node_size < 1:
        raise ValueError(f"node_size must be >= 1 (or None for the real nodes), got {node_size}")


def check_async(staleness: int | None, compensation: str, lam: float) -> None:
    """The SSP bound and the stale-gradient compensation."""
    if staleness is not None and staleness < 0:
        raise ValueError(f"staleness must be >= 0 or None (ASP), got {staleness}; HINT: 0 is synchronous")
    if compensation not in COMPENSATIONS:
        raise ValueError(f"compensation must be one of {COMPENSATIONS}, got {compensation!r}")
    StaleGradientCompensation(compensation, lam)  # type: ignore[arg-type]  # validates lam

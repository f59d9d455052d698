"""Averages of replicas, launched in the background and applied late: ``hier_sync``'s bounded-delay averaging of node
models (``DelayedAverager``), ``async_ssp``'s round-level exchange (``RoundExchange``), and the outer optimizer both
use (``OuterOptimizer``).

``from lightning_syncasync.algorithms.averaging import DelayedAverager`` keeps working from when this was one module.
"""

from lightning_syncasync.algorithms.averaging.delayed import DelayedAverager, check_settings
from lightning_syncasync.algorithms.averaging.outer import OUTERS, OuterOptimizer, check_outer
from lightning_syncasync.algorithms.averaging.rounds import NonFiniteRoundError, RoundExchange, RoundStats, check_rounds
from lightning_syncasync.algorithms.watchdog import PeerLostError

__all__ = [
    "OUTERS",
    "DelayedAverager",
    "NonFiniteRoundError",
    "OuterOptimizer",
    "PeerLostError",
    "RoundExchange",
    "RoundStats",
    "check_outer",
    "check_rounds",
    "check_settings",
]

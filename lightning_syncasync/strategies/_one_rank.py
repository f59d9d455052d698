"""At one rank there is nothing to exchange, so the DDP-based strategies (``hier_sync``, ``auto_sync``,
``ddp_measured``) leave the model unwrapped there, as Lightning's ``auto`` strategy does at ``devices=1``.

DDP at a world of one still copies every gradient into its buckets and back, all-reduces them over a group of one
and, with this package's measuring comm hooks, runs Python per bucket: about 0.3 ms of host time per step
(``scripts/host_overhead.py``), which on a GPU whose step the host already bounds is steps/s lost for nothing. The
gradients are the same without it: DDP divides them by a world size of 1 and sums them over one rank, both exact.
A compressing hook is the exception: at one rank it would quantize gradients it never sends, and unwrapped it does
not run at all, which is what a run with nothing to send should do.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def unwrapped_at_one_rank(name: str, world_size: int) -> bool:
    """Whether strategy ``name`` leaves the model unwrapped (``world_size == 1``); says so in the log when it does."""
    if world_size != 1:
        return False
    log.info("%s: one rank, so the model is not wrapped in DDP (there are no gradients to exchange)", name)
    return True

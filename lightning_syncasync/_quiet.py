"""Third-party noise the front ends (``syncasync-train``, ``syncasync-cli``) keep out of every run's output.

Only messages that say nothing about the user's run, printed by every job (and some by every rank), are dropped:

* Lightning's advertisements, "💡 Tip: ... try installing litlogger / litmodels" (``rank_zero_info`` on every job);
* torch's ``FutureWarning`` that Lightning's own ``utilities/_pytree.py`` still uses ``LeafSpec``: printed once per
  rank, about Lightning's code, with nothing for the user to change.

A library import does not do this: ``import lightning_syncasync`` in the user's own script leaves their logging and
warnings filters alone.
"""

from __future__ import annotations

import logging
import warnings

_TIP = "💡 Tip:"


class _DropTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_TIP)


def quiet_third_party_noise() -> None:
    """Install the filters (idempotent)."""
    leafspec = r"`isinstance\(treespec, LeafSpec\)` is deprecated"
    warnings.filterwarnings("ignore", message=leafspec, category=FutureWarning)
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropTips) for f in logger.filters):
            logger.addFilter(_DropTips())

"""Whether the tools' jobs (``syncasync-train``, ``syncasync-cli``) show a progress bar: on a terminal only.

A progress bar is for a person watching a terminal. Written to a log file, CI console or pipe, Lightning's
``TQDMProgressBar`` leaves one ``\\r``-joined line per refresh and ``RichProgressBar`` prints its final frame when it
stops, wrapped over several lines at rich's 80-column default for non-terminals, after everything else the job printed
(issue 23). ``Trainer(enable_progress_bar=None)`` means "a bar" to Lightning; for the tools' jobs it means "a bar when
standard output is a terminal", and an explicit ``true``/``false`` is the user's choice.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from typing import Any, TextIO

from lightning.pytorch.callbacks import ProgressBar


def resolve_enable_progress_bar(
    trainer_kwargs: Mapping[str, Any], callbacks: Iterable[object] = (), stream: TextIO | None = None
) -> bool | None:
    """The ``enable_progress_bar`` to build a tool's Trainer with.

    Args:
        trainer_kwargs: the Trainer arguments as configured; an ``enable_progress_bar`` that is not ``None`` wins.
        callbacks: the configured callbacks. A progress-bar callback among them (``callbacks=rich_progress_bar``)
            asks for a bar, and Lightning refuses ``enable_progress_bar=False`` beside one.
        stream: where the bar would be drawn (default ``sys.stdout``, where Lightning's bars write).

    Returns:
        ``None`` (Lightning decides) under ``barebones=True``, which refuses any bar and so any ``True``; otherwise a
        bool.
    """
    setting = trainer_kwargs.get("enable_progress_bar")
    if setting is not None:
        return bool(setting)
    if trainer_kwargs.get("barebones"):
        return None
    if any(isinstance(c, ProgressBar) for c in callbacks):
        return True
    stream = sys.stdout if stream is None else stream
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a replaced stdout without isatty, or a closed one
        return False

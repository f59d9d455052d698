"""The end-of-fit printout of the policies' events: a few lines a user reads, where the full log is a results file.

``auto_sync`` on a user's own MLP printed 24 rebalance and switch events, each wrapped over two lines with raw floats
(``predicted_speedup=1.0666666666666667``). What a user needs after the table is how many of each there were, every
mode switch and rollback with its one-line reason (they say why the run went the way it did), and the batch split
the run ended with; every event with all its fields stays in ``SyncMonitor.summary["events"]`` (and its
``summary_file``).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

_PLURALS = {"switch": "switches", "batch": "batches"}
_MODE_EVENTS = ("switch", "rollback")
_SPLIT_EVENTS = ("rebalance", "grow_batch")


def event_lines(events: list[dict[str, Any]], width: int = 120, where: str | None = None) -> list[str]:
    """The compact summary of ``events`` (module docstring), each line at most ``width`` characters; ``where``
    names the file that holds the full log."""
    if not events:
        return []
    counts = Counter(e["kind"] for e in events)
    lines = ["events: " + ", ".join(f"{n} {_plural(kind, n)}" for kind, n in counts.items())]
    for e in events:
        if e["kind"] in _MODE_EVENTS:
            reason = str(e.get("reason", ""))
            lines.append(f"  {_when(e)} {e['kind']}: {e.get('mode', '?')} -> {e.get('next', '?')}: {reason}")
    splits = [e for e in events if e["kind"] in _SPLIT_EVENTS]
    if splits:
        last = splits[-1]
        speedup = last.get("predicted_speedup")
        predicted = f", predicted {speedup:.2f}x faster" if isinstance(speedup, (int, float)) else ""
        lines.append(f"  batch split: {len(splits)} {_plural('change', len(splits))}, the last {_when(last)}: "
                     f"{last.get('previous')} -> {last.get('sizes')}{predicted}")  # fmt: skip
    for e in [e for e in events if e["kind"] not in _MODE_EVENTS + _SPLIT_EVENTS][-3:]:
        detail = "; ".join(f"{k}={_short(v)}" for k, v in e.items() if k not in ("kind", "step", "train_s"))
        lines.append(f"  {_when(e)} {e['kind']}: {detail}")
    if where:
        lines.append(f'  every event with all its fields: {where} ("events")')
    return [_fit(line, width) for line in lines]


def _when(e: dict[str, Any]) -> str:
    return f"step {e.get('step', '?')} ({float(e.get('train_s') or 0.0):.1f} s)"


def _plural(word: str, n: int) -> str:
    return word if n == 1 else _PLURALS.get(word, word + "s")


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_short(v) for v in value) + "]"
    return str(value)


def _fit(line: str, width: int) -> str:
    return line if len(line) <= width else line[: width - 1] + "…"

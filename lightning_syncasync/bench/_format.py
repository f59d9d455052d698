"""Numbers as the benchmark's reports print them, and figures saved the same way: shared by
:mod:`~lightning_syncasync.bench.report` and the modules that write its parts."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def fmt(v: float | None, spec: str = ".1f", none: str = "n/a") -> str:
    return none if v is None else format(v, spec)


def spread(values: list[float | None], spec: str) -> str:
    present = [v for v in values if v is not None]
    if len(present) < 2:
        return ""
    return f" [{min(present):{spec}}-{max(present):{spec}}]"


def pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def save_figure(fig: Any, plt: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

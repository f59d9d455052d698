"""Host time each strategy and callback adds to a training step, at one rank, on a model too small to compute.

On a GPU the host must queue a step's kernels faster than the GPU runs them; for a small model (the transformer
demo on an H200) the host is the bottleneck, so every Python microsecond a strategy or callback adds per step shows
in steps/s (the GPU check's target: every strategy within 3% of plain Lightning at one rank). This script reads
that cost on any machine, CPU included: it fits a 16 -> 4 linear model (about a millisecond of Lightning's own work
per step, almost no arithmetic) with plain Lightning and with each contender, interleaved over rounds, and prints
each one's milliseconds per step and what it adds to plain Lightning's, medians over the rounds.

    python scripts/host_overhead.py                              # the one-rank strategies and SyncMonitor
    python scripts/host_overhead.py --contenders ddp,hier_sync --steps 300 --rounds 3 --out run.json
    python scripts/host_overhead.py --table before.json after.json    # Markdown: x plain, a column per run
    python scripts/host_overhead.py --calls --steps 400 --out calls.json   # function calls per step, not time
    python scripts/host_overhead.py --table calls.json --metric calls_per_step

``auto+sync_monitor`` is plain Lightning with ``SyncMonitor``; ``ddp`` (Lightning's own DDP at one rank) shows what
the DDP wrapper costs, which the DDP-based strategies share.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_syncasync.bench._gpu_fit import BASELINE, MONITORED, default_strategies, fit_steps_per_s  # noqa: E402


class Tiny(L.LightningModule):
    """A linear classifier on random data, logging its loss as models do."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(16, 4)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(4096, 16, generator=g), torch.randint(0, 4, (4096,), generator=g))
        return DataLoader(data, batch_size=8, shuffle=True)


def ms_per_step(name: str, warmup: int, steps: int) -> float:
    """Milliseconds per step of one fit of :class:`Tiny` after ``warmup`` steps (``bench.gpu``'s timed fit).

    This machine's own speed drifts: on the project's 2-core VM, 200-step windows of one plain fit took 1.05-2.6 ms
    per step, as much in the thread's CPU time as in wall time, in spells of seconds. So the contenders are
    interleaved, fit by fit, over many short rounds, and each one's figure is its median fit."""
    rate, _ = fit_steps_per_s(name, torch.device("cpu"), warmup, steps, seed=0, verbose=False,
                              fit=lambda trainer: trainer.fit(Tiny()))  # fmt: skip
    return 1000.0 / rate


class CallCounter(L.Callback):
    """The Python and C function calls the training thread makes from the end of step ``start`` to the end of step
    ``stop`` (``sys.setprofile``: it slows the fit, so a counted fit is not timed)."""

    def __init__(self, start: int, stop: int) -> None:
        self.start, self.stop = start, stop
        self.calls = 0
        self._on = False

    def _count(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call" or event == "c_call":
            self.calls += 1

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        step = trainer.global_step
        if not self._on and self.start <= step < self.stop:
            self._on = True
            sys.setprofile(self._count)
        elif self._on and step >= self.stop:
            sys.setprofile(None)
            self._on = False

    def on_fit_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self._on:
            sys.setprofile(None)
            raise RuntimeError("the fit ended before the counted steps did")


def calls_per_step(name: str, warmup: int, steps: int) -> float:
    """Function calls (Python and C) of the training thread per step, over ``steps`` steps after ``warmup``. The same
    on every run and machine where the time per step is not; but it weighs a call to ``len`` like a tensor copy and
    does not see C++ work (DDP's bucket copies) or other threads (an exchange thread's turn at the GIL)."""
    counter = CallCounter(warmup, warmup + steps)

    def fit(trainer: L.Trainer) -> None:
        trainer.callbacks.append(counter)  # type: ignore[attr-defined]
        trainer.fit(Tiny())

    fit_steps_per_s(name, torch.device("cpu"), warmup, steps + 1, seed=0, verbose=False, fit=fit)
    return counter.calls / steps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contenders", default=None, help="comma-separated names (default: SyncMonitor and every "
                   "strategy of this package that runs at one rank)")  # fmt: skip
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", action="store_true", help="count the training thread's function calls per step (one "
                   "fit per contender, over --steps) instead of timing")  # fmt: skip
    p.add_argument("--metric", choices=["ms_per_step", "calls_per_step"], default="ms_per_step",
                   help="what --table compares")  # fmt: skip
    p.add_argument("--out", default=None, help="also write the results to this JSON file")
    p.add_argument("--label", default=None, help="the run's name in --table (default: the --out file's stem)")
    p.add_argument("--table", nargs="+", default=None, metavar="JSON", help="print a Markdown table of these runs")
    args = p.parse_args(argv)
    if args.table:
        print(markdown_table([json.loads(Path(f).read_text()) for f in args.table], args.metric))
        return 0
    import lightning_syncasync  # noqa: F401  (registers the strategy names)

    # One intra-op thread: the model is too small to split, and torch's idle OpenMP worker spun at 100% of the other
    # core of the 2-core VM (top -H), which the fits then competed with.
    torch.set_num_threads(1)

    names = args.contenders.split(",") if args.contenders else [MONITORED, *default_strategies()]
    contenders = [BASELINE, *[n for n in names if n != BASELINE]]
    if args.calls:
        calls = {n: calls_per_step(n, args.warmup_steps, args.steps) for n in contenders}
        results: dict[str, dict[str, Any]] = {
            n: {"calls_per_step": c, "added_calls": c - calls[BASELINE]} for n, c in calls.items()
        }
        print(f"{'contender':<22} {'calls/step':>10} {'added':>8} {'x plain':>8}")
        for name, c in calls.items():
            print(f"{name:<22} {c:>10.1f} {c - calls[BASELINE]:>+8.1f} {c / calls[BASELINE]:>8.3f}")
        _write(args, results)
        return 0
    runs: dict[str, list[float]] = {n: [] for n in contenders}
    for _ in range(args.rounds):
        for name in contenders:  # interleaved: drift hits every contender alike
            runs[name].append(ms_per_step(name, args.warmup_steps, args.steps))
    plain = statistics.median(runs[BASELINE])
    results = {n: {"ms_per_step": statistics.median(r), "added_ms": statistics.median(r) - plain, "runs": r}
               for n, r in runs.items()}  # fmt: skip
    print(f"{'contender':<22} {'ms/step':>8} {'added ms':>9} {'x plain':>8}  runs")
    for name, rec in results.items():
        runs_text = ", ".join(f"{x:.3f}" for x in rec["runs"])
        print(f"{name:<22} {rec['ms_per_step']:>8.3f} {rec['added_ms']:>+9.3f} {rec['ms_per_step'] / plain:>8.2f}"
              f"  [{runs_text}]")  # fmt: skip
    _write(args, results)
    return 0


def _write(args: argparse.Namespace, results: dict[str, dict[str, Any]]) -> None:
    if args.out:
        label = args.label or Path(args.out).stem
        record = {"label": label, "command": " ".join(sys.argv), "results": results}
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")


def markdown_table(runs: list[dict[str, Any]], metric: str = "ms_per_step") -> str:
    """Each contender's ``metric`` per step (``ms_per_step`` or ``calls_per_step``) as a multiple of plain
    Lightning's in the same run, a column per run; ``-`` where a run did not measure it."""
    names = [n for n in runs[0]["results"] if n != BASELINE]
    lines = ["| contender | " + " | ".join(r["label"] for r in runs) + " |", "|---|" + "---|" * len(runs)]
    digits = 2 if metric == "ms_per_step" else 3
    for name in names:
        cells = []
        for run in runs:
            rec, plain = run["results"].get(name), run["results"][BASELINE].get(metric)
            value = None if rec is None or plain is None else rec.get(metric)
            cells.append("-" if value is None else f"{value / plain:.{digits}f}x")
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

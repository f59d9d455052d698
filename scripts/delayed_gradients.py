"""How the benchmark workloads learn from delayed gradients, in one process, without any distributed code.

Asynchronous training applies gradients computed on older weights. This script trains the two demo workloads of
``syncasync-bench`` with plain Adam(W) on gradients that are ``delay`` optimizer steps old (the delay async training
adds at its best), and with the remedies the literature proposes, and prints the validation accuracy along the way.

    python scripts/delayed_gradients.py conv    # the straggler/jitter convnet (batch 512 = 4 ranks x 128)
    python scripts/delayed_gradients.py lm      # the transformer LM (batch 64 = 4 ranks x 16)

Each row: ``variant -> [(step, val_acc), ...]``. ``stale_frac=f``: each update mixes ``1-f`` of the fresh gradient
with ``f`` of the one a step older (only a straggler's share is late).

The ``rounds`` mode moves the delay from single gradients to whole rounds of local SGD (asynchronous local SGD, what
the round-delayed strategy does): 4 simulated workers, each with its own replica and its own optimizer, take ``H``
local steps, and the average of their progress is applied ``d`` rounds late as a correction that keeps what each
worker learned meanwhile. It compares fresh gradients and per-step delay 1 with round delay 0, 1 and 2 at H = 4, 8, 16:

    python scripts/delayed_gradients.py rounds conv --steps 96 --out docs/results/delayed_rounds.json
    python scripts/delayed_gradients.py rounds lm --steps 80 --out docs/results/delayed_rounds.json
    python scripts/delayed_gradients.py --table docs/results/delayed_rounds.json    # Markdown tables

``--out`` merges into an existing file (one entry per workload), so both workloads can share it.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import sys
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from lightning_syncasync.demo import Classifier, DigitsDataModule
from lightning_syncasync.demo.lm import TransformerLM
from lightning_syncasync.demo.text import TextDataModule

WORKERS = 4  # the benchmark's 4 ranks: the global batch is split over them


def _batches(loader) -> Iterator:
    while True:
        yield from loader


def _accuracy(model, loader, limit: int) -> float:
    model.eval()
    right = total = 0
    with torch.no_grad():
        for i, (x, y) in enumerate(loader):
            if i >= limit:
                break
            right += int((model(x).argmax(-1) == y).sum())
            total += y.numel()
    model.train()
    return round(right / total, 3)


def _lm_loss(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _workload(workload: str, lr: float):
    """The data module, default budget (steps, eval every, val batches), model and loss of a workload.

    Builds the model here, so the caller's ``torch.manual_seed`` fixes its initialisation; every variant of both
    modes starts from the same weights.
    """
    if workload == "conv":
        data, steps, every, limit = DigitsDataModule(batch_size=512, resize=32), 48, 12, 100
        model = Classifier(input_shape=[1, 32, 32], channels=64, depth=3, lr=lr, arch="convnet")
        return data, steps, every, limit, model, F.cross_entropy
    if workload == "lm":
        data, steps, every, limit = TextDataModule(seq_len=64, batch_size=64), 40, 10, 4
        return data, steps, every, limit, TransformerLM(lr=lr, warmup_steps=10), _lm_loss
    raise ValueError(f"workload must be 'conv' or 'lm', got {workload!r}")


def _optimizer(workload: str, model, lr: float, beta1: float):
    """The workload's own optimizer and lr schedule for ``model``: Adam (constant lr) for the convnet, the LM's
    ``configure_optimizers`` (AdamW, linear warm-up stepped per optimizer step) for the LM."""
    if workload == "conv":
        return torch.optim.Adam(model.parameters(), lr=lr, betas=(beta1, 0.999)), None
    conf = model.configure_optimizers()
    opt, sched = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
    for group in opt.param_groups:
        group["betas"] = (beta1, group["betas"][1])
    return opt, sched


def run(workload: str, delay: int = 0, lr: float = 3e-3, dc_lambda: float = 0.0, predict: bool = False,
        stale_frac: float = 0.0, beta1: float = 0.9, steps: int | None = None) -> list[tuple[int, float]]:  # fmt: skip
    """One model, one optimizer, global batches; each gradient applied ``delay`` optimizer steps after it was
    computed. ``steps``: the budget in steps (``None``: the workload's default, 48 conv / 40 lm)."""
    torch.manual_seed(0)
    data, default_steps, every, limit, model, loss_fn = _workload(workload, lr)
    steps = steps or default_steps
    opt, sched = _optimizer(workload, model, lr, beta1)

    data.setup("fit")
    train, val = _batches(data.train_dataloader()), data.val_dataloader()
    params = list(model.parameters())
    pending: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
    last_update = [torch.zeros_like(p) for p in params]
    mean_square = [torch.zeros_like(p) for p in params]
    previous: list[torch.Tensor] | None = None
    out = []
    for step in range(1, steps + 1):
        x, y = next(train)
        read = [p.detach().clone() for p in params]
        if predict:  # weight prediction: the gradient at where the weights will be when it is applied
            with torch.no_grad():
                for p, d in zip(params, last_update, strict=True):
                    p.add_(d * delay)
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        if predict:
            with torch.no_grad():
                for p, w in zip(params, read, strict=True):
                    p.copy_(w)
        grads = [p.grad.detach().clone() for p in params]
        if stale_frac:
            mixed = (
                grads
                if previous is None
                else [(1 - stale_frac) * g + stale_frac * o for g, o in zip(grads, previous, strict=True)]
            )
            previous, grads = grads, mixed
        pending.append((grads, read))
        if len(pending) > delay:
            grads, stale = pending.pop(0)
            if dc_lambda:  # DC-ASGD-a: g + lambda / sqrt(ms) * g * g * (w_now - w_stale)
                for i, (p, g, w) in enumerate(zip(params, grads, stale, strict=True)):
                    mean_square[i] = g * g if step == delay + 1 else 0.95 * mean_square[i] + 0.05 * g * g
                    g.add_(dc_lambda / (mean_square[i] + 1e-7).sqrt() * g * g * (p.detach() - w))
            before = [p.detach().clone() for p in params]
            for p, g in zip(params, grads, strict=True):
                p.grad = g
            opt.step()
            last_update = [p.detach() - b for p, b in zip(params, before, strict=True)]
        if sched is not None:
            sched.step()
        if step % every == 0:
            out.append((step, _accuracy(model, val, limit)))
    return out


# -- round-level delay (asynchronous local SGD) -----------------------------------------------------------------------


def _state(model) -> list[torch.Tensor]:
    """The tensors a round averages: parameters and floating-point buffers (as the strategy does), in a fixed order.
    ``parameters()`` lists a tied weight (the LM's embedding and head) once, so it is averaged once."""
    return [p.data for p in model.parameters()] + [b for b in model.buffers() if b.is_floating_point()]


def _local_steps_at(tick: int, steps: int, period: int) -> bool:
    """Whether a worker that takes ``steps`` local steps per round of ``period`` ticks takes one at ``tick`` (0-based
    within the round): spread evenly, the last one on the round's last tick, so every worker finishes the round
    together (dynamic local updates: a slower worker is given fewer steps instead of being waited for)."""
    return (tick + 1) * steps // period > tick * steps // period


def run_rounds(workload: str, period: int, delay: int, outer: str = "average", outer_lr: float = 0.7,
               outer_momentum: float = 0.9, slow_worker: bool = False, lr: float = 3e-3, beta1: float = 0.9,
               steps: int | None = None, seed: int = 0) -> list[tuple[int, float]]:  # fmt: skip
    """Asynchronous local SGD with round delay ``delay``, simulated exactly in one process.

    ``WORKERS`` replicas start from the per-step runs' initial weights; each has its own optimizer and lr schedule
    (advanced by its own steps) and its own shuffled stream of per-worker batches (global batch / ``WORKERS``). The
    workers move in lockstep ticks: at each tick every worker takes one local step, so ``period`` (H) ticks are a
    round and a tick is one global step's worth of samples. At the end of round ``r`` worker ``i`` ships its
    pseudo-gradient ``delta_i = base_i - theta_i`` (``base_i``: its replica when its previous round was launched, plus
    the corrections applied since) and sets ``base_i = theta_i``. The global pseudo-gradient is ``G_r = mean_i
    delta_i`` (with plain SGD that moves the global model by -lr/W times the sum of all gradients: DDP's per-sample
    mean). Outer step: ``"average"`` is ``anchor -= G_r``; ``"nesterov"`` (DiLoCo) is ``m = mu m + G_r; anchor -=
    outer_lr (G_r + mu m)``. Round ``r`` is applied when the workers finish round ``r + delay`` (0: synchronous local
    SGD), in order: ``c = delta_i - (anchor_before - anchor_after)``, ``theta_i += c``, ``base_i += c``. That
    replaces the worker's own contribution to round ``r`` by the global step and keeps its local progress since, so
    nothing is counted twice.

    Evaluated: the mean of the replicas (with ``"average"`` the corrections sum to zero over the workers, so this is
    the anchor plus the mean progress not yet synchronised), every ``every`` global steps, where a global step is
    (samples taken by all workers) / (global batch). ``slow_worker``: the last worker is 1.5x slower and takes
    ``round(H / 1.5)`` steps per round, so fewer samples go by per tick and the run takes more ticks to spend the
    same budget of samples.
    """
    torch.manual_seed(seed)
    data, default_steps, every, limit, model, loss_fn = _workload(workload, lr)
    steps = steps or default_steps
    # deepcopy consumes no random numbers: every replica (and the evaluation model) is the per-step runs' model.
    replicas = [model] + [copy.deepcopy(model) for _ in range(WORKERS - 1)]
    evaluator = copy.deepcopy(model)
    optimizers = [_optimizer(workload, m, lr, beta1) for m in replicas]

    data.setup("fit")
    val = data.val_dataloader()
    batch = data.batch_size // WORKERS
    # Each worker its own shuffling order (a seeded generator per worker), as DDP's sampler gives each rank its own.
    streams = [
        _batches(DataLoader(data.train_dataset, batch_size=batch, shuffle=True,
                            generator=torch.Generator().manual_seed(1000 * seed + 1 + i)))
        for i in range(WORKERS)
    ]  # fmt: skip
    local = [period] * WORKERS
    if slow_worker:
        local[-1] = max(1, round(period / 1.5))

    states = [_state(m) for m in replicas]
    anchor = [t.clone() for t in states[0]]  # the global model; every replica starts on it
    bases = [[t.clone() for t in anchor] for _ in range(WORKERS)]
    momentum: list[torch.Tensor] | None = None
    in_flight: deque[tuple[int, list[list[torch.Tensor]]]] = deque()  # (round, per-worker deltas), oldest first

    def apply(deltas: list[list[torch.Tensor]]) -> None:
        nonlocal momentum
        mean = [torch.stack(ts).mean(0) for ts in zip(*deltas, strict=True)]  # G_r, the same for every worker
        if outer == "average":
            outer_step = mean
        else:  # DiLoCo: outer SGD with Nesterov momentum on the pseudo-gradient
            momentum = (
                mean if momentum is None else [outer_momentum * m + g for m, g in zip(momentum, mean, strict=True)]
            )
            outer_step = [outer_lr * (g + outer_momentum * m) for g, m in zip(mean, momentum, strict=True)]
        for a, s in zip(anchor, outer_step, strict=True):
            a.sub_(s)  # anchor_before - anchor_after == outer_step
        for state, base, delta in zip(states, bases, deltas, strict=True):
            for t, b, d, s in zip(state, base, delta, outer_step, strict=True):
                c = d - s  # take back this worker's own share of round r, put the global step in its place
                t.add_(c)
                b.add_(c)  # keeps theta - base (the progress since the last launch) as it was

    out: list[tuple[int, float]] = []
    samples = 0  # per-worker batches taken by all workers: samples / (global batch) = samples / WORKERS batches
    next_eval, tick = every, 0
    while samples < steps * WORKERS:
        k = tick % period  # the tick within the round
        for i, (m, (opt, sched), stream) in enumerate(zip(replicas, optimizers, streams, strict=True)):
            if not _local_steps_at(k, local[i], period):
                continue
            x, y = next(stream)
            opt.zero_grad()
            loss_fn(m(x), y).backward()
            opt.step()
            if sched is not None:
                sched.step()  # each worker's schedule advances with its own steps
            samples += 1
        tick += 1
        if tick % period == 0:  # every worker has finished round r = tick // period - 1: launch it
            r = tick // period - 1
            deltas = []
            with torch.no_grad():
                for state, base in zip(states, bases, strict=True):
                    deltas.append([b - t for b, t in zip(base, state, strict=True)])
                    for b, t in zip(base, state, strict=True):
                        b.copy_(t)
                in_flight.append((r, deltas))
                # Round r' arrives when the workers finish round r' + delay; with several in flight, in order.
                while in_flight and in_flight[0][0] + delay <= r:
                    apply(in_flight.popleft()[1])
        # The first tick at or past each evaluation point (a tick is at most one global step of samples).
        while next_eval <= steps and samples >= next_eval * WORKERS:
            with torch.no_grad():
                for t, *ts in zip(_state(evaluator), *states, strict=True):
                    t.copy_(torch.stack(ts).mean(0))
            out.append((next_eval, _accuracy(evaluator, val, limit)))
            next_eval += every
    return out


def _label(v: dict) -> str:
    """A variant's row title in the Markdown table."""
    if v["kind"] == "step":
        return "fresh gradients (per-step delay 0)" if v["delay"] == 0 else f"per-step delay {v['delay']}"
    text = f"H={v['H']}, round delay {v['delay']}"
    if v["delay"] == 0:
        text += " (synchronous local SGD)"
    if v.get("outer", "average") != "average":
        text += f", outer Nesterov (lr {v['outer_lr']:g}, momentum {v['outer_momentum']:g})"
    if v.get("slow_worker"):
        text += f", one worker 1.5x slower ({round(v['H'] / 1.5)} steps a round)"
    return text


def _name(v: dict) -> str:
    """A variant's key in the JSON (stable, so a rerun of one variant replaces it)."""
    if v["kind"] == "step":
        return f"step_delay{v['delay']}"
    name = f"H{v['H']}_round_delay{v['delay']}"
    if v.get("outer", "average") != "average":
        name += "_nesterov"
    if v.get("slow_worker"):
        name += "_slow_worker"
    return name


def _dump(results: dict) -> str:
    """Indented JSON with each ``[step, val_acc]`` pair on one line."""
    return re.sub(r"\[\s+([\d.]+),\s+([\d.]+)\s+\]", r"[\1, \2]", json.dumps(results, indent=1)) + "\n"


def rounds_study(
    workload: str,
    steps: int | None,
    periods: list[int],
    delays: list[int],
    outer: str,
    outer_lr: float,
    slow_worker: bool,
    out_path: str | None,
    skip_done: bool = False,
) -> dict:
    """Fresh gradients, per-step delay 1, then every (H, round delay) pair; printed as they finish and merged into
    ``out_path`` (keyed by workload, then by variant) after each one, so an interrupted study keeps what it ran.
    ``skip_done``: leave out the variants ``out_path`` already holds at the same settings (resume, or add a variant
    such as ``--outer nesterov`` without rerunning the baselines)."""
    _, default_steps, every, *_ = _workload(workload, 3e-3)
    steps = steps or default_steps
    settings = {
        "seed": 0,
        "steps": steps,
        "eval_every": every,
        "workers": WORKERS,
        "global_batch": 512 if workload == "conv" else 64,
        "lr": 3e-3,
        "optimizer": "Adam (constant lr)" if workload == "conv" else "AdamW, linear warm-up over 10 steps",
        "step": "global step = samples / global batch; round variants: each worker H local steps per round on "
        "global batch / workers, its own optimizer and lr schedule; val_acc of the mean of the replicas",
    }
    variants: list[dict] = [{"kind": "step", "delay": 0}, {"kind": "step", "delay": 1}]
    for period in periods:
        for delay in delays:
            v = {"kind": "rounds", "H": period, "delay": delay, "outer": outer, "slow_worker": slow_worker}
            if outer == "nesterov":
                v.update(outer_lr=outer_lr, outer_momentum=0.9)
            variants.append(v)
    results: dict = {}
    path = Path(out_path) if out_path else None
    if path is not None and path.exists():
        results = json.loads(path.read_text())
    entry = results.get(workload)
    if entry is None or entry["settings"] != settings:  # another budget: the old curves are not comparable
        entry = results[workload] = {"settings": settings, "variants": {}}
    for v in variants:
        if skip_done and _name(v) in entry["variants"]:
            continue
        start = time.perf_counter()
        if v["kind"] == "step":
            curve = run(workload, delay=v["delay"], steps=steps)
        else:
            curve = run_rounds(
                workload, v["H"], v["delay"], outer=outer, outer_lr=outer_lr, slow_worker=slow_worker, steps=steps
            )
        wall = round(time.perf_counter() - start, 1)
        print(f"{_label(v)} -> {curve} ({wall} s)", flush=True)
        entry["variants"][_name(v)] = {**v, "label": _label(v), "curve": curve, "wall_s": wall}
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(_dump(results))
    return results


def table(path: str) -> str:
    """Markdown tables (one per workload) of val_acc at 25%, 50% and 100% of the budget, from ``--out``'s JSON."""
    results = json.loads(Path(path).read_text())
    lines: list[str] = []
    for workload, entry in results.items():
        s = entry["settings"]
        budget = s["steps"]
        # The recorded points nearest each fraction of the budget (exact when the budget is a multiple of 4 * every).
        recorded = sorted({step for v in entry["variants"].values() for step, _ in v["curve"]})
        cols = []
        for frac in (0.25, 0.5, 1.0):
            best = min(recorded, key=lambda st, want=frac * budget: abs(st - want))
            if best not in cols:
                cols.append(best)
        lines += [
            f"**{workload}** (seed {s['seed']}, {budget} global steps of batch {s['global_batch']}, {s['workers']} "
            f"workers in the round variants; val_acc)",
            "",
            "| variant | " + " | ".join(f"step {c}" for c in cols) + " |",
            "|---|" + "---|" * len(cols),
        ]
        for v in entry["variants"].values():
            acc = dict((step, a) for step, a in v["curve"])
            lines.append(f"| {v['label']} | " + " | ".join(f"{acc[c]:.3f}" if c in acc else "-" for c in cols) + " |")
        lines.append("")
    return "\n".join(lines)


def _legacy(workload: str) -> None:
    """The original per-step study: delays and the stale-gradient remedies."""
    variants: list[dict] = [
        {"delay": 0}, {"delay": 1}, {"delay": 2},
        {"delay": 0, "lr": 1.5e-3}, {"delay": 1, "lr": 1.5e-3},
        {"delay": 1, "dc_lambda": 1.0}, {"delay": 1, "dc_lambda": 4.0}, {"delay": 1, "predict": True},
        {"delay": 1, "beta1": 0.5}, {"delay": 0, "stale_frac": 0.25}, {"delay": 0, "stale_frac": 0.5},
    ]  # fmt: skip
    if workload == "lm":
        variants = variants[:2] + [{"delay": 1, "dc_lambda": 1.0}]
    for kw in variants:
        print(kw, "->", run(workload, **kw), flush=True)


def main(argv: list[str]) -> None:
    if argv[:1] == ["--table"]:
        if len(argv) != 2:
            raise SystemExit("usage: delayed_gradients.py --table PATH")
        print(table(argv[1]))
        return
    if argv[:1] != ["rounds"]:
        _legacy(argv[0] if argv else "conv")
        return
    parser = argparse.ArgumentParser(prog="delayed_gradients.py rounds", description=run_rounds.__doc__.split("\n")[0])
    parser.add_argument("workload", choices=["conv", "lm"])
    parser.add_argument("--steps", type=int, default=None, help="budget in global steps (default: 48 conv, 40 lm)")
    parser.add_argument("--H", dest="periods", default="4,8,16", help="local steps per round, comma-separated")
    parser.add_argument("--delays", default="0,1,2", help="round delays, comma-separated")
    parser.add_argument("--outer", choices=["average", "nesterov"], default="average")
    parser.add_argument("--outer-lr", type=float, default=0.7, help="outer lr of --outer nesterov (momentum 0.9)")
    parser.add_argument("--slow-worker", action="store_true", help="the last worker 1.5x slower: round(H/1.5) steps")
    parser.add_argument("--out", default=None, help="JSON to merge the curves into (keyed by workload)")
    parser.add_argument("--skip-done", action="store_true", help="skip the variants --out already holds")
    args = parser.parse_args(argv[1:])
    periods, delays = [int(h) for h in args.periods.split(",")], [int(d) for d in args.delays.split(",")]
    rounds_study(
        args.workload,
        args.steps,
        periods,
        delays,
        args.outer,
        args.outer_lr,
        args.slow_worker,
        args.out,
        args.skip_done,
    )


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    main(sys.argv[1:])

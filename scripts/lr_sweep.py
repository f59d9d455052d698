"""Choose the MNIST-5k workload's learning rate and target from synchronous (DDP-equivalent) runs alone.

DDP over ``R`` ranks of per-rank batch ``b`` applies, at every optimizer step, the mean gradient of ``R x b`` samples
(each rank's mean over equally many samples, averaged by the all-reduce) to one set of weights. One process with
batch ``R x b`` computes the same update; the convnet has no BatchNorm or dropout, so nothing in the forward pass
depends on how the batch is split, and the two differ only in the order of floating-point sums and in which samples
share a step (a random permutation per epoch in both). With 4,000 training images and ``R`` dividing 4,000, DDP's
``DistributedSampler`` gives every rank ``4000 / R`` images and one epoch has the same number of steps (and the
same size of last batch, ``R x (4000/R mod b)``) in both. The model, the optimizer and the learning-rate schedule
(warm-up, cosine over the budget) are the ``Classifier`` the benchmark trains, built with the same arguments.

For every learning rate and seed the sweep trains for the budget and validates after every epoch (as the scenarios
do), then prints the validation accuracy per epoch and, per candidate target, the first step at which it was reached.
The choice it prints and saves follows a rule fixed before any asynchronous run:

1. target: the highest candidate that the best learning rate reaches with every seed by ``--latest`` of the budget
   (default 75 %), so a faster method has room to reach it earlier while DDP still needs most of the budget;
2. learning rate: the one that reaches that target with every seed in the fewest steps (the largest over seeds, so a
   lucky seed does not decide); ties go to the lower learning rate.

Run (30-100 s per learning rate and seed on one core; the scenarios' numbers came from these two)::

    python scripts/lr_sweep.py --lrs 1e-3 2e-3 4e-3 8e-3 1.6e-2 3.2e-2 --seeds 0 1 2 3 4 \
        --out docs/results/lr_sweep_mnist5k.json
    python scripts/lr_sweep.py --lrs 1.6e-2 --seeds 0 1 2 3 4 --epochs 6 --out docs/results/lr_sweep_mnist5k_quick.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from lightning_syncasync.demo import Classifier, Mnist5kDataModule

DEFAULT_TARGETS = (0.94, 0.95, 0.96, 0.965, 0.97, 0.975, 0.98)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    lrs = [1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2, 3.2e-2]
    p.add_argument("--lrs", type=float, nargs="+", default=lrs, help="Adam learning rates")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="training seeds (initialisation, data order)")
    p.add_argument("--ranks", type=int, default=4, help="DDP ranks the sweep stands for")
    p.add_argument("--batch-size", type=int, default=40, help="per-rank batch (data.batch_size)")
    p.add_argument("--epochs", type=int, default=16, help="budget in epochs at --ranks ranks")
    p.add_argument("--channels", type=int, default=32, help="model.channels")
    p.add_argument("--depth", type=int, default=4, help="model.depth")
    p.add_argument("--warmup-steps", type=int, default=25, help="model.warmup_steps")
    p.add_argument("--schedule", default="cosine", choices=["constant", "cosine"], help="model.schedule")
    p.add_argument("--min-lr-ratio", type=float, default=0.0, help="model.min_lr_ratio")
    p.add_argument("--split-seed", type=int, default=0, help="data.seed (the benchmark keeps the default, 0)")
    p.add_argument("--targets", type=float, nargs="+", default=list(DEFAULT_TARGETS), help="candidate val_acc targets")
    p.add_argument("--latest", type=float, default=0.75, help="latest crossing allowed, as a fraction of the budget")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--out", type=Path, help="write every run and the choice as JSON")
    args = p.parse_args(argv)
    if args.ranks < 1 or args.batch_size < 1 or args.epochs < 1:
        p.error("--ranks, --batch-size and --epochs must be >= 1")
    if not 0 < args.latest <= 1:
        p.error(f"--latest must be in (0, 1], got {args.latest}")
    return args


def steps_per_epoch(train_size: int, ranks: int, batch_size: int) -> int:
    """Optimizer steps per epoch of DDP (``DistributedSampler`` pads the split to a multiple of ``ranks``)."""
    return math.ceil(math.ceil(train_size / ranks) / batch_size)


def train_one(args: argparse.Namespace, dm: Mnist5kDataModule, lr: float, seed: int) -> dict[str, Any]:
    assert dm.train_dataset is not None and dm.val_dataset is not None
    train_x, train_y = dm.train_dataset.tensors
    val_x, val_y = dm.val_dataset.tensors
    per_epoch = steps_per_epoch(len(train_y), args.ranks, args.batch_size)
    budget = args.epochs * per_epoch
    torch.manual_seed(seed)
    model = Classifier(
        input_shape=dm.input_shape, num_classes=10, arch="convnet", channels=args.channels, depth=args.depth, lr=lr,
        optimizer="adam", warmup_steps=args.warmup_steps, schedule=args.schedule, min_lr_ratio=args.min_lr_ratio,
        total_steps=budget if args.schedule == "cosine" else None,
    )  # fmt: skip
    configured = model.configure_optimizers()
    if isinstance(configured, dict):
        optimizer, scheduler = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    else:
        optimizer, scheduler = configured, None
    global_batch = args.ranks * args.batch_size
    order = torch.Generator().manual_seed(seed)
    history: list[dict[str, Any]] = []
    step, start = 0, time.perf_counter()
    for epoch in range(args.epochs):
        model.train()
        perm = torch.randperm(len(train_y), generator=order)
        for i in range(0, len(perm), global_batch):
            idx = perm[i : i + global_batch]
            loss = F.cross_entropy(model.net(train_x[idx]), train_y[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            step += 1
        model.eval()
        with torch.no_grad():
            acc = float((model.net(val_x).argmax(-1) == val_y).float().mean())
        history.append({"epoch": epoch + 1, "step": step, "val_acc": acc, "train_loss": loss.item()})
        print(f"  lr={lr:g} seed={seed} epoch {epoch + 1:2d} step {step:4d}: val_acc {acc:.4f}", flush=True)
    reached = {f"{t:g}": next((h["step"] for h in history if h["val_acc"] >= t), None) for t in args.targets}
    return {
        "lr": lr, "seed": seed, "budget_steps": budget, "steps_per_epoch": per_epoch, "history": history,
        "final_val_acc": history[-1]["val_acc"], "first_step_reaching": reached,
        "seconds": time.perf_counter() - start,
    }  # fmt: skip


def choose(runs: list[dict[str, Any]], targets: list[float], latest: float) -> dict[str, Any] | None:
    """The rule of the module docstring: ``{"target", "lr", "worst_steps", "median_steps", ...}`` or ``None``."""
    budget = runs[0]["budget_steps"]
    by_lr: dict[float, list[dict[str, Any]]] = {}
    for r in runs:
        by_lr.setdefault(r["lr"], []).append(r)
    for target in sorted(targets, reverse=True):
        key = f"{target:g}"
        worst = {}
        for lr, rs in by_lr.items():
            steps = [r["first_step_reaching"][key] for r in rs]
            if all(s is not None for s in steps):
                worst[lr] = max(steps)
        if not worst:
            continue
        lr = min(worst, key=lambda k: (worst[k], k))
        if worst[lr] <= latest * budget:
            steps = sorted(r["first_step_reaching"][key] for r in by_lr[lr])
            return {
                "target": target, "lr": lr, "worst_steps": worst[lr], "median_steps": steps[len(steps) // 2],
                "steps_by_seed": {r["seed"]: r["first_step_reaching"][key] for r in by_lr[lr]},
                "fraction_of_budget": worst[lr] / budget, "budget_steps": budget,
                "rule": f"highest target the best lr reaches with every seed by {latest:.0%} of the budget; "
                "best lr = fewest steps to it, worst seed",
            }  # fmt: skip
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    dm = Mnist5kDataModule(batch_size=args.batch_size, seed=args.split_seed)
    dm.setup("fit")
    assert dm.train_dataset is not None
    train_size = len(dm.train_dataset)
    if train_size % args.ranks:
        print(f"note: {train_size} training images do not split evenly over {args.ranks} ranks", file=sys.stderr)
    per_epoch = steps_per_epoch(train_size, args.ranks, args.batch_size)
    print(
        f"MNIST-5k: {train_size} train images, {args.ranks} ranks x batch {args.batch_size} = global batch "
        f"{args.ranks * args.batch_size}; {per_epoch} steps/epoch, budget {args.epochs} epochs = "
        f"{args.epochs * per_epoch} steps; convnet channels={args.channels} depth={args.depth}, Adam, warm-up "
        f"{args.warmup_steps} steps, schedule {args.schedule}",
        flush=True,
    )
    runs = [train_one(args, dm, lr, seed) for lr in args.lrs for seed in args.seeds]
    print(f"\nfirst step reaching each target (seeds {args.seeds}; '-' = not within the budget), final val_acc:")
    rows = []
    for lr in args.lrs:
        rs = [r for r in runs if r["lr"] == lr]
        cells = [f"{lr:g}"]
        for t in args.targets:
            steps = [r["first_step_reaching"][f"{t:g}"] for r in rs]
            cells.append("/".join("-" if s is None else str(s) for s in steps))
        rows.append([*cells, "/".join(f"{r['final_val_acc']:.3f}" for r in rs)])
    header = ["lr", *(f">={t:g}" for t in args.targets), "final"]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)))
    choice = choose(runs, args.targets, args.latest)
    if choice is None:
        print(f"\nno candidate target is reached by every seed of any lr within {args.latest:.0%} of the budget")
    else:
        print(
            f"\nchosen: lr={choice['lr']:g}, target val_acc >= {choice['target']:g}: reached by every seed at step "
            f"{choice['steps_by_seed']} (worst {choice['worst_steps']} = {choice['fraction_of_budget']:.0%} of "
            f"{choice['budget_steps']} steps)"
        )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        payload = {"command": "python scripts/lr_sweep.py " + " ".join(sys.argv[1:] if argv is None else argv),
                   "config": config, "train_size": train_size, "runs": runs, "choice": choice}  # fmt: skip
        args.out.write_text(json.dumps(payload, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

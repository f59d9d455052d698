"""DC-ASGD(-adaptive) under delayed gradients, in one process, no distributed code: with and without the bound.

A small BatchNorm CNN trains on scikit-learn digits with SGD (momentum 0.9). Every gradient is applied ``delay``
steps after the weights it was computed on were read, as when several server updates land between reading the
weights and shipping the gradient over a slow link: ``delta = w_now - w_read`` holds ``tau = delay`` updates, and
the gradient goes through :meth:`StaleGradientCompensation.apply` before the optimizer step. Arms per delay:

* ``none``: the stale gradient as it is;
* ``unbounded``: ``dc_asgd_adaptive`` with ``max_ratio=None``, the papers' formula (the code before the bound);
* ``bounded``: ``dc_asgd_adaptive`` as the strategy builds it (the default ``max_ratio=1.0``).

``lam`` is swept because the correction-to-gradient ratio is ``lam * |delta_i| * |g_i| / sqrt(ms_i)``: it depends
on how far the weights move between read and apply *in parameter units*, not on the loss scale. ``lam=100`` here is
the default ``lam=1`` on a model whose weights move 100x farther per exchange (larger steps, more updates in flight,
or parameters stored at a larger scale: reparametrising ``w = u / 100`` multiplies ``delta`` by 100 and the ratio
with it).

Per run: the final validation accuracy (or the step where the loss became non-finite), ``||c|| / ||g||`` (the
applied correction against the raw gradient, median over the first 50 compensated steps and over the last 10), the
largest elementwise ``|c_i| / |g_i|`` (median over steps), ``||delta||_inf`` (median) and, with the bound, the
fraction of elements it clipped.

Run (about 1.5 min on one core)::

    python scripts/dc_asgd_slow_link.py
    python scripts/dc_asgd_slow_link.py --delays 2 --lams 1 30 100 300 --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from torch import nn

from lightning_syncasync.algorithms.ssp.compensation import StaleGradientCompensation
from lightning_syncasync.demo import DigitsDataModule

ARMS = {"none": ("none", None), "unbounded": ("dc_asgd_adaptive", None), "bounded": ("dc_asgd_adaptive", 1.0)}


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
    )  # fmt: skip


def run(arm: str, delay: int, lam: float, steps: int, lr: float, batch: int, seed: int, data: DigitsDataModule) -> dict:
    method, max_ratio = ARMS[arm]
    model = make_model(seed)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=lr, momentum=0.9)
    comp = StaleGradientCompensation(method, lam=lam, max_ratio=max_ratio)  # type: ignore[arg-type]
    x_tr, y_tr = data.train_dataset.tensors
    x_va, y_va = data.val_dataset.tensors
    gen = torch.Generator().manual_seed(seed)

    def flat() -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in params])

    pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # (gradient, the weights it was computed on)
    ratios, elem_ratios, delta_inf, clipped = [], [], [], []
    diverged_at = None
    for step in range(steps):
        idx = torch.randint(0, len(x_tr), (batch,), generator=gen)
        model.train()
        model.zero_grad()
        loss = nn.functional.cross_entropy(model(x_tr[idx]), y_tr[idx])
        if not torch.isfinite(loss):
            diverged_at = step
            break
        loss.backward()
        pending.append((torch.cat([p.grad.reshape(-1) for p in params]), flat()))
        if len(pending) <= delay:
            continue
        grad, read = pending.pop(0)
        delta = flat() - read
        raw = grad.clone()
        out = comp.apply(grad, delta if delay else None, delay)
        if delay and method != "none":
            corr = out - raw
            ratios.append(float(corr.norm() / raw.norm().clamp_min(1e-30)))
            nz = raw != 0
            elem_ratios.append(float((corr[nz].abs() / raw[nz].abs()).max()))
            delta_inf.append(float(delta.abs().max()))
            if max_ratio is not None:  # what the unbounded formula would have added, from the same running mean
                ms = comp.mean_square
                unb = lam / (ms + comp.eps).sqrt() * raw * raw * delta
                clipped.append(float((unb.abs() > max_ratio * raw.abs()).float().mean()))
        offset = 0
        for p in params:
            p.grad = out[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        opt.step()
    acc = float("nan")
    if diverged_at is None and torch.isfinite(flat()).all():
        model.eval()
        with torch.no_grad():
            acc = float((model(x_va).argmax(1) == y_va).float().mean())
    med = lambda xs: statistics.median(xs) if xs else 0.0  # noqa: E731
    return {
        "acc": acc,
        "diverged_at": diverged_at,
        "ratio_first": med(ratios[:50]),
        "ratio_last": med(ratios[-10:]),
        "elem": med(elem_ratios),
        "delta_inf": med(delta_inf),
        "clipped": statistics.mean(clipped) if clipped else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--delays", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--lams", type=float, nargs="+", default=[1.0, 100.0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    data = DigitsDataModule(seed=0)
    data.setup()
    print(f"BatchNorm CNN on digits, SGD lr={args.lr} momentum=0.9, {args.steps} steps of batch {args.batch}")
    print(f"{'arm':<10}{'delay':>6}{'lam':>6}{'seed':>5}  {'val_acc':<13}||c||/||g|| first50 last10  "
          "max_i|c_i|/|g_i|  ||delta||_inf  clipped")  # fmt: skip
    for delay in args.delays:
        for lam in args.lams:
            for arm in ARMS:
                if arm == "none" and lam != args.lams[0]:
                    continue  # lam does not matter
                for seed in args.seeds:
                    r = run(arm, delay, lam, args.steps, args.lr, args.batch, seed, data)
                    if r["diverged_at"] is not None:
                        acc = f"NaN@step{r['diverged_at']}"
                    elif r["acc"] != r["acc"]:
                        acc = "NaN weights"
                    else:
                        acc = f"{r['acc']:.3f}"
                    clip = "" if r["clipped"] is None else f"{r['clipped']:.2%}"
                    lam_s = "-" if arm == "none" else f"{lam:g}"
                    print(f"{arm:<10}{delay:>6}{lam_s:>6}{seed:>5}  {acc:<13}{r['ratio_first']:>16.3g} "
                          f"{r['ratio_last']:>7.3g}  {r['elem']:>16.3g}  {r['delta_inf']:>13.3g}  {clip:>7}",
                          flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

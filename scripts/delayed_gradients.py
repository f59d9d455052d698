"""How the benchmark workloads learn from delayed gradients, in one process, without any distributed code.

Asynchronous training applies gradients computed on older weights. This script trains the two demo workloads of
``syncasync-bench`` with plain Adam(W) on gradients that are ``delay`` optimizer steps old (the delay async training
adds at its best), and with the remedies the literature proposes, and prints the validation accuracy along the way.

    python scripts/delayed_gradients.py conv    # the straggler/jitter convnet (batch 512 = 4 ranks x 128)
    python scripts/delayed_gradients.py lm      # the transformer LM (batch 64 = 4 ranks x 16)

Each row: ``variant -> [(step, val_acc), ...]``. ``stale_frac=f``: each update mixes ``1-f`` of the fresh gradient
with ``f`` of the one a step older (only a straggler's share is late).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from lightning_syncasync.demo import Classifier, DigitsDataModule
from lightning_syncasync.demo.lm import TransformerLM
from lightning_syncasync.demo.text import TextDataModule


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


def run(workload: str, delay: int = 0, lr: float = 3e-3, dc_lambda: float = 0.0, predict: bool = False,
        stale_frac: float = 0.0, beta1: float = 0.9) -> list[tuple[int, float]]:  # fmt: skip
    torch.manual_seed(0)
    if workload == "conv":
        data, steps, every, limit = DigitsDataModule(batch_size=512, resize=32), 48, 12, 100
        model = Classifier(input_shape=[1, 32, 32], channels=64, depth=3, lr=lr, arch="convnet")
        opt, sched = torch.optim.Adam(model.parameters(), lr=lr, betas=(beta1, 0.999)), None
        loss_fn = F.cross_entropy
    else:
        data, steps, every, limit = TextDataModule(seq_len=64, batch_size=64), 40, 10, 4
        model = TransformerLM(lr=lr, warmup_steps=10)
        conf = model.configure_optimizers()
        opt, sched = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
        for group in opt.param_groups:
            group["betas"] = (beta1, group["betas"][1])

        def loss_fn(logits, y):
            return F.cross_entropy(logits.flatten(0, 1), y.flatten())

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


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    workload = sys.argv[1] if len(sys.argv) > 1 else "conv"
    variants = [
        {"delay": 0}, {"delay": 1}, {"delay": 2},
        {"delay": 0, "lr": 1.5e-3}, {"delay": 1, "lr": 1.5e-3},
        {"delay": 1, "dc_lambda": 1.0}, {"delay": 1, "dc_lambda": 4.0}, {"delay": 1, "predict": True},
        {"delay": 1, "beta1": 0.5}, {"delay": 0, "stale_frac": 0.25}, {"delay": 0, "stale_frac": 0.5},
    ]  # fmt: skip
    if workload == "lm":
        variants = variants[:2] + [{"delay": 1, "dc_lambda": 1.0}]
    for kw in variants:
        print(kw, "->", run(workload, **kw), flush=True)

# ---
# jupyter:
#   jupytext:
#     text_representation:
#       format_name: percent
# ---

# %% [markdown]
# # lightning_syncasync in a notebook
#
# This file is in the percent format: VS Code, PyCharm and Spyder run its `# %%` cells as they are, and
# `jupytext --to notebook examples/notebook.py` turns it into an `.ipynb`. It also runs as a script
# (`python examples/notebook.py`).
#
# **Which start method works in Jupyter.** Our strategies start their processes the way Lightning's `DDPStrategy`
# does (`start_method=`), and Lightning decides what an interactive session may use
# (`lightning/pytorch/trainer/connectors/accelerator_connector.py`, `is_interactive_compatible`):
#
# - `"popen"` (`hier_sync`, `async_ssp`): re-runs the script for every rank; a notebook has no script to re-run.
#   Refused in Jupyter.
# - `"spawn"` (`hier_sync_spawn`, `async_ssp_spawn`): starts fresh interpreters that unpickle the model. A class
#   defined in a cell lives in `__main__`, which a spawned interpreter cannot import, so the model class would have to
#   come from an importable module (such as `examples/own_module.py`). Lightning refuses spawn in an interactive
#   session anyway (`Trainer(strategy=...) is not compatible with an interactive environment`); the `_spawn` names
#   are for scripts, Hydra multirun and tests.
# - `"fork"` (Lightning's `ddp_notebook`): the ranks are copies of the notebook's process, so classes defined in
#   cells just work and nothing is re-imported (fast). This is what the cells below use:
#   `HierSyncStrategy(start_method="fork")`, `AsyncSSPStrategy(start_method="fork")`. Linux and macOS only (no fork
#   on Windows); on GPUs, touch no CUDA tensor in the notebook before `fit`.
#
# The ranks are separate processes: after `fit`, Lightning copies rank 0's metrics and weights back into the
# notebook, and `SyncMonitor` leaves its summary in `summary_file`.

# %%
import json
import os
import tempfile
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import Strategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_syncasync  # noqa: F401  (registers the strategy names)
from lightning_syncasync.callbacks import SyncMonitor
from lightning_syncasync.strategies import AsyncSSPStrategy, HierSyncStrategy

EPOCHS = 3
# Training batches per epoch and rank; the example tests set SYNCASYNC_EXAMPLE_BATCHES to a few (None: whole epochs).
BATCHES = int(os.environ.get("SYNCASYNC_EXAMPLE_BATCHES", "0")) or None
OUT = Path(tempfile.mkdtemp(prefix="syncasync-notebook-"))

# %% [markdown]
# A model and data defined right here in the notebook (with fork, no module file is needed).

# %%
g = torch.Generator().manual_seed(0)
x = torch.randn(4096, 16, generator=g)
y = (torch.tanh(x @ torch.randn(16, 32, generator=g)) @ torch.randn(32, 4, generator=g)).argmax(dim=1)
train_set, val_set = TensorDataset(x[:3276], y[:3276]), TensorDataset(x[3276:], y[3276:])


class NotebookMLP(L.LightningModule):
    def __init__(self, hidden: int = 64, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(16, hidden), nn.ReLU(), nn.Linear(hidden, 4))

    def training_step(self, batch, batch_idx):
        inputs, labels = batch
        loss = F.cross_entropy(self.net(inputs), labels)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        inputs, labels = batch
        acc = (self.net(inputs).argmax(dim=1) == labels).float().mean()
        self.log("val_acc", acc, sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


def fit(name: str, strategy: Strategy) -> dict:
    """One fit with 2 CPU processes; returns the final val_acc and SyncMonitor's summary."""
    summary_file = OUT / f"{name}_summary.json"
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=EPOCHS,
        limit_train_batches=BATCHES,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[SyncMonitor(print_summary=False, summary_file=str(summary_file))],
    )
    trainer.fit(
        NotebookMLP(),
        train_dataloaders=DataLoader(train_set, batch_size=32, shuffle=True),
        val_dataloaders=DataLoader(val_set, batch_size=256),
    )
    return {"val_acc": float(trainer.callback_metrics["val_acc"]), "summary": json.loads(summary_file.read_text())}


# %% [markdown]
# `hier_sync` on one machine: `node_size=1` makes each process its own virtual node, so the two replicas are averaged
# every `inter_period` steps in the background (with one node of 2 ranks it would be plain DDP).

# %%
hier = fit("hier_sync", HierSyncStrategy(node_size=1, inter_period=4, start_method="fork"))
print(f"hier_sync: val_acc={hier['val_acc']:.4f}")

# %% [markdown]
# `async_ssp`: each process trains its own replica for `local_steps` steps a round, and the averaged progress comes
# back at most `staleness` rounds late.

# %%
ssp = fit("async_ssp", AsyncSSPStrategy(local_steps=4, staleness=1, start_method="fork"))
print(f"async_ssp: val_acc={ssp['val_acc']:.4f}")

# %%
# SyncMonitor's summary of each fit: what synchronisation cost (rank 0 wrote it; the numbers are per step).
for name, result in (("hier_sync", hier), ("async_ssp", ssp)):
    s = result["summary"]
    print(
        f"{name:10s} val_acc={result['val_acc']:.4f}  {s['global_samples_per_s']:8.1f} samples/s  "
        f"wait {1e3 * s['wait_s_per_step']:.2f} ms/step  inter-node {s['bytes_inter_per_step'] / 1e3:.1f} KB/step"
    )

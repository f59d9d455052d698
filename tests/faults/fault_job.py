"""One rank of a fault-injection job, started by ``EmulatedCluster`` with torchrun's environment.

``python fault_job.py STRATEGY COMPRESSION TIMEOUT_S OUT_DIR [MAX_STEPS]``: trains ``TinyModel`` with the named
strategy (``ddp`` is Lightning's own, plus our ``PeerWatchdog``), while ``SYNCASYNC_FAULT`` makes one rank fail.
Each rank records in ``OUT_DIR/rank{r}.json`` how it ended (the exception, if any, and its time).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for _models

import torch  # noqa: E402
from _models import ShardedTinyModel, TinyModel  # noqa: E402
from lightning.pytorch import Trainer  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402

from lightning_syncasync.callbacks import FaultInjector, PeerWatchdog  # noqa: E402
from lightning_syncasync.strategies.async_ssp import AsyncSSPStrategy  # noqa: E402
from lightning_syncasync.strategies.async_ssp_sharded import ShardedAsyncSSPStrategy  # noqa: E402
from lightning_syncasync.strategies.auto_sync import AutoSyncStrategy  # noqa: E402
from lightning_syncasync.strategies.hier_sync import HierSyncStrategy  # noqa: E402
from lightning_syncasync.strategies.hier_sync_sharded import ShardedHierSyncStrategy  # noqa: E402
from lightning_syncasync.strategies.measured_ddp import MeasuredDDPStrategy  # noqa: E402


class SlowTinyModel(TinyModel):
    """A step of ~20 ms, so the fault lands mid-training and the others are inside a collective or an exchange."""

    def training_step(self, batch, batch_idx):
        time.sleep(0.02)
        return super().training_step(batch, batch_idx)


class SlowShardedTinyModel(ShardedTinyModel):
    """SlowTinyModel's step, sharded with FSDP2 by the strategy that gives it a mesh."""

    def training_step(self, batch, batch_idx):
        time.sleep(0.02)
        return super().training_step(batch, batch_idx)


def build(name: str, compression: str, timeout_s: float):
    if name == "ddp":
        return DDPStrategy(), [PeerWatchdog(timeout_s=timeout_s, grace_s=1.0)]
    if name == "ddp_measured":  # compressed DDP (bench contenders ddp_int8, ...): no peer_timeout_s of its own
        return MeasuredDDPStrategy(compression=compression), [PeerWatchdog(timeout_s=timeout_s, grace_s=1.0)]
    kw = {"peer_timeout_s": timeout_s, "compression": compression}
    if name == "hier_sync":
        return HierSyncStrategy(node_size=1, **kw), []
    if name == "hier_sync_sharded":  # 4 ranks as 2 nodes of 2: FSDP2 inside each
        return ShardedHierSyncStrategy(node_size=2, **kw), []
    if name == "async_ssp_sharded":  # the same layout, rounds across the nodes
        return ShardedAsyncSSPStrategy(node_size=2, **kw), []
    if name == "async_ssp":
        return AsyncSSPStrategy(staleness=2, **kw), []
    if name == "auto_sync":
        return AutoSyncStrategy(**kw), []
    raise ValueError(f"unknown strategy {name!r}")


def main() -> None:
    name, compression, timeout_s, out = sys.argv[1], sys.argv[2], float(sys.argv[3]), Path(sys.argv[4])
    max_steps = int(sys.argv[5]) if len(sys.argv) > 5 else 100_000
    rank = int(os.environ["RANK"])
    strategy, callbacks = build(name, compression, timeout_s)
    fault = FaultInjector.from_env()
    trainer = Trainer(
        accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        num_nodes=int(os.environ["WORLD_SIZE"]) // int(os.environ["LOCAL_WORLD_SIZE"]), strategy=strategy,
        max_steps=max_steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, callbacks=[*callbacks, *([fault] if fault else [])],
    )  # fmt: skip
    torch.manual_seed(0)
    record = {"rank": rank, "error": None}
    try:
        trainer.fit(SlowShardedTinyModel() if name.endswith("_sharded") else SlowTinyModel())
    except BaseException as err:  # noqa: BLE001 - recorded for the test, then re-raised
        record.update(error=f"{type(err).__name__}: {err}"[:2000], t=time.time())
        (out / f"rank{rank}.json").write_text(json.dumps(record))
        raise
    record["t"] = time.time()
    (out / f"rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()

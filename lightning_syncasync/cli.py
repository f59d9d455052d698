"""``syncasync-cli``: Lightning's CLI with this package's strategies and demos available.

Any LightningModule/LightningDataModule works (``--model path.to.Class``); the defaults train the digits demo with 2
CPU processes, like ``syncasync-train``. Importing this module registers the strategy names, so short names such as
``--trainer.strategy=hier_sync`` resolve (Lightning has no entry point for third-party strategies)::

    syncasync-cli fit --trainer.callbacks+=lightning_syncasync.callbacks.SyncMonitor
    syncasync-cli fit --print_config > job.yaml && syncasync-cli fit --config job.yaml
"""

from __future__ import annotations

from pathlib import Path

from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningCLI

import lightning_syncasync  # noqa: F401  (registers the strategy names)
import lightning_syncasync.callbacks  # noqa: F401  (makes SyncMonitor resolvable by its short name)
import lightning_syncasync.demo  # noqa: F401  (makes the demo classes resolvable by their short names)

DEFAULT_CONFIG = Path(__file__).with_name("cli_defaults.yaml")


class SyncAsyncCLI(LightningCLI):
    """``LightningCLI`` in subclass mode for both the model and the data, with the package's defaults."""


def build_cli(args: list[str] | None = None, run: bool = True) -> SyncAsyncCLI:
    """Build (and with ``run=True`` run) the CLI; ``args`` replaces ``sys.argv[1:]`` (for tests and notebooks)."""
    default_files = [str(DEFAULT_CONFIG)]
    return SyncAsyncCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=args,
        run=run,
        save_config_kwargs={"overwrite": True},
        parser_kwargs={sub: {"default_config_files": default_files} for sub in ("fit", "validate", "test", "predict")}
        if run
        else {"default_config_files": default_files},
    )


def main() -> None:
    """Entry point of ``syncasync-cli`` (returns nothing: a console script's return value becomes its exit status)."""
    build_cli()


if __name__ == "__main__":
    main()

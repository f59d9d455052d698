"""``syncasync-cli``: Lightning's CLI with this package's strategies and demos available.

Any LightningModule/LightningDataModule works (``--model path.to.Class``); the defaults train the digits demo with 2
CPU processes, like ``syncasync-train``. Importing this module registers the strategy names, so short names such as
``--trainer.strategy=hier_sync`` resolve (Lightning has no entry point for third-party strategies)::

    syncasync-cli fit --trainer.callbacks+=lightning_syncasync.callbacks.SyncMonitor
    syncasync-cli fit --print_config > job.yaml && syncasync-cli fit --config job.yaml
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from typing_extensions import override

import lightning_syncasync  # noqa: F401  (registers the strategy names)
import lightning_syncasync.callbacks  # noqa: F401  (makes SyncMonitor resolvable by its short name)
import lightning_syncasync.demo  # noqa: F401  (makes the demo classes resolvable by their short names)
from lightning_syncasync._progress_bar import resolve_enable_progress_bar
from lightning_syncasync.strategies import check_strategy_name

DEFAULT_CONFIG = Path(__file__).with_name("cli_defaults.yaml")
CLI_EXTRA_HINT = 'HINT: pip install "lightning-syncasync[cli]"'

# Lightning's CLI needs jsonargparse (the `cli` extra). Without it, importing lightning.pytorch.cli fails (or its
# parser fails when built) with Lightning's own hint; this module must still import, so that `syncasync-cli` can say
# which extra to install instead of printing a traceback.
try:
    from lightning.pytorch.cli import _JSONARGPARSE_SIGNATURES_AVAILABLE, LightningCLI

    _MISSING_CLI_EXTRA: str | None = (
        None if _JSONARGPARSE_SIGNATURES_AVAILABLE else str(_JSONARGPARSE_SIGNATURES_AVAILABLE)
    )
except ImportError as _err:
    LightningCLI = object  # type: ignore[assignment,misc]  # never instantiated: build_cli raises first
    _MISSING_CLI_EXTRA = str(_err)


class CLIExtraMissing(ModuleNotFoundError):
    """``syncasync-cli`` was run without jsonargparse, which Lightning's CLI needs."""


class SyncAsyncCLI(LightningCLI):
    """``LightningCLI`` in subclass mode for both the model and the data, with the package's defaults.

    ``--trainer.enable_progress_bar`` left at ``null`` shows a bar only when stdout is a terminal, as in
    ``syncasync-train``.
    """

    @override
    def before_instantiate_classes(self) -> None:
        # A misspelt strategy name would otherwise reach Lightning's generic "invalid strategy name" list, after the
        # model and data are built; here it gets "did you mean ...?" and this package's names, as a parser error.
        config = self.config.get(str(self.subcommand), self.config) if self.subcommand else self.config
        strategy = config.get("trainer", {}).get("strategy")
        if isinstance(strategy, str):
            try:
                check_strategy_name(strategy, setting="--trainer.strategy")
            except ValueError as err:
                parser = self._subcommand_parsers.get(self.subcommand, self.parser) if self.subcommand else self.parser
                parser.error(str(err))

    @override
    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        config = self.config_init.get(str(self.subcommand), self.config_init)
        trainer_kwargs = {**config.get("trainer", {}), **kwargs}
        callbacks: list[Any] = []
        for value in (trainer_kwargs.get("callbacks"), self.trainer_defaults.get("callbacks")):
            callbacks += value if isinstance(value, list) else [] if value is None else [value]
        # The bar's setting is resolved before the Trainer sees it: Lightning's `None` would mean a bar everywhere.
        enable_progress_bar = resolve_enable_progress_bar(trainer_kwargs, callbacks)
        return super().instantiate_trainer(**{**kwargs, "enable_progress_bar": enable_progress_bar})


def build_cli(args: list[str] | None = None, run: bool = True) -> SyncAsyncCLI:
    """Build (and with ``run=True`` run) the CLI; ``args`` replaces ``sys.argv[1:]`` (for tests and notebooks).

    Raises:
        CLIExtraMissing: jsonargparse (the ``cli`` extra) is not installed.
    """
    if _MISSING_CLI_EXTRA is not None:
        raise CLIExtraMissing(
            f"syncasync-cli needs Lightning's CLI parser, jsonargparse[signatures] >= 4.27, which is missing or too "
            f"old here ({_MISSING_CLI_EXTRA.splitlines()[0]}); {CLI_EXTRA_HINT}"
        )
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
    try:
        build_cli()
    except CLIExtraMissing as err:
        sys.exit(f"syncasync-cli: error: {err}")  # one line on stderr, exit status 1, no traceback


if __name__ == "__main__":
    main()

"""``syncasync-cli``: Lightning's CLI with this package's strategies and demos available.

Any LightningModule/LightningDataModule works (``--model path.to.Class``); the defaults train the digits demo with 2
CPU processes, like ``syncasync-train``. Importing this module registers the strategy names, so short names such as
``--trainer.strategy=hier_sync`` resolve (Lightning has no entry point for third-party strategies)::

    syncasync-cli fit --trainer.callbacks+=lightning_syncasync.callbacks.SyncMonitor
    syncasync-cli fit --print_config > job.yaml && syncasync-cli fit --config job.yaml

``--ft N`` (before the subcommand) runs a fault-tolerant job on this machine: a torchft Lighthouse and N jobs of the
CLI, one per emulated node (``--trainer.strategy=hier_sync_ft`` or ``async_ssp_ft``), each under
``ft/node{n}`` unless ``--trainer.default_root_dir`` is given; ``--ft-faults kill:1@20,start:1@40`` kills a node's job
and starts it again::

    syncasync-cli --ft 2 fit --trainer.strategy=hier_sync_ft --trainer.max_epochs=20
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from typing_extensions import override

import lightning_syncasync  # noqa: F401  (registers the strategy names)
import lightning_syncasync.callbacks  # noqa: F401  (makes SyncMonitor resolvable by its short name)
import lightning_syncasync.demo  # noqa: F401  (makes the demo classes resolvable by their short names)
from lightning_syncasync._progress_bar import resolve_enable_progress_bar
from lightning_syncasync._quiet import quiet_third_party_noise
from lightning_syncasync.strategies import check_strategy_name, is_fault_tolerant

quiet_third_party_noise()

DEFAULT_CONFIG = Path(__file__).with_name("cli_defaults.yaml")
CLI_EXTRA_HINT = 'HINT: pip install -e ".[cli]"'

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
        if os.environ.get("SYNCASYNC_FT_NODE") and not is_fault_tolerant(strategy):
            parser = self._subcommand_parsers.get(self.subcommand, self.parser) if self.subcommand else self.parser
            parser.error(
                f"--ft runs one job per node joined through a Lighthouse, which only the fault-tolerant strategies "
                f"do; --trainer.strategy is {strategy!r}. HINT: --trainer.strategy=hier_sync_ft (or async_ssp_ft)"
            )
        if isinstance(strategy, str):
            try:
                check_strategy_name(strategy, setting="--trainer.strategy")
            except ValueError as err:
                parser = self._subcommand_parsers.get(self.subcommand, self.parser) if self.subcommand else self.parser
                parser.error(str(err))

    @override
    def instantiate_classes(self) -> None:
        # A refused setting raises our ValueError (its message ends in a HINT) inside jsonargparse's instantiation,
        # which wraps it in a traceback and a dump of every default. A CLI user gets our paragraph and exit status 2,
        # as for a parser error.
        try:
            super().instantiate_classes()
        except Exception as err:  # noqa: BLE001 - re-raised unless it carries one of our messages
            message = our_message(err)
            if message is None:
                raise
            print(f"syncasync-cli: error: {message}", file=sys.stderr)
            raise SystemExit(2) from None

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

    def after_fit(self) -> None:
        """The final metrics, as ``syncasync-train`` ends (Lightning's CLI prints none after fit)."""
        trainer = self.trainer
        if not trainer.is_global_zero:
            return
        shown = ", ".join(f"{k}={float(v):.4f}" for k, v in sorted(trainer.callback_metrics.items())
                          if k.startswith("val") and getattr(v, "numel", lambda: 0)() == 1)  # fmt: skip
        print(f"done: {shown or 'no validation metric logged'} after {trainer.global_step} steps", flush=True)


def our_message(err: BaseException) -> str | None:
    """The first message of this package's in ``err``'s chain (a line with ``HINT:``), without jsonargparse's
    wrapping; ``None`` when there is none (somebody else's error keeps its traceback)."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        for line in str(current).splitlines():
            line = line.strip().removeprefix("- ").strip()
            if "HINT:" in line:
                return line.split(". Got value:")[0]
        current = current.__cause__ or current.__context__
    return None


def expand_strategy_name(argv: list[str]) -> list[str]:
    """``--trainer.strategy=hier_sync --trainer.strategy.inter_period=4``: a registered name with settings of its
    own. jsonargparse accepts settings only after a class path, so the name becomes its class path plus the name's
    own settings (``hier_sync_virtual``'s ``virtual_nodes=2``, a ``*_spawn`` name's ``start_method``), ahead of the
    user's, which win. A name with no settings after it is left to Lightning's registry."""
    from lightning.pytorch.strategies import StrategyRegistry

    out = list(argv)
    for i, arg in enumerate(out):
        if arg.startswith("--trainer.strategy="):
            name, at = arg.split("=", 1)[1], i
        elif arg == "--trainer.strategy" and i + 1 < len(out):
            name, at = out[i + 1], i + 1
        else:
            continue
        settings = any(a.startswith("--trainer.strategy.") for a in out)
        if not settings or name not in StrategyRegistry:
            return out
        entry = StrategyRegistry[name]
        cls = entry["strategy"]
        path = f"{cls.__module__}.{cls.__qualname__}"
        own = [f"--trainer.strategy.init_args.{k}={_cli_value(v)}" for k, v in entry["init_params"].items()]
        out[at] = f"--trainer.strategy={path}" if at == i else path
        return out[: at + 1] + own + out[at + 1 :]
    return out


def _cli_value(value: Any) -> str:
    return "true" if value is True else "false" if value is False else "null" if value is None else str(value)


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
    if args is not None:
        args = expand_strategy_name(args)
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


def split_ft_args(argv: list[str]) -> tuple[int, str, list[str]]:
    """``--ft N`` and ``--ft-faults SPEC`` (either ``--opt value`` or ``--opt=value``) out of ``argv``."""
    nodes, faults, rest = 0, "", []
    it = iter(argv)
    for arg in it:
        name, eq, value = arg.partition("=")
        if name in ("--ft", "--ft-faults"):
            if not eq:
                value = next(it, "")
            if name == "--ft":
                try:
                    nodes = int(value)
                except ValueError:
                    raise ValueError(f"--ft {value!r} is not a number of nodes; HINT: --ft 2") from None
                if nodes < 1:
                    raise ValueError(f"--ft {nodes} is not a number of nodes; HINT: --ft 2 runs 2 emulated nodes")
            else:
                faults = value
        else:
            rest.append(arg)
    if faults and not nodes:
        raise ValueError("--ft-faults needs --ft N; HINT: --ft 2 --ft-faults kill:1@20,start:1@40")
    return nodes, faults, rest


def _run_ft(nodes: int, faults: str, argv: list[str]) -> int:
    from lightning_syncasync.emulate.replica_groups import ReplicaGroupCluster, node_command

    devices = next((int(a.split("=", 1)[1]) for a in argv if a.startswith("--trainer.devices=") and
                    a.split("=", 1)[1].isdigit()), 2)  # fmt: skip
    root = Path("ft").resolve()
    if not any(a.startswith("--trainer.default_root_dir") for a in argv):
        argv = [*argv, f"--trainer.default_root_dir={root}/node{{node}}"]
    try:
        cluster = ReplicaGroupCluster(
            nodes=nodes, procs_per_node=devices, faults=faults, log_dir=root, faults_setting="--ft-faults"
        )
    except ValueError as err:  # a bad --ft-faults schedule, torchft missing
        sys.exit(f"syncasync-cli: error: {err}")
    report = cluster.run(node_command(devices, "lightning_syncasync.cli", argv))
    for r in report.runs:
        print(f"syncasync-cli: node {r.node} exit {r.exit_code}{' (killed)' if r.killed else ''}: {r.log}")
    return 1 if report.failed or report.interrupted else 0


def main() -> None:
    """Entry point of ``syncasync-cli`` (returns nothing: a console script's return value becomes its exit status)."""
    try:
        nodes, faults, argv = split_ft_args(sys.argv[1:])
    except ValueError as err:
        sys.exit(f"syncasync-cli: error: {err}")
    if nodes and not os.environ.get("SYNCASYNC_FT_NODE"):
        sys.exit(_run_ft(nodes, faults, argv))
    sys.argv[1:] = expand_strategy_name(argv)
    try:
        build_cli()
    except CLIExtraMissing as err:
        sys.exit(f"syncasync-cli: error: {err}")  # one line on stderr, exit status 1, no traceback


if __name__ == "__main__":
    main()

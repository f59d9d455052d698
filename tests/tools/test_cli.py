"""syncasync-cli: Lightning's CLI with our strategy names, the demos and SyncMonitor."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from _commands import CommandFailed, run_cli

from lightning_syncasync.cli import build_cli
from lightning_syncasync.strategies import pack_strategy_names

CLI = [sys.executable, "-m", "lightning_syncasync.cli"]


@pytest.fixture(autouse=True)
def _own_argv(monkeypatch):
    """The CLI reads sys.argv when it is given no args: pytest's own arguments are not a user's command line."""
    monkeypatch.setattr(sys, "argv", ["syncasync-cli"])


def _cli(tmp_path: Path, *args: str, timeout: int = 200) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], cwd=tmp_path, capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(120)
def test_print_config_round_trips(tmp_path):
    args = [
        "fit",
        "--trainer.strategy=ddp_spawn",
        "--trainer.callbacks+=lightning_syncasync.callbacks.SyncMonitor",
        # Our callbacks resolve by their short names too, as the README shows.
        "--trainer.callbacks+=AdaptiveBatchSize",
        "--trainer.callbacks.init_args.interval=5",
        "--model.init_args.hidden=64",
    ]
    first = run_cli(*args, "--print_config")
    (tmp_path / "job.yaml").write_text(first)
    second = run_cli("fit", "--config", str(tmp_path / "job.yaml"), "--print_config")
    assert second == first
    cfg = yaml.safe_load(first)
    assert cfg["trainer"]["callbacks"][0]["class_path"] == "lightning_syncasync.callbacks.SyncMonitor"
    adaptive = cfg["trainer"]["callbacks"][1]
    assert adaptive["class_path"] == "lightning_syncasync.callbacks.AdaptiveBatchSize"
    assert adaptive["init_args"]["interval"] == 5
    assert cfg["model"]["class_path"] == "lightning_syncasync.demo.Classifier"
    assert cfg["model"]["init_args"]["hidden"] == 64


@pytest.mark.slow  # the default run fits examples/cli_config.yaml (SyncMonitor with a summary file) instead
@pytest.mark.timeout(240)
def test_fit_with_sync_monitor_from_the_command_line(tmp_path):
    proc = _cli(
        tmp_path,
        "fit",
        "--trainer.strategy=ddp_spawn",
        "--trainer.max_epochs=1",
        "--trainer.enable_progress_bar=false",
        "--trainer.callbacks+=lightning_syncasync.callbacks.SyncMonitor",
        f"--trainer.callbacks.init_args.summary_file={tmp_path / 's.json'}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "syncasync summary" in proc.stdout
    assert (tmp_path / "s.json").exists()


def test_defaults_parse_in_process():
    cli = build_cli(args=["--trainer.logger=false", "--trainer.enable_checkpointing=false"], run=False)
    assert cli.trainer.world_size == 2
    assert type(cli.model).__name__ == "Classifier" and type(cli.datamodule).__name__ == "DigitsDataModule"


@pytest.mark.parametrize(
    ("args", "tty", "bar"),
    [([], False, False), ([], True, True), (["--trainer.enable_progress_bar=true"], False, True)],
)
def test_progress_bar_only_on_a_terminal_unless_set(monkeypatch, args, tty, bar):
    import io

    class Stdout(io.StringIO):
        def isatty(self) -> bool:
            return tty

    monkeypatch.setattr(sys, "stdout", Stdout())
    cli = build_cli(args=["--trainer.logger=false", "--trainer.enable_checkpointing=false", *args], run=False)
    assert (cli.trainer.progress_bar_callback is not None) is bar


@pytest.mark.parametrize(
    ("args", "message"),
    [
        # A typo gets a suggestion and the package's names, as a parser error before anything is built.
        (
            ["fit", "--trainer.strategy=hier_synk"],
            "error: --trainer.strategy='hier_synk' is not a registered strategy "
            "name; HINT: did you mean 'hier_sync'? lightning_syncasync's names: "
            "hier_sync, hier_sync_spawn",
        ),
        (["fit", "--model.init_args.hiden=3"], "hiden"),
        (["fit", "--trainer.max_epochs=ten"], "max_epochs"),
    ],
)
@pytest.mark.timeout(120)
def test_bad_input_is_rejected_with_the_setting_named(args, message):
    with pytest.raises(CommandFailed) as failed:
        run_cli(*args)
    assert failed.value.code not in (0, None)
    assert message in str(failed.value)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("strategy_args", "modes"),
    [
        pytest.param(
            ["--trainer.strategy=hier_sync_spawn"],
            ("hier",),
            # The default run builds every name's strategy in process (below) and fits examples/cli_config.yaml.
            marks=pytest.mark.slow,
        ),
        pytest.param(
            [
                "--trainer.strategy=lightning_syncasync.strategies.async_ssp.AsyncSSPStrategy",
                "--trainer.strategy.init_args.staleness=2",
                "--trainer.strategy.init_args.local_steps=2",
                # Claimed batches would make max_steps a budget over ranks; per-rank steps are checked below.
                "--trainer.strategy.init_args.claim_batches=false",
                "--trainer.strategy.init_args.compression=int8",
                "--trainer.strategy.init_args.start_method=spawn",
            ],
            ("async",),
            # The default run fits examples/cli_config.yaml (async_ssp by class path with init_args) instead.
            marks=pytest.mark.slow,
        ),
        pytest.param(
            [
                "--trainer.strategy=lightning_syncasync.strategies.auto_sync.AutoSyncStrategy",
                "--trainer.strategy.init_args.mode=async",
                "--trainer.strategy.init_args.switcher=false",
                "--trainer.strategy.init_args.start_method=spawn",
            ],
            ("async",),
            marks=pytest.mark.slow,  # examples/cli_config.yaml fits by class path; hier_sync_by_name stays
        ),
    ],
    ids=["hier_sync_by_name", "async_ssp_with_arguments", "auto_sync_with_arguments"],
)
def test_our_strategies_from_the_command_line(tmp_path, strategy_args, modes):
    proc = _cli(
        tmp_path, "fit", *strategy_args, "--trainer.max_steps=6", "--trainer.enable_progress_bar=false",
        "--trainer.callbacks+=lightning_syncasync.callbacks.SyncMonitor",
        f"--trainer.callbacks.init_args.summary_file={tmp_path / 's.json'}",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["ranks"][0]["steps"] == 6 and summary["mode"] in modes


@pytest.mark.parametrize("name", pack_strategy_names())
def test_every_strategy_name_of_ours_builds_its_strategy_from_the_command_line(name):
    """What the CLI adds to a name is its resolution (``--trainer.strategy=hier_sync``): each name builds its
    registered class with the entry's init params. A fit by name starts processes (about 20 s on 2 cores), so it runs
    with ``-m slow``; the default run fits examples/cli_config.yaml."""
    from lightning.pytorch.strategies import StrategyRegistry

    cli = build_cli(
        args=[f"--trainer.strategy={name}", "--trainer.logger=false", "--trainer.enable_checkpointing=false"],
        run=False,
    )
    entry = StrategyRegistry[name]
    assert type(cli.trainer.strategy) is entry["strategy"]
    strategy = cli.trainer.strategy
    for key, value in entry["init_params"].items():  # start_method is Lightning's _start_method
        held = [getattr(strategy, attr) for attr in (key, f"_{key}") if hasattr(strategy, attr)]
        assert held and held[0] == value, (key, held)
    assert cli.trainer.world_size == 2


@pytest.mark.timeout(120)
def test_without_the_cli_extra_it_names_the_extra_and_prints_no_traceback(tmp_path):
    # As on a machine without jsonargparse: its import fails.
    code = (
        "import sys; sys.modules['jsonargparse'] = None; sys.argv = ['syncasync-cli', 'fit']; "
        "from lightning_syncasync.cli import main; main()"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 1
    assert "syncasync-cli: error: syncasync-cli needs Lightning's CLI parser" in proc.stderr
    assert 'HINT: pip install -e ".[cli]"' in proc.stderr
    assert "Traceback" not in proc.stderr


def test_ft_options_come_out_of_the_cli_arguments():
    from lightning_syncasync.cli import split_ft_args

    assert split_ft_args(["--ft", "2", "fit", "--trainer.max_epochs=3"]) == (2, "", ["fit", "--trainer.max_epochs=3"])
    assert split_ft_args(["--ft=3", "--ft-faults=kill:1@5", "fit"]) == (3, "kill:1@5", ["fit"])
    for bad, match in ((["--ft", "two", "fit"], "--ft 'two'"), (["--ft", "0", "fit"], "--ft 0"),
                       (["--ft-faults", "kill:1@5", "fit"], "--ft-faults needs --ft")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            split_ft_args(bad)


@pytest.mark.parametrize(
    "strategy",
    [
        ["--trainer.strategy=HierSyncStrategy", "--trainer.strategy.init_args.inter_period=0"],  # the documented form
        ["--trainer.strategy=hier_sync", "--trainer.strategy.init_args.inter_period=0"],  # a registered name
        ["--trainer.strategy", "hier_sync", "--trainer.strategy.inter_period=0"],  # and the short settings form
    ],
)
def test_a_refused_setting_gives_our_message_and_exit_2_in_every_form(strategy):
    with pytest.raises(CommandFailed) as failed:
        run_cli("fit", *strategy)
    assert failed.value.code == 2
    message = str(failed.value)
    assert message == (
        "syncasync-cli: error: inter_period must be an integer >= 1 or None, got 0; HINT: None (the default) decides "
        "it from the measured step and exchange times, 1 averages across nodes every step"
    )


def test_a_registered_name_takes_settings_and_keeps_its_own():
    printed = yaml.safe_load(run_cli("fit", "--trainer.strategy=hier_sync_virtual_spawn",
                                     "--trainer.strategy.inter_period=3", "--print_config"))  # fmt: skip
    strategy = printed["trainer"]["strategy"]
    assert strategy["class_path"].endswith("HierSyncStrategy")
    # The name's own settings (2 virtual nodes, spawn) and the user's.
    assert (strategy["init_args"]["virtual_nodes"], strategy["init_args"]["start_method"]) == (2, "spawn")
    assert strategy["init_args"]["inter_period"] == 3

"""Every command in the README's bash blocks runs: the ``syncasync-train`` lines compose (every sweep value, through
the app's own schemas), the ``syncasync-cli`` lines print their config (``--print_config``: the whole parse, the
strategy and callbacks resolved), the tool lines parse with the tool's own parser, and ``syncasync-bench report``
is checked by ``test_publish.py``. Installing and the test suite itself are what CI runs; nothing is left unchecked
silently: a line no rule knows fails here."""

from __future__ import annotations

import itertools
import re
import shlex
from pathlib import Path

import pytest
from _commands import run_cli

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
# Lines CI runs itself (.ci/run) or that only set up a machine.
ENVIRONMENT = ("pip install", "ruff ", "python -m pytest")


def _commands() -> list[str]:
    out = []
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(), re.S):
        for line in block.splitlines():
            line = line.split("  #", 1)[0].strip()
            if line and not line.startswith("#"):
                out.extend(part.strip() for part in line.split("&&"))
    return out


def _by_tool(prefix: str) -> list[str]:
    return [c for c in _commands() if c.startswith(prefix)]


def test_every_readme_command_is_covered_by_a_rule():
    known = ("syncasync-train", "syncasync-cli", "syncasync-bench report", "torchrun ", *ENVIRONMENT)
    unknown = [c for c in _commands() if not c.startswith(known)]
    assert not unknown, f"README commands no test checks: {unknown}"
    assert _by_tool("syncasync-train") and _by_tool("syncasync-cli")


def _sweep(overrides: list[str]) -> list[list[str]]:
    """Every combination of a multirun's comma-separated values (``strategy=ddp,hier_sync``)."""
    axes = [[f"{o.split('=', 1)[0]}={v}" for v in o.split("=", 1)[1].split(",")] for o in overrides]
    return [list(combo) for combo in itertools.product(*axes)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command", _by_tool("syncasync-train"))
def test_train_lines_compose(command):
    from lightning_syncasync.advise.probe import compose_config

    args = shlex.split(command)[1:]
    overrides = [a for a in args if a != "-m"]
    for combo in _sweep(overrides):
        cfg = compose_config(combo)
        for o in combo:
            key, value = o.split("=", 1)
            if key == "strategy":
                assert cfg.strategy is not None, combo
            elif not key.startswith(("experiment", "hydra")):
                node = cfg
                for part in key.split("."):
                    node = node[part]
                assert str(node) == value, (o, node)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command", _by_tool("syncasync-cli"))
def test_cli_lines_parse_and_print_their_config(command, monkeypatch):
    monkeypatch.chdir(ROOT)  # where the README's relative paths (examples/...) start
    printed = run_cli(*shlex.split(command)[1:], "--print_config")
    assert "strategy" in printed and "model" in printed


@pytest.mark.parametrize("command", _by_tool("torchrun "))
def test_torchrun_lines_start_a_module_that_parses_its_arguments(command):
    args = shlex.split(command)
    module = args[args.index("-m") + 1]
    assert module == "lightning_syncasync.advise", module  # the one torchrun line the README shows
    from lightning_syncasync.advise.__main__ import build_parser

    parsed = build_parser().parse_args(args[args.index("-m") + 2 :])
    assert parsed.seconds > 0

"""What the README states about the code comes from the code: its config-group table, its strategy names and the
per-strategy Python examples are checked here, so they cannot drift from what is shipped."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from lightning.pytorch import Trainer

import lightning_syncasync.train as train_app
from lightning_syncasync.strategies import STRATEGIES

README = Path(__file__).resolve().parents[2] / "README.md"
CONF = Path(train_app.__file__).parent / "conf"
GROUPS = ("strategy", "model", "data", "trainer", "callbacks", "logger", "experiment", "hparams_search")


def _text() -> str:
    return README.read_text()


@pytest.mark.parametrize("group", GROUPS)
def test_the_config_group_table_lists_every_option(group):
    row = next(line for line in _text().splitlines() if line.startswith(f"| `{group}`"))
    options_cell = row.rstrip(" |").rsplit("|", 1)[1]
    listed = set(re.findall(r"`([a-z0-9_]+)`", options_cell))
    assert listed == {p.stem for p in (CONF / group).glob("*.yaml")}


def test_every_registered_name_is_in_the_strategy_names_table():
    section = _text().split("## Strategy names", 1)[1].split("\n## ", 1)[0]
    table = "\n".join(line for line in section.splitlines() if line.startswith("|"))
    missing = [e.name for e in STRATEGIES if f"`{e.name}`" not in table]
    assert not missing, missing


def _example_block() -> tuple[str, list[str], str]:
    """The per-strategy example: its imports, its ``strategy, devices = ...`` lines and its Trainer line."""
    after = _text().split("One Python example per strategy", 1)[1]
    code = after.split("```python\n", 1)[1].split("```", 1)[0]
    chunks = code.split("\n\n")
    choices = [line for line in chunks[1].splitlines() if line.startswith("strategy, devices =")]
    trainer = chunks[2].splitlines()[0]
    return chunks[0], choices, trainer


def test_the_example_block_has_one_line_per_strategy_class():
    _, choices, trainer = _example_block()
    assert trainer.startswith("trainer = L.Trainer(") and "strategy=strategy" in trainer
    for cls in ("MeasuredDDPStrategy", "HierSyncStrategy", "AsyncSSPStrategy", "AutoSyncStrategy",
                "DeepSpeedCPUStrategy"):  # fmt: skip
        assert any(cls in line for line in choices), cls
    names = {e.name for e in STRATEGIES if not e.name.endswith("_spawn")}
    named = {m for line in choices for m in re.findall(r'"([a-z_]+)"', line)}
    assert named == names, names ^ named  # every name a user types, and nothing that is not one


@pytest.mark.parametrize("line", _example_block()[1])
def test_each_example_builds_its_trainer(line):
    imports, _, trainer_line = _example_block()
    scope: dict = {}
    exec(imports, scope)  # noqa: S102 - the README's own code
    exec(line, scope)  # noqa: S102
    exec(trainer_line.replace("max_epochs=2,", "max_epochs=2, logger=False,"), scope)  # noqa: S102
    trainer: Trainer = scope["trainer"]
    assert trainer.world_size == scope["devices"]
    assert type(trainer.strategy).__module__.startswith("lightning_syncasync.strategies")

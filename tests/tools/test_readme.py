"""What the documentation states about the code comes from the code: the config-group table of docs/usage.md, the
strategy-names table and the per-strategy Python examples of docs/strategies.md are checked here, so they cannot drift
from what is shipped; and every relative link of README.md and docs/*.md must lead to a file (and heading) that
exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from lightning.pytorch import Trainer

import lightning_syncasync.train as train_app
from lightning_syncasync.strategies import STRATEGIES

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
USAGE = ROOT / "docs" / "usage.md"
STRATEGIES_DOC = ROOT / "docs" / "strategies.md"
CONF = Path(train_app.__file__).parent / "conf"
GROUPS = ("strategy", "model", "data", "trainer", "callbacks", "logger", "experiment", "hparams_search")


def _text(path: Path) -> str:
    return path.read_text()


@pytest.mark.parametrize("group", GROUPS)
def test_the_config_group_table_lists_every_option(group):
    row = next(line for line in _text(USAGE).splitlines() if line.startswith(f"| `{group}`"))
    options_cell = row.rstrip(" |").rsplit("|", 1)[1]
    listed = set(re.findall(r"`([a-z0-9_]+)`", options_cell))
    assert listed == {p.stem for p in (CONF / group).glob("*.yaml")}


def test_every_registered_name_is_in_the_strategy_names_table():
    section = _text(STRATEGIES_DOC).split("## Strategy names", 1)[1].split("\n## ", 1)[0]
    table = "\n".join(line for line in section.splitlines() if line.startswith("|"))
    missing = [e.name for e in STRATEGIES if f"`{e.name}`" not in table]
    assert not missing, missing


def _example_block() -> tuple[str, list[str], str]:
    """The per-strategy example: its imports, its ``strategy, devices = ...`` lines and its Trainer line."""
    after = _text(STRATEGIES_DOC).split("One Python example per strategy", 1)[1]
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
    exec(imports, scope)  # noqa: S102 - the documentation's own code
    exec(line, scope)  # noqa: S102
    exec(trainer_line.replace("max_epochs=2,", "max_epochs=2, logger=False,"), scope)  # noqa: S102
    trainer: Trainer = scope["trainer"]
    assert trainer.world_size == scope["devices"]
    assert type(trainer.strategy).__module__.startswith("lightning_syncasync.strategies")


# [text](target): the target up to the first space or ")" (a Markdown title would follow a space). Images too.
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+[^)]*)?\)")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"`[^`\n]*`")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, markup dropped, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())  # a link's text only
    text = re.sub(r"[^\w\- ]", "", text.replace("`", ""))
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    """Every heading's slug in ``path``, with GitHub's -1, -2, ... suffixes for repeated headings."""
    seen: dict[str, int] = {}
    out = set()
    for line in _FENCE.sub("", path.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = _slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _documents() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("doc", _documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    broken = []
    for target in _LINK.findall(_CODE_SPAN.sub("", _FENCE.sub("", doc.read_text()))):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE) or target.startswith("#"):
            continue  # http(s), mailto and other schemes; anchors into the same file are GitHub's to resolve
        file_part, _, anchor = target.partition("#")
        linked = (doc.parent / file_part).resolve()
        if not linked.exists():
            broken.append(f"{target}: {linked.relative_to(ROOT) if linked.is_relative_to(ROOT) else linked} is missing")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(f"{target}: no heading with anchor #{anchor} in {linked.name}")
    assert not broken, broken


def test_the_readme_is_a_front_door():
    """Issue 67's targets: at most 150 lines, what the pack is and both Quickstart commands on the first screen (40
    lines), and no table cell over 200 characters (intervals and file names live behind links)."""
    lines = _text(README).splitlines()
    assert len(lines) <= 150, len(lines)
    first = "\n".join(lines[:40])
    assert "strategy pack" in first
    assert "pip install torch==2.13.0 . && syncasync-train" in first
    assert 'pip install torch==2.13.0 -e ".[test]" && python -m pytest -m "not slow"' in first
    cells = [c.strip() for line in lines if line.startswith("|") for c in line.strip().strip("|").split(" | ")]
    long = [c for c in cells if len(c) > 200]
    assert cells and not long, long


def test_the_docs_name_the_strategy_for_each_situation_in_the_readmes_words():
    """docs/strategies.md's "Which strategy?" is the README's marker, word for word (both rendered from the results)."""
    spec = re.compile(r"<!-- bench:which\n.*?-->", re.S)
    (readme,) = spec.findall(_text(README))
    assert spec.findall(_text(STRATEGIES_DOC)) == [readme]

from __future__ import annotations

import random

import pytest
from _models import TinyModel
from lightning.pytorch import Trainer

from lightning_syncasync.callbacks import StragglerEmulator, SyncMonitor
from lightning_syncasync.callbacks.straggler import (
    LinkWindow,
    Window,
    parse_jitter,
    parse_jitter_window,
    parse_link,
    parse_schedule,
    parse_slowdown,
)


def test_specs_parse():
    assert parse_slowdown("3:1.5, 1:2") == [Window(3, 1.5), Window(1, 2.0)]
    assert parse_schedule("3:2@0.33-0.67") == [Window(3, 2.0, 0.33, 0.67)]
    assert parse_jitter("0.1:4") == (0.1, 4.0) and parse_jitter("") == (0.0, 0.0)
    assert parse_jitter("0.1:4@0.67-1") == (0.1, 4.0) and parse_jitter_window("0.1:4@0.67-1") == (0.67, 1.0)
    assert parse_jitter_window("0.1:4") == (0.0, 1.0)
    assert parse_link("50@0.7-1, 10@0.33-0.67") == [LinkWindow(10.0, 0.33, 0.67), LinkWindow(50.0, 0.7, 1.0)]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"slowdown": "3"}, "RANK:FACTOR"),
        ({"slowdown": "3:0.5"}, "factor must be >= 1"),
        ({"slowdown": "-1:2"}, "RANK:FACTOR"),
        ({"schedule": "3:2@0.8-0.2"}, "START-END"),
        ({"schedule": "3:2"}, "START-END"),
        ({"jitter": "1.5:4"}, "probability"),
        ({"jitter": "0.1:0"}, "factor must be > 0"),
        ({"jitter": "0.1:4@0.7"}, "START-END"),
        ({"link": "10@0.5-1"}, "needs link_control"),
        ({"link": "0@0.5-1", "link_control": "x"}, "MBIT > 0"),
        ({"link": "10@0.2-0.6,20@0.5-1", "link_control": "x"}, "overlap"),
    ],
)
def test_bad_specs_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StragglerEmulator(**kwargs)


def test_from_env_only_when_configured():
    assert StragglerEmulator.from_env({}) is None
    emu = StragglerEmulator.from_env({"SYNCASYNC_JITTER": "0.2:3", "SYNCASYNC_STRAGGLER_SEED": "5"})
    assert emu is not None and (emu.jitter_prob, emu.jitter_factor, emu.seed) == (0.2, 3.0, 5)


def _fit(emu: StragglerEmulator, steps: int = 30) -> SyncMonitor:
    monitor = SyncMonitor(print_summary=False)
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, callbacks=[monitor, emu],
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(TinyModel())
    return monitor


def test_jitter_draws_are_seeded_and_the_pause_is_counted_as_compute():
    emu = StragglerEmulator(jitter="0.3:4", seed=11)
    monitor = _fit(emu)
    # The same generator (seed and rank 0) decides the same steps; the first step has no measurement yet.
    rng = random.Random(11 * 1_000_003 + 0)
    assert emu.events == sum(rng.random() < 0.3 for _ in range(29)) > 0
    assert emu.injected_s > 0
    history = list(monitor.recorder.history)
    assert sum(s.compute_s for s in history) >= emu.injected_s  # the pause falls inside the measured steps


def test_a_scheduled_straggler_only_sleeps_inside_its_window():
    emu = StragglerEmulator(schedule="0:3@0.5-1.0")
    monitor = _fit(emu, steps=40)
    walls = [s.wall_s for s in monitor.recorder.history]
    first, second = sorted(walls[2:20])[9], sorted(walls[21:])[9]  # medians, away from the boundary
    assert second > 2.0 * first  # 3x slower in the second half (2x leaves room for timing noise)
    assert StragglerEmulator(schedule="1:3@0.0-1.0").active  # other ranks' windows are parsed but not applied
    other = StragglerEmulator(schedule="1:3@0.0-1.0")
    _fit(other, steps=10)
    assert other.injected_s == 0.0


def test_a_time_bounded_run_places_the_window_in_time():
    # The benchmark's no-communication runs are bounded by max_time: the window is then a fraction of that time.
    emu = StragglerEmulator(schedule="0:3@0.5-1.0")
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=-1, max_time={"seconds": 3}, logger=False,
                      callbacks=[SyncMonitor(print_summary=False), emu], enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(TinyModel())
    assert emu._planned_s == 3.0
    # 3x slower in the second half: about 2/3 of that half is injected sleep.
    assert 0.5 < emu.injected_s < 1.5


def test_jitter_in_a_window_pauses_only_there():
    emu = StragglerEmulator(jitter="1:3@0.5-1", seed=1)
    monitor = _fit(emu, steps=30)
    walls = [s.wall_s for s in monitor.recorder.history]
    assert emu.events == 15  # p=1 in the window: every step from step 15 on, none before
    assert sorted(walls[16:])[7] > 2.0 * sorted(walls[2:14])[6]


def test_rank_0_asks_for_each_link_rate_as_its_window_opens_and_closes(tmp_path):
    control = tmp_path / "link_control"
    emu = StragglerEmulator(link="10@0.3-0.6", link_control=str(control))
    _fit(emu, steps=10)
    # Due at the first step: the emulation's own rate (0); 10 Mbit/s from step 3 (0.3 of 10); its own from step 6.
    assert emu.link_changes == [(0, 0.0), (3, 10.0), (6, 0.0)]
    assert control.read_text() == "0\n" and not (tmp_path / "link_control.tmp").exists()
    env = {"SYNCASYNC_LINK_SCHEDULE": "10@0.3-0.6", "SYNCASYNC_LINK_CONTROL": str(control)}
    from_env = StragglerEmulator.from_env(env)
    assert from_env is not None and from_env.link == [LinkWindow(10.0, 0.3, 0.6)]
    with pytest.raises(ValueError, match="SYNCASYNC_LINK_SCHEDULE='10@0.6-0.3'"):
        StragglerEmulator.from_env({**env, "SYNCASYNC_LINK_SCHEDULE": "10@0.6-0.3"})

"""RoundLength: the round length from measured step and exchange times (numbers checkable by hand)."""

from __future__ import annotations

import pytest

from lightning_syncasync.algorithms.averaging.round_length import RoundLength


def test_the_rule_is_the_shortest_round_that_hides_the_exchange_with_the_margin():
    policy = RoundLength(min_steps=2)
    # 9 steps of 50 ms = 450 ms >= 1.5 x 300 ms; 8 steps (400 ms) would not be.
    assert policy.rule(0.05, 0.30) == 9
    assert policy.rule(0.05, 0.01) == 2  # a fast link: the floor (async_ssp's per-step mode is 1)
    assert policy.rule(0.05, 10.0) == 64  # the longest allowed
    assert RoundLength(overlap=2).rule(0.05, 0.30) == 5  # two rounds to hide behind: half as long
    # Two workloads whose compute-to-communication ratios differ 10x get lengths 10x apart, not one constant.
    assert RoundLength().rule(0.05, 1.0) == 10 * RoundLength().rule(0.05, 0.1) == 30


def test_the_first_measurement_decides_and_noise_does_not_make_rounds_flap():
    policy = RoundLength(min_steps=2)
    assert policy.steps == 4 and policy.auto
    assert policy.update(0.05, 0.30) == 9  # link-bound: longer at once
    assert policy.decisions[-1].reason.startswith("link-bound")
    # +-20% noise around the same link: the rule's answer moves between 8 and 10, the length stays.
    for exchange in (0.26, 0.34, 0.28, 0.32, 0.30):
        assert policy.update(0.05, exchange) is None
    assert policy.steps == 9 and len(policy.decisions) == 1


def test_a_link_that_slows_mid_run_lengthens_the_rounds_and_a_faster_one_shortens_them():
    policy = RoundLength(min_steps=2)
    policy.update(0.05, 0.05)  # first measurement on a fast link: 2 steps
    assert policy.steps == 2
    changed = [policy.update(0.05, 0.5) for _ in range(6)]  # 10x slower link
    assert any(changed) and policy.steps >= 10
    before = policy.steps
    for _ in range(20):
        policy.update(0.05, 0.05)  # back to fast: shorter once the smoothed answer is 1.5x below
    assert policy.steps < before / 1.5 and policy.steps <= 3


def test_a_pinned_length_is_kept_and_warned_about_once_when_link_bound():
    policy = RoundLength(fixed=4)
    assert policy.update(0.05, 0.30) is None and policy.steps == 4
    warning = policy.take_warning()
    assert warning is not None and "pinned at 4 steps are link-bound" in warning and "300 ms" in warning
    assert "choose 9" in warning and "HINT" in warning
    policy.update(0.05, 0.30)
    assert policy.take_warning() is None  # once
    assert RoundLength(fixed=16).update(0.05, 0.30) is None  # hidden: nothing to say
    quiet = RoundLength(fixed=16)
    quiet.update(0.05, 0.30)
    assert quiet.take_warning() is None


def test_a_link_too_slow_for_the_longest_round_is_said_once_and_training_goes_on():
    policy = RoundLength(max_steps=8)
    policy.update(0.01, 1.0)
    assert policy.steps == 8
    warning = policy.take_warning()
    assert warning is not None and "too slow for even the longest round" in warning and "1000 ms" in warning
    policy.update(0.01, 1.0)
    assert policy.take_warning() is None


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"fixed": 0}, "fixed must be an integer >= 1 or None"),
        ({"fixed": True}, "fixed must be an integer"),
        ({"min_steps": 0}, "min_steps must be an integer >= 1"),
        ({"min_steps": 4, "max_steps": 2}, "max_steps must be an integer >= min_steps"),
        ({"margin": 1.0}, "margin must be > 1"),
        ({"overlap": 0}, "overlap must be > 0"),
        ({"drift": 1.0}, "drift must be > 1"),
    ],
)
def test_bad_settings_are_refused_with_the_setting_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RoundLength(**kwargs)


def test_unmeasured_numbers_decide_nothing():
    policy = RoundLength()
    assert policy.update(0.0, 0.3) is None and policy.update(float("nan"), 0.3) is None
    assert policy.steps == 4 and "not measured yet" in policy.describe()


def test_synchronous_rounds_weigh_the_exchange_against_one_round_of_compute():
    from lightning_syncasync.strategies._round_length import round_length

    # staleness=0 must not divide by ~0 (it gave the longest round, 64 steps, before this was fixed).
    assert round_length(None, 0, 2).rule(0.05, 0.30) == round_length(None, 1, 2).rule(0.05, 0.30) == 9
    assert round_length(None, 2, 2).rule(0.05, 0.30) == 5
    assert round_length(3, 1, 2).steps == 3 and round_length(1, 1, 2).min_steps == 1  # pinned below the floor: kept

"""OuterOptimizer in one process: the three outer steps, their steady state, their state, bad settings."""

from __future__ import annotations

import pytest
import torch

from lightning_syncasync.algorithms.averaging.outer import OuterOptimizer


@pytest.mark.timeout(30)
def test_average_applies_the_pseudo_gradient_as_it_is():
    g = torch.tensor([1.0, -2.0])
    assert torch.equal(OuterOptimizer("average", lr=0.3).step(g), g)  # lr belongs to the Nesterov variants


@pytest.mark.timeout(30)
def test_nesterov_is_diloco_outer_sgd():
    opt, g = OuterOptimizer("nesterov", lr=0.5, momentum=0.9), torch.ones(3)
    first = opt.step(g)
    torch.testing.assert_close(first, 0.5 * (g + 0.9 * g))  # m = g, step = lr (g + mu m)
    second = opt.step(g)
    torch.testing.assert_close(second, 0.5 * (g + 0.9 * (0.9 * g + g)))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("every", [1, 2, 4])
def test_delayed_nesterov_moves_as_far_as_nesterov_in_the_steady_state(every):
    g = torch.ones(2)
    nesterov, delayed = OuterOptimizer("nesterov", 0.7, 0.9), OuterOptimizer("delayed_nesterov", 0.7, 0.9, every)
    steps_n = [float(nesterov.step(g)[0]) for _ in range(400)]
    steps_d = [float(delayed.step(g)[0]) for _ in range(400)]
    # Both approach lr g / (1 - mu) per round (the delayed momentum builds up every `every` rounds, so later).
    assert steps_n[-1] == pytest.approx(0.7 / (1 - 0.9), rel=1e-3)
    assert sum(steps_d[-every:]) / every == pytest.approx(0.7 / (1 - 0.9), rel=1e-3)
    assert sum(steps_d) <= sum(steps_n) + 1e-3  # never ahead of Nesterov


@pytest.mark.timeout(30)
def test_delayed_nesterov_changes_its_momentum_only_every_few_rounds():
    opt = OuterOptimizer("delayed_nesterov", lr=1.0, momentum=0.5, every=3)
    steps = [opt.step(torch.tensor([x])) for x in (3.0, 6.0, 0.0)]
    assert [float(s) for s in steps[:2]] == [3.0, 6.0]  # plain steps until the momentum update
    # Third round: momentum = mean(3, 6, 0) = 3, applied as lr mu every m = 1 * 0.5 * 3 * 3.
    assert float(steps[2]) == pytest.approx(0.0 + 0.5 * 3 * 3.0)
    assert opt.count == 0 and opt.pending is None


@pytest.mark.timeout(30)
@pytest.mark.parametrize("outer", ["nesterov", "delayed_nesterov"])
def test_state_round_trips(outer):
    a = OuterOptimizer(outer, 0.7, 0.9, 3)
    for x in (1.0, -2.0, 0.5, 4.0):
        a.step(torch.tensor([x, 2 * x]))
    b = OuterOptimizer(outer, 0.7, 0.9, 3)
    b.load_state_dict(a.state_dict())
    g = torch.tensor([0.3, -0.1])
    assert torch.equal(a.step(g), b.step(g))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"outer": "adam"}, "outer must be one of"),
        ({"outer": "nesterov", "lr": 0.0}, "outer_lr must be > 0"),
        ({"outer": "nesterov", "momentum": 1.0}, "outer_momentum must be in"),
        ({"outer": "delayed_nesterov", "every": 0}, "outer_momentum_every"),
    ],
)
def test_bad_settings_name_the_setting_with_a_hint(kwargs, match):
    with pytest.raises(ValueError, match=match) as err:
        OuterOptimizer(**kwargs)
    assert "HINT" in str(err.value)

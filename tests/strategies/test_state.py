"""The merged optimizer state a node starts from when a checkpoint of more or fewer nodes is resumed."""

from __future__ import annotations

import torch
from torch import nn

from lightning_syncasync.strategies._state import mean_optimizer_state


def _stepped(grads: list[float], momentum_only: bool = False) -> torch.optim.Optimizer:
    """An optimizer over one 3-element parameter after one step per gradient value (the same lr and steps)."""
    p = nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9) if momentum_only else torch.optim.Adam([p], lr=0.1)
    for g in grads:
        p.grad = torch.full((3,), g)
        opt.step()
    return opt


def test_adam_moments_are_averaged_and_the_step_count_and_groups_kept():
    a, b = _stepped([1.0, 2.0]).state_dict(), _stepped([3.0, -1.0]).state_dict()
    merged = mean_optimizer_state([a, b])
    for name in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(merged["state"][0][name], (a["state"][0][name] + b["state"][0][name]) / 2)
    assert torch.equal(merged["state"][0]["step"], a["state"][0]["step"])  # equal on every node: kept as is
    assert merged["param_groups"] == a["param_groups"]
    # It loads into a fresh optimizer of the same parameters.
    fresh = torch.optim.Adam([nn.Parameter(torch.zeros(3))], lr=0.1)
    fresh.load_state_dict(merged)
    torch.testing.assert_close(fresh.state_dict()["state"][0]["exp_avg"], merged["state"][0]["exp_avg"])


def test_sgd_momentum_mean_is_the_momentum_of_the_mean_gradient():
    # Momentum is linear in the gradients: the mean of two replicas' buffers is the buffer one optimizer fed the mean
    # of their gradients holds (exp_avg likewise; exp_avg_sq is not linear, and its mean is at least that square).
    a, b = _stepped([1.0, 2.0], True).state_dict(), _stepped([3.0, -1.0], True).state_dict()
    merged = mean_optimizer_state([a, b])
    of_mean = _stepped([2.0, 0.5], True).state_dict()
    torch.testing.assert_close(merged["state"][0]["momentum_buffer"], of_mean["state"][0]["momentum_buffer"])


def test_the_inputs_are_left_as_they_were():
    a, b = _stepped([1.0]).state_dict(), _stepped([3.0]).state_dict()
    before = a["state"][0]["exp_avg"].clone()
    mean_optimizer_state([a, b])
    assert torch.equal(a["state"][0]["exp_avg"], before)


def test_a_replica_without_state_for_a_parameter_adds_nothing_to_its_mean():
    a, b = _stepped([1.0]).state_dict(), _stepped([3.0]).state_dict()
    c = {**b, "state": {}}  # a replica that never stepped the parameter
    merged = mean_optimizer_state([a, b, c])
    torch.testing.assert_close(merged["state"][0]["exp_avg"], (a["state"][0]["exp_avg"] + b["state"][0]["exp_avg"]) / 2)

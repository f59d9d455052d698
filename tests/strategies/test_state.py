"""The merged optimizer state a node starts from when a checkpoint of more or fewer nodes is resumed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_syncasync.algorithms.compression.compressor import Compressor
from lightning_syncasync.strategies._sharded import _mean_rank_states
from lightning_syncasync.strategies._state import mean_optimizer_state, mean_state


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


def test_mean_state_averages_floating_tensors_of_any_nesting_and_keeps_the_rest():
    a = {
        "step": 4,
        "momentum": torch.tensor([1.0, 2.0]),
        "optimizers": [[{"exp_avg": torch.ones(2), "n": torch.tensor(3)}]],
    }
    b = {
        "step": 4,
        "momentum": torch.tensor([3.0, 2.0]),
        "optimizers": [[{"exp_avg": -torch.ones(2), "n": torch.tensor(3)}]],
    }
    merged = mean_state([a, b])
    assert merged["step"] == 4 and torch.equal(merged["momentum"], torch.tensor([2.0, 2.0]))
    assert torch.equal(merged["optimizers"][0][0]["exp_avg"], torch.zeros(2))
    assert merged["optimizers"][0][0]["n"] is a["optimizers"][0][0]["n"]  # an integer tensor: the first one's
    with pytest.raises(ValueError, match="differ in structure"):
        mean_state([a, {**b, "momentum": torch.zeros(3)}])


def test_a_shards_state_from_several_nodes_folds_compression_and_averages_the_rest():
    # The same shard on 2 saved nodes (their cross-node group, node order): the outer state is averaged, and the
    # compressor's residuals, with each node's server residual folded in, as Compressor.resized_state does.
    def node(value: float) -> dict:
        compression = {"method": "int8", "residuals": {"k": torch.full((4,), value)},
                       "server_residuals": {"k": torch.full((2,), value / 10)}, "factors": {}, "calls": 7}  # fmt: skip
        return {"delivered": 3, "outer": {"buffer": torch.full((4,), value), "count": 0}, "compression": compression}

    states = [node(1.0), node(3.0)]
    merged = _mean_rank_states(states)
    assert merged["delivered"] == 3 and torch.equal(merged["outer"]["buffer"], torch.full((4,), 2.0))
    want = Compressor.resized_state([s["compression"] for s in states])
    torch.testing.assert_close(merged["compression"]["residuals"], want["residuals"])
    residual = merged["compression"]["residuals"]["k"]
    # own mean (1 + 3) / 2, plus 2 x server / 2 at each node's half: node 0 owns [0, 2), node 1 [2, 4)
    torch.testing.assert_close(residual, torch.tensor([2.1, 2.1, 2.3, 2.3]))
    assert not merged["compression"]["server_residuals"] and merged["compression"]["calls"] == 7

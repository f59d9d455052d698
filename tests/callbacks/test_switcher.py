"""SyncSwitcher's rollback state on its own: what it keeps, and what a rollback restores (the policy and the mode
switches run in tests/strategies/test_auto_sync.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from _models import TinyModel

from lightning_syncasync.callbacks.switcher import SyncSwitcher


class _Modes:
    def __init__(self) -> None:
        self.switched: list[str] = []

    def switch_mode(self, mode: str, step: int) -> None:
        self.switched.append(mode)


def _steps(model: TinyModel, opt: torch.optim.Optimizer, n: int) -> None:
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(n))
    for _ in range(n):
        opt.zero_grad()
        model.net(x).square().mean().backward()
        opt.step()


def test_the_good_state_is_a_cpu_copy_that_later_steps_leave_alone_and_a_rollback_restores():
    # The optimizer's state is kept on the CPU, like the model (a copy on the GPU held Adam's moments twice there),
    # and a restore loads a copy of it: the kept state must survive the steps after a rollback too.
    torch.manual_seed(0)
    model = TinyModel()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    _steps(model, opt, 3)
    trainer = SimpleNamespace(optimizers=[opt])
    switcher = SyncSwitcher()
    switcher._keep_good(trainer, model)  # type: ignore[arg-type]
    want_model = {k: v.clone() for k, v in model.state_dict().items()}
    want_moments = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
    kept = switcher._good
    assert kept is not None
    tensors = [t for s in kept["optimizers"][0]["state"].values() for t in s.values() if isinstance(t, torch.Tensor)]
    assert tensors and all(t.device.type == "cpu" for t in tensors)
    for _ in range(2):  # a rollback, more steps, and a second rollback to the same kept state
        _steps(model, opt, 2)
        assert not torch.equal(opt.state[next(iter(model.parameters()))]["exp_avg"], want_moments[0])
        modes = _Modes()
        switcher._restore(trainer, model, modes, 9, {"reason": "diverged"})  # type: ignore[arg-type]
        assert modes.switched == ["sync"]
        for k, v in model.state_dict().items():
            assert torch.equal(v, want_model[k]), k
        for p, want in zip(model.parameters(), want_moments, strict=True):
            assert torch.equal(opt.state[p]["exp_avg"], want)


def test_async_is_allowed_by_default_on_any_topology_and_a_setting_decides_everywhere():
    # Measured on one node (sooner under jitter, never chosen without it) and on several (issue 66).
    default = SyncSwitcher()
    assert default.async_allowed(("sync", "async"))[0] is True
    allowed, why = default.async_allowed(("sync", "hier", "async"))
    assert allowed is True and "allow_async=False" in why  # since issue 66: measured under pauses across nodes
    for setting in (True, False):
        for modes in (("sync", "async"), ("sync", "hier", "async")):
            assert SyncSwitcher(allow_async=setting).async_allowed(modes) == (setting, f"allow_async={setting}")
    with pytest.raises(ValueError, match="allow_async must be None, True or False, got 'yes'; HINT"):
        SyncSwitcher(allow_async="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="allow_async must be None, True or False, got 1; HINT"):
        SyncSwitcher(allow_async=1)  # type: ignore[arg-type]


def _row(compute_wait_wall: list[tuple[float, float, float]]) -> list[float]:
    """A ``_window_values`` row: the fixed fields (their values do not matter here), then the per-step triples."""
    return [1.0, 0.1, 0.5, 32.0, 1.0, 0.1, 0.0, *[x for step in compute_wait_wall for x in step]]


def test_the_link_wait_is_the_wait_of_each_steps_last_rank_to_arrive():
    from lightning_syncasync.callbacks.switcher import _link_frac, _window_stats

    # Jitter across nodes: each step one rank pauses (computes 0.5 s instead of 0.1 s) and the others wait for it;
    # the link itself costs 0.02 s a step. Every rank's window share of waiting is ~ 0.45, the link's ~ 0.04.
    def step(paused: int, rank: int) -> tuple[float, float, float]:
        compute = 0.5 if rank == paused else 0.1
        wall = 0.52
        return compute, wall - compute, wall

    rows = [_row([step(paused, rank) for paused in (0, 1, 2, 3)]) for rank in range(4)]
    for r in rows:  # the per-window share the policy read before (the fixed fields, recomputed)
        r[2] = sum(r[7 + 3 * i + 1] for i in range(4)) / sum(r[7 + 3 * i + 2] for i in range(4))
    w = _window_stats(rows, 40)
    assert min(w.wait_frac) > 0.4  # the old signal: "communication 45%" -> hier
    assert _link_frac(rows) == pytest.approx(0.02 / 0.52)
    assert w.comm_frac == pytest.approx(0.02 / 0.52)  # the policy reads the link's own cost
    # A slow link with equal ranks: every rank waits the same, and the link's share is that wait.
    slow = [_row([(0.1, 0.4, 0.5)] * 3) for _ in range(4)]
    assert _link_frac(slow) == pytest.approx(0.8)
    # The window's first steps some rank did not measure (NaN padding) are left out; none measured: no signal.
    padded = [_row([(float("nan"),) * 3, (0.1, 0.4, 0.5)]) for _ in range(2)]
    assert _link_frac(padded) == pytest.approx(0.8)
    assert _link_frac([_row([(float("nan"),) * 3])] * 2) is None

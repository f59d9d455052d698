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


def test_async_is_allowed_by_default_on_one_node_only_and_a_setting_decides_everywhere():
    # Measured on one node (sooner under jitter, never chosen without it); not measured with several nodes.
    default = SyncSwitcher()
    assert default.async_allowed(("sync", "async"))[0] is True
    allowed, why = default.async_allowed(("sync", "hier", "async"))
    assert allowed is False and "allow_async=True" in why
    for setting in (True, False):
        for modes in (("sync", "async"), ("sync", "hier", "async")):
            assert SyncSwitcher(allow_async=setting).async_allowed(modes) == (setting, f"allow_async={setting}")
    with pytest.raises(ValueError, match="allow_async must be None, True or False, got 'yes'; HINT"):
        SyncSwitcher(allow_async="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="allow_async must be None, True or False, got 1; HINT"):
        SyncSwitcher(allow_async=1)  # type: ignore[arg-type]

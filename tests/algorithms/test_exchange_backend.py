"""``SYNCASYNC_EXCHANGE_BACKEND``: the backend of the groups the background threads run collectives on."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from lightning_syncasync.algorithms._comm import EXCHANGE_BACKEND_ENV, exchange_backend


def test_unset_is_the_jobs_own_backend_and_gloo_is_gloo(monkeypatch, tmp_path):
    monkeypatch.delenv(EXCHANGE_BACKEND_ENV, raising=False)
    assert exchange_backend() is None
    monkeypatch.setenv(EXCHANGE_BACKEND_ENV, "gloo")
    assert exchange_backend() == "gloo"
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        group = dist.new_group(backend=exchange_backend())
        assert dist.get_backend(group) == "gloo"
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("value", ["nccl", "GLOO", "mpi"])
def test_any_other_value_is_refused_with_the_fix(monkeypatch, value):
    # Only gloo moves the background hop off NCCL; "nccl" is what unset already means on GPUs.
    monkeypatch.setenv(EXCHANGE_BACKEND_ENV, value)
    with pytest.raises(ValueError, match=f"{EXCHANGE_BACKEND_ENV} must be unset or 'gloo', got '{value}'.*HINT"):
        exchange_backend()

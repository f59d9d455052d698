"""Every registered strategy on one GPU (``devices=1``, Lightning's default backend there: NCCL). The DeepSpeed
presets are in ``test_deepspeed_presets.py``, which ``scripts/gpu_check.sh`` runs last."""

from __future__ import annotations

import statistics

import pytest
from _gpu import ACCELERATOR, CUDA, DRY_RUN, gpu_tests, lightning_accelerator, misplaced
from _ranks import run_ranks

from lightning_syncasync.bench._gpu_fit import EXCLUDED_AT_WORLD_SIZE_1
from lightning_syncasync.strategies._registry import pack_strategy_names

pytestmark = gpu_tests

# The names that run on one rank (the benchmark's list and reasons: lightning_syncasync/bench/_gpu_fit.py); the sharded
# ones need 2 ranks per node, which one GPU cannot give NCCL. deepspeed_cpu has the presets test below.
ONE_RANK = [n for n in pack_strategy_names() if not n.endswith("_spawn") and n not in EXCLUDED_AT_WORLD_SIZE_1]


def test_the_one_rank_list_is_every_replica_strategy():
    assert {"hier_sync", "async_ssp", "auto_sync", "ddp_measured"} <= set(ONE_RANK)


# Device operations (kernels on a GPU) a strategy may add to plain Lightning's in a typical step at one rank
# (the median of the steady steps): async_ssp sums each step's loss for its once-per-round finite check.
ADDED_DEVICE_OPS = {"async_ssp": 1}


@pytest.fixture(scope="module")
def plain_device_ops(tmp_path_factory: pytest.TempPathFactory) -> float | None:
    """Plain Lightning's device operations per steady step on one device (the reference of the test below)."""
    (rank,) = run_ranks(tmp_path_factory.mktemp("plain"), "auto", ACCELERATOR, {}, steps=10, ranks=1)
    return statistics.median(rank["device_ops"]) if rank["device_ops"] else None


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", ONE_RANK)
def test_each_strategy_trains_on_one_gpu_with_its_state_there(tmp_path, name, plain_device_ops):
    (rank,) = run_ranks(tmp_path, name, ACCELERATOR, {}, steps=10, ranks=1)
    assert len(rank["losses"]) == 10
    assert rank["losses"][-1] < rank["losses"][0], "it did not learn"
    backend = "nccl" if CUDA else "gloo"
    assert not misplaced(rank["tensors"], backend), misplaced(rank["tensors"], backend)
    # Without SYNCASYNC_EXCHANGE_BACKEND every group the strategy holds is on the job's backend.
    assert set(rank["groups"].values()) <= {backend}, rank["groups"]
    # No host sync of ours in every steady step (at one rank there is nothing to wait for; the target of the steps/s
    # benchmark, within 3% of plain Lightning, needs the host to stay ahead of the GPU). A policy that looks at the
    # GPU once per window (SyncSwitcher's decisions) is allowed: it costs one sync per window, not per step.
    every_step = {where: steps for where, steps in rank["syncs"].items() if len(steps) >= 7}  # steps 2..8 watched
    assert not every_step, rank["syncs"]
    # Nor device work of its own in a typical step beyond what it needs (each kernel is host time on a GPU).
    if plain_device_ops is not None:
        added = statistics.median(rank["device_ops"]) - plain_device_ops
        assert added <= ADDED_DEVICE_OPS.get(name, 0), (name, rank["device_ops"], plain_device_ops)


@pytest.mark.timeout(180)
def test_async_rounds_over_a_gloo_exchange_under_an_nccl_job_keep_their_state_on_the_gpu(tmp_path):
    # SYNCASYNC_EXCHANGE_BACKEND=gloo: the job stays NCCL, the group the rounds' thread uses is gloo, and the state
    # stays on the GPU. (At one rank a round's exchange runs inline with no collective; the staging of GPU tensors
    # through gloo that 2 ranks need runs in test_shared_gpu.py, whose job is gloo.)
    options = {"compression": "int8", "local_steps": 2, "dynamic_local_steps": False}
    env = {"SYNCASYNC_EXCHANGE_BACKEND": "gloo"}
    (rank,) = run_ranks(tmp_path, "async_ssp", ACCELERATOR, options, steps=10, ranks=1, env=env)
    assert len(rank["losses"]) == 10 and rank["losses"][-1] < rank["losses"][0]
    assert rank["groups"]["_group"] == "gloo", rank["groups"]  # the rounds' group, whatever the job's backend
    # "gloo": the exchange's group is, so a wire-side buffer may sit on the CPU as under a gloo job.
    assert not misplaced(rank["tensors"], "gloo"), misplaced(rank["tensors"], "gloo")


@pytest.mark.timeout(120)
def test_a_nan_loss_on_the_gpu_stops_async_rounds_before_the_round_leaves_the_rank(tmp_path):
    from _models import NaNAfterModel  # its loss turns NaN at its third step
    from lightning.pytorch import Trainer

    from lightning_syncasync.strategies.async_ssp import AsyncSSPStrategy, DivergenceError

    trainer = Trainer(
        accelerator=lightning_accelerator(),
        devices=1,
        strategy=AsyncSSPStrategy(local_steps=4),
        max_steps=12,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    # On a GPU the check is read once per round (no host sync per step): at the end of round 0, steps 0-3.
    match = "loss is nan in round" if DRY_RUN else r"not finite \(nan or inf\) in round 0"
    with pytest.raises(DivergenceError, match=match):
        trainer.fit(NaNAfterModel())


@pytest.mark.timeout(60)
def test_sync_switchers_good_state_is_kept_on_the_cpu_and_restored_to_the_gpu():
    # The rollback copy of the optimizer's state was a deep copy on the GPU (Adam's moments twice there for the whole
    # fit); it is on the CPU, like the model's, and a rollback puts it back on the GPU.
    from types import SimpleNamespace

    import torch
    from _gpu import DEVICE

    from lightning_syncasync.callbacks.switcher import SyncSwitcher

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)).to(DEVICE)
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    x = torch.randn(16, 8).to(DEVICE)

    def steps(n: int) -> None:
        for _ in range(n):
            opt.zero_grad()
            net(x).square().mean().backward()
            opt.step()

    steps(3)
    # A hyper-parameter held as a device tensor (a capturable Adam's lr): the load takes param_groups as they are.
    opt.param_groups[0]["marker"] = torch.ones((), device=DEVICE)
    switcher, trainer = SyncSwitcher(), SimpleNamespace(optimizers=[opt])
    switcher._keep_good(trainer, net)  # type: ignore[arg-type]
    want = [opt.state[p]["exp_avg"].cpu() for p in net.parameters()]
    kept = switcher._good["optimizers"][0]["state"]  # type: ignore[index]
    assert {t.device.type for s in kept.values() for t in s.values() if isinstance(t, torch.Tensor)} == {"cpu"}
    assert switcher._good["optimizers"][0]["param_groups"][0]["marker"].device.type == torch.device(DEVICE).type  # type: ignore[index]
    steps(2)
    switcher._restore(trainer, net, SimpleNamespace(switch_mode=lambda mode, step: None), 5, {"reason": "test"})  # type: ignore[arg-type]
    for p, w in zip(net.parameters(), want, strict=True):
        assert opt.state[p]["exp_avg"].device == p.device and torch.equal(opt.state[p]["exp_avg"].cpu(), w)
    assert opt.param_groups[0]["marker"].device.type == torch.device(DEVICE).type

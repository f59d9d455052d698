"""SSPExchange on gloo processes: no gradient lost or applied twice, the SSP bound, cuts, compression, liveness."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from lightning_syncasync.algorithms.compression.compressor import Compressor
from lightning_syncasync.algorithms.ssp.exchange import SSPExchange
from lightning_syncasync.testing import run_distributed


def _grad(rank: int) -> torch.Tensor:
    # A fixed gradient per rank: the sum of everything applied is known in closed form.
    return torch.arange(10.0) * 0.01 + rank


def _sgd(w: list[torch.Tensor]):
    def apply(grad: torch.Tensor, lrs: list[float]) -> None:
        w[0].sub_(lrs[0] * grad[:4])
        w[1].sub_(lrs[0] * grad[4:].view(2, 3))

    return apply


def _train(rank: int, world: int, steps: list[int], staleness, slow: dict, method: str, every: int = 1) -> dict:
    w = [torch.zeros(4), torch.zeros(2, 3)]
    ex = SSPExchange(w, dist.new_group(), staleness=staleness, timeout_s=30, exchange_every=every,
                     compressor=Compressor(method, seed=rank) if method != "none" else None)  # fmt: skip
    ex.start()
    apply, reads = _sgd(w), []
    for _ in range(steps[rank]):
        ex.begin_step(apply)
        reads.append(ex.flat())
        time.sleep(slow.get(rank, 0.002))  # compute
        ex.ship(_grad(rank), [1.0])
    ex.cut(apply, stop=True)
    return {"w": torch.cat([t.flatten() for t in w]), "stats": ex.stats, "clock": ex.clock, "reads": reads}


def _expected(steps: list[int]) -> torch.Tensor:
    world = len(steps)
    return -sum(steps[r] * _grad(r) for r in range(world)) / world


@pytest.mark.timeout(120)
def test_ssp_bound_holds_under_a_straggler_and_nothing_is_lost():
    steps, s = [30, 30, 30], 2
    res = run_distributed(_train, 3, steps, s, {2: 0.03}, "none")
    for r in res:
        # Every update of every rank is in every replica exactly once (fp64 exchange, fp32 replica).
        torch.testing.assert_close(r["w"], _expected(steps), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(r["w"], res[0]["w"], rtol=0, atol=0)  # the cut makes replicas bitwise equal
        assert max(r["stats"].clock_gaps) <= s  # never past the bound
    # The fast ranks did run ahead of the straggler (the bound was used, not trivially met).
    assert max(res[0]["stats"].clock_gaps) == s
    # The straggler's gradients land after server updates the fast ranks filled meanwhile: version staleness.
    assert max(res[2]["stats"].version_staleness) >= 1


@pytest.mark.timeout(120)
def test_asp_fast_ranks_contribute_more_updates():
    steps = [40, 12]  # rank 0 is 3x faster and does 3x the steps in the same time
    res = run_distributed(_train, 2, steps, None, {1: 0.03}, "none")
    for r in res:
        torch.testing.assert_close(r["w"], _expected(steps), rtol=1e-5, atol=1e-5)
    assert max(res[0]["stats"].clock_gaps) > 5  # no gate: rank 0 ran well ahead
    for r in res:
        # Every gradient is in exactly one server update, and the fast rank filled most of them.
        assert sum(r["stats"].gradients) == sum(steps) and r["stats"].gradients == res[0]["stats"].gradients
        assert len(r["stats"].gradients) > steps[1]


@pytest.mark.timeout(120)
def test_exchanging_every_third_step_loses_nothing_and_keeps_the_bound():
    steps = [24, 24]
    res = run_distributed(_train, 2, steps, 4, {1: 0.01}, "none", 3)
    for r in res:
        torch.testing.assert_close(r["w"], _expected(steps), rtol=1e-5, atol=1e-5)
        assert max(r["stats"].clock_gaps) <= 4
        assert r["stats"].rounds < 24  # fewer rounds than steps


@pytest.mark.timeout(120)
def test_staleness_zero_is_ddp():
    res = run_distributed(_train, 2, [10, 10], 0, {1: 0.01}, "none")
    for r in res:
        assert r["stats"].clock_gaps == [0] * 10
        assert r["stats"].version_staleness == [0] * 10  # each gradient is applied in the very next update
        assert r["stats"].gradients == [2] * 10  # ... which holds one gradient of each rank: DDP's mean
        # Step k reads DDP's weights after k steps, exactly.
        for k, read in enumerate(r["reads"]):
            torch.testing.assert_close(read, _expected([k, k]), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(r["w"], _expected([10, 10]), rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(120)
def test_compressed_exchange_loses_nothing_at_the_cut():
    steps = [20, 20]
    res = run_distributed(_train, 2, steps, 3, {1: 0.01}, "int8")
    for r in res:
        torch.testing.assert_close(r["w"], _expected(steps), rtol=1e-4, atol=1e-4)


def _checked(rank: int, world: int, bad_at: int, every: int) -> dict:
    # Rank 1's gradient of step `bad_at` is NaN and shipped with its (NaN) loss: the exchange checks it, as it does
    # for an accelerator's loop, which does not read the loss back.
    w = [torch.zeros(4), torch.zeros(2, 3)]
    ex = SSPExchange(w, dist.new_group(), staleness=2, timeout_s=30, exchange_every=every)
    ex.start()
    apply, found = _sgd(w), []
    for step in range(12):
        ex.begin_step(apply)
        bad = rank == 1 and step == bad_at
        grad = torch.full((10,), float("nan")) if bad else _grad(rank)
        ex.ship(grad, [1.0], loss=torch.tensor(float("nan") if bad else 0.5))
        found += ex.pop_nonfinite()
    ex.cut(apply, stop=True)
    found += ex.pop_nonfinite()
    return {"w": torch.cat([t.flatten() for t in w]), "found": found, "gradients": sum(ex.stats.gradients)}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("every", [1, 3])
def test_a_gradient_shipped_with_a_non_finite_loss_is_dropped_and_reported(every):
    res = run_distributed(_checked, 2, 5, every)
    # Rank 1's step 5 never counted: the replicas hold every other gradient once, and nothing non-finite.
    want = -(12 * _grad(0) + 11 * _grad(1)) / 2
    for r in res:
        torch.testing.assert_close(r["w"], want, rtol=1e-5, atol=1e-5)
        assert r["gradients"] == 23
    assert len(res[1]["found"]) == 1 and res[1]["found"][0][0] == 5 and res[1]["found"][0][1] != res[1]["found"][0][1]
    assert res[0]["found"] == []


def _hung(rank: int, world: int, flag: str) -> dict:
    from _hang import fault_seen, stay_hung_until

    from lightning_syncasync.algorithms.watchdog import PeerLostError

    w = [torch.zeros(3)]
    ex = SSPExchange(w, dist.new_group(), staleness=1, timeout_s=2)
    ex.start()
    try:
        for _ in range(4 if rank == 1 else 20):
            ex.begin_step(lambda grad, lrs: w[0].sub_(grad))
            ex.ship(torch.ones(3), [1.0])
        if rank == 1:
            stay_hung_until(flag, at_most_s=30)  # hung after 4 steps: never reaches the next step
            return {}
    except PeerLostError as err:
        fault_seen(flag)
        return {"error": str(err), "clock": ex.clock}
    return {"error": None}


@pytest.mark.timeout(120)
def test_a_hung_rank_is_named_with_its_last_clock(tmp_path):
    res = run_distributed(_hung, 2, str(tmp_path / "seen"), timeout_s=40, hard_exit=True)
    err = res[0]["error"]
    assert err is not None and "rank 1 (last clock 4," in err and "timeout_s=2" in err, err
    # Rank 0 stopped at the bound: its step 6 began at clock 5 with rank 1 at 4 (gap 1 = staleness); step 7 never.
    assert res[0]["clock"] == 6


def test_bad_arguments():
    with pytest.raises(ValueError, match="staleness"):
        SSPExchange.__init__(object.__new__(SSPExchange), [torch.zeros(1)], None, staleness=-1)


def _killed(rank: int, world: int) -> dict:
    import os

    from lightning_syncasync.algorithms.watchdog import PeerLostError

    w = [torch.zeros(3)]
    ex = SSPExchange(w, dist.new_group(timeout=__import__("datetime").timedelta(seconds=5)), staleness=None,
                     timeout_s=5)  # fmt: skip
    ex.start()
    start = time.perf_counter()
    try:
        for step in range(400):
            if rank == 1 and step == 3:
                os._exit(0)  # killed: no cleanup, sockets closed by the kernel
            ex.begin_step(lambda grad, lrs: w[0].sub_(grad))
            ex.ship(torch.ones(3), [1.0])
            time.sleep(0.02)
    except PeerLostError as err:
        return {"error": str(err), "after_s": time.perf_counter() - start}
    return {"error": None}


@pytest.mark.timeout(120)
def test_a_killed_rank_stops_the_others_with_its_name():
    res = run_distributed(_killed, 2, timeout_s=40, hard_exit=True)
    assert res[1] is None
    err = res[0]["error"]
    # ASP (no gate): the failed exchange round is what stops rank 0; the heartbeat tells which rank is gone.
    assert err is not None and "rank 1 (last clock" in err and "heartbeat stopped" in err, err
    assert res[0]["after_s"] < 30

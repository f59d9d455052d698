"""RoundExchange on 2-4 gloo processes: nothing lost or counted twice, outer optimizers, the staleness bound in
rounds, dynamic local steps under a straggler, compression with its residuals flushed at the cut, resume, a lost
peer."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from lightning_syncasync.algorithms.averaging.outer import OuterOptimizer
from lightning_syncasync.algorithms.averaging.round_checks import NonFiniteRoundError, RoundsStopped, check_rounds
from lightning_syncasync.algorithms.averaging.rounds import RoundExchange
from lightning_syncasync.algorithms.compression.compressor import Compressor
from lightning_syncasync.algorithms.watchdog import PeerLostError
from lightning_syncasync.testing import run_distributed


def _toy(rank: int, world: int, steps: list[int], local_steps: int, staleness: int, outer: str = "average",
         compression: str = "none", dynamic: bool = False, sleep: dict[int, float] | None = None) -> dict:  # fmt: skip
    """Each local step moves rank i's replica by -(i + 1) on every element (SGD with a constant gradient): the
    global model must end at -(sum over ranks of steps_i * (i + 1)) / world, whatever the rounds did."""
    w = [torch.zeros(5), torch.zeros(2, 3)]
    comp = Compressor(compression, seed=rank) if compression != "none" else None
    opt = OuterOptimizer(outer, lr=0.7, momentum=0.9) if outer != "average" else None  # type: ignore[arg-type]
    ex = RoundExchange(w, dist.new_group(), local_steps=local_steps, staleness=staleness, dynamic=dynamic,
                       outer=opt, compressor=comp)  # fmt: skip
    ex.start()
    lags_ok = True
    for _ in range(steps[rank]):
        with torch.no_grad():
            for t in w:
                t.sub_(float(rank + 1))
        if sleep and rank in sleep:
            time.sleep(sleep[rank])
        elif sleep:
            time.sleep(0.01)
        ex.after_step()
        lags_ok &= ex.in_flight <= max(staleness, 1)
    ex.cut(stop=True)
    return {"w": [t.clone() for t in w], "stats": ex.stats, "lags_ok": lags_ok, "delivered": ex.delivered}


def _expected(steps: list[int]) -> float:
    return -sum(n * (i + 1) for i, n in enumerate(steps)) / len(steps)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_every_local_step_counts_once_with_uneven_ranks(staleness):
    steps = [13, 20]  # rank 0 stops mid-round; the cut still takes every step of both ranks
    res = run_distributed(_toy, 2, steps, 4, staleness)
    for r in res:
        for t in r["w"]:
            assert torch.equal(t, torch.full_like(t, _expected(steps))), (staleness, t)
        assert max(r["stats"].lags) <= staleness
    assert torch.equal(res[0]["w"][0], res[1]["w"][0]) and res[0]["delivered"] == res[1]["delivered"]


@pytest.mark.timeout(120)
def test_synchronous_rounds_with_nesterov_follow_the_outer_optimizer():
    steps, h = [16, 16, 16], 4
    res = run_distributed(_toy, 3, steps, h, 0, "nesterov")
    # One process: each round every rank moved by -(i+1)*h, so G = sum_i (i+1) h / 3 per element.
    opt, anchor = OuterOptimizer("nesterov", lr=0.7, momentum=0.9), torch.zeros(1)
    for _ in range(4):
        anchor -= opt.step(torch.full((1,), sum((i + 1) * h for i in range(3)) / 3))
    for r in res:
        torch.testing.assert_close(r["w"][0], anchor.expand(5), rtol=1e-6, atol=1e-5)


@pytest.mark.timeout(120)
def test_delayed_nesterov_keeps_replicas_identical_after_the_cut():
    res = run_distributed(_toy, 2, [12, 12], 3, 1, "delayed_nesterov")
    assert torch.equal(res[0]["w"][1], res[1]["w"][1])
    assert res[0]["w"][0].abs().min() > abs(_expected([12, 12]))  # momentum moved it further than averaging


@pytest.mark.timeout(180)
def test_compressed_rounds_flush_every_residual_at_the_cut():
    steps = [24, 24, 24, 24]  # 4 ranks: int8 takes the two-phase layout (own and server residuals)
    res = run_distributed(_toy, 4, steps, 4, 1, "average", "int8")
    for r in res:
        for t in r["w"]:
            torch.testing.assert_close(t, torch.full_like(t, _expected(steps)), rtol=1e-5, atol=1e-4)
    assert torch.equal(res[0]["w"][0], res[3]["w"][0])


@pytest.mark.timeout(120)
def test_dynamic_rounds_let_a_fast_rank_take_more_steps_without_waiting():
    # Rank 1 is 4x slower per step. With rounds of wall-clock length the fast rank fits more steps into each round
    # and never blocks on the slow one for long; every step still counts once.
    steps = [120, 30]
    res = run_distributed(_toy, 2, steps, 4, 1, "average", "none", True, {1: 0.04})
    fast, slow = res[0]["stats"], res[1]["stats"]
    later = slice(3, None)  # after the step-counted first rounds
    assert sum(fast.local_steps[later]) > 2 * sum(slow.local_steps[later]), (fast.local_steps, slow.local_steps)
    for r in res:
        for t in r["w"]:
            assert torch.equal(t, torch.full_like(t, _expected(steps)))


def _resume(rank: int, world: int, stop_at: int | None) -> dict:
    w = [torch.zeros(4)]
    ex = RoundExchange(w, dist.new_group(), local_steps=3, staleness=1, dynamic=False,
                       outer=OuterOptimizer("nesterov", lr=0.5, momentum=0.9))  # fmt: skip
    ex.start()
    state = None
    for step in range(18):
        if stop_at is not None and step == stop_at:
            ex.cut()
            state = ({"w": [t.clone() for t in w]}, ex.state_dict())
            w2 = [state[0]["w"][0].clone()]
            ex.close()
            ex = RoundExchange(w2, dist.new_group(), local_steps=3, staleness=1, dynamic=False,
                               outer=OuterOptimizer("nesterov", lr=0.5, momentum=0.9))  # fmt: skip
            ex.load_state_dict(state[1])
            ex.start()
            w = w2
        with torch.no_grad():
            w[0].sub_(float(rank + 1) * (1 + 0.01 * float(w[0].sum())))  # depends on the weights
        ex.after_step()
    ex.cut(stop=True)
    return {"w": w[0].clone()}


@pytest.mark.timeout(120)
def test_resume_from_a_cut_continues_the_same_trajectory():
    plain = run_distributed(_resume, 2, None)
    # A cut at step 9 (a round boundary) is a consistent cut the uninterrupted run does not make, so compare a run
    # that cuts and resumes against one that cuts and goes on: the only difference is the restart.
    resumed = run_distributed(_resume, 2, 9)
    torch.testing.assert_close(resumed[0]["w"], resumed[1]["w"])
    assert not torch.equal(plain[0]["w"], torch.zeros(4))
    cut_only = run_distributed(_cut_and_go_on, 2, 9)
    torch.testing.assert_close(resumed[0]["w"], cut_only[0]["w"], rtol=0, atol=0)


def _cut_and_go_on(rank: int, world: int, cut_at: int) -> dict:
    w = [torch.zeros(4)]
    ex = RoundExchange(w, dist.new_group(), local_steps=3, staleness=1, dynamic=False,
                       outer=OuterOptimizer("nesterov", lr=0.5, momentum=0.9))  # fmt: skip
    ex.start()
    for step in range(18):
        if step == cut_at:
            ex.cut()
        with torch.no_grad():
            w[0].sub_(float(rank + 1) * (1 + 0.01 * float(w[0].sum())))
        ex.after_step()
    ex.cut(stop=True)
    return {"w": w[0].clone()}


def _one_learner(rank: int, world: int, compression: str, collective: bool) -> dict:
    """Rounds at one rank, on a gradient that depends on the weights (so when a round lands changes the result)."""
    w = [torch.linspace(-1.0, 2.0, 6)]
    comp = Compressor(compression, seed=0) if compression != "none" else None
    ex = RoundExchange(w, dist.new_group(), local_steps=3, staleness=1, dynamic=False,
                       outer=OuterOptimizer("nesterov", lr=0.5, momentum=0.9), compressor=comp)  # fmt: skip
    ex._inline = not collective  # collective: the cluster's path (the thread, its all-reduces over one rank)
    ex.start()
    submitted = []
    real_submit = ex._thread.submit  # type: ignore[union-attr]
    ex._thread.submit = lambda fn: submitted.append(fn) or real_submit(fn)  # type: ignore[union-attr]
    for _ in range(17):
        with torch.no_grad():
            w[0].sub_(0.3 * (w[0] - 0.5) ** 3)
        ex.after_step()
    ex.cut(stop=True)
    return {"w": w[0].clone(), "delivered": ex.delivered, "thread_jobs": len(submitted)}


@pytest.mark.timeout(60)
def test_one_learner_runs_its_rounds_inline_with_the_same_arithmetic_and_no_compression():
    (alone,) = run_distributed(_one_learner, 1, "none", False)
    (cluster,) = run_distributed(_one_learner, 1, "none", True)
    # The rounds ran (5 full rounds and the cut's) and the outer Nesterov step moved the replica, as on a cluster...
    assert alone["delivered"] == cluster["delivered"] == 6
    assert torch.equal(alone["w"], cluster["w"])
    # ...with no job for the exchange thread: no wake-up of it per round (host time at one rank).
    assert alone["thread_jobs"] == 0 and cluster["thread_jobs"] == 6
    # Compression at one rank would quantize a pseudo-gradient that is never sent: the round stays exact.
    (int8,) = run_distributed(_one_learner, 1, "int8", False)
    assert torch.equal(int8["w"], alone["w"])


def _killed(rank: int, world: int) -> dict:
    w = [torch.zeros(3)]
    ex = RoundExchange(w, dist.new_group(timeout=timedelta(seconds=4)), local_steps=2, staleness=1, timeout_s=4)
    ex.start()
    start = time.perf_counter()
    try:
        for step in range(400):
            if rank == 1 and step == 5:
                os._exit(0)  # killed: no cleanup, sockets closed by the kernel
            w[0].sub_(1.0)
            ex.after_step()
            time.sleep(0.01)
    except PeerLostError as err:
        return {"error": str(err), "after_s": time.perf_counter() - start}
    return {"error": None}


@pytest.mark.timeout(120)
def test_a_killed_rank_stops_the_others_with_its_name():
    res = run_distributed(_killed, 2, timeout_s=40, hard_exit=True)
    err = res[0]["error"]
    assert err is not None and "rank 1" in err and "timeout_s=4" in err, err
    assert res[0]["after_s"] < 45


def _stopped(rank: int, world: int) -> dict:
    """Rank 1 stops stepping (it was signalled at a step boundary, as SIGTERM's per-rank check stops it) and never
    launches its next round; rank 0, signalled a second later while it waits at the bound for that round, must stop
    waiting at once, not at the 30 s peer timeout."""
    import threading

    w = [torch.zeros(3)]
    flag = threading.Event()
    ex = RoundExchange(w, dist.new_group(timeout=timedelta(seconds=30)), local_steps=2, staleness=0, dynamic=False,
                       timeout_s=30, should_stop=flag.is_set)  # fmt: skip
    ex.start()
    for _ in range(4):
        w[0].sub_(1.0)
        ex.after_step()
    if rank == 1:
        time.sleep(5)  # "exiting": never joins round 2
        return {"stopped": None}
    threading.Timer(1.0, flag.set).start()
    start = time.perf_counter()
    try:
        for _ in range(2):
            w[0].sub_(1.0)
            ex.after_step()
    except RoundsStopped as err:
        return {"stopped": time.perf_counter() - start, "index": err.index}
    return {"stopped": None}


@pytest.mark.timeout(60)
def test_a_stop_requested_while_waiting_for_a_round_ends_the_wait_at_once():
    res = run_distributed(_stopped, 2, timeout_s=30)
    assert res[0]["stopped"] is not None and 0.9 <= res[0]["stopped"] < 3.0, res[0]
    assert res[0]["index"] == 2


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"local_steps": 0, "staleness": 1, "round_s": None}, "local_steps must be an integer >= 1"),
        ({"local_steps": 4, "staleness": -1, "round_s": None}, "staleness must be an integer >= 0"),
        ({"local_steps": 4, "staleness": None, "round_s": None}, "staleness must be an integer >= 0"),
        ({"local_steps": 4, "staleness": 1, "round_s": 0.0}, "round_s must be > 0"),
    ],
)
def test_bad_settings_are_refused_with_a_hint(kwargs, match):
    with pytest.raises(ValueError, match=match) as err:
        check_rounds(**kwargs)
    assert "HINT" in str(err.value)


def _nonfinite(rank: int, world: int) -> dict:
    w = [torch.zeros(4)]
    ex = RoundExchange(w, dist.new_group(), local_steps=4, staleness=1, dynamic=False)
    ex.start()
    raised = []
    for step in range(12):
        with torch.no_grad():
            w[0].sub_(1.0)
        # Each step's loss, as finite_closure hands it over on a GPU: step 6 (round 1) had a NaN loss.
        ex.note_loss(torch.tensor(float("nan") if step == 6 else 1.0))
        try:
            ex.after_step()
        except NonFiniteRoundError as err:
            raised.append((step, err.index, ex.launched))
            ex._steps = 0  # the strategy stops the fit here; this test goes on to see the flag start clean
    ex.cut(stop=True)
    return {"raised": raised, "launched": ex.launched}


def _large_half_losses(rank: int, world: int) -> int:
    w = [torch.zeros(4)]
    ex = RoundExchange(w, dist.new_group(), local_steps=4, staleness=1, dynamic=False)
    ex.start()
    for _ in range(4):
        with torch.no_grad():
            w[0].sub_(1.0)
        ex.note_loss(torch.tensor(30000.0, dtype=torch.float16))  # four of them sum past fp16's 65504
        ex.after_step()
    ex.cut(stop=True)
    return ex.launched


@pytest.mark.timeout(60)
def test_large_finite_half_precision_losses_do_not_stop_a_round():
    # The round's sum is kept in fp32: in fp16 it would be inf, and a finite run would be stopped as diverged.
    assert run_distributed(_large_half_losses, 1) == [2]  # the round of the 4 steps, then the cut's


@pytest.mark.timeout(60)
def test_a_round_with_a_non_finite_loss_is_refused_at_its_end_and_never_launched():
    (res,) = run_distributed(_nonfinite, 1)
    # Checked once, at the end of round 1 (step 7), before its launch: round 1 never left the rank.
    assert res["raised"] == [(7, 1, 1)]
    # The flag started clean after it: the next 4 steps ended round 1 normally, then the cut's round.
    assert res["launched"] == 3

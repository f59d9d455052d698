"""DelayedAverager on 4 gloo processes as 2 virtual nodes of 2: exact averages, delays, outer Nesterov, bytes."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from lightning_syncasync.algorithms.averaging.delayed import DelayedAverager
from lightning_syncasync.algorithms.stats import StatsRecorder
from lightning_syncasync.algorithms.topology import Topology
from lightning_syncasync.testing import run_distributed


def _groups(rank: int, topo: Topology):
    node, _ = dist.new_subgroups_by_enumeration(topo.all_nodes())
    cross, _ = dist.new_subgroups_by_enumeration(topo.all_cross_node())
    return node, cross


def _run(rank: int, world: int, max_delay: int, outer: str, steps: int) -> dict:
    topo = Topology(world, 2)
    node_group, cross_group = _groups(rank, topo)
    node = topo.node_of(rank)
    # 7 + 4 elements: not a multiple of node_size, so the last shard is padded.
    w = [torch.zeros(7), torch.ones(2, 2)]
    rec = StatsRecorder()
    avg = DelayedAverager(w, cross_group, node_group, topo.local_rank_of(rank), 2, 2, inter_period=1,
                          max_delay=max_delay, outer=outer, outer_lr=0.5, outer_momentum=0.5, recorder=rec)  # fmt: skip
    history = []
    for _ in range(steps):
        rec.begin_step()
        with torch.no_grad():
            for t in w:
                t.sub_(float(node + 1))  # node-identical local update: node 0 moves by 1, node 1 by 2
        avg.after_step()
        history.append([t.clone() for t in w])
        stats = rec.end_step(0, 1)
    avg.drain()
    return {"history": history, "final": [t.clone() for t in w], "stats": stats, "applied": avg.rounds_applied}


@pytest.mark.timeout(120)
def test_synchronous_average_is_the_mean_of_node_updates():
    res = run_distributed(_run, 4, 0, "average", 3)
    for r in res:
        # Each step the mean update is 1.5, applied to every rank.
        torch.testing.assert_close(r["final"][0], torch.full((7,), -4.5))
        torch.testing.assert_close(r["final"][1], torch.full((2, 2), 1 - 4.5))
        # One shard of the padded 12-element model crosses nodes, with the round-length policy's 2 numbers; the
        # whole model is gathered in the node, and the 2 numbers of each of its 2 ranks.
        assert r["stats"].bytes_inter == (6 + 2) * 4 and r["stats"].bytes_intra == (12 + 2 * 2) * 4
        assert r["applied"] == 3


@pytest.mark.timeout(120)
def test_one_step_delay_keeps_local_progress_and_converges_after_drain():
    res = run_distributed(_run, 4, 1, "average", 2)
    for rank, r in enumerate(res):
        u = float(rank // 2 + 1)
        # Step 1: launch on snapshot s = -u; nothing applied yet.
        torch.testing.assert_close(r["history"][0][0], torch.full((7,), -u))
        # Step 2: local -u again, then the step-1 round lands: s - u + (avg(s) - s) = -1.5 - u.
        torch.testing.assert_close(r["history"][1][0], torch.full((7,), -1.5 - u))
    # After the drain every replica applied the step-2 round too: all ranks agree.
    for r in res[1:]:
        torch.testing.assert_close(r["final"][0], res[0]["final"][0])


@pytest.mark.timeout(120)
def test_outer_nesterov_step():
    res = run_distributed(_run, 4, 0, "nesterov", 1)
    # anchor a = 0 (the start), snapshots s_n = -(n+1), avg = -1.5, pseudo-gradient g = a - avg = 1.5 on every node,
    # momentum m = g (first round), new global = a - lr (g + mu m) = -0.5 * 1.5 * 1.5: the same on every node.
    for r in res:
        torch.testing.assert_close(r["final"][0], torch.full((7,), -0.5 * 1.5 * 1.5))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"inter_period": 0}, "inter_period"),
        ({"max_delay": -1}, "max_delay"),
        ({"outer": "adam"}, "outer"),
        ({"outer_lr": 0.0}, "outer_lr"),
        ({"outer_momentum": 1.0}, "outer_momentum"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DelayedAverager([torch.zeros(2)], None, None, 0, 2, 2, **kwargs)


def _random_updates(rank: int, world: int, max_delay: int, steps: int) -> list[torch.Tensor]:
    topo = Topology(world, 2)
    node_group, cross_group = _groups(rank, topo)
    node = topo.node_of(rank)
    w = [torch.zeros(5), torch.zeros(3, 2)]
    avg = DelayedAverager(w, cross_group, node_group, topo.local_rank_of(rank), 2, 2, inter_period=1,
                          max_delay=max_delay)  # fmt: skip
    out = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * node + step)  # node-identical, element-varying updates
        with torch.no_grad():
            for t in w:
                t.add_(torch.randn(t.shape, generator=g))
        avg.after_step()
        out.append(torch.cat([t.flatten().clone() for t in w]))
    return out


def _simulate(max_delay: int, steps: int) -> list[list[torch.Tensor]]:
    """Reference in one process: x_n += u_n; rounds launched on snapshots, applied max_delay steps later."""
    x = [torch.zeros(11), torch.zeros(11)]
    pending: list[tuple[int, list[torch.Tensor]]] = []
    hist: list[list[torch.Tensor]] = [[], []]
    for step in range(1, steps + 1):
        for n in range(2):
            g = torch.Generator().manual_seed(100 * n + step - 1)
            x[n] = x[n] + torch.cat([torch.randn(5, generator=g), torch.randn(3, 2, generator=g).flatten()])
        while pending and step - pending[0][0] >= max_delay:
            _, snaps = pending.pop(0)
            mean = (snaps[0] + snaps[1]) / 2
            x = [x[n] + mean - snaps[n] for n in range(2)]
        pending.append((step, [t.clone() for t in x]))
        if max_delay == 0:
            _, snaps = pending.pop(0)
            mean = (snaps[0] + snaps[1]) / 2
            x = [mean.clone(), mean.clone()]
        for n in range(2):
            hist[n].append(x[n].clone())
    return hist


@pytest.mark.timeout(120)
@pytest.mark.parametrize("max_delay", [0, 1, 2])
def test_element_wise_against_a_single_process_reference(max_delay):
    res = run_distributed(_random_updates, 4, max_delay, 5)
    ref = _simulate(max_delay, 5)
    for rank, steps in enumerate(res):
        for got, want in zip(steps, ref[rank // 2], strict=True):
            torch.testing.assert_close(got, want)


def _compressed(rank: int, world: int, method: str, steps: int) -> dict:
    from lightning_syncasync.algorithms.compression.compressor import Compressor

    topo = Topology(world, 2)
    node_group, cross_group = _groups(rank, topo)
    node = topo.node_of(rank)
    w = [torch.zeros(300), torch.zeros(20, 10)]
    rec = StatsRecorder()
    avg = DelayedAverager(w, cross_group, node_group, topo.local_rank_of(rank), 2, 2, inter_period=1, max_delay=1,
                          recorder=rec, compressor=Compressor(method, seed=rank))  # fmt: skip
    inter = 0
    for step in range(steps):
        rec.begin_step()
        g = torch.Generator().manual_seed(100 * node + step)
        with torch.no_grad():
            for t in w:
                t.add_(torch.randn(t.shape, generator=g))
        avg.after_step()
        inter += rec.end_step(step, 1).bytes_inter
    rec.begin_step()
    avg.synchronize()  # the exact round that flushes the residuals
    avg.close()
    inter += rec.end_step(steps, 1).bytes_inter
    return {"final": torch.cat([t.flatten().clone() for t in w]), "inter": inter, "residuals": avg.compressor.residuals}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["int8", "sign"])
def test_compressed_rounds_lose_nothing_at_a_consistent_cut(method):
    steps = 6
    res = run_distributed(_compressed, 4, method, steps)
    # Every update of both nodes is in the final model once: the mean of the two nodes' summed updates.
    total = torch.zeros(2, 500)
    for node in range(2):
        for step in range(steps):
            g = torch.Generator().manual_seed(100 * node + step)
            total[node] += torch.cat([torch.randn(300, generator=g), torch.randn(20, 10, generator=g).flatten()])
    want = total.mean(0)
    for r in res:
        torch.testing.assert_close(r["final"], want, atol=1e-4, rtol=1e-4)
        assert r["residuals"] == {}
    # Each rank sends its 250-element shard compressed every step, then once uncompressed at the cut; every round
    # also carries the round-length policy's 2 fp32 numbers.
    limit = {"int8": 0.26, "sign": 0.04}[method]
    for r in res:
        payload = r["inter"] - (250 + 2) * 4 - steps * 2 * 4
        assert steps * 250 * 4 * limit * 0.5 < payload <= steps * 250 * 4 * limit


def _hung_peer(rank: int, world: int, timeout_s: float, flag: str) -> dict:
    import time

    from _hang import fault_seen, stay_hung_until

    from lightning_syncasync.algorithms.watchdog import PeerLostError

    topo = Topology(world, 1)  # 2 nodes of 1 rank
    node_group, _ = dist.new_subgroups_by_enumeration(topo.all_nodes())
    cross_group, _ = dist.new_subgroups_by_enumeration(topo.all_cross_node(), timeout=timedelta(seconds=timeout_s))
    avg = DelayedAverager([torch.zeros(4)], cross_group, node_group, 0, 1, 2, max_delay=0, timeout_s=timeout_s)
    if rank == 1:
        stay_hung_until(flag, at_most_s=timeout_s + 20)  # hung: never joins the average
        return {}
    start = time.perf_counter()
    try:
        avg.after_step()
    except PeerLostError as err:
        fault_seen(flag)
        return {"error": str(err), "after_s": time.perf_counter() - start}
    return {"error": None}


@pytest.mark.timeout(120)
def test_a_hung_peer_ends_the_round_with_an_error_naming_it(tmp_path):
    timeout_s = 3.0
    res = run_distributed(_hung_peer, 2, timeout_s, str(tmp_path / "seen"), timeout_s=30, hard_exit=True)
    err = res[0]["error"]
    assert err is not None and "lost peer rank 1" in err and "timeout_s=3" in err, err
    assert timeout_s - 0.5 <= res[0]["after_s"] <= timeout_s + 5


def _self_tuned(rank: int, world: int, numel: int, step_s: float, steps: int) -> dict:
    """A self-tuned period (``RoundLength``) on 2 virtual nodes of 2: every rank must decide the same period and
    delay at the same steps, from numbers that ride on the rounds, and nothing may be lost or counted twice."""
    import time

    from lightning_syncasync.algorithms.averaging.round_length import RoundLength

    topo = Topology(world, 2)
    node_group, cross_group = _groups(rank, topo)
    node = topo.node_of(rank)
    w = [torch.zeros(numel)]
    avg = DelayedAverager(w, cross_group, node_group, topo.local_rank_of(rank), 2, 2, inter_period=None,
                          max_delay=None, length=RoundLength(min_steps=1))  # fmt: skip
    launches, delays = [], []
    for _ in range(steps):
        with torch.no_grad():
            w[0].sub_(float(node + 1))
        time.sleep(step_s)
        before = len(avg.pending)
        avg.after_step()
        if len(avg.pending) > before or (avg.max_delay == 0 and avg.rounds_applied):
            launches.append(avg.step)
        delays.append(avg.max_delay)
    avg.synchronize()
    avg.close()
    return {"launches": launches, "delays": delays, "periods": [d.steps for d in avg.length.decisions],
            "w": float(w[0][0]), "exchange_s": avg.length.exchange_s}  # fmt: skip


@pytest.mark.timeout(120)
def test_a_self_tuned_period_is_decided_alike_on_every_rank_from_numbers_riding_on_the_rounds():
    # 4M floats (16 MB) per all-reduce on loopback against 5 ms steps: an exchange of several steps, so the period
    # must grow from its start of 4, and the delay with it.
    steps = 60
    res = run_distributed(_self_tuned, 4, 4_000_000, 0.005, steps)
    for r in res[1:]:
        assert (r["launches"], r["delays"], r["periods"]) == (res[0]["launches"], res[0]["delays"], res[0]["periods"])
    assert res[0]["periods"] and res[0]["periods"][-1] > 4, res[0]
    assert max(res[0]["delays"]) > 1
    # Every step of both nodes counted once: node 0 moved 1 a step, node 1 2; the synchronized model is the mean.
    for r in res:
        assert r["w"] == pytest.approx(-1.5 * steps)

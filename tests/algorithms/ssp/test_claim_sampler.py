"""ClaimingBatchSampler with a real torch store shared by two samplers (the ranks): every batch of an epoch is
trained exactly once, faster ranks claim more, the budget ends every rank at the same epoch."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from lightning_syncasync.algorithms.ssp.claim_sampler import ClaimingBatchSampler


def _run_epoch(samplers, epoch, pace):
    """Drain one epoch; rank r pulls ``pace[r]`` batches per turn (its speed)."""
    its = []
    for s in samplers:
        s.set_epoch(epoch)
        its.append(iter(s))
    got, live = [[] for _ in samplers], set(range(len(samplers)))
    while live:
        for r in sorted(live):
            for _ in range(pace[r]):
                batch = next(its[r], None)
                if batch is None:
                    live.discard(r)
                    break
                got[r].append(batch)
    return got


def test_every_batch_once_and_the_fast_rank_takes_more():
    store = dist.HashStore()
    samplers = [ClaimingBatchSampler(100, 10, r, 2, store, seed=3) for r in range(2)]
    for epoch in range(2):
        got = _run_epoch(samplers, epoch, pace=[3, 1])
        flat = sorted(i for batches in got for b in batches for i in b)
        assert flat == list(range(100))  # every sample once, by one rank
        assert len(got[0]) > len(got[1]) >= 1
        assert not any(s.exhausted for s in samplers)
    # A new epoch is a new permutation (the same on every rank).
    assert samplers[0]._batches() != ClaimingBatchSampler(100, 10, 0, 2, store, seed=3)._batches()


def test_the_budget_ends_every_rank_in_the_same_epoch():
    store = dist.HashStore()
    samplers = [ClaimingBatchSampler(80, 10, r, 3, store, budget=13, shuffle=False, borrow=False) for r in range(3)]
    first = _run_epoch(samplers, 0, pace=[2, 1, 1])
    assert sum(len(g) for g in first) == 8 and not any(s.exhausted for s in samplers)
    second = _run_epoch(samplers, 1, pace=[1, 2, 1])
    # 8 + 5 = 13 batches; every rank had its reserved batch, so the last epoch may overshoot by world - 1 at most.
    assert 5 <= sum(len(g) for g in second) <= 5 + 2
    assert all(len(g) >= 1 for g in second)
    assert all(s.exhausted for s in samplers)  # the same verdict on every rank


def test_a_straggler_hands_over_the_tail_and_no_batch_is_lost():
    # Rank 2 takes 3x as long per batch; it stops claiming once the two others would drain the rest sooner.
    store = dist.HashStore()
    times = [0.1, 0.1, 0.3]
    samplers = [ClaimingBatchSampler(230, 10, r, 3, store, seed=1, pace=lambda: times) for r in range(3)]
    got = _run_epoch(samplers, 0, pace=[3, 3, 1])
    assert sorted(i for g in got for b in g for i in b) == list(range(230))
    assert samplers[2].handed_over == 1 and samplers[0].handed_over == samplers[1].handed_over == 0
    # Positions count claims over every rank: the last batch drawn anywhere is the epoch's last.
    assert max(s.position for s in samplers) == 23


def test_the_last_rank_to_ask_is_refused_so_the_queue_drains():
    # Views that disagree (each rank believes it is the straggler) must still leave one rank draining the queue.
    store = dist.HashStore()
    samplers = [
        ClaimingBatchSampler(
            100, 10, r, 3, store, shuffle=False, pace=lambda r=r: [1.0 if q == r else 0.1 for q in range(3)]
        )
        for r in range(3)
    ]
    got = _run_epoch(samplers, 0, pace=[1, 1, 1])
    assert sorted(i for g in got for b in g for i in b) == list(range(100))
    assert sum(s.handed_over for s in samplers) == 2


def test_a_rank_waiting_at_the_epoch_end_borrows_the_next_epoch_and_nothing_is_trained_twice():
    # Rank 1 stalls (a pause) at the end of epoch 0: rank 0 trains batches of epoch 1 meanwhile, and epoch 1 then
    # trains only the rest, so every sample of each epoch is trained exactly once.
    store = dist.HashStore()
    samplers = [ClaimingBatchSampler(100, 10, r, 2, store, seed=5, budget=20) for r in range(2)]
    its = []
    for s in samplers:
        s.set_epoch(0)
        its.append(iter(s))
    got0, got1 = [next(its[0])], [next(its[1])]  # the reserved batches
    while True:  # rank 0 drains epoch 0 while rank 1 is "paused"
        batch = next(its[0], None)
        got0.append(batch)
        if samplers[0].borrowed:
            break
    borrowed = [got0.pop()]
    for _ in range(3):  # rank 1 still paused: rank 0 keeps borrowing
        borrowed.append(next(its[0]))
    assert next(its[1], None) is None  # rank 1 resumes: the queue is empty, it arrives; rank 0 stops borrowing
    assert next(its[0], None) is None
    epoch0 = sorted(i for b in got0 + got1 for i in b)
    assert epoch0 == list(range(100)) and samplers[0].borrowed == 4 and samplers[1].borrowed == 0
    got = _run_epoch(samplers, 1, pace=[1, 1])
    epoch1 = sorted(i for b in [*borrowed, *got[0], *got[1]] for i in b)
    assert epoch1 == list(range(100))  # the borrowed batches were not trained again
    assert all(s.exhausted for s in samplers)  # budget 20 = both epochs; no borrowing past it
    assert not samplers[0].borrowed - 4 and not samplers[1].borrowed


def test_without_a_budget_or_when_slow_a_rank_does_not_borrow():
    store = dist.HashStore()
    samplers = [ClaimingBatchSampler(100, 10, r, 2, store) for r in range(2)]
    _run_epoch(samplers, 0, pace=[3, 1])
    assert not any(s.borrowed for s in samplers)  # no budget: a next epoch may not exist
    store = dist.HashStore()
    samplers = [ClaimingBatchSampler(100, 10, r, 2, store, budget=100, pace=lambda: [0.3, 0.1]) for r in range(2)]
    its = [iter(s) for s in samplers]
    next(its[1])  # rank 1 (fast) holds its reserved batch; rank 0 (3x slower) drains and arrives first
    while next(its[0], None) is not None:
        pass
    assert samplers[0].borrowed == 0


def test_ranks_of_equal_speed_never_hand_over():
    store = dist.HashStore()
    samplers = [ClaimingBatchSampler(100, 10, r, 2, store, pace=lambda: [0.1, 0.11]) for r in range(2)]
    _run_epoch(samplers, 0, pace=[1, 1])
    assert not any(s.handed_over for s in samplers)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"batch_size": 0}, "batch_size"), ({"rank": 2}, "rank"), ({"budget": 0}, "budget"),
     ({"batch_size": 100}, "at least one batch per epoch"), ({"tail_ratio": 1.0}, "tail_ratio")],
)  # fmt: skip
def test_bad_arguments(kwargs, match):
    args = {"dataset_len": 100, "batch_size": 10, "rank": 0, "world": 2, "store": dist.HashStore(), **kwargs}
    with pytest.raises(ValueError, match=match):
        ClaimingBatchSampler(**args)


def test_a_warm_up_is_dealt_in_turn_then_the_rest_is_claimed():
    # 100 samples of 10: 10 batches per epoch, 3 ranks, a warm-up of 5 steps per rank. Epoch 0 lies wholly in it:
    # 3 batches each, dealt in turn (no claims, whatever the ranks' speeds), the 10th dropped. Epoch 1 deals the
    # warm-up's last 2 steps each, then the 4 batches left go to whoever claims first.
    store = dist.HashStore()
    samplers = [ClaimingBatchSampler(100, 10, r, 3, store, shuffle=False, lockstep=5) for r in range(3)]
    first = _run_epoch(samplers, 0, pace=[3, 1, 1])
    assert [[b[0] // 10 for b in g] for g in first] == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]
    assert [s.position for s in samplers] == [7, 8, 9]  # claim numbers over ranks: the LR schedule's progress
    second = _run_epoch(samplers, 1, pace=[3, 1, 1])
    assert [[b[0] // 10 for b in g][:2] for g in second] == [[0, 3], [1, 4], [2, 5]]
    assert sorted(b[0] // 10 for g in second for b in g[2:]) == [6, 7, 8, 9]  # every batch once
    assert len(second[0]) > len(second[1])  # past the warm-up the fast rank claims more
    assert [s.dealt(e) for s in samplers[:1] for e in range(3)] == [3, 2, 1]
    with pytest.raises(ValueError, match="lockstep must be an integer >= 0"):
        ClaimingBatchSampler(100, 10, 0, 2, store, lockstep=-1)

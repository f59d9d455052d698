"""ScalingModel: formulas against hand computations, monotonicity, order statistics, regimes, bad input."""

from __future__ import annotations

import math

import pytest

from lightning_syncasync.algorithms._costmodel_ranks import _expected_max
from lightning_syncasync.algorithms.costmodel import DEFAULT_PARAMS, ScalingModel

FAST = (0.0, 1e12)


def _model(**kw):
    args = dict(compute_s_per_sample=0.01, batch_size=10, grad_bytes=1e6, procs_per_node=2, intra_link=FAST,
                inter_link=(0.0, 1e7))  # fmt: skip
    args.update(kw)
    return ScalingModel(**args)


@pytest.mark.timeout(10)
def test_ring_formulas_match_hand_computations():
    # 2 (k-1)/k * B / beta + 2 (k-1) alpha = 1.5 s + 6 ms
    assert ScalingModel.ring_all_reduce_s(4, 1e6, (1e-3, 1e6)) == pytest.approx(1.506)
    assert ScalingModel.ring_all_reduce_s(1, 1e6, (1e-3, 1e6)) == 0.0
    assert ScalingModel.ring_all_gather_s(4, 1e6, (0.0, 1e6)) == pytest.approx(3.0)


@pytest.mark.timeout(10)
def test_ddp_step_by_hand():
    # 2 nodes x 2 ranks: T = 10 x 0.01 = 0.1 s; the ring crosses the 10 MB/s link: 2 * 3/4 * 1 MB / 10 MB/s = 0.15 s.
    p = _model().predict("ddp", nodes=2)
    assert p.step_s == pytest.approx(0.25)
    assert p.samples_per_s == pytest.approx(40 / 0.25)
    assert p.ideal_samples_per_s == pytest.approx(400)
    assert p.efficiency == pytest.approx(0.4)
    assert p.bottleneck == "communication"
    # Half of the all-reduce hidden behind backward.
    assert _model(overlap=0.5).predict("ddp", nodes=2).step_s == pytest.approx(0.175)
    # One node: only the fast intra link.
    assert _model().predict("ddp", nodes=1).efficiency == pytest.approx(1.0, abs=1e-4)


@pytest.mark.timeout(10)
def test_int8_all_gather_and_powersgd_bytes():
    m = _model()
    # int8 on 2 nodes x 2 is hierarchical: an fp32 all-reduce inside the node, then each local rank's 0.5 MB shard
    # as an int8 all-gather across the 2 nodes, the 2 shards sharing the node's 10 MB/s: 0.254 x 0.5 MB / 5 MB/s.
    inside = ScalingModel.ring_all_reduce_s(2, 1e6, FAST)
    assert m.predict("ddp_int8", 2).comm_s == pytest.approx(inside + 0.254 * 0.5e6 / 5e6)
    # One rank per node: flat, an all-gather of 0.254 B over the 2 ranks.
    assert _model(procs_per_node=1).predict("ddp_int8", 2).comm_s == pytest.approx(0.254e6 / 1e7)
    assert m.predict("ddp_powersgd", 2).comm_s == pytest.approx(1.5 * 0.03e6 / 1e7)  # powersgd stays flat
    # Encode/decode: int8 decodes N-1 payloads (of the shard, N = nodes, when hierarchical).
    slow = _model(codec_s_per_byte=1e-9).predict("ddp_int8", 2).comm_s - m.predict("ddp_int8", 2).comm_s
    assert slow == pytest.approx(1e-9 * 0.5e6 * 2)


@pytest.mark.timeout(10)
def test_monotone_in_nodes_and_bandwidth():
    m = _model(grad_bytes=50e6)
    for strategy in ("ddp", "hier_sync", "ddp_powersgd", "async_ssp"):
        effs = [m.predict(strategy, n).efficiency for n in (2, 4, 16, 128, 1024)]
        assert all(a >= b - 1e-12 for a, b in zip(effs, effs[1:], strict=False)), (strategy, effs)
    rates = [_model(inter_link=(0.0, bw)).predict("ddp", 8).samples_per_s for bw in (1e6, 1e7, 1e8, 1e9)]
    assert rates == sorted(rates)


@pytest.mark.timeout(10)
def test_expected_max_order_statistic():
    assert _expected_max([(2, [(1.0, 0.5), (2.0, 0.5)])]) == pytest.approx(1.75)
    p, f, n = 0.1, 4.0, 8
    m = _model(procs_per_node=4, grad_bytes=0.0, jitter_p=p, jitter_factor=f)
    ddp = m.predict("ddp", nodes=2)
    assert ddp.step_s == pytest.approx(0.1 * (1 + f * (1 - (1 - p) ** n)))
    # The no-communication limit runs each rank at its own mean: T (1 + p f).
    assert ddp.ideal_samples_per_s == pytest.approx(8 * 10 / (0.1 * (1 + p * f)))
    # SSP with staleness 0 is the same order statistic; staleness lets ranks catch up over a window.
    assert m.predict("async_ssp", 2, staleness=0, local_steps=1).step_s == pytest.approx(ddp.step_s)
    paces = [m.predict("async_ssp", 2, staleness=s, local_steps=1).step_s for s in (0, 1, 4, 16, 64)]
    assert paces == sorted(paces, reverse=True)
    assert paces[-1] >= 0.1 * (1 + p * f) - 1e-12


@pytest.mark.timeout(10)
def test_hier_sync_beats_ddp_on_a_slow_link_only():
    lm = _model(compute_s_per_sample=1 / 23.5, batch_size=16, grad_bytes=12.97e6, intra_link=(5e-5, 231e6),
                inter_link=(5e-5, 12.5e6))  # fmt: skip
    assert lm.predict("hier_sync", 2).samples_per_s > 2 * lm.predict("ddp", 2).samples_per_s
    fast = _model(compute_s_per_sample=1 / 23.5, batch_size=16, grad_bytes=12.97e6, intra_link=(5e-6, 50e9),
                  inter_link=(5e-6, 50e9))  # fmt: skip
    assert fast.predict("hier_sync", 2).samples_per_s < 1.01 * fast.predict("ddp", 2).samples_per_s


@pytest.mark.timeout(10)
def test_async_absorbs_jitter_and_asp_runs_at_own_rates():
    m = _model(procs_per_node=4, grad_bytes=1e4, inter_link=FAST, jitter_p=0.1, jitter_factor=4.0)
    ddp = m.predict("ddp", 2).efficiency
    assert m.predict("async_ssp", 2, staleness=8, local_steps=1).efficiency > ddp + 0.2
    # Rounds of wall-clock length: every rank at its own mean rate, whatever the pauses.
    assert m.predict("async_ssp", 2).efficiency == pytest.approx(1.0, abs=1e-3)
    assert m.predict("async_asp", 2).efficiency == pytest.approx(1.0, abs=1e-3)
    # Adaptive batches do not help against pauses.
    assert m.predict("ddp_adaptive_batch", 2).efficiency == pytest.approx(ddp, rel=1e-6)


@pytest.mark.timeout(10)
def test_adaptive_batch_handles_a_persistent_straggler():
    m = ScalingModel([0.01, 0.01, 0.01, 0.015], 10, 0.0, procs_per_node=4, intra_link=FAST, inter_link=FAST)
    ddp, adaptive = m.predict("ddp", 1), m.predict("ddp_adaptive_batch", 1)
    # 4 x the slowest rate over the sum of the rates: 4 / 1.5 / (3 + 1 / 1.5)
    assert ddp.efficiency == pytest.approx(4 / 1.5 / (3 + 1 / 1.5))
    assert adaptive.efficiency == pytest.approx(1.0)
    # SSP is paced by the persistent straggler; ASP is not.
    assert m.predict("async_ssp", 1, staleness=4, local_steps=1).efficiency == pytest.approx(ddp.efficiency)
    assert m.predict("async_asp", 1).efficiency == pytest.approx(1.0)
    # Rounds with dynamic local steps: the straggler takes fewer steps per round, nobody waits.
    assert m.predict("async_ssp", 1).efficiency == pytest.approx(1.0)
    # The list tiles over larger worlds: a quarter of the ranks stay slow.
    assert m.predict("ddp", 64).efficiency == pytest.approx(ddp.efficiency)
    single = ScalingModel(0.01, 10, 0.0, 4, FAST, FAST, straggler_fraction=0.25, straggler_factor=1.5)
    assert single.predict("ddp", 16).efficiency == pytest.approx(ddp.efficiency)


@pytest.mark.timeout(60)
def test_a_million_nodes_is_cheap():
    # No wall-clock assertion (CI machines differ in speed, and speed targets belong to the benchmarks): the pytest
    # timeout is the only bound on how long the prediction may take.
    m = ScalingModel([0.01, 0.012, 0.01], batch_size=8, grad_bytes=1e8, procs_per_node=8, jitter_p=0.05,
                     jitter_factor=2.0, inter_link=(2e-5, 1.25e9))  # fmt: skip
    preds = m.table(["ddp", "hier_sync", "async_ssp", "ddp_adaptive_batch", "auto_sync"], [1, 1_000_000])
    assert all(math.isfinite(p.samples_per_s) and 0 < p.efficiency <= 1 + 1e-9 for p in preds)


@pytest.mark.timeout(30)
def test_calibration_recovers_parameters_and_reports_errors():
    truth = {**DEFAULT_PARAMS, "overlap": 0.3, "unlimited_bytes_per_s": 10**8.5}
    base = dict(ideal_per_rank_samples_per_s=[24.0] * 4, batch_size=16, grad_bytes=13e6, nodes=2, procs_per_node=2,
                jitter=None, settings={})  # fmt: skip
    records = []
    for scenario, link in (("slow_link", 100.0), ("homogeneous", None)):
        for strategy in ("ddp", "ddp_powersgd"):
            rec = {**base, "scenario": scenario, "strategy": strategy, "model_strategy": strategy, "link_mbit": link}
            rec["samples_per_s"] = ScalingModel._predict_record(rec, truth)
            records.append(rec)
    fitted = ScalingModel.calibrate(records)
    errors = ScalingModel.prediction_error(records, fitted)
    assert len(errors) == 4 and max(abs(e["rel_error"]) for e in errors) < 0.01
    assert fitted["overlap"] == pytest.approx(0.3)
    default = ScalingModel.prediction_error(records)
    assert max(abs(e["rel_error"]) for e in default) > 0.05


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"compute_s_per_sample": 0.0}, "compute_s_per_sample"),
        ({"compute_s_per_sample": []}, "compute_s_per_sample"),
        ({"batch_size": 0}, "batch_size"),
        ({"grad_bytes": -1.0}, "grad_bytes"),
        ({"procs_per_node": 0}, "procs_per_node"),
        ({"inter_link": (0.0, 0.0)}, "inter_link"),
        ({"jitter_p": 1.5}, "jitter_p"),
        ({"straggler_factor": 0.5}, "straggler_factor"),
        ({"overlap": 2.0}, "overlap"),
        ({"compute_s_per_sample": [0.01, 0.02], "straggler_fraction": 0.5}, "straggler_fraction"),
    ],
)
def test_bad_constructor_arguments_name_the_setting(kwargs, message):
    with pytest.raises(ValueError, match=message) as err:
        _model(**kwargs)
    assert "HINT" in str(err.value) or "must be" in str(err.value)


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "strategy, nodes, settings, message",
    [
        ("hier_sink", 2, {}, "unknown strategy"),
        ("ddp", 0, {}, "nodes"),
        ("ddp", 2, {"inter_period": 4}, "no setting"),
        ("hier_sync", 2, {"inter_period": 0}, "inter_period"),
        ("async_ssp", 2, {"staleness": -1}, "staleness"),
        ("async_ssp", 2, {"staleness": None}, "staleness must be an integer >= 0 with local_steps > 1"),
        ("async_ssp", 2, {"local_steps": 0}, "local_steps"),
        ("ddp", 2, {"compression": "zip"}, "compression"),
    ],
)
def test_bad_predict_arguments_name_the_setting(strategy, nodes, settings, message):
    with pytest.raises(ValueError, match=message):
        _model().predict(strategy, nodes, **settings)


@pytest.mark.timeout(10)
def test_async_rounds_hide_a_slow_exchange_until_it_outlasts_a_round():
    # The LM over 100 Mbit/s: a fp32 exchange of 13 MB takes ~2 s, a step ~0.7 s.
    lm = _model(compute_s_per_sample=1 / 23.5, batch_size=16, grad_bytes=12.97e6, intra_link=(5e-5, 231e6),
                inter_link=(5e-5, 12.5e6))  # fmt: skip
    effs = [lm.predict("async_ssp", 2, local_steps=h).efficiency for h in (2, 4, 8, 16)]
    assert effs == sorted(effs) and effs[0] < 0.9 and effs[-1] == pytest.approx(1.0)  # 2 steps do not hide it
    # Synchronous rounds wait for every exchange.
    assert lm.predict("async_ssp", 2, local_steps=16, staleness=0).efficiency < effs[-1] - 0.05
    assert lm.predict("async_ssp_int8", 2, local_steps=2).efficiency > effs[0]  # int8 hides it in 2 steps


@pytest.mark.timeout(10)
def test_hier_sync_round_must_be_back_max_delay_steps_after_its_launch():
    # One rank per node: 0.1 s of compute per step; a round all-reduces 1 MB across 2 nodes at 1 MB/s: 1 s.
    m = _model(procs_per_node=1, inter_link=(0.0, 1e6))
    assert m._hier_round_s(2, "none", 1.0)[0] == pytest.approx(1.0)
    # max_delay counts steps, not periods (DelayedAverager applies a round D steps after launching it): with D=1 the
    # round waits 1 - 0.1 s once per 4 steps; with D=4 it is hidden except for the link's pace, 1 s per 4 steps.
    assert m.predict("hier_sync", 2, inter_period=4, max_delay=1).step_s == pytest.approx(0.1 + 0.9 / 4)
    assert m.predict("hier_sync", 2, inter_period=4, max_delay=4).step_s == pytest.approx(1.0 / 4)
    assert m.predict("hier_sync", 2, inter_period=4, max_delay=0).step_s == pytest.approx(0.1 + 1.0 / 4)


@pytest.mark.timeout(10)
def test_two_phase_moves_a_ring_all_reduce_of_the_payload_and_all_gather_grows_with_the_ranks():
    m = _model(procs_per_node=1)
    # 4 ranks, one per node: two-phase moves 2 (k-1)/k of the payload, the all-gather layout k-1 payloads.
    two_phase = ScalingModel.ring_all_reduce_s(4, 0.254e6, (0.0, 1e7))
    assert m.predict("ddp_int8", 4).comm_s == pytest.approx(two_phase)
    assert m.predict("ddp_int8_allgather", 4).comm_s == pytest.approx(3 * 0.254e6 / 1e7)
    # On 2 ranks both layouts move one payload (Compressor's collective="auto" all-gathers there).
    assert m.predict("ddp_int8", 2).comm_s == pytest.approx(m.predict("ddp_int8_allgather", 2).comm_s)
    assert m.predict("ddp", 4, compression="int4").comm_s == pytest.approx(two_phase * 0.129 / 0.254)
    with pytest.raises(ValueError, match="collective='ring' is unknown"):
        m.predict("ddp", 4, compression="int8", collective="ring")


@pytest.mark.timeout(30)
def test_compression_keeps_its_advantage_at_scale():
    # The transformer LM over 100 Mbit/s links with 2 ranks per node (syncasync-bench's slow_link: 12.7 MB of
    # gradients, 16 samples per rank, about 0.042 s of compute per sample): the simulation, where the
    # all-gather layout fell below uncompressed hier_sync from a few dozen nodes on.
    lm = ScalingModel(0.042, batch_size=16, grad_bytes=12.7e6, procs_per_node=2, intra_link=(50e-6, 1e9),
                      inter_link=(50e-6, 12.5e6))  # fmt: skip

    def eff(strategy: str, nodes: int) -> float:
        return lm.predict(strategy, nodes).efficiency

    for nodes in (64, 512, 1024):
        assert eff("hier_sync_int8", nodes) >= eff("hier_sync", nodes)
        assert eff("hier_sync_int8_allgather", nodes) < eff("hier_sync", nodes)
    assert eff("ddp_int8", 512) > 50 * eff("ddp_int8_allgather", 512)
    # PowerSGD (rank 4: 3% of the bytes) stays ahead of int8 (25.4%) on this bandwidth-bound link at any scale; sign
    # (3.5%) keeps up with it at 512 nodes.
    assert lm.predict("ddp", 512, compression="sign").efficiency >= eff("ddp_powersgd", 512)
    # Per-rank traffic of two-phase is flat in the node count: the compressed exchange's time grows only by its
    # latency terms from 8 to 1024 nodes, where the all-gather layout's grows with the nodes.
    grow = lm.predict("ddp_int8", 1024).comm_s / lm.predict("ddp_int8", 8).comm_s
    grow_ag = lm.predict("ddp_int8_allgather", 1024).comm_s / lm.predict("ddp_int8_allgather", 8).comm_s
    assert grow < 1.5 < 50 < grow_ag


@pytest.mark.timeout(10)
def test_sharded_strategies_by_hand():
    # 2 nodes x 2 ranks, T = 0.1 s, B = 1 MB, 10 MB/s between nodes, a free link inside.
    model = _model()
    # FSDP over all 4 ranks: 3 ring passes (2 all-gathers, 1 reduce-scatter) of 3/4 MB through the node link.
    assert model.predict("fsdp", nodes=2).step_s == pytest.approx(0.1 + 3 * 0.075, rel=1e-4)
    # HSDP: the passes stay inside the node; each rank all-reduces its 0.5 MB gradient shard across the 2 nodes, the
    # node's 2 shards sharing its link: 2 x 1/2 x 0.5 MB / 5 MB/s = 0.1 s a step.
    assert model.predict("hsdp", nodes=2).step_s == pytest.approx(0.2, rel=1e-4)
    # hier_sync_sharded: the same exchange every 4 steps, in the background within a step: hidden.
    assert model.predict("hier_sync_sharded", nodes=2).step_s == pytest.approx(0.1, rel=1e-4)
    slow = _model(inter_link=(0.0, 1e6))  # a round takes 1 s = 10 steps: it paces the node
    assert slow.predict("hier_sync_sharded", nodes=2).step_s == pytest.approx(0.1 + (1.0 - 0.1) / 4, rel=1e-4)
    assert (
        slow.predict("hier_sync_sharded_int8", nodes=2).samples_per_s
        > slow.predict("hier_sync_sharded", nodes=2).samples_per_s
    )
    # On one node there is nothing to average across: all three are FSDP over the node's ranks.
    inside = _model(intra_link=(0.0, 1e8))
    one = [inside.predict(s, nodes=1).step_s for s in ("fsdp", "hsdp", "hier_sync_sharded")]
    assert one == pytest.approx([0.1 + 3 * 0.5e6 / 1e8] * 3, rel=1e-4)
    # Sharding costs a third more traffic inside the node than a replicated all-reduce (3 passes against 2).
    assert inside.predict("hier_sync_sharded", nodes=1).comm_s == pytest.approx(
        1.5 * inside.predict("hier_sync", nodes=1).comm_s
    )
    with pytest.raises(ValueError, match="fsdp has no setting"):
        model.predict("fsdp", nodes=2, inter_period=4)

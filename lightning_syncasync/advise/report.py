"""The advisor's decision: measured numbers in, a recommended strategy (and why) out; no processes, no torch.

:func:`recommend` is a pure function of :class:`Measurements` and :class:`Thresholds`, so every branch of the
decision flow can be unit-tested on synthetic numbers. The flow only narrows the candidates (a branch *allows*
strategies that address what it found); among the allowed ones the predicted *time to a target* decides, and a
candidate replaces plain DDP only when it is predicted at least ``min_gain`` sooner.

Time to a target is steps x step time, so the :class:`ScalingModel`'s throughput is divided by how many more steps
than DDP a strategy needs (``Thresholds.local_sgd_steps`` for the delayed-averaging ones, ``powersgd_steps`` for
PowerSGD). A few seconds of probing cannot measure learning per step, so these factors are priors measured on the
benchmark's LM; fp16 and int8 DDP crossed its target at DDP's step and keep 1 (README).

What it decides from is :class:`~lightning_syncasync.advise.measurements.Measurements`; the recommendation's command
lines are written by ``advise/_lines.py``, the predictions' tables and the scaling simulation by
:mod:`~lightning_syncasync.advise.predictions`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from lightning_syncasync.advise._lines import cli_line, format_settings, hydra_line
from lightning_syncasync.advise.measurements import Measurements
from lightning_syncasync.algorithms.costmodel import Prediction, ScalingModel

CANDIDATES: tuple[str, ...] = (
    "ddp",
    "hier_sync",
    "hier_sync_int8",
    "async_ssp",
    "ddp_adaptive_batch",
    "ddp_int8",
    "ddp_powersgd",
    "auto_sync",
)
# For a model that does not fit one device (``Thresholds.shard``): the strategies that shard it, the synchronous
# anchor first. async_ssp_sharded is left out: on slow_link_sharded (one seed, docs/benchmarks.md) it ran slower than
# hier_sync_sharded_int8 and reached 0.34 later, and the cost model has no form for its validation cuts.
SHARDED_CANDIDATES: tuple[str, ...] = ("fsdp", "hsdp", "hier_sync_sharded", "hier_sync_sharded_int8")
ALL_CANDIDATES: tuple[str, ...] = CANDIDATES + SHARDED_CANDIDATES
# Settings the advisor searches; the smallest (the least stale) within `settings_tolerance` of the best is chosen.
# inter_period 1 is left out: on slow_link it learned worst of all (quick budget: 0.269 final with fp32 and with
# int8, target 0.27 never reached, while 2 and 4 reached it; README, hier_sync table), although it is the least stale.
_HIER_GRID = [(p, d) for p in (2, 4, 8, 16) for d in (1, 2)]
# async_ssp's rounds, least stale first: (local_steps, staleness in rounds).
_ROUNDS_GRID = ((4, 0), (8, 0), (4, 1), (8, 1), (16, 0), (16, 1))


# The cost model's measured error: mean |relative error| of its predicted samples/s against 61 committed benchmark
# records of 6 scenarios (`syncasync-advise --calibrate docs/results/{straggler_long,jitter_long_levers,
# mid_run_straggler_long,hetero_slow_link,slow_link,slow_link_sharded}.json`): 24.8% with the default parameters
# (what the advisor uses without --params), 17.7% with parameters calibrated on the other scenarios (held out by
# scenario: what --params FILE from --calibrate gives on a cluster it was not fitted to). Worst rows: HSDP +167%
# (default), hier_sync -31.5% and hier_sync_sharded_int8 +28.3% (held out). Those sharded rows were modelled as
# hier_sync then. With fsdp, hsdp and hier_sync_sharded modelled (2026-12-05, the same command, 64 records) one
# prediction errs by 17.0% on average (default parameters) and 11.4% held out, the worst rows fsdp +40.6% and
# hier_sync_sharded_int8 +32.8%. The tie bands below are kept: a margin is a ratio of two predictions and carries
# both errors, and the advisor's scored records (docs/results/advice.json) were made with these bands.
MODEL_ERROR = 0.248
MODEL_ERROR_CALIBRATED = 0.177
# Why the flow's "keep DDP" becomes auto_sync (Thresholds.later_stragglers), measured with 5 seeds each, ranked to the
# rule target by `syncasync-bench` (docs/benchmarks.md): DDP's time to it over auto_sync's.
LATER_STRAGGLERS_EVIDENCE = (
    "DDP's time to target over auto_sync's, 5 seeds: 1.26x [0.91-1.93] and 1.45x [0.84-2.11] in two invocations "
    "with no straggler (homogeneous_long), 1.32x [1.01-2.63] and 1.32x [0.91-1.55] with one for the middle third "
    "(mid_run_straggler_long)"
)


@dataclass(frozen=True)
class Thresholds:
    """Where the decision flow branches.

    Args:
        straggler_ratio: slowest/median step at or above which ranks are called persistently heterogeneous. Probes
            inside the emulated scenarios (docs/results/advice.json and its predecessor) read 1.00-1.04 for equal
            ranks in 7 probes and 1.13 in one (homogeneous_long), and 1.19-1.30 in 5 probes of one slow rank or
            node (straggler_long, hetero_slow_link; truly 1.23-1.25x slower by the per-rank rates of their
            no-communication runs). 1.10 was set before the 1.13 reading: it sits in the probe's noise. It only
            lets the rebalancing and async candidates in; the cost model still ranks them against DDP.
        straggler_cv: a slow rank whose own step times vary less than this (coefficient of variation) is slow
            all the time (persistent), not pausing now and then.
        jitter_p: pause probability per rank and step at or above which transient stragglers matter.
        comm_fraction: predicted share of flat DDP's step spent communicating at or above which it is
            communication-bound.
        bandwidth_ratio: inter/intra bandwidth at or below which a hierarchy pays off.
        min_gain: a candidate replaces DDP only when predicted at least this much faster (DDP is the safe default:
            no staleness, no lossy compression).
        settings_tolerance: among a strategy's settings, the least stale within this of the best is chosen.
        allow_async: let the flow recommend async_ssp (its round mode, the default) as the pick. Off by default (the
            flow's ``auto_sync`` goes async by itself under jitter on one node: ``SyncSwitcher.allow_async``): per-step
            async learned less per sample on every benchmark scenario;
            round-level async reached the target 1.30x (``straggler_long``) and 1.95x (``jitter_long``) sooner than
            DDP by the median of 3 seeds but missed it in one seed of each, and on ``hetero_slow_link`` it was 1.04x
            where ``ddp_adaptive_batch`` was 1.43x; the model predicts throughput only.
        local_sgd_steps: steps to a target of ``hier_sync``/``hier_sync_int8`` (and ``auto_sync`` predicted to
            settle in ``hier``) relative to DDP's; the ranking divides their predicted throughput by it. Measured
            on the slow_link LM, full budget: hier_sync crossed 0.34 at step 113 and hier_sync_int8 at 108 against
            DDP's 90 (1.20-1.26; auto_sync, in hier mode from step 3, crossed at 90 and 75 in two runs; torch's
            period averager at 100 at periods 16-32). 1.0 ranks by throughput.
        powersgd_steps: the same for ``ddp_powersgd`` (rank 4): on the slow_link LM it crossed 0.34 at step 128
            against ``ddp_int8``'s 85 and DDP's 90, and ended 2.6 points below DDP.
        model_error: the cost model's measured relative error of a predicted throughput (``MODEL_ERROR``, with the
            default parameters; ``syncasync-advise --params`` uses ``MODEL_ERROR_CALIBRATED``). A pick predicted to
            reach a target less than ``1 + model_error`` times as fast as its runner-up is a tie, not a winner: the
            advisor says so and names both.
        later_stragglers: where the flow keeps DDP, recommend ``auto_sync`` in sync mode instead: the probe cannot
            see a straggler that arrives after it, and auto_sync is DDP until one does (``LATER_STRAGGLERS_EVIDENCE``
            has the measurements). ``False`` keeps DDP.
        shard: ``True``: the model must be sharded (it does not fit one device, or the user wants its memory
            back), so only ``SHARDED_CANDIDATES`` are considered, with ``fsdp`` as the synchronous anchor;
            ``False``: replicated strategies only; ``None`` (default): decided from the measured replicated
            training state against the memory of one rank (``shard_fraction``).
        shard_fraction: share of a rank's memory above which the replicated training state (parameters,
            gradients, optimizer state) calls for sharding: the rest is what activations and buffers get. 0.5, a
            rule of thumb (activations of a large model's batch are of the order of its state), not a measurement.

    Example::

        from lightning_syncasync.advise.report import Thresholds, recommend

        rec = recommend(measurements, Thresholds(straggler_ratio=1.5, allow_async=True))
        print(rec.strategy, rec.settings)
    """

    straggler_ratio: float = 1.10
    straggler_cv: float = 0.25
    jitter_p: float = 0.02
    comm_fraction: float = 0.2
    bandwidth_ratio: float = 0.5
    min_gain: float = 0.05
    settings_tolerance: float = 0.05
    allow_async: bool = False
    local_sgd_steps: float = 1.2
    powersgd_steps: float = 1.4
    model_error: float = MODEL_ERROR
    later_stragglers: bool = True
    shard: bool | None = None
    shard_fraction: float = 0.5

    def __post_init__(self) -> None:
        if self.straggler_ratio < 1:
            raise ValueError(f"straggler_ratio must be >= 1, got {self.straggler_ratio}")
        if not 0 < self.shard_fraction <= 1:
            raise ValueError(
                f"shard_fraction must be in (0, 1], got {self.shard_fraction}; HINT: the share of a rank's memory the "
                "replicated training state may take (0.5)"
            )
        for name in ("jitter_p", "comm_fraction", "bandwidth_ratio", "min_gain", "settings_tolerance", "straggler_cv",
                     "model_error"):  # fmt: skip
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("local_sgd_steps", "powersgd_steps"):
            if not getattr(self, name) >= 1:
                raise ValueError(
                    f"{name} must be >= 1, got {getattr(self, name)}; HINT: it is how many times DDP's steps the "
                    "strategy needs to a target (1.0 ranks by throughput alone)"
                )


@dataclass
class Recommendation:
    """The advisor's answer. ``steps_factor``: each candidate's steps to a target relative to DDP's, the divisor
    of its predicted throughput in the ranking (``Thresholds.local_sgd_steps``, ``powersgd_steps``)."""

    strategy: str
    settings: dict[str, Any]
    allowed: list[str]
    flow: list[str]
    predictions: dict[str, Prediction]
    hydra: str
    cli: str
    regime: dict[str, bool]
    steps_factor: dict[str, float] = field(default_factory=dict)
    # The pick's predicted rate to the target over the runner-up's, and whether that margin is within the cost
    # model's measured error (then ``tie_with`` names the runner-up: the prediction cannot tell them apart).
    runner_up: str | None = None
    margin: float | None = None
    model_error: float = 0.0
    tie_with: str | None = None

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["predictions"] = {k: v.as_dict() for k, v in self.predictions.items()}
        return d


def build_model(m: Measurements, params: dict[str, float] | None = None) -> ScalingModel:
    """The ScalingModel of a measurement: per-rank compute from median steps, pauses, links."""
    params = params or {}
    p, f = m.jitter
    intra = (m.intra_alpha_s or 0.0, m.intra_bytes_per_s) if m.intra_bytes_per_s else None
    inter = (m.inter_alpha_s or 0.0, m.inter_bytes_per_s) if m.inter_bytes_per_s else None
    if intra is None and inter is None:
        raise ValueError("no link was measured or assumed; HINT: pass --intra-gbit and --inter-gbit")
    # One rank per node has no intra-node link, one node no inter-node link: the other one stands in.
    intra = intra or inter
    inter = inter or intra
    fitted = {k: v for k, v in params.items() if k in ("overlap", "collective_overhead_s", "comm_cpu_s_per_byte",
                                                       "codec_s_per_byte")}  # fmt: skip
    if "comm_cpu_s_per_byte" not in fitted and m.comm_cpu_s_per_byte:
        fitted["comm_cpu_s_per_byte"] = m.comm_cpu_s_per_byte  # measured by the probe (advise/probe.py)
    if "codec_s_per_byte" not in fitted and m.codec_s_per_byte:
        fitted["codec_s_per_byte"] = m.codec_s_per_byte  # measured by the probe, unless --calibrate fitted it
    return ScalingModel(
        compute_s_per_sample=[t / m.batch_size for t in m.median_step_s], batch_size=m.batch_size,
        grad_bytes=m.grad_bytes, procs_per_node=m.procs_per_node, intra_link=intra, inter_link=inter,  # type: ignore[arg-type]
        jitter_p=p, jitter_factor=f, **fitted,
    )  # fmt: skip


def best_settings(model: ScalingModel, strategy: str, nodes: int, tolerance: float) -> dict[str, Any]:
    """The least stale settings of ``strategy`` predicted within ``tolerance`` of its best."""
    if strategy.startswith("hier_sync"):
        grid: list[dict[str, Any]] = [{"inter_period": p, "max_delay": d} for p, d in _HIER_GRID]
    elif strategy == "async_ssp":
        grid = [{"local_steps": h, "staleness": s} for h, s in _ROUNDS_GRID]
    else:
        return {}
    rates = [model.predict(strategy, nodes, **g).samples_per_s for g in grid]
    best = max(rates)
    return next(g for g, r in zip(grid, rates, strict=True) if r >= best * (1 - tolerance))


def candidate_settings(
    model: ScalingModel, nodes: int, tolerance: float, candidates: Sequence[str] = CANDIDATES
) -> dict[str, dict[str, Any]]:
    """Every candidate's settings at ``nodes``; auto_sync's hier mode takes the chosen hier_sync settings."""
    settings = {s: best_settings(model, s, nodes, tolerance) for s in candidates}
    if "auto_sync" in settings:
        hier = settings["hier_sync"] if "hier_sync" in settings else best_settings(model, "hier_sync", nodes, tolerance)
        settings["auto_sync"] = dict(hier)
    return settings


def sharding(m: Measurements, th: Thresholds) -> tuple[bool, str]:
    """Whether the model must be sharded, and the decision flow's line saying why."""
    yes = f"yes: the sharded strategies ({', '.join(SHARDED_CANDIDATES)})"
    if th.shard is not None:
        return th.shard, f"|- shard the model? set by the user (--shard {'yes' if th.shard else 'no'}) -> " + (
            yes if th.shard else "no"
        )
    if m.state_bytes <= 0 or m.device_bytes <= 0:
        return False, "|- shard the model? its memory was not measured -> no (--shard yes to shard it)"
    share = m.state_bytes / m.device_bytes
    sharded = share > th.shard_fraction
    return sharded, (
        f"|- shard the model? replicated, its training state (parameters, gradients, optimizer state) is "
        f"{m.state_bytes / 1e6:.1f} MB per rank, {share:.1%} of a rank's {m.device_bytes / 1e9:.1f} GB (threshold "
        f"{th.shard_fraction:.0%}; the rest is for activations) -> " + (yes if sharded else "no")
    )


def recommend(
    m: Measurements,
    thresholds: Thresholds | None = None,
    available: Sequence[str] = ALL_CANDIDATES,
    params: dict[str, float] | None = None,
) -> Recommendation:
    """Decide from measured numbers only (see the module docstring). ``available``: strategies this install can
    run (``auto_sync`` is left out while it is not registered). A model that must be sharded (``Thresholds.shard``)
    is advised among ``SHARDED_CANDIDATES``, with ``fsdp`` in DDP's place as the synchronous anchor."""
    th = thresholds or Thresholds()
    model = build_model(m, params)
    n = m.nodes
    sharded, shard_line = sharding(m, th)
    pool = SHARDED_CANDIDATES if sharded else CANDIDATES
    anchor = pool[0]  # the synchronous strategy every other must beat: ddp, or fsdp for a sharded model
    anchor_name = "DDP" if anchor == "ddp" else anchor
    settings = candidate_settings(model, n, th.settings_tolerance, pool)
    preds = {s: model.predict(s, n, **settings[s]) for s in pool}
    if "auto_sync" in preds:
        # auto_sync starts in the mode it is predicted to settle in; its switcher moves on from there.
        settings["auto_sync"] = {"mode": preds["auto_sync"].settings["mode"], **settings["auto_sync"]}
    ddp = preds[anchor]
    ratio = m.straggler_ratio
    slow = max(range(m.world_size), key=lambda r: m.median_step_s[r])
    jp, jf = m.jitter
    comm_frac = ddp.comm_s / ddp.step_s
    bw = m.bandwidth_ratio

    flow: list[str] = [shard_line]
    allowed = {anchor}
    # No sharded strategy rebalances batches or trains asynchronously: stragglers are reported, not acted on.
    unanswered = "|    `- no sharded strategy rebalances batches or trains asynchronously: noted, not acted on"
    persistent = ratio >= th.straggler_ratio and m.step_cv[slow] < th.straggler_cv
    hetero_note = f"straggler ratio max/median step = {ratio:.2f} (threshold {th.straggler_ratio:.2f})"
    if ratio >= th.straggler_ratio:
        kind = "persistent" if persistent else "not persistent"
        hetero_note += f"; slowest rank {slow}'s step CV {m.step_cv[slow]:.2f} (< {th.straggler_cv} = persistent)"
        flow.append(f"|- ranks alike? {hetero_note} -> heterogeneous, {kind}")
    else:
        flow.append(f"|- ranks alike? {hetero_note} -> homogeneous")
    if persistent and sharded:
        flow.append(unanswered)
    elif persistent:
        allowed |= {"ddp_adaptive_batch", "auto_sync"} | ({"async_ssp"} if th.allow_async else set())
        flow.append(
            "|    `- allows ddp_adaptive_batch (shares by speed), auto_sync (rebalances in sync mode)"
            + (", async_ssp (no per-step wait)" if th.allow_async else "")
        )
    jitter = jp >= th.jitter_p
    flow.append(
        f"|- transient pauses? p = {jp:.3f} per rank-step (threshold {th.jitter_p}), mean pause {jf:.2f}x the step; "
        f"{anchor_name} waits {ddp.wait_s * 1e3:.1f} ms/step for the slowest -> "
        f"{'jitter' if jitter else 'no'}"
    )
    if jitter and sharded:
        flow.append(unanswered)
    elif jitter:
        allowed |= {"ddp_adaptive_batch", "auto_sync"} | ({"async_ssp"} if th.allow_async else set())
        flow.append(
            "|    `- allows ddp_adaptive_batch, auto_sync"
            + (", async_ssp (staleness absorbs pauses)" if th.allow_async else "")
        )
    if not th.allow_async and not sharded:
        flow.append(
            "|- async_ssp left out (--allow-async to consider it): its rounds reached the target 1.30x and 1.95x "
            "sooner than DDP on straggler_long and jitter_long but in 2 of 3 seeds, and 1.04x on hetero_slow_link, "
            "where ddp_adaptive_batch was 1.43x (docs/benchmarks.md)"
        )
    if n == 1:
        bw_text = "n/a (one node)"
    elif bw is None:
        bw_text = "n/a (one rank per node: every hop is inter-node)"
    else:
        bw_text = f"{bw:.3f} (threshold {th.bandwidth_ratio})"
    comm_bound = comm_frac >= th.comm_fraction
    flow.append(
        f"|- communication-bound? {'flat DDP' if anchor == 'ddp' else anchor} predicted {comm_frac:.1%} of its step "
        f"communicating (threshold {th.comm_fraction:.0%}); inter/intra bandwidth {bw_text} -> "
        f"{'yes' if comm_bound else 'no'}"
    )
    # With one rank per node hier_sync is periodic averaging across nodes: it pays whenever the link is the cost.
    hier = comm_bound and n > 1 and (bw is None or bw <= th.bandwidth_ratio)
    if comm_bound and sharded:
        if n > 1:
            # HSDP keeps FSDP2's traffic inside the node and sends the gradient shards across once a step;
            # hier_sync_sharded sends them every few steps, in the background.
            allowed.add("hsdp")
            if hier:
                allowed |= {"hier_sync_sharded", "hier_sync_sharded_int8"}
            flow.append(
                "|    `- "
                + ("slow inter-node link: allows hsdp, hier_sync_sharded, hier_sync_sharded_int8" if hier
                   else "uniform links: allows hsdp (shards inside each node)")
            )  # fmt: skip
        else:
            flow.append("|    `- one node: fsdp is the only sharded strategy (nothing to average across)")
    elif comm_bound:
        allowed |= {"ddp_int8", "ddp_powersgd"}
        if hier:
            allowed |= {"hier_sync", "hier_sync_int8", "auto_sync"}
            flow.append(
                "|    `- slow inter-node link: allows hier_sync, hier_sync_int8, auto_sync, ddp_int8, ddp_powersgd"
            )
        else:
            flow.append("|    `- uniform links: allows compression (ddp_int8, ddp_powersgd)")
    usable = [s for s in pool if s in allowed and s in available]
    missing = sorted(allowed - set(available))
    if missing:
        flow.append(f"|- not available in this install: {', '.join(missing)}")
    factor = {s: _steps_factor(s, preds[s], th) for s in pool}
    # Samples per second towards the target: throughput over the steps a strategy needs relative to DDP.
    useful = {s: preds[s].samples_per_s / factor[s] for s in pool}
    slowed = [f"{s} {factor[s]:.2f}x" for s in usable if factor[s] > 1]
    if slowed:
        flow.append(
            f"|- time to target: steps needed relative to DDP's (measured, README): {', '.join(slowed)}; "
            "their throughput is divided by it"
        )
    best = max(usable, key=lambda s: useful[s])
    if best != anchor and useful[best] < ddp.samples_per_s * (1 + th.min_gain):
        flow.append(
            f"|- {best} predicted to reach a target only {useful[best] / ddp.samples_per_s:.2f}x sooner than "
            f"{anchor_name} (< {1 + th.min_gain:.2f}x): keep {anchor_name}"
        )
        best = anchor
    # (One rank has no other to fall behind; auto_sync replicates the model, so it is no answer for a sharded one.)
    later = best == "ddp" and th.later_stragglers and "auto_sync" in available and m.world_size > 1
    if later:
        # What a probe of a few seconds cannot see: a straggler that arrives later (a noisy neighbour, a node that
        # throttles). auto_sync trains as DDP does until its switcher sees one, then rebalances the batches.
        flow.append(
            "|- later stragglers? a probe of a few seconds cannot see one that arrives after it; auto_sync trains as "
            f"DDP (sync mode) until its switcher sees one and rebalances then ({LATER_STRAGGLERS_EVIDENCE}) -> "
            "auto_sync in sync mode, the same as DDP where nothing changes (--no-later-stragglers: keep DDP)"
        )
        best = "auto_sync"
        settings["auto_sync"] = {**settings["auto_sync"], "mode": "sync"}
        preds["auto_sync"] = preds["ddp"]
        useful["auto_sync"] = useful["ddp"]
    gain = useful[best] / ddp.samples_per_s
    # Confidence: the pick's predicted rate to the target against the runner-up's, next to the model's measured
    # error. Within it, the prediction cannot tell them apart, and the flow says "tie" rather than name a winner.
    # auto_sync is modelled as the mode it settles in: predicted the same as the pick, it is the pick, not a rival.
    rivals = [s for s in usable if s != best and not (s == "auto_sync" and useful[s] == useful[best])]
    if later:
        rivals = ["ddp"]  # it is DDP until a straggler comes: no prediction can tell them apart before that
    runner = max(rivals, key=lambda s: useful[s], default=None)
    margin = useful[best] / useful[runner] if runner is not None else None
    tie = runner if margin is not None and margin < 1 + th.model_error else None
    if margin is not None:
        flow.append(
            f"|- confidence: {best} predicted to reach a target {margin:.2f}x as fast as the runner-up {runner}; the "
            f"cost model's measured error is +-{th.model_error:.0%}"
            + (f" -> a tie: the prediction cannot tell {best} from {runner}" if tie else " -> a winner")
        )
    flow.append(
        f"`- recommendation: {best} {format_settings(settings[best])}(predicted {preds[best].samples_per_s:.1f} "
        f"samples/s, {preds[best].efficiency:.1%} efficiency, a target {gain:.2f}x sooner than {anchor_name})"
        + (f"; tied with {tie}" if tie else "")
    )
    if sharded:
        flow.append(
            "   every sharded strategy needs the LightningModule to shard itself in configure_model (fully_shard over "
            "self.device_mesh['data_parallel'], as lightning_syncasync/demo/_shard.py does)"
        )
    return Recommendation(
        strategy=best, settings=settings[best], allowed=usable, flow=flow, predictions=preds,
        hydra=hydra_line(best, settings[best], m), cli=cli_line(best, settings[best], m),
        regime={"persistent_straggler": persistent, "jitter": jitter, "comm_bound": comm_bound, "hierarchy": hier,
                "sharded": sharded},
        steps_factor=factor, runner_up=runner, margin=margin, model_error=th.model_error, tie_with=tie,
    )  # fmt: skip


def _steps_factor(strategy: str, pred: Prediction, th: Thresholds) -> float:
    """Steps to a target relative to DDP's: ``local_sgd_steps`` where replicas drift between delayed averages,
    ``powersgd_steps`` for the low-rank gradients; the other compressors keep DDP's (measured, ``Thresholds``)."""
    if strategy.startswith("hier_sync") or (strategy == "auto_sync" and pred.settings.get("mode") == "hier"):
        return th.local_sgd_steps
    return th.powersgd_steps if strategy == "ddp_powersgd" else 1.0

"""``syncasync-advise``: measure this cluster for a few seconds, then say which strategy to train with, and why.

    torchrun --nnodes 2 --nproc-per-node 4 ... -m lightning_syncasync.advise          # on a real cluster
    syncasync-emulate --nodes 2 --procs-per-node 2 --link-mbit 100 -- syncasync-advise --seconds 3
    syncasync-advise --experiment lm -- data.batch_size=8                                # a single process
    syncasync-advise --simulate-nodes 8,64,512 --plot scaling.png                       # plan beyond this cluster
    syncasync-advise --calibrate bench_out/results.json                                 # the model vs the bench

One process per rank (torchrun's environment: ``WORLD_SIZE``, ``RANK``, ``LOCAL_WORLD_SIZE``, ...); rank 0 prints.
Overrides after ``--`` are ``syncasync-train`` overrides, so the probe runs the model and data you would train.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from importlib import resources
from pathlib import Path
from typing import Any

from lightning_syncasync.advise._calibration import calibration_record
from lightning_syncasync.advise.measurements import Measurements
from lightning_syncasync.advise.predictions import format_predictions, format_simulation, plot_scaling, simulate
from lightning_syncasync.advise.report import (
    ALL_CANDIDATES,
    CANDIDATES,
    MODEL_ERROR,
    MODEL_ERROR_CALIBRATED,
    SHARDED_CANDIDATES,
    Thresholds,
    recommend,
)
from lightning_syncasync.algorithms.costmodel import DEFAULT_PARAMS, EMULATED_ALPHA_S, ScalingModel

MAX_NODES = 1_000_000


def _nodes_list(spec: str) -> list[int]:
    try:
        nodes = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--simulate-nodes {spec!r} is not a comma-separated list of integers; HINT: e.g. 8,64,512"
        ) from None
    if not nodes:
        raise argparse.ArgumentTypeError("--simulate-nodes is empty; HINT: e.g. 8,64,512")
    bad = [n for n in nodes if not 1 <= n <= MAX_NODES]
    if bad:
        raise argparse.ArgumentTypeError(f"--simulate-nodes {bad} out of range; HINT: node counts in [1, {MAX_NODES}]")
    return sorted(set(nodes))


def _float(name: str, text: str, example: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{name} {text!r} is not a number; HINT: e.g. {name} {example}") from None


def _positive(name: str, upper: float = math.inf):
    def parse(text: str) -> float:
        value = _float(name, text, "5")
        if not (0 < value <= upper):
            raise argparse.ArgumentTypeError(f"{name} must be in (0, {upper:g}], got {text}; HINT: e.g. {name} 5")
        return value

    return parse


def _at_least_one(name: str):
    def parse(text: str) -> float:
        value = _float(name, text, "1.2")
        if not value >= 1:
            raise argparse.ArgumentTypeError(
                f"{name} must be >= 1 (a multiple of DDP's steps), got {text}; HINT: 1 ranks by throughput alone"
            )
        return value

    return parse


_SHARD = {"auto": None, "yes": True, "no": False}


def _shard(text: str) -> bool | None:
    if text not in _SHARD:
        raise argparse.ArgumentTypeError(
            f"--shard {text!r} is not one of auto, yes, no; HINT: --shard yes for a model that does not fit one "
            "device (auto decides from its measured memory)"
        )
    return _SHARD[text]


def _strategies(spec: str) -> list[str]:
    names = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [s for s in names if s not in ALL_CANDIDATES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"--strategies: unknown {unknown or spec!r}; HINT: a comma-separated subset of {', '.join(ALL_CANDIDATES)}"
        )
    return names


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="syncasync-advise",
        description="Measure compute speed, links and stragglers, then recommend a strategy with the reasons and "
        "a predicted throughput for each candidate; simulate larger clusters with the cost model.",
        epilog="Example: syncasync-emulate --nodes 2 --procs-per-node 2 --link-mbit 100 -- syncasync-advise",
    )
    p.add_argument("--seconds", type=_positive("--seconds", 3600), default=5.0, help="compute timing per rank (5)")
    p.add_argument(
        "--experiment", default=None, help="syncasync-train experiment (e.g. lm); default: the straggler convnet"
    )
    p.add_argument("--json", default=None, metavar="PATH", help="write measurements and predictions here")
    p.add_argument("--simulate-nodes", type=_nodes_list, default=None, metavar="N,N,...", help="e.g. 8,64,512")
    p.add_argument("--plot", default="advise_scaling.png", help="scaling plot of --simulate-nodes (PNG)")
    p.add_argument("--strategies", type=_strategies, default=None, help="only these candidates (comma-separated)")
    p.add_argument(
        "--calibrate", nargs="+", default=None, metavar="RESULTS_JSON", help="fit the model to syncasync-bench results"
    )
    p.add_argument("--params", default=None, metavar="PATH", help="calibrated parameters (--calibrate --json output)")
    p.add_argument(
        "--intra-gbit", type=_positive("--intra-gbit"), default=100.0, help="assumed when not measured (100)"
    )
    p.add_argument("--inter-gbit", type=_positive("--inter-gbit"), default=10.0, help="assumed when not measured (10)")
    p.add_argument("--latency-us", type=_positive("--latency-us"), default=20.0, help="assumed when not measured")
    p.add_argument("--reps", type=int, default=3, help="timed all-reduces per size and group (3)")
    p.add_argument(
        "--allow-async",
        action="store_true",
        help="consider async_ssp (off by default: on the benchmark it learned less per sample than sync)",
    )
    p.add_argument(
        "--no-later-stragglers",
        action="store_true",
        help="keep DDP where the flow finds nothing to fix (default: auto_sync in sync mode, which is DDP until a "
        "straggler arrives after the probe)",
    )
    p.add_argument(
        "--local-sgd-steps",
        type=_at_least_one("--local-sgd-steps"),
        default=Thresholds.local_sgd_steps,
        help=f"hier_sync's steps to a target relative to DDP's, measured on your workload "
        f"({Thresholds.local_sgd_steps:g}, measured on the LM; 1 ranks by throughput alone)",
    )
    p.add_argument(
        "--powersgd-steps",
        type=_at_least_one("--powersgd-steps"),
        default=Thresholds.powersgd_steps,
        help=f"the same for ddp_powersgd ({Thresholds.powersgd_steps:g}, measured on the LM)",
    )
    p.add_argument(
        "--shard",
        type=_shard,
        default=None,
        metavar="{auto,yes,no}",
        help="advise among the strategies that shard the model (fsdp, hsdp, hier_sync_sharded): yes, no, or auto "
        "(default: when its replicated training state would take over half of a rank's memory)",
    )
    p.add_argument("overrides", nargs=argparse.REMAINDER, help="-- then syncasync-train overrides")
    return p


def _default_overrides(experiment: str | None) -> tuple[list[str], str]:
    if experiment:
        return [f"experiment={experiment}"], f"experiment={experiment}"
    from lightning_syncasync.bench.scenarios import SCENARIOS

    return list(SCENARIOS["straggler"].overrides), "the straggler scenario's convnet on digits 32x32"


def _available() -> list[str]:
    # auto_sync is reserved until its strategy config ships; recommending it earlier would print a broken command.
    conf = resources.files("lightning_syncasync.conf") / "strategy" / "auto_sync.yaml"
    return [s for s in ALL_CANDIDATES if s != "auto_sync" or conf.is_file()]


def _load_params(path: str | None) -> dict[str, float] | None:
    if path is None:
        return None
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"--params {path}: {err}; HINT: pass the file written by --calibrate ... --json") from None
    params = data.get("params", data)
    unknown = set(params) - set(DEFAULT_PARAMS)
    if unknown:
        raise ValueError(f"--params {path}: unknown parameters {sorted(unknown)}; HINT: {sorted(DEFAULT_PARAMS)}")
    return {k: float(v) for k, v in params.items()}


def _fill_assumed_links(m: Measurements, args: argparse.Namespace) -> list[str]:
    notes = []
    alpha = args.latency_us * 1e-6
    if m.intra_bytes_per_s is None and m.inter_bytes_per_s is None:
        m.intra_alpha_s, m.intra_bytes_per_s = alpha, args.intra_gbit * 1e9 / 8
        notes.append(f"intra-node link assumed {args.intra_gbit:g} Gbit/s, {args.latency_us:g} us (--intra-gbit)")
    if m.inter_bytes_per_s is None:
        m.inter_alpha_s, m.inter_bytes_per_s = alpha, args.inter_gbit * 1e9 / 8
        notes.append(f"inter-node link assumed {args.inter_gbit:g} Gbit/s, {args.latency_us:g} us (--inter-gbit)")
        m.links_assumed = True
    return notes


def _print_measurements(m: Measurements, notes: list[str]) -> None:
    gb = m.grad_bytes
    print(
        f"workload: {m.workload}; {m.params:,} parameters ({gb / 1e6:.2f} MB of gradients), batch {m.batch_size}/rank"
    )
    for r in range(m.world_size):
        print(
            f"  rank {r} (node {r // m.procs_per_node}): median step {m.median_step_s[r] * 1e3:.1f} ms "
            f"({m.batch_size / m.median_step_s[r]:.1f} samples/s), CV {m.step_cv[r]:.2f}, "
            f"pauses {m.pause_p[r]:.2f} of {m.steps[r] if m.steps else '?'} steps"
        )
    if m.intra_bytes_per_s and m.intra_alpha_s is not None and m.procs_per_node > 1:
        print(
            f"  intra-node link: alpha {m.intra_alpha_s * 1e6:.0f} us, {m.intra_bytes_per_s / 1e6:.1f} MB/s (measured)"
        )
    if m.inter_bytes_per_s and m.inter_alpha_s is not None and m.nodes > 1 and not m.links_assumed:
        print(
            f"  inter-node link: alpha {m.inter_alpha_s * 1e6:.0f} us, {m.inter_bytes_per_s / 1e6:.1f} MB/s (measured)"
        )
    if m.comm_cpu_s_per_byte:
        print(
            f"  background inter-node all-reduce: {m.comm_cpu_s_per_byte * 1e9:.2f} s of this rank's compute per GB "
            "sent (measured CPU time over the compute's CPU share)"
        )
    if m.codec_s_per_byte:
        print(
            f"  compression codec (int8 encode or decode, slowest rank): {m.codec_s_per_byte * 1e9:.2f} s per GB of "
            "gradients (measured)"
        )
    if m.state_bytes and m.device_bytes:
        print(
            "  training state per rank, replicated (parameters, gradients, optimizer state): "
            f"{m.state_bytes / 1e6:.1f} MB; memory per rank: {m.device_bytes / 1e9:.1f} GB"
        )
    for note in notes:
        print(f"  {note}")


def _advise(args: argparse.Namespace, overrides: list[str], workload: str) -> int:
    from lightning_syncasync.advise.probe import run_probe

    world = os.environ.get("WORLD_SIZE")
    if world is None:
        print("syncasync-advise: WORLD_SIZE is not set: running as a single process (no link measured; launch one "
              "process per rank with torchrun or syncasync-emulate to measure links)")  # fmt: skip
    params = _load_params(args.params)
    meas = run_probe(overrides, args.seconds, workload, reps=max(1, args.reps))
    if meas is None:
        return 0  # not rank 0: rank 0 reports
    notes = _fill_assumed_links(meas, args)
    print(
        f"\nsyncasync-advise: {meas.world_size} rank(s) = {meas.nodes} node(s) x {meas.procs_per_node} "
        f"({meas.backend}), {args.seconds:g} s of compute timing per rank"
    )
    _print_measurements(meas, notes)
    # The synchronous anchors (ddp, fsdp for a sharded model) are always candidates: the others must beat them.
    anchors = (CANDIDATES[0], SHARDED_CANDIDATES[0])
    available = [s for s in _available() if args.strategies is None or s in args.strategies or s in anchors]
    thresholds = Thresholds(
        allow_async=args.allow_async, local_sgd_steps=args.local_sgd_steps, powersgd_steps=args.powersgd_steps,
        model_error=MODEL_ERROR_CALIBRATED if params else MODEL_ERROR, later_stragglers=not args.no_later_stragglers,
        shard=args.shard,
    )  # fmt: skip
    rec = recommend(meas, thresholds, available, params)
    if meas.flat_all_reduce_s:
        model_flat = ScalingModel.ring_all_reduce_s(
            meas.world_size, meas.grad_bytes,
            (meas.inter_alpha_s or 0.0, meas.inter_bytes_per_s or 1.0) if meas.nodes > 1
            else (meas.intra_alpha_s or 0.0, meas.intra_bytes_per_s or 1.0),
        )  # fmt: skip
        print(
            f"  flat all-reduce of the gradients over all ranks: measured {meas.flat_all_reduce_s * 1e3:.1f} ms, "
            f"ring model from the group links {model_flat * 1e3:.1f} ms"
        )
    print("\ndecision flow")
    print("\n".join(rec.flow))
    shown = {
        k: v for k, v in rec.predictions.items() if args.strategies is None or k in args.strategies or k in anchors
    }
    source = f"calibrated ({args.params})" if params else "defaults, uncalibrated (--params FILE from --calibrate)"
    print(f"\npredicted at {meas.nodes} node(s) x {meas.procs_per_node}; cost-model parameters: {source}")
    print("\n".join(format_predictions(shown, rec.allowed, rec.strategy, rec.steps_factor)))
    if rec.tie_with:
        print(f"\nrecommended: {rec.strategy}, a tie with {rec.tie_with} (predicted {rec.margin:.2f}x as fast to a "
              f"target, within the cost model's measured error of +-{rec.model_error:.0%}): either")  # fmt: skip
    else:
        confidence = (
            "" if rec.margin is None else f" ({rec.margin:.2f}x its runner-up {rec.runner_up}'s predicted rate)"
        )
        print(f"\nrecommended: {rec.strategy}{confidence}")
    print(f"  Hydra: {rec.hydra}")
    print(f"  CLI:   {rec.cli}  (plus your --model/--data)")
    out: dict[str, Any] = {"measurements": meas.as_dict(), "recommendation": rec.as_dict(), "params": params}
    if args.simulate_nodes:
        strategies = [s for s in ALL_CANDIDATES if s in shown]
        preds = simulate(meas, args.simulate_nodes, strategies, params)
        print(f"\nsimulated ({meas.procs_per_node} ranks per node, measured per-rank numbers, cost model):")
        print("\n".join(format_simulation(preds)))
        grid = sorted(set(args.simulate_nodes) | {2**k for k in range(1, 11)})
        plotted = simulate(meas, grid, strategies, params)
        plot_scaling(plotted, args.plot)
        print(f"plot: {args.plot}")
        out["simulation"] = [p.as_dict() for p in preds]
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))
        print(f"json: {args.json}")
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from lightning_syncasync.bench.scenarios import SCENARIOS

    records, skipped = [], {}
    grad_cache: dict[str, float] = {}
    for path in args.calibrate:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"--calibrate {path}: {err}; HINT: pass a syncasync-bench results.json") from None
        if not isinstance(data, list):
            raise ValueError(f"--calibrate {path}: not a list of bench records; HINT: syncasync-bench's results.json")
        for rec in data:
            scenario = SCENARIOS.get(rec.get("scenario", ""))
            key = f"{rec.get('scenario')}/{rec.get('strategy')}"
            if scenario is None:
                skipped[key] = "unknown scenario"
                continue
            model_cfg = json.dumps((rec.get("config") or {}).get("model"), sort_keys=True)
            if model_cfg not in grad_cache:
                grad_cache[model_cfg] = _grad_bytes(json.loads(model_cfg))
            out = calibration_record(rec, scenario, grad_cache[model_cfg])
            if isinstance(out, str):
                skipped[key] = out
            else:
                records.append(out)
    if not records:
        raise ValueError("--calibrate: no record of a modelled strategy; HINT: ddp, hier_sync, async_ssp, "
                         "ddp_adaptive_batch and compressed ddp records are modelled")  # fmt: skip
    params = ScalingModel.calibrate(records)
    before = {_key(e): e for e in ScalingModel.prediction_error(records, DEFAULT_PARAMS)}
    after = ScalingModel.prediction_error(records, params)
    held: dict[tuple[str, str, str], dict] = {}
    scenarios = sorted({r["scenario"] for r in records})
    if len(scenarios) > 1:
        for s in scenarios:
            fit = ScalingModel.calibrate([r for r in records if r["scenario"] != s])
            for e in ScalingModel.prediction_error([r for r in records if r["scenario"] == s], fit):
                held[_key(e)] = e
    print(f"syncasync-advise --calibrate: {len(records)} records from {len(args.calibrate)} file(s)")
    print(
        f"{'scenario':<18}{'strategy':<24}{'workload':<22}{'runs':>5}{'measured':>10}{'default':>10}{'err':>8}"
        f"{'calibrated':>12}{'err':>8}{'held-out':>10}{'err':>8}"
    )
    for e in sorted(after, key=_key):
        k = _key(e)
        h = held.get(k)
        print(
            f"{e['scenario']:<18}{e['strategy']:<24}{e['workload']:<22}{e['runs']:>5}{e['measured_samples_per_s']:>10.1f}"
            f"{before[k]['predicted_samples_per_s']:>10.1f}{before[k]['rel_error']:>+8.1%}"
            f"{e['predicted_samples_per_s']:>12.1f}{e['rel_error']:>+8.1%}"
            + (f"{h['predicted_samples_per_s']:>10.1f}{h['rel_error']:>+8.1%}" if h else f"{'-':>10}{'-':>8}")
        )
    mean_abs = sum(abs(e["rel_error"]) for e in after) / len(after)
    print(f"mean |relative error|: default {sum(abs(e['rel_error']) for e in before.values()) / len(before):.1%}, "
          f"calibrated {mean_abs:.1%}"
          + (f", held out by scenario {sum(abs(e['rel_error']) for e in held.values()) / len(held):.1%}"
             if held else ""))  # fmt: skip
    print("calibrated: " + ", ".join(f"{k}={v:.3g}" for k, v in params.items()))
    print(f"assumed: link latency {EMULATED_ALPHA_S * 1e6:.0f} us (no netem), link rate = the scenario's --link-mbit, "
          "compression ratios from the README table, per-rank compute from each record's ideal run")  # fmt: skip
    if skipped:
        print("not modelled: " + "; ".join(f"{k} ({v})" for k, v in sorted(skipped.items())))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"params": params, "errors": after, "held_out": list(held.values()), "skipped": skipped}, indent=2
            )
        )
        print(f"json: {args.json}")
    return 0


def _key(e: dict[str, Any]) -> tuple[str, str, str]:
    return e["scenario"], e["strategy"], e["workload"]


def _grad_bytes(model_cfg: dict | None) -> float:
    import hydra

    if not model_cfg:
        raise ValueError("a bench record has no model config; HINT: results.json from syncasync-bench carry one")
    model = hydra.utils.instantiate(model_cfg, _convert_="all")
    return float(sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    extra = args.overrides[1:] if args.overrides[:1] == ["--"] else args.overrides
    if args.reps < 1:
        parser.error("--reps must be >= 1; HINT: e.g. --reps 3")
    try:
        if args.calibrate:
            return _calibrate(args)
        # Overrides that pick their own data or model describe the user's workload (on syncasync-train's defaults,
        # like the app); others adjust the default workload.
        own = any(o.lstrip("+~").split("=")[0] in ("data", "model", "experiment") for o in extra)
        if own and not args.experiment:
            return _advise(args, list(extra), " ".join(extra))
        overrides, workload = _default_overrides(args.experiment)
        if extra:
            workload += " + " + " ".join(extra)
        return _advise(args, overrides + extra, workload)
    except ValueError as err:
        print(f"syncasync-advise: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

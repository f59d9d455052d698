"""``syncasync-bench``: measure strategies side by side on an emulated cluster.

syncasync-bench --scenario slow_link --strategies ddp --quick --out bench_out
syncasync-bench --scenario straggler --strategies baselines --repeats 3 --out bench_out
syncasync-bench report --from docs/results --to docs/benchmarks.md --to docs/benchmarks_archive.md \\
    --to docs/strategies.md --to README.md  # the docs
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
from pathlib import Path

from lightning_syncasync.bench.report import merge_advice, merge_results, write_plots, write_report
from lightning_syncasync.bench.runner import BenchRunner, available_contenders, resolve_contenders
from lightning_syncasync.bench.scenarios import SCENARIOS
from lightning_syncasync.emulate.network import EmulationUnavailable, check_netns_support


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="syncasync-bench",
        description=__doc__.split("\n")[0],
        epilog="examples:\n"
        + "\n".join(f"  {line}" for line in __doc__.strip().splitlines()[2:])
        + "\n\n`syncasync-bench report --help`: regenerate docs from committed results. `--list`: the scenarios "
        "(smoke: seconds on loopback, a check that everything runs, not a measurement) and contenders.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--scenario", required=True, help=f"comma-separated, from {sorted(SCENARIOS)}")
    p.add_argument(
        "--strategies", default="ddp", help="comma-separated contenders, 'baselines', or 'none' (with --advise)"
    )
    p.add_argument("--out", default="bench_out", help="output folder (results accumulate across invocations)")
    p.add_argument("--quick", action="store_true", help="short budgets: a scenario in minutes on 2 cores")
    p.add_argument("--repeats", type=int, default=1, help="measurements per contender (medians are reported)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--vary-seed",
        action="store_true",
        help="repeat r trains with --seed + r, so --repeats measure how learning varies (final metric, steps to "
        "target), not only timing",
    )
    p.add_argument("--no-netns", action="store_true", help="loopback only: no link limits (no root needed)")
    p.add_argument(
        "--link-mbit",
        type=float,
        default=None,
        help="run the (multi-node) scenarios with this inter-node link rate instead of their own; results go under "
        "the scenario's name with the rate appended (slow_link_25mbit)",
    )
    p.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra syncasync-train override for every run, e.g. model=my_model or "
        "model._target_=my_pkg.MyModule (your own workload on the scenario's cluster); repeatable",
    )
    p.add_argument(
        "--advise",
        action="store_true",
        help="also run syncasync-advise inside each scenario's emulated cluster (before its contenders) and keep its "
        "pick in advice.json, which `syncasync-bench report` scores against the measured ranking",
    )
    p.add_argument("--list", action="store_true", help="list scenarios and contenders and exit")
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="[syncasync-bench] %(message)s")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["report"]:
        from lightning_syncasync.bench.publish import main as report_main

        return report_main(argv[1:])
    if "--list" in argv:
        for s in SCENARIOS.values():
            print(f"scenario {s.name}: {s.description}")
        print("contenders:", ", ".join(available_contenders()), "(or 'baselines')")
        return 0
    args = build_parser().parse_args(argv)
    try:
        names = [s.strip() for s in args.scenario.split(",") if s.strip()]
        unknown = [n for n in names if n not in SCENARIOS]
        if unknown or not names:
            raise ValueError(f"unknown --scenario {unknown or names}; HINT: choose from {sorted(SCENARIOS)}")
        scenarios = [SCENARIOS[n] for n in names]
        if args.link_mbit is not None:
            if args.no_netns:
                raise ValueError("--link-mbit needs network namespaces; HINT: drop --no-netns (and run as root)")
            scenarios = [s.with_link(args.link_mbit) for s in scenarios]
        contenders = resolve_contenders(args.strategies)
        if not contenders and not args.advise:
            raise ValueError(
                "--strategies none runs nothing; HINT: add --advise (the advisor alone), or name contenders"
            )
        netns = not args.no_netns
        if netns and any(s.netns for s in scenarios):
            check_netns_support()
        bad = [o for o in args.override if "=" not in o]
        if bad:
            raise ValueError(f"--override {bad[0]!r} is not KEY=VALUE, e.g. --override data.batch_size=64")
        runner = BenchRunner(args.out, quick=args.quick, repeats=args.repeats, seed=args.seed, netns=netns,
                             extra_overrides=args.override, vary_seed=args.vary_seed)  # fmt: skip
        for scenario in scenarios:
            # Every contender of every scenario is checked before the first run starts.
            runner.check(scenario, contenders)
    except (ValueError, EmulationUnavailable) as err:
        print(f"syncasync-bench: error: {err}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "syncasync-bench " + shlex.join(argv)
    records = []
    for scenario in scenarios:
        if args.advise:
            advice = runner.advise(scenario)
            advice["command"] = command
            merge_advice(out, advice)
        if not contenders:
            continue
        fresh = runner.run(scenario, contenders)
        for rec in fresh:
            rec["command"] = command
        records = merge_results(out, fresh)
    if not records:
        return 0  # the advisor alone (--strategies none --advise): advice.json holds its picks
    report = write_report(out, records, command)
    write_plots(out, records)
    logging.info("report: %s", report)
    print(report.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())

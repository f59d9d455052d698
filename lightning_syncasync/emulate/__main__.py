"""``syncasync-emulate``: run a training command as a multi-node job on this machine.

    syncasync-emulate --nodes 2 --procs-per-node 2 --link-mbit 100 --straggler 3:1.5 -- \\
        syncasync-train trainer.num_nodes=2 trainer.devices=2

The command runs once per rank, started like torchrun starts ranks on real nodes; ``{rank}`` in its arguments is
replaced by the rank. The training command must ask for the same shape (``num_nodes x devices`` = world size).

With ``--ft`` the nodes are torchft replica groups instead (``strategy=hier_sync_ft`` or ``async_ssp_ft``): a
Lighthouse, and the command once per node (``{node}`` replaced by its id; Lightning starts the node's ranks, so it asks
for ``trainer.devices``), with ``--node-faults`` killing a node's whole job and starting it again::

    syncasync-emulate --ft --nodes 2 --procs-per-node 2 --node-faults kill:1@20,start:1@40 -- \
        syncasync-train strategy=hier_sync_ft trainer.devices=2 hydra.run.dir=out/node{node}
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict

from lightning_syncasync.emulate.cluster import EmulatedCluster
from lightning_syncasync.emulate.network import EmulationUnavailable


def _straggler(spec: str) -> tuple[int, float]:
    rank, sep, factor = spec.partition(":")
    try:
        if not sep:
            raise ValueError
        return int(rank), float(factor)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--straggler {spec!r} is not RANK:FACTOR, e.g. 3:1.5") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="syncasync-emulate",
        description="Emulate a multi-node cluster on one machine: network namespaces joined by rate-limited links "
        "(tc tbf), fixed CPU shares per rank (cgroups), persistent and transient stragglers.",
        epilog="Example: syncasync-emulate --nodes 2 --procs-per-node 2 --link-mbit 100 -- "
        "syncasync-train trainer.num_nodes=2 trainer.devices=2",
    )
    p.add_argument("--nodes", type=int, default=2, help="emulated nodes (default 2)")
    p.add_argument("--procs-per-node", type=int, default=2, help="ranks per node (default 2)")
    p.add_argument(
        "--link-mbit", type=float, default=None, help="inter-node link rate per node, Mbit/s (default: none)"
    )
    p.add_argument(
        "--straggler",
        type=_straggler,
        action="append",
        default=[],
        metavar="RANK:FACTOR",
        help="persistent slowdown: RANK's CPU share is FACTOR times smaller (repeatable)",
    )
    p.add_argument(
        "--straggler-schedule",
        default="",
        metavar="RANK:FACTOR@START-END",
        help="slowdown during a window of the planned steps, e.g. 3:2@0.33-0.67",
    )
    p.add_argument(
        "--jitter",
        default="",
        metavar="PROB:FACTOR[@START-END]",
        help="each step, each rank pauses FACTOR x its compute time with probability PROB (in a window of the "
        "planned steps with @START-END, e.g. 0.1:4@0.67-1)",
    )
    p.add_argument(
        "--link-schedule",
        default="",
        metavar="MBIT@START-END",
        help="the inter-node link at MBIT Mbit/s during a window of the planned steps (another job's traffic), "
        "--link-mbit outside it, e.g. 20@0.33-0.67",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the jitter draws (logged)")
    p.add_argument(
        "--cpu-budget",
        type=float,
        default=None,
        help="cores shared by all ranks (default 75%% of this machine's, leaving headroom); each rank an equal part",
    )
    p.add_argument(
        "--no-netns",
        action="store_true",
        help="no namespaces: plain loopback, no bandwidth limit (stragglers still emulated)",
    )
    p.add_argument("--no-cgroups", action="store_true", help="no CPU caps: slowdowns become sleeps (confounded)")
    p.add_argument(
        "--independent",
        action="store_true",
        help="each rank trains alone as a world of one: measures the no-communication limit",
    )
    p.add_argument("--log-dir", default=None, help="rank logs and emulation.json (default: a temporary folder)")
    p.add_argument("--timeout", type=float, default=None, help="stop everything after this many seconds")
    p.add_argument(
        "--grace",
        type=float,
        default=30.0,
        help="seconds the other ranks may run after one fails (none once only stopped ranks are left)",
    )
    p.add_argument(
        "--fault",
        default="",
        metavar="KIND:RANK@STEP[+SECONDS]",
        help="inject a fault: kill:1@5 (SIGKILL), stop:1@5 (SIGSTOP, a hang), raise:1@5, cut:2@6+3 (rank 2's node "
        "link down for 3 s); fires in the first attempt only",
    )
    p.add_argument(
        "--ft",
        action="store_true",
        help="fault-tolerant nodes: a torchft Lighthouse and the command once per node (hier_sync_ft, async_ssp_ft)",
    )
    p.add_argument(
        "--node-faults",
        default="",
        metavar="KIND:NODE@SECONDS,...",
        help="with --ft: kill:1@20 SIGKILLs node 1's whole job 20 s in, start:1@40 starts it again (or late)",
    )
    p.add_argument("--min-replicas", type=int, default=1, help="with --ft: the Lighthouse's quorum minimum")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- followed by the training command")
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="[syncasync-emulate] %(message)s")
    args = build_parser().parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        build_parser().error("no training command; put it after --, e.g. -- syncasync-train trainer.devices=2")
    if args.no_netns and args.link_mbit is not None:
        build_parser().error("--link-mbit needs network namespaces; drop --no-netns or drop --link-mbit")
    if args.ft:
        return _run_ft(args, command)
    if args.node_faults:
        build_parser().error("--node-faults needs --ft (nodes that leave and join); HINT: add --ft, or use --fault")
    try:
        cluster = EmulatedCluster(
            nodes=args.nodes, procs_per_node=args.procs_per_node, link_mbit=args.link_mbit,
            stragglers=dict(args.straggler), jitter=args.jitter, schedule=args.straggler_schedule, seed=args.seed,
            cpu_budget=args.cpu_budget, netns=not args.no_netns, cgroups=not args.no_cgroups,
            independent=args.independent, log_dir=args.log_dir, grace_s=args.grace, fault=args.fault,
            link_schedule=args.link_schedule,
        )  # fmt: skip
        logging.info(
            "%d node(s) x %d, link %s Mbit/s, cores per rank %s, netns=%s, cgroups=%s",
            args.nodes, args.procs_per_node, args.link_mbit or "unlimited",
            [round(c, 3) for c in cluster.cores_per_rank()], not args.no_netns, cluster.use_cgroups,
        )  # fmt: skip
        report = cluster.run(command, timeout_s=args.timeout)
    except (ValueError, EmulationUnavailable) as err:
        print(f"syncasync-emulate: error: {err}", file=sys.stderr)
        return 2
    logging.info("finished in %.1fs, exit codes %s; logs in %s", report.wall_s, report.exit_codes, cluster.log_dir)
    if report.interrupted:
        return 130
    if any(report.exit_codes):
        # The first rank that failed on its own decides the exit status (the others were stopped by us).
        failed = (
            report.failed_rank
            if report.failed_rank is not None
            else next(r for r, c in enumerate(report.exit_codes) if c)
        )
        code = report.exit_codes[failed] or 1
        logging.error("rank %d failed with exit code %d; see %s", failed, code, cluster.log_dir)
        print(json.dumps(asdict(report)), file=sys.stderr)
        return code if 0 < code < 256 else 1
    return 0


def _run_ft(args: argparse.Namespace, command: list[str]) -> int:
    from lightning_syncasync.emulate.replica_groups import ReplicaGroupCluster

    unsupported = (("--straggler", args.straggler), ("--straggler-schedule", args.straggler_schedule),
                   ("--jitter", args.jitter), ("--fault", args.fault), ("--independent", args.independent),
                   ("--link-schedule", args.link_schedule))  # fmt: skip
    for flag, value in unsupported:
        if value:
            print(f"syncasync-emulate: error: {flag} is not supported with --ft (yet); HINT: drop it", file=sys.stderr)
            return 2
    try:
        cluster = ReplicaGroupCluster(
            nodes=args.nodes, procs_per_node=args.procs_per_node, link_mbit=args.link_mbit, netns=not args.no_netns,
            faults=args.node_faults, min_replicas=args.min_replicas, log_dir=args.log_dir,
        )  # fmt: skip
        report = cluster.run(command, timeout_s=args.timeout)
    except (ValueError, EmulationUnavailable) as err:
        print(f"syncasync-emulate: error: {err}", file=sys.stderr)
        return 2
    runs = [(r.node, r.exit_code, "killed" if r.killed else "") for r in report.runs]
    logging.info("finished in %.1fs; runs %s; logs in %s", report.wall_s, runs, cluster.log_dir)
    if report.interrupted:
        return 130
    if report.failed:
        logging.error("node %d failed with exit code %s; see %s", report.failed[0].node, report.failed[0].exit_code,
                      report.failed[0].log)  # fmt: skip
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What fault tolerance costs with no fault, and what a preempted node costs: ``hier_sync`` (one world over both
nodes) against ``hier_sync_ft`` (one job per node, torchft's Lighthouse and process groups), side by side in one
invocation, on ``slow_link``'s cluster and workload (2 nodes x 2 ranks, 100 Mbit/s between the nodes, the transformer
LM), with ``hier_sync_ft`` also run with node 1 SIGKILLed at 30% of its fault-free run's wall time and started again
at 60%.

    python scripts/ft_overhead.py --repeats 2 --steps 40 --sync --out docs/results/ft_overhead.json --doc

Neither run caps CPU shares (the replica-group emulator has no cgroups yet): 4 ranks share this machine's cores in
both, so the ratio compares like with like, and the absolute samples/s are this machine's. Every run is the real
``syncasync-emulate`` (network namespaces, root) and ``syncasync-train``; the figures come from their results.json.
``--doc`` writes the table into docs/fault_tolerance.md between its ``ft:overhead`` markers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lightning_syncasync.bench.scenarios import lookup

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "fault_tolerance.md"


def _run(contender: str, steps: int, seed: int, out: Path, faults: str = "", sync: bool = False) -> dict:
    scenario = lookup("slow_link")
    assert scenario is not None
    train = ["syncasync-train", *scenario.overrides, f"trainer.max_steps={steps}", "trainer.max_epochs=-1",
             f"seed={seed}", "logger=[]"]  # fmt: skip
    emulate = ["syncasync-emulate", "--nodes", "2", "--procs-per-node", "2", "--link-mbit", "100", "--log-dir",
               str(out)]  # fmt: skip
    if contender == "hier_sync":
        cmd = [*emulate, "--no-cgroups", "--", *train, "strategy=hier_sync", "trainer.num_nodes=2",
               "trainer.devices=2", f"hydra.run.dir={out}/run",
               *(["strategy.max_delay=0"] if sync else [])]  # fmt: skip
        results = [out / "run" / "results.json"]
    else:
        extra = ["strategy.exchange=torchft_diloco"] if contender == "torchft_diloco" else []
        cmd = [*emulate, "--ft", *(["--node-faults", faults] if faults else []), "--", *train,
               "strategy=hier_sync_ft", "trainer.devices=2", f"hydra.run.dir={out}/node{{node}}",
               *(["strategy.staleness=0"] if sync and not extra else []), *extra]  # fmt: skip
        results = [out / "node0" / "results.json", out / "node1" / "results.json"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{contender} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    found = [json.loads(p.read_text()) for p in results if p.is_file()]
    samples_per_s = sum(r["sync_summary"]["global_samples_per_s"] for r in found)
    metric = statistics.mean(r["metrics"]["val_acc"] for r in found)
    # Samples trained over the whole run (every node's ranks), per second of the job's wall time.
    samples = sum(sum(rank["steps"] for rank in r["sync_summary"]["ranks"]) * 16 for r in found)
    return {"contender": contender + (" (node 1 killed at 30%, back at 60%)" if faults else ""), "seed": seed,
            "samples_per_s": samples_per_s, "val_acc": metric, "wall_s": wall, "goodput": samples / wall,
            "faults": faults}  # fmt: skip


def _table(records: list[dict]) -> str:
    rows = ["| contender | runs | samples/s (median, SyncMonitor, both nodes) | vs hier_sync | val_acc (median) | "
            "samples per wall second (goodput) |", "|---|---|---|---|---|---|"]  # fmt: skip
    names = list(dict.fromkeys(r["contender"] for r in records))
    base_runs = [r["samples_per_s"] for r in records if r["contender"] == "hier_sync"]
    base = statistics.median(base_runs) if base_runs else float("nan")
    for name in names:
        rs = [r for r in records if r["contender"] == name]
        sps = statistics.median(r["samples_per_s"] for r in rs)
        # A restarted node's SyncMonitor rate is over its own, shorter run: summed, it is no job throughput.
        ratio = f"{sps / base:.2f}x" if base == base else "-"  # nan: no hier_sync run in this invocation
        shown = "(n/a: a node restarted) | -" if rs[0]["faults"] else f"{sps:.1f} | {ratio}"
        rows.append(
            f"| `{name}` | {len(rs)} | {shown} | "
            f"{statistics.median(r['val_acc'] for r in rs):.4f} | {statistics.median(r['goodput'] for r in rs):.1f} |"
        )
    return "\n".join(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--steps", type=int, default=40, help="optimizer steps per rank (slow_link's quick budget: 40)")
    p.add_argument("--out", default=None, help="results JSON")
    p.add_argument("--doc", action="store_true", help="write the table into docs/fault_tolerance.md")
    p.add_argument("--no-faults", action="store_true", help="skip the preempted run")
    p.add_argument(
        "--contenders",
        default="hier_sync,hier_sync_ft",
        help="among hier_sync, hier_sync_ft and torchft_diloco (torchft's own DiLoCo on hier_sync_ft's launch); every "
        "fault-tolerant one is also run preempted unless --no-faults",
    )
    p.add_argument("--marker", default="ft:overhead", help="the docs/fault_tolerance.md marker --doc writes under")
    p.add_argument("--from", dest="source", default=None, help="render the table of a results file; run nothing")
    p.add_argument(
        "--sync",
        action="store_true",
        help="synchronous rounds in both (hier_sync max_delay=0, hier_sync_ft staleness=0): the same algorithm, so "
        "the ratio is the cost of torchft's machinery; by default each runs its own default overlap (hier_sync "
        "applies a round 1 step after its launch, hier_sync_ft a whole round later)",
    )
    args = p.parse_args()
    records: list[dict] = []
    if args.source:
        records = json.loads(Path(args.source).read_text())["records"]
    with tempfile.TemporaryDirectory(prefix="ft-overhead-") as tmp:
        for rep in range(0 if args.source else args.repeats):
            order = [c.strip() for c in args.contenders.split(",") if c.strip()]
            order = order[rep % len(order) :] + order[: rep % len(order)]  # rotated: drift favours nobody
            for contender in order:
                rec = _run(contender, args.steps, rep, Path(tmp) / f"{contender}{rep}", sync=args.sync)
                print(json.dumps(rec), flush=True)
                records.append(rec)
                if args.no_faults or contender == "hier_sync":
                    continue
                faults = f"kill:1@{0.3 * rec['wall_s']:.1f},start:1@{0.6 * rec['wall_s']:.1f}"
                out = Path(tmp) / f"{contender}_preempted{rep}"
                rec = _run(contender, args.steps, rep, out, faults, sync=args.sync)
                print(json.dumps(rec), flush=True)
                records.append(rec)
    table = _table(records)
    print(table)
    if args.out and not args.source:
        Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "records": records}, indent=2))
    if args.doc:
        text = DOC.read_text()
        start, end = f"<!-- {args.marker} -->", "<!-- ft:end -->"
        head, _, rest = text.partition(start)
        _, _, tail = rest.partition(end)
        DOC.write_text(f"{head}{start}\n{table}\n{end}{tail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

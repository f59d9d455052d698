"""What fault tolerance costs with no fault, and what a preempted node costs: each plain strategy (one world over
both nodes) against its fault-tolerant form (one job per node, torchft's Lighthouse and process groups), side by side
in one invocation, on a bench scenario's cluster and workload (2 nodes x 2 ranks, 100 Mbit/s between the nodes):
``slow_link`` (the transformer LM) or ``elastic_no_faults`` (the MNIST-5k convnet). A fault-tolerant contender is
also run with node 1 SIGKILLed at 30% of its fault-free run's wall time and started again at 60% (unless
``--no-faults``).

    python scripts/ft_overhead.py --repeats 2 --steps 40 --sync --out docs/results/ft_overhead.json --doc
    python scripts/ft_overhead.py --scenario elastic_no_faults --steps 150 --repeats 5 --no-faults \
        --contenders hier_sync,hier_sync_ft,async_ssp,async_ssp_ft --round 4 --out docs/results/ft_overhead_mnist.json

``--round N`` gives every contender rounds of N steps (``hier_sync.inter_period``, ``async_ssp.local_steps``,
``*_ft.local_steps``), so that a ratio is the cost of torchft's machinery and not of another round length. The
seed of repeat ``r`` is ``r`` for every contender, and the contenders' order rotates from repeat to repeat.

No run caps CPU shares (the replica-group emulator has none): 4 ranks share this machine's cores in both, so the
ratio compares like with like, and the absolute samples/s are this machine's. Every run is the real
``syncasync-emulate`` (network namespaces, root) and ``syncasync-train``; the figures come from their results.json.
``--doc`` writes the table into docs/fault_tolerance.md between its markers (``--marker``).
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


PLAIN = {"hier_sync_ft": "hier_sync", "async_ssp_ft": "async_ssp", "torchft_diloco": "hier_sync"}
ROUND = {"hier_sync": "inter_period", "async_ssp": "local_steps", "hier_sync_ft": "local_steps",
         "async_ssp_ft": "local_steps", "torchft_diloco": "local_steps"}  # fmt: skip


def _run(contender: str, scenario_name: str, steps: int, seed: int, out: Path, faults: str = "", sync: bool = False,
         round_steps: int | None = None) -> dict:  # fmt: skip
    scenario = lookup(scenario_name)
    assert scenario is not None and scenario.nodes == 2 and scenario.procs_per_node == 2
    batch = next((int(o.split("=", 1)[1]) for o in scenario.overrides if o.startswith("data.batch_size=")), 16)
    train = ["syncasync-train", *scenario.overrides, f"trainer.max_steps={steps}", "trainer.max_epochs=-1",
             f"seed={seed}", "logger=[]"]  # fmt: skip
    emulate = ["syncasync-emulate", "--nodes", "2", "--procs-per-node", "2", "--link-mbit",
               f"{scenario.link_mbit:g}", "--log-dir", str(out)]  # fmt: skip
    base, _, codec = contender.partition("_ft_")  # hier_sync_ft_int8: hier_sync_ft with compression=int8
    strategy = "hier_sync_ft" if contender == "torchft_diloco" else (f"{base}_ft" if codec else contender)
    extra = [f"strategy.{ROUND[strategy if codec else contender]}={round_steps}"] if round_steps else []
    if codec:
        extra.append(f"strategy.compression={codec}")
    if contender in ("hier_sync", "async_ssp"):
        if sync:
            extra.append("strategy.max_delay=0" if contender == "hier_sync" else "strategy.staleness=0")
        cmd = [*emulate, "--no-cgroups", "--", *train, f"strategy={strategy}", "trainer.num_nodes=2",
               "trainer.devices=2", f"hydra.run.dir={out}/run", *extra]  # fmt: skip
        results = [out / "run" / "results.json"]
    else:
        if contender == "torchft_diloco":
            extra.append("strategy.exchange=torchft_diloco")
        elif sync:
            extra.append("strategy.staleness=0")
        cmd = [*emulate, "--ft", *(["--node-faults", faults] if faults else []), "--", *train,
               f"strategy={strategy}", "trainer.devices=2", f"hydra.run.dir={out}/node{{node}}", *extra]  # fmt: skip
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
    samples = sum(sum(rank["steps"] for rank in r["sync_summary"]["ranks"]) * batch for r in found)
    record = {"contender": contender + (" (node 1 killed at 30%, back at 60%)" if faults else ""), "seed": seed,
              "scenario": scenario_name, "samples_per_s": samples_per_s, "val_acc": metric, "wall_s": wall,
              "goodput": samples / wall, "faults": faults, "round_steps": round_steps}  # fmt: skip
    record["inter_bytes_per_step"] = statistics.mean(r["sync_summary"]["bytes_inter_per_step"] for r in found)
    if len(found) == 2 and "state_digest" in found[0]:
        record["nodes_identical"] = found[0]["state_digest"] == found[1]["state_digest"]
    elastic = [r["elastic"] for r in found if "elastic" in r]
    if elastic:  # where a fault-tolerant round's time went (node 0's rank 0), per committed round, in ms
        e, n = elastic[0], max(1, elastic[0]["committed"])
        record["phases_ms"] = {k: 1000 * e[k] / n for k in ("quorum_s", "header_s", "body_s", "vote_s",
                               "wait_exchange_s", "heal_check_s", "apply_s", "wait_s") if k in e}  # fmt: skip
    return record


def _table(records: list[dict]) -> str:
    rows = ["| contender | runs | samples/s (median, SyncMonitor, both nodes) | vs its plain form (median of the "
            "repeats' ratios, min-max) | val_acc (median) | samples per wall second (goodput) | nodes bitwise equal "
            "at the end |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    names = list(dict.fromkeys(r["contender"] for r in records))
    for name in names:
        rs = [r for r in records if r["contender"] == name]
        sps = statistics.median(r["samples_per_s"] for r in rs)
        plain = PLAIN.get(name)
        ratios = []
        for r in rs:  # paired by repeat (same seed), the plain form's run of the same invocation
            base = [b["samples_per_s"] for b in records if b["contender"] == plain and b["seed"] == r["seed"]]
            if base:
                ratios.append(r["samples_per_s"] / base[0])
        ratio = f"{statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]" if ratios else "-"
        # A restarted node's SyncMonitor rate is over its own, shorter run: summed, it is no job throughput.
        shown = "(n/a: a node restarted) | -" if rs[0]["faults"] else f"{sps:.1f} | {ratio}"
        same = [r["nodes_identical"] for r in rs if "nodes_identical" in r]
        rows.append(
            f"| `{name}` | {len(rs)} | {shown} | {statistics.median(r['val_acc'] for r in rs):.4f} | "
            f"{statistics.median(r['goodput'] for r in rs):.1f} | {f'{sum(same)}/{len(same)}' if same else '-'} |"
        )
    compressed = [n for n in names if "_ft_" in n]
    if compressed:
        rows += [
            "",
            "| compressed | runs | bytes across nodes per step vs its fp32 form (median of the repeats' "
            "ratios, min-max) | val_acc minus its fp32 form's (median, min-max; points) |",
            "|---|---|---|---|",
        ]
        for name in compressed:
            fp32 = name.partition("_ft_")[0] + "_ft"
            pairs = [(r, b) for r in records if r["contender"] == name for b in records
                     if b["contender"] == fp32 and b["seed"] == r["seed"]]  # fmt: skip
            if not pairs:
                continue
            ratios = [r["inter_bytes_per_step"] / b["inter_bytes_per_step"] for r, b in pairs]
            diffs = [100 * (r["val_acc"] - b["val_acc"]) for r, b in pairs]
            rows.append(
                f"| `{name}` | {len(pairs)} | {statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}] "
                f"| {statistics.median(diffs):+.2f} [{min(diffs):+.2f} to {max(diffs):+.2f}] |"
            )
    return "\n".join(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--scenario", default="slow_link", help="slow_link (the LM) or elastic_no_faults (MNIST convnet)")
    p.add_argument("--round", type=int, default=None, help="rounds of N steps in every contender")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps per rank (slow_link's quick budget: 40)")
    p.add_argument("--out", default=None, help="results JSON")
    p.add_argument("--doc", action="store_true", help="write the table into docs/fault_tolerance.md")
    p.add_argument("--no-faults", action="store_true", help="skip the preempted run")
    p.add_argument(
        "--contenders",
        default="hier_sync,hier_sync_ft",
        help="among hier_sync, hier_sync_ft, async_ssp, async_ssp_ft and torchft_diloco (torchft's own DiLoCo on "
        "hier_sync_ft's launch); every "
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
                rec = _run(
                    contender,
                    args.scenario,
                    args.steps,
                    rep,
                    Path(tmp) / f"{contender}{rep}",
                    sync=args.sync,
                    round_steps=args.round,
                )
                print(json.dumps(rec), flush=True)
                records.append(rec)
                if args.out:  # as it goes: a run cut short keeps what it measured
                    Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "records": records}, indent=2))
                if args.no_faults or contender in ("hier_sync", "async_ssp") or "_ft_" in contender:
                    continue
                faults = f"kill:1@{0.3 * rec['wall_s']:.1f},start:1@{0.6 * rec['wall_s']:.1f}"
                out = Path(tmp) / f"{contender}_preempted{rep}"
                rec = _run(
                    contender, args.scenario, args.steps, rep, out, faults, sync=args.sync, round_steps=args.round
                )
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

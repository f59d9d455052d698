"""Bytes on the wire per rank for one compressed all-reduce, measured on emulated nodes' interfaces.

Each configuration (method, layout, nodes x ranks per node) is one emulated job (network namespaces, no rate
limit: only bytes are measured here). Every rank all-reduces a tensor of the transformer LM's size (3.2 M fp32
elements, 12.7 MB) ``--steps`` times through ``Compressor``; the emulator reads each node's link and loopback
counters at the end. A job that does the same with no exchange at all measures the set-up's bytes (rendezvous, gloo's
connections), which are subtracted. Printed per configuration: bytes each rank sent and received per exchange
(link + loopback, mean over ranks), relative to the fp32 tensor, next to what the ``Compressor`` computes for a
ring implementation (``last_wire``).

    python scripts/collective_bytes.py --out collective_bytes.json        # needs root (network namespaces)
    python scripts/collective_bytes.py --table collective_bytes.json      # the Markdown table of those rows
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

NUMEL = 3_200_000


def worker(method: str, collective: str, steps: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from lightning_syncasync.algorithms.compression.compressor import Compressor

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # "idle": the set-up's traffic alone, subtracted from the others.
    comp = Compressor("none" if method == "idle" else method, collective=collective, seed=rank)  # type: ignore[arg-type]
    x = torch.randn(NUMEL, generator=torch.Generator().manual_seed(rank))
    handed = 0
    for _ in range(steps if method != "idle" else 0):
        _, nbytes = comp.allreduce(x, None, key="g")
        handed += nbytes
    dist.barrier()
    if rank == 0:
        Path(out).write_text(json.dumps({"handed": handed / max(steps, 1), "last_wire": list(comp.last_wire)}))
    dist.destroy_process_group()


def measure(nodes: int, per_node: int, method: str, collective: str, steps: int) -> dict:
    from lightning_syncasync.emulate import EmulatedCluster

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "worker.json"
        cluster = EmulatedCluster(nodes=nodes, procs_per_node=per_node, cgroups=False, log_dir=Path(tmp) / "logs",
                                  echo_rank0=False)  # fmt: skip
        cmd = [sys.executable, __file__, "--worker", method, collective, str(steps), str(out)]
        report = cluster.run(cmd, timeout_s=600)
        if any(report.exit_codes):
            raise RuntimeError(f"{method}/{collective} on {nodes}x{per_node} failed: {report.exit_codes}")
        worker_out = json.loads(out.read_text()) if out.exists() else {}
    ranks = nodes * per_node
    sent = sum(n["link_tx"] + n["lo_tx"] for n in report.net_bytes) / ranks
    recv = sum(n["link_rx"] + n["lo_rx"] for n in report.net_bytes) / ranks
    return {"sent": sent, "recv": recv, **worker_out}


def table(rows: list[dict]) -> list[str]:
    """Markdown: one row per method and layout, one column per cluster shape, bytes sent per rank per exchange as a
    fraction of the fp32 tensor (measured on the interfaces; the ring model's figure in brackets)."""
    shapes = list(dict.fromkeys((r["nodes"], r["ranks_per_node"]) for r in rows))
    kinds = list(dict.fromkeys((r["method"], r["collective"]) for r in rows))
    by = {(r["method"], r["collective"], r["nodes"], r["ranks_per_node"]): r for r in rows}
    head = ["method", "layout", *[f"{n} nodes x {k} ({n * k} ranks)" for n, k in shapes]]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for method, collective in kinds:
        cells = []
        for n, k in shapes:
            r = by.get((method, collective, n, k))
            cells.append("" if r is None else f"{r['sent_vs_fp32']:.3f} ({r['ring_model_vs_fp32']:.3f})")
        out.append("| " + " | ".join([f"`{method}`", collective, *cells]) + " |")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", nargs=4, metavar=("METHOD", "COLLECTIVE", "STEPS", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=5, help="exchanges per job (default 5)")
    parser.add_argument("--methods", default="none,int8,sign,int4", help="comma-separated Compressor methods")
    parser.add_argument("--shapes", default="2x1,2x2,2x4,4x1,4x2", help="NODESxRANKS_PER_NODE, comma-separated")
    parser.add_argument("--layouts", default=None, help="only these chunked layouts (two_phase,allgather,summable)")
    parser.add_argument("--out", default="collective_bytes.json", help="where the rows go (JSON)")
    parser.add_argument("--table", default=None, metavar="JSON", help="print the Markdown table of a results file")
    args = parser.parse_args()
    if args.table:
        print("\n".join(table(json.loads(Path(args.table).read_text()))))
        return 0
    if args.worker:
        method, collective, steps, out = args.worker
        worker(method, collective, int(steps), out)
        return 0
    if os.geteuid() != 0:
        parser.error("network namespaces need root; HINT: run as root (the emulator's requirement)")
    fp32 = NUMEL * 4
    rows = []
    for shape in args.shapes.split(","):
        nodes, per_node = (int(v) for v in shape.split("x"))
        idle = measure(nodes, per_node, "idle", "auto", args.steps)
        for method in args.methods.split(","):
            layouts = ["two_phase", "allgather"] if method in ("int8", "sign", "int4", "int2") else ["auto"]
            layouts += ["summable"] if method in ("int8", "int4", "int2") else []
            for collective in [c for c in layouts if args.layouts is None or c in args.layouts.split(",")]:
                got = measure(nodes, per_node, method, collective, args.steps)
                row = {
                    "nodes": nodes, "ranks_per_node": per_node, "ranks": nodes * per_node, "method": method,
                    "collective": collective,
                    "sent_vs_fp32": (got["sent"] - idle["sent"]) / args.steps / fp32,
                    "recv_vs_fp32": (got["recv"] - idle["recv"]) / args.steps / fp32,
                    "ring_model_vs_fp32": got["last_wire"][0] / fp32,
                    "handed_vs_fp32": got["handed"] / fp32,
                }  # fmt: skip
                rows.append(row)
                print(json.dumps(row), flush=True)
    Path(args.out).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

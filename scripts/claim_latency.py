"""How long one claim on the TCPStore takes across an emulated slow link, idle and while bulk data crosses it.

``async_ssp``'s claiming sampler (``algorithms/ssp/claim_sampler.py``) asks the job's TCPStore for every batch it
trains (an atomic ``add``), so the store's round trip sits on each batch's path. Across nodes that request shares
the node's link with the exchange's bulk transfers, and queues behind them. This script measures it: two emulated
nodes (network namespaces, ``tbf`` at ``--link-mbit`` both ways: ``lightning_syncasync/emulate/network.py``), the
store on node 0, a client on node 1 timing ``--claims`` adds, first idle, then while one TCP flow from node 1 fills
the link towards node 0 (as a rank's pseudo-gradients do), then idle again. Needs root (namespaces).

    sudo python scripts/claim_latency.py --link-mbit 100
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

STORE_PORT, SINK_PORT = 29755, 29756


def serve(addr: str) -> None:
    """Node 0: the store, and a sink that reads and drops whatever is sent to it, until the client says done."""
    import torch.distributed as dist

    store = dist.TCPStore(addr, STORE_PORT, 2, True, timeout=timedelta(seconds=120))
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((addr, SINK_PORT))
    srv.listen(4)

    def drain(conn: socket.socket) -> None:
        while conn.recv(1 << 20):
            pass

    def accept() -> None:
        while True:
            conn, _ = srv.accept()
            threading.Thread(target=drain, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    store.wait(["done"])


def measure(addr: str, claims: int) -> None:
    """Node 1: time ``claims`` adds (10 ms apart) idle, under one bulk flow, and idle again."""
    import torch.distributed as dist

    store = dist.TCPStore(addr, STORE_PORT, 2, False, timeout=timedelta(seconds=120))

    def sample() -> list[float]:
        out = []
        for _ in range(claims):
            t = time.perf_counter()
            store.add("claim", 1)
            out.append((time.perf_counter() - t) * 1000)
            time.sleep(0.01)
        return sorted(out)

    def show(name: str, xs: list[float]) -> None:
        p90 = xs[int(0.9 * (len(xs) - 1))]
        print(f"{name:<40} median {statistics.median(xs):7.2f} ms  p90 {p90:7.2f} ms  max {xs[-1]:7.2f} ms")

    show("idle", sample())
    stop = threading.Event()

    def bulk() -> None:
        conn = socket.create_connection((addr, SINK_PORT))
        block = b"x" * (1 << 20)
        while not stop.is_set():
            conn.sendall(block)

    sender = threading.Thread(target=bulk, daemon=True)
    sender.start()
    time.sleep(1.0)  # the flow reaches the link's rate
    show("one bulk flow towards the store's node", sample())
    stop.set()
    sender.join()
    time.sleep(1.0)
    show("idle again", sample())
    store.set("done", "1")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--link-mbit", type=float, default=100.0, help="each node's link rate (default 100)")
    p.add_argument("--claims", type=int, default=100, help="adds timed per phase (default 100)")
    p.add_argument("--role", choices=["serve", "measure"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--addr", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.role == "serve":
        serve(args.addr)
        return 0
    if args.role == "measure":
        measure(args.addr, args.claims)
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from lightning_syncasync.emulate.network import EmulatedNetwork, check_netns_support

    check_netns_support()
    net = EmulatedNetwork(num_nodes=2, link_mbit=args.link_mbit)
    net.setup()
    me = [sys.executable, __file__, "--addr", net.address(0), "--claims", str(args.claims)]
    try:
        server = subprocess.Popen(net.exec_prefix(0) + [*me, "--role", "serve"])
        time.sleep(2.0)
        print(f"2 emulated nodes, {args.link_mbit:g} Mbit/s each way; TCPStore on node 0, claims from node 1")
        done = subprocess.run(net.exec_prefix(1) + [*me, "--role", "measure"], timeout=300)
        server.wait(timeout=60)
        return done.returncode
    finally:
        net.teardown()


if __name__ == "__main__":
    sys.exit(main())

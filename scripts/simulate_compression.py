"""The advisor's scaling simulation of the compressed exchanges, from the transformer LM's per-rank numbers.

``advise.predictions.simulate`` (the code behind ``syncasync-advise --simulate-nodes``), with the cost model's default
parameters, fed the LM's measurements on ``slow_link`` instead of a probe: 0.68 s per step of 16 sequences per rank,
12.97 MB of gradients, 2 ranks per node, 100 Mbit/s between nodes (12.5 MB/s), 231 MB/s inside a node, 50 us latency
(the numbers ``tests/tools/test_advise.py`` uses). Prints each strategy's samples/s and efficiency at 8, 64 and 512
nodes, the two-phase exchanges (``ddp_int8``, ``ddp_int4``, ``hier_sync_int8``) next to the all-gather layout
(``*_allgather``) and the uncompressed and PowerSGD anchors.

    python scripts/simulate_compression.py
"""

from __future__ import annotations

from lightning_syncasync.advise.measurements import Measurements
from lightning_syncasync.advise.predictions import format_simulation, simulate

STRATEGIES = [
    "ddp", "ddp_int8", "ddp_int8_allgather", "ddp_int4", "ddp_powersgd", "hier_sync", "hier_sync_int8",
    "hier_sync_int8_allgather",
]  # fmt: skip


def main() -> None:
    n = 4
    meas = Measurements(
        world_size=n, nodes=2, procs_per_node=2, batch_size=16, grad_bytes=12.97e6, median_step_s=[0.68] * n,
        step_cv=[0.03] * n, pause_p=[0.0] * n, pause_f=[0.0] * n, intra_alpha_s=5e-5, intra_bytes_per_s=231e6,
        inter_alpha_s=5e-5, inter_bytes_per_s=12.5e6,
    )  # fmt: skip
    print("\n".join(format_simulation(simulate(meas, [8, 64, 512], STRATEGIES))))


if __name__ == "__main__":
    main()

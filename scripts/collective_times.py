"""Wall time of the raw gloo collectives behind DDP's exchange and the two-phase int8 exchange, on whatever cluster
runs it (one process per rank, torchrun's environment), for the LM demo's gradient size (3,241,472 elements).

    syncasync-emulate --nodes 4 --procs-per-node 1 --link-mbit 100 -- python scripts/collective_times.py

Rank 0 prints the minimum of 3 timed calls (after one warm-up) of: the fp32 all-reduce of the gradient (DDP), the
all-to-all of its int8 payload and the all-gather of one int8 shard per rank (the two phases), and an fp32
all-reduce of a quarter of the gradient (the same bytes as the int8 payload, for reference).
"""

import time

import torch
import torch.distributed as dist

NUMEL = 3_241_472


def _seconds(fn, reps: int = 3) -> float:
    fn()
    times = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    grad = torch.randn(NUMEL)
    payload, received = torch.zeros(NUMEL, dtype=torch.uint8), torch.empty(NUMEL, dtype=torch.uint8)
    shard, gathered = (
        torch.zeros(NUMEL // world, dtype=torch.uint8),
        torch.empty(NUMEL // world * world, dtype=torch.uint8),
    )
    quarter = torch.randn(NUMEL // 4)
    times = {
        "all_reduce fp32 (DDP)": _seconds(lambda: dist.all_reduce(grad)),
        "all_to_all int8 payload": _seconds(lambda: dist.all_to_all_single(received, payload)),
        "all_gather int8 shards": _seconds(lambda: dist.all_gather_into_tensor(gathered, shard)),
        "all_reduce fp32, a quarter": _seconds(lambda: dist.all_reduce(quarter)),
    }
    if dist.get_rank() == 0:
        for name, seconds in times.items():
            print(f"{name:28s} {seconds:.3f} s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

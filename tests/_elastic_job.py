"""One rank of one torchft replica group running :class:`ElasticRounds` on a toy model, for tests/algorithms.

Run with torchrun's variables for the group (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) and
``TORCHFT_LIGHTHOUSE``; argv: ``OUT_JSON GROUP STEPS LOCAL_STEPS STALENESS [KILL_AT_STEP|-1] [SLEEP_S] [OUTER]``.

The toy: every local step moves every element of group ``g``'s replica by ``-(g + 1)`` and adds 1 to a fake inner
optimizer counter, so each committed round's pseudo-gradient is ``samples x (g + 1)`` and the tests can check the
global model exactly. A group SIGKILLs itself (every rank at the same step) at ``KILL_AT_STEP``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from lightning_syncasync.algorithms.averaging.elastic import ElasticRounds
from lightning_syncasync.algorithms.averaging.ft_manager import make_manager
from lightning_syncasync.algorithms.averaging.outer import OuterOptimizer


def main() -> None:
    out, group, steps, local_steps, staleness = sys.argv[1], int(sys.argv[2]), *map(int, sys.argv[3:6])
    kill_at = int(sys.argv[6]) if len(sys.argv) > 6 else -1
    sleep_s = float(sys.argv[7]) if len(sys.argv) > 7 else 0.02
    outer_name = sys.argv[8] if len(sys.argv) > 8 else "average"
    compression = sys.argv[9] if len(sys.argv) > 9 else "none"
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    manager = make_manager(
        "test", rank, world, f"group{group}", os.environ["TORCHFT_LIGHTHOUSE"], min_replicas=1, timeout_s=5.0,
        quorum_timeout_s=30.0,
    )  # fmt: skip
    # 7 elements: the last shard is padded with 2 ranks. ELASTIC_JOB_B changes the second tensor's length (a joiner
    # with another model).
    w = [torch.zeros(5), torch.zeros(int(os.environ.get("ELASTIC_JOB_B", "2")))]
    inner = {"count": torch.zeros(1)}  # the fake inner optimizer state a joiner must heal

    def save_extra() -> dict:
        return {"count": inner["count"].clone(), "step": done}

    def load_extra(state: dict) -> None:
        nonlocal done
        inner["count"] = state["count"].clone()
        done = int(state["step"])

    def on_heal(behind: int) -> None:
        nonlocal done
        done += behind
        heals.append(snapshot())

    outer = OuterOptimizer(outer_name, lr=0.7, momentum=0.9) if outer_name != "average" else None  # type: ignore[arg-type]
    heals: list[dict] = []
    rounds = ElasticRounds(
        w, manager, names=["a", "b"], node_group=dist.group.WORLD, local_rank=rank, node_size=world,
        local_steps=local_steps, staleness=staleness, outer=outer, extra_state=(save_extra, load_extra),
        compression=compression,
        on_heal=on_heal,
    )  # fmt: skip
    done = 0
    per_round: dict[int, dict] = {}

    def snapshot() -> dict:
        return {
            "step": manager.current_step(),
            "w": torch.cat([t.reshape(-1) for t in w]).tolist(),
            "anchor": rounds.anchor.tolist(),
            "outer": None if rounds.outer.buffer is None else rounds.outer.buffer.tolist(),
            "count": inner["count"].tolist(),
            "done": done,
        }

    barrier = os.environ.get("ELASTIC_JOB_BARRIER")  # "DIR:N": wait until N ranks of all groups are up
    if barrier:
        folder, count = barrier.rsplit(":", 1)
        open(os.path.join(folder, f"ready_{group}_{rank}"), "w").close()
        deadline = time.time() + 120
        while len([f for f in os.listdir(folder) if f.startswith("ready_")]) < int(count):
            if time.time() > deadline:
                raise TimeoutError(f"the other groups did not start within 120 s ({barrier})")
            time.sleep(0.05)
    rounds.join()
    progress = 0.0  # this rank's own local progress (its own steps only), which must all be committed
    started = time.time()
    own = 0  # this process's own steps (done follows the quorum's when the group heals)
    while done < steps:
        if own == kill_at:
            print(f"self-kill at own step {own}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        rounds.before_step()
        with torch.no_grad():
            for t in w:
                t.sub_(float(group + 1))
        inner["count"] += 1
        progress += float(group + 1)
        done += 1
        own += 1
        time.sleep(sleep_s)
        committed, launched = rounds.stats.committed, len(rounds.stats.launches)
        rounds.after_step(samples=1)
        if rounds.stats.committed != committed:
            per_round[manager.current_step()] = snapshot()
        if len(rounds.stats.launches) != launched:
            with open(out + ".launches", "a") as fh:  # read by the tests when this group is killed
                fh.write(json.dumps(rounds.stats.launches[-1]) + "\n")
    rounds.cut(stop=True)
    per_round[manager.current_step()] = snapshot()
    result = {
        "group": group,
        "rank": rank,
        "final": snapshot(),
        "history": rounds.stats.history,
        "committed_at": rounds.stats.committed_at,
        "failed": rounds.stats.failed,
        "heals": heals,
        "per_round": per_round,
        "progress": progress,
        "samples_discarded": rounds.stats.samples_discarded,
        "started": started,
    }
    with open(out, "w") as fh:
        json.dump(result, fh)
    manager.shutdown(wait=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

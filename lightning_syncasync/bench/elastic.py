"""Node faults in the benchmark: every contender runs as one job per emulated node, one node's whole job is killed
and started again (``preemption``), or starts late (``scale_out``), and the run is measured against wall time.

How each kind of contender runs (the way a user runs it today):

* the fault-tolerant strategies (``hier_sync_ft``, ``async_ssp_ft``, torchft's DiLoCo through ``exchange=
  torchft_diloco``): one Lightning job per node joined through a torchft Lighthouse
  (:class:`~lightning_syncasync.emulate.replica_groups.ReplicaGroupCluster`); a killed node leaves the quorum, a
  started one heals from a live peer;
* every other strategy (``ddp``, ``hier_sync``): ``torchrun --nnodes=1:N`` on every node with a c10d rendezvous on
  node 0 and ``--max-restarts``, a ``ModelCheckpoint`` every ``checkpoint_every`` steps and ``ckpt_path=last``, and
  ``trainer.num_nodes`` read from torchrun's ``GROUP_WORLD_SIZE``: when a node dies the others' collectives fail
  (the watchdog names the lost rank), torchrun's agent restarts the survivors, which resume alone from the last
  checkpoint; when the node comes back, the agent restarts everyone again from the last checkpoint with every node.
  Work since that checkpoint is lost at each restart: that is what the checkpoint interval trades.

The fault times are fractions of the *budget time*: the scenario's sample budget at the no-communication limit
measured in the same repeat (``steps x global batch / ideal samples/s``), counted from the first training step, so
start-up does not move them and a faster machine scales them with its speed.

Every figure comes from the nodes' timelines (:mod:`lightning_syncasync.callbacks._timeline`), the emulation's
report (when each node's job started and was killed) and the nodes' ``results.json``:

* ``time_to_target_s``: wall time from the first training step to the first validation at or past the target
  (validation time included: every contender validates at the same steps);
* ``goodput_samples_per_s``: samples in the final model's trajectory over the wall time from the first training step
  to the end of fit; samples trained and then lost (after the last checkpoint of a restarted job, or in a killed
  node's round that never committed) are ``samples_lost``;
* ``limit_samples_per_s``: the capacity actually present: each node's no-communication rate (its ranks' ideal
  samples/s) times the time its job was running, over the same wall time; ``goodput_frac`` = goodput / limit;
* ``kill_to_commit_s``: from the kill to the survivors' next committed update (a committed round of a
  fault-tolerant strategy; the first step of the resumed survivors of a restarted job);
* ``outage_samples_per_s`` / ``outage_frac``: the samples the survivors trained from the kill to the killed node's
  next start, per second, and over the survivors' capacity (their nodes' no-communication rates);
* ``start_to_commit_s``: from the (re)start of the node's job to the first committed update with every node in it
  (Python start-up, rendezvous or heal included); ``join_to_heal_s`` / ``join_to_commit_s``: a fault-tolerant
  joiner's own figures, from its first quorum (after its start-up) to its heal and to its first committed round;
* ``rate_before_join`` / ``rate_after_join``: every node's samples/s before the (re)started node's job began and
  after its first full update (``scale_out``'s speed-up).
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_syncasync._cores import usable_cores
from lightning_syncasync.callbacks._timeline import read_timeline
from lightning_syncasync.emulate.cluster import free_port
from lightning_syncasync.emulate.replica_groups import (
    TIMELINE_FILE,
    ReplicaGroupCluster,
    first_step_clock,
    node_command,
)

if TYPE_CHECKING:
    from lightning_syncasync.bench.scenarios import Scenario

log = logging.getLogger(__name__)

PLOT_POINTS = 300  # per series kept in results.json for the plots


def runs_fault_tolerant(overrides: list[str] | tuple[str, ...]) -> bool:
    """Whether the composed run's strategy is a fault-tolerant one (one job per node, through a Lighthouse)."""
    from omegaconf import OmegaConf

    from lightning_syncasync.advise.probe import compose_config
    from lightning_syncasync.strategies import is_fault_tolerant

    return is_fault_tolerant(OmegaConf.select(compose_config(list(overrides)), "trainer.strategy"))


def budget_time_s(scenario: Scenario, steps: int, ideal_samples_per_s: float) -> float:
    """The scenario's sample budget at the no-communication limit (the fault schedule's time unit)."""
    return steps * scenario.batch_size * scenario.world_size / ideal_samples_per_s


def fault_schedule(scenario: Scenario, budget_s: float) -> str:
    """``kill:1@0.3,start:1@0.6`` (fractions of the budget time) -> seconds."""
    items = []
    for item in filter(None, (s.strip() for s in scenario.node_faults.split(","))):
        head, _, frac = item.partition("@")
        items.append(f"{head}@{float(frac) * budget_s:.2f}")
    return ",".join(items)


@dataclass(frozen=True)
class ElasticRun:
    """What the bench's runner hands the launcher for one (contender, repeat): the launcher never reads the runner.

    Args:
        contender: the contender's name (the record's ``strategy``).
        rep: the repeat.
        overrides: the contender's ``syncasync-train`` overrides on the scenario, as a flat run would take them.
        steps: the training budget per rank.
        train_seed: the repeat's ``seed=``.
        out_dir: the bench's output folder; the run's files go to ``<out_dir>/<scenario>/<contender>/rep<rep>``.
        quick: the scenario's quick budget and target.
        netns: emulate the link in network namespaces (where the scenario has one).
        run_timeout_s: the whole run's time limit.
    """

    contender: str
    rep: int
    overrides: list[str]
    steps: int
    train_seed: int
    out_dir: Path
    quick: bool
    netns: bool
    run_timeout_s: float


def run_elastic(job: ElasticRun, scenario: Scenario, ideal: dict[str, Any]) -> dict[str, Any]:
    """One (contender, repeat) of a node-fault scenario; the record has the usual fields and the ones above."""
    rep = job.rep
    run_dir = job.out_dir / scenario.name / job.contender / f"rep{rep}"
    if run_dir.exists():
        shutil.rmtree(run_dir)  # a restarted job resumes from checkpoints/last.ckpt: never from an older run's
    run_dir.mkdir(parents=True)
    steps = job.steps
    budget_s = budget_time_s(scenario, steps, ideal["samples_per_s"])
    faults = fault_schedule(scenario, budget_s)
    base = job.overrides
    ft = runs_fault_tolerant(base)
    ppn = scenario.procs_per_node
    if ft:
        overrides = [*base, "trainer.num_nodes=1", f"trainer.devices={ppn}", f"hydra.run.dir={run_dir}/node{{node}}"]
        cmd = node_command(ppn, "lightning_syncasync.train", overrides)
        env: dict[str, str] = {}
    else:
        overrides = [
            *[o for o in base if not o.startswith(("trainer.num_nodes=", "callbacks.model_checkpoint=",
                                                   "trainer.enable_checkpointing="))],
            # torchrun sets the number of nodes present; Lightning checks num_nodes x devices against the world.
            "trainer.num_nodes=${oc.env:GROUP_WORLD_SIZE,1}",
            "trainer.enable_checkpointing=true",
            "callbacks.model_checkpoint.monitor=null",
            f"callbacks.model_checkpoint.every_n_train_steps={scenario.checkpoint_every}",
            "+callbacks.model_checkpoint.save_on_train_epoch_end=false",
            "ckpt_path=last",
            f"hydra.run.dir={run_dir}",
        ]  # fmt: skip
        cmd = [
            sys.executable, "-m", "torch.distributed.run", f"--nnodes=1:{scenario.nodes}", f"--nproc-per-node={ppn}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={{host0}}:{free_port()}", f"--rdzv-id=bench{rep}",
            "--local-addr={host}", "--max-restarts=20", "--monitor-interval=0.5",
            "--rdzv-conf=last_call_timeout=1,is_host={is_node0}",
            "-m", "lightning_syncasync.train", *overrides,
        ]  # fmt: skip
        # The workers' store of their own: a store shared with the agent does not survive a restart (train.py).
        env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    clock_env, origin = first_step_clock(run_dir, scenario.nodes)
    env.update(clock_env)
    netns = job.netns and scenario.netns
    cores = 0.75 * usable_cores() / scenario.world_size * ppn  # the ideal's per-rank shares (EmulatedCluster)
    cluster = ReplicaGroupCluster(
        nodes=scenario.nodes, procs_per_node=ppn, link_mbit=scenario.link_mbit if netns else None, netns=netns,
        faults=faults, lighthouse=ft, cores_per_node=cores, origin=origin, env=env, log_dir=run_dir / "logs",
        echo=False, faults_setting=f"scenario {scenario.name!r} node_faults",
    )  # fmt: skip
    log.info("[%s] %s rep %d (%s; faults %s)", scenario.name, job.contender, rep,
             "fault-tolerant" if ft else "torchrun restarts", faults or "none")  # fmt: skip
    start = time.monotonic()
    report = cluster.run(cmd, timeout_s=job.run_timeout_s)
    wall = time.monotonic() - start
    record: dict[str, Any] = {
        "scenario": scenario.name, "strategy": job.contender, "repeat": rep, "train_seed": job.train_seed,
        "quick": job.quick, "target": scenario.quick_target if job.quick else scenario.target,
        "val_metric_name": scenario.metric, "steps": steps, "run_dir": str(run_dir), "wall_s": wall,
        "samples_per_s": None, "time_to_target_s": None, "final_val_metric": None, "inter_node_bytes_per_step": None,
        "config": None, "elastic_launch": "torchft" if ft else "torchrun_restarts", "faults": faults,
        "budget_s": budget_s,
        "emulation": {"cpu_mode": report.cpu_mode, "cores_per_rank": [cores / ppn] * scenario.world_size,
                      "netns": report.netns, "exit_codes": [r.exit_code for r in report.runs]},
    }  # fmt: skip
    if report.interrupted or report.failed:
        bad = ", ".join(f"node {r.node} exit {r.exit_code} ({r.log})" for r in report.failed) or "interrupted"
        record["error"] = f"run failed: {bad}; logs in {run_dir / 'logs'}"
        log.error("[%s] %s rep %d failed: %s", scenario.name, job.contender, rep, record["error"])
        return record
    node_rates = [sum(ideal["per_rank"][n * ppn : (n + 1) * ppn]) for n in range(scenario.nodes)]
    record["node_rates"] = node_rates
    record.update(measure(run_dir, scenario, job.quick, node_rates, ft))
    return record


def measure(run_dir: Path, scenario: Scenario, quick: bool, node_rates: list[float], ft: bool) -> dict[str, Any]:
    """A finished run's figures from its files alone (timelines, ``logs/emulation.json``, the nodes'
    ``results.json``), so that a results file can be measured again when the analysis changes (``--remeasure``)."""
    emulation = json.loads((run_dir / "logs" / "emulation.json").read_text())
    lines = {n: read_timeline(run_dir / TIMELINE_FILE.format(node=n)) for n in range(scenario.nodes)}
    origin = float(emulation["started_at"])
    runs = [
        {"node": r["node"], "start": origin + r["started_at"],
         "end": None if r["ended_at"] is None else origin + r["ended_at"], "killed": r["killed"] or r["terminated"]}
        for r in emulation["runs"]
    ]  # fmt: skip
    out = analyse(lines, runs, node_rates, scenario.nodes, lambda v: scenario.reached(v, quick), scenario.metric,
                  restarted=not ft)  # fmt: skip
    results = [run_dir / "results.json"]
    if ft:
        results = [run_dir / f"node{n}" / "results.json" for n in range(scenario.nodes)]
        out.update(_joiner(results))
    first = next((p for p in results if p.exists()), None)
    if first is not None:
        data = json.loads(first.read_text())
        out["config"] = data.get("config")
        summary = data.get("sync_summary") or {}
        out["inter_node_bytes_per_step"] = summary.get("bytes_inter_per_step")
        out["checkpoint_s"] = max((r.get("checkpoint_s", 0.0) for r in summary.get("ranks", [])), default=None)
    return out


def remeasure(path: Path) -> int:
    """Measure every node-fault record of a results file again from its run folder (kept in place)."""
    from lightning_syncasync.bench.scenarios import lookup

    records = json.loads(path.read_text())
    done = 0
    for rec in records:
        sc = lookup(rec["scenario"])
        if sc is None or not sc.elastic or "error" in rec or not Path(rec["run_dir"]).exists():
            continue
        rates = rec.get("node_rates") or [
            sum(rec["ideal_per_rank_samples_per_s"][n * sc.procs_per_node : (n + 1) * sc.procs_per_node])
            for n in range(sc.nodes)
        ]
        fresh = measure(Path(rec["run_dir"]), sc, bool(rec.get("quick")), rates, rec["elastic_launch"] == "torchft")
        for key in ("samples_useful", "samples_lost", "goodput_samples_per_s", "goodput_frac", "kill_to_commit_s",
                    "start_to_commit_s", "rate_before_join", "rate_after_join", "outage_samples_per_s",
                    "outage_frac"):  # fmt: skip
            rec.pop(key, None)  # a figure the analysis no longer gives must not survive from the old one
        rec.update(fresh)
        ideal = rec.get("ideal_samples_per_s")
        rec["efficiency"] = rec["samples_per_s"] / ideal if rec.get("samples_per_s") and ideal else None
        done += 1
    path.write_text(json.dumps(records, indent=1, default=str))
    return done


def _joiner(results: list[Path]) -> dict[str, float | None]:
    """A fault-tolerant joiner's own clock (its last run's ``results.json``): from the start of its join (its first
    quorum) to its heal, and to its first committed round."""
    for path in results:
        if path.exists():
            e = json.loads(path.read_text()).get("elastic") or {}
            if e.get("heals") and e.get("joined_at") and e.get("healed_at"):
                joined = float(e["joined_at"])
                first = min(e.get("committed_at") or [None], key=lambda v: v or 0.0)
                return {
                    "join_to_heal_s": float(e["healed_at"]) - joined,
                    "join_to_commit_s": None if first is None else float(first) - joined,
                }
    return {"join_to_heal_s": None, "join_to_commit_s": None}


def analyse(
    lines: dict[int, list[dict[str, Any]]],
    runs: list[dict[str, Any]],
    node_rates: list[float],
    nodes: int,
    reached: Any,
    metric: str,
    restarted: bool = True,
) -> dict[str, Any]:
    """The figures of the module docstring from the nodes' timelines and the scheduler's view of each node's runs
    (``start``/``end`` wall times, ``killed``). Pure: tested on hand-made timelines."""
    segments = []  # (node, lines of one process run): split at the "start" events
    for node, ls in lines.items():
        current: list[dict[str, Any]] = []
        for line in ls:
            if line.get("event") == "start" and current:
                segments.append((node, current))
                current = []
            current.append(line)
        if current:
            segments.append((node, current))
    all_lines = sorted((line for _, seg in segments for line in seg), key=lambda x: x["t"])
    if not all_lines:
        return {"error": "no timeline was written (did SyncMonitor run?)"}
    t0 = all_lines[0]["t"]
    t_end = max(line["t"] for line in all_lines)
    # Samples trained and kept, per process run.
    trained = useful = 0.0
    measurable = True  # False when an exchange reports no commits: what it kept is unknown
    commits: list[tuple[float, int, int, float]] = []  # (time, node, participants, its run's start) per update
    for i, (node, seg) in enumerate(segments):
        st = [x for x in seg if "samples" in x]
        if not st:
            continue
        total = float(st[-1]["samples"])
        trained += total
        if not restarted and "committed_steps" not in st[-1]:
            # A fault-tolerant node whose exchange reports no commits (torchft's DiLoCo): what it kept is unknown.
            measurable = False
            continue
        if "committed_steps" in st[-1]:
            per_step = total / len(st)
            useful += st[-1]["committed_steps"] * per_step
            last = 0
            for x in st:
                if x["committed_steps"] > last:
                    commits.append((x["t"], node, x["participants"], seg[0]["t"]))
                last = x["committed_steps"]
        else:
            # A restarted job: what the next run of the job resumed from (its first step) was kept.
            later = [s for _, s in segments[i + 1 :] if any("samples" in x for x in s) and s[0]["t"] > seg[0]["t"]]
            nxt = min(later, key=lambda s: s[0]["t"]) if later else None
            resumed = None if nxt is None else nxt[0].get("step")
            useful += total if resumed is None else sum(x["samples"] - p for x, p in _incr(st) if x["step"] <= resumed)
            # Every step commits an update, but steps taken after a kill that the next restart rolls back do not
            # count: a run's steps count from its start, and the kill's recovery is the first step of a run that
            # started after it (kill_to_commit_s below).
            commits += [(x["t"], node, x["participants"], seg[0]["t"]) for x in st]
    commits.sort()
    wall = t_end - t0
    present = 0.0
    for r in runs:
        a, b = max(r["start"], t0), min(r["end"] if r["end"] is not None else t_end, t_end)
        if b > a:
            present += node_rates[r["node"]] * (b - a)
    val = [x for x in all_lines if "val" in x and metric in x["val"]]
    hit = next((x for x in val if reached(x["val"][metric])), None)
    known = measurable
    out: dict[str, Any] = {
        "samples_trained": trained,
        "samples_useful": useful if known else None,
        "samples_lost": max(trained - useful, 0.0) if known else None,
        "samples_per_s": trained / wall if wall > 0 else None,
        "goodput_samples_per_s": useful / wall if wall > 0 and known else None,
        "limit_samples_per_s": present / wall if wall > 0 else None,
        "goodput_frac": useful / present if present > 0 and known else None,
        "time_to_target_s": None if hit is None else hit["t"] - t0,
        "final_val_metric": val[-1]["val"][metric] if val else None,
        "elastic_wall_s": wall,
    }
    kills = [r for r in runs if r["killed"] and r["end"] is not None]
    if kills:
        k = kills[0]
        after = [c for c in commits if c[0] > k["end"] and c[1] != k["node"] and (not restarted or c[3] > k["end"])]
        out["kill_to_commit_s"] = min(after)[0] - k["end"] if after else None
        # The outage: from the kill to the killed node's next start. What the survivors trained there, against the
        # capacity they had (their nodes' no-communication rates): a fault-tolerant survivor should keep training
        # at its own pace, a restarted job loses its restart and its rollback.
        back = min((r["start"] for r in runs if r["node"] == k["node"] and r["start"] > k["end"]), default=t_end)
        capacity = sum(node_rates[n] for n in range(nodes) if n != k["node"])
        rate = _rate(segments, k["end"], back)
        if rate is not None and capacity > 0:
            out["outage_samples_per_s"], out["outage_frac"] = rate, rate / capacity
    # The (re)started node: its last run's start (a node restarted after a kill, or one that joined late).
    late = [r for r in runs if r["start"] > t0 or sum(1 for q in runs if q["node"] == r["node"]) > 1]
    late = [r for r in late if not r["killed"]]
    if late:
        s = max(late, key=lambda r: r["start"])
        full = next((c for c in commits if c[0] > s["start"] and c[2] >= nodes), None)
        out["start_to_commit_s"] = None if full is None else full[0] - s["start"]
        # Throughput before the node's (re)start and after its first full update (scale-out's speed-up).
        out["rate_before_join"] = _rate(segments, t0, s["start"])
        out["rate_after_join"] = None if full is None else _rate(segments, full[0], t_end)
    out["series"] = _series(segments, val, metric, t0)
    return out


def _rate(segments: list[tuple[int, list[dict[str, Any]]]], a: float, b: float) -> float | None:
    """Every node's samples trained between wall times ``a`` and ``b``, per second."""
    if b <= a:
        return None
    total = 0.0
    for _, seg in segments:
        total += sum(float(x["samples"]) - p for x, p in _incr([x for x in seg if "samples" in x]) if a < x["t"] <= b)
    return total / (b - a)


def _incr(st: list[dict[str, Any]]) -> list[tuple[dict[str, Any], float]]:
    """Each step line of one process run with the cumulative samples of the line before it."""
    prev = 0.0
    out = []
    for x in st:
        out.append((x, prev))
        prev = float(x["samples"])
    return out


def _series(segments: list[tuple[int, list[dict[str, Any]]]], val: list[dict[str, Any]], metric: str,
            t0: float) -> dict[str, Any]:  # fmt: skip
    """Participants, throughput (every node's samples in 2 s windows) and the metric against seconds from the first
    training step, for the plots."""
    steps = sorted((x for _, seg in segments for x in seg if "samples" in x), key=lambda x: x["t"])
    every = max(1, len(steps) // PLOT_POINTS)
    window = 2.0
    bins: dict[int, float] = {}
    for _, seg in segments:
        for x, prev in _incr([x for x in seg if "samples" in x]):
            b = int((x["t"] - t0) // window)
            bins[b] = bins.get(b, 0.0) + float(x["samples"]) - prev
    return {
        "participants": [(round(x["t"] - t0, 2), x["participants"]) for x in steps[::every]],
        # Windows with no step count as 0 (an outage shows as one, not as a line across it).
        "samples_per_s": [((b + 0.5) * window, bins.get(b, 0.0) / window) for b in range(min(bins), max(bins) + 1)]
        if bins
        else [],
        "val": [(round(x["t"] - t0, 2), x["val"][metric]) for x in val],
    }


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="measure node-fault records again from their run folders")
    parser.add_argument("--remeasure", type=Path, required=True, help="a syncasync-bench results.json")
    print(f"{remeasure(parser.parse_args().remeasure)} record(s) measured again")

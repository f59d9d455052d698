"""Run contenders side by side on one scenario, interleaved, each inside ``syncasync-emulate``'s cluster.

For every repeat the contenders run one after another in a rotated order (so slow drift of the machine does not
favour whoever runs first), and the *ideal* run is one of them: the same ranks, CPU shares, stragglers and jitter,
but every rank trains alone (``--independent``: a world of one, no communication at all). Its summed throughput is
the physical limit the contenders are measured against, in the same invocation.

That limit is measured with every rank busy all the time. On a machine whose ranks share cores, caches and memory
bandwidth, ranks that wait leave those to the ones that compute, so a contender that waits (DDP behind a straggler)
computes faster per step than the ideal's ranks did (so does one that moves samples between ranks, at other batch
sizes), and its ``efficiency`` overstates it: on ``straggler`` DDP read 86.5% where a perfect synchronous run at the
ideal's per-rank speeds reaches 73.6% (``straggler_long``: 75.7% against 63.4%). Each record therefore also carries
the contender's own no-wait throughput (``busy_samples_per_s``: every rank's samples over its time not spent
waiting; an injected straggler pause counts as compute, as in the ideal), the larger of that and the ideal as
``bound_samples_per_s`` (a strict upper bound: no rank can beat its own compute speed), ``bounded_efficiency``
against it, and ``bound_error``: how much faster the contender's ranks computed than the ideal's
(``busy / ideal - 1``; above 0, ``efficiency`` overstates by that much). The true efficiency lies between
``bounded_efficiency`` (the busy speed is what the ranks reached while others waited) and ``efficiency``.

Every run is the real ``syncasync-train`` app with the scenario's and the contender's Hydra overrides; the figures
come from its ``results.json`` (``SyncMonitor``'s summary and validation history).
"""

from __future__ import annotations

import json
import logging
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lightning_syncasync.bench.evidence import tta_curve
from lightning_syncasync.bench.phases import TIMELINE_FILE, boundaries, changing, phase_series
from lightning_syncasync.bench.scenarios import SCENARIOS, Scenario
from lightning_syncasync.callbacks._timeline import ENV_TIMELINE, read_timeline
from lightning_syncasync.emulate.cluster import EmulatedCluster

log = logging.getLogger(__name__)

IDEAL = "ideal"
CONTENDER_DIR = Path(__file__).resolve().parent.parent / "conf" / "bench" / "contender"
# Steps left out of throughput figures (one-off start-up costs), the same for every contender and the ideal.
WARMUP_STEPS = 5
BASELINES = ("ddp", "ddp_post_local_sgd", "ddp_hier_averager")
# Start methods with which a strategy starts its ranks' processes itself (Lightning's _MultiProcessingLauncher). The
# emulator already starts one `syncasync-train` per rank, so each would start a second set that binds the same
# rendezvous port: gloo's EADDRINUSE in the rank logs and only "run failed" in the report (issue 23).
SELF_LAUNCHING_START_METHODS = frozenset({"spawn", "fork", "forkserver"})


@dataclass(frozen=True)
class Contender:
    """A named set of ``syncasync-train`` overrides (a file in ``conf/bench/contender/`` or a strategy name)."""

    name: str
    overrides: tuple[str, ...]
    description: str = ""


def available_contenders() -> list[str]:
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_syncasync  # noqa: F401  (registers our strategy names)

    files = sorted(p.stem for p in CONTENDER_DIR.glob("*.yaml"))
    ours = [e.name for e in __import__("lightning_syncasync").strategies.STRATEGIES]
    return files + [n for n in ours if n not in files and n in StrategyRegistry]


def resolve_contenders(spec: str) -> list[Contender]:
    """``"ddp,hier_sync"`` or ``"baselines"`` -> contenders, with a clear error for unknown names; ``"none"``: no
    contender (the advisor alone, ``--advise``)."""
    if spec.strip() == "none":
        return []
    names: list[str] = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        names.extend(BASELINES if item == "baselines" else [item])
    if not names:
        raise ValueError("--strategies is empty; HINT: --strategies ddp or --strategies baselines")
    out = []
    for name in dict.fromkeys(names):
        path = CONTENDER_DIR / f"{name}.yaml"
        if path.exists():
            cfg = OmegaConf.load(path)
            out.append(Contender(name, tuple(cfg.overrides), str(cfg.get("description", ""))))
        elif name in available_contenders():
            # A registered strategy name is a contender of itself: its constructor defaults, nothing tuned.
            out.append(Contender(name, ("~strategy", f"trainer.strategy={name}"), f"registered strategy {name!r}"))
        else:
            raise ValueError(
                f"unknown contender {name!r}; HINT: choose from {available_contenders()} or 'baselines', "
                f"or add {CONTENDER_DIR}/{name}.yaml"
            )
    return out


def check_launcher(contender: Contender, overrides: list[str]) -> None:
    """Refuse a contender whose strategy would start processes of its own inside the emulated ranks.

    Args:
        contender: the contender, named in the message.
        overrides: the run's ``syncasync-train`` overrides (scenario, ``--override``, contender), composed as the app
            composes them, so a strategy from a user's own config (``hydra.searchpath``) is seen too.

    Raises:
        ValueError: naming the contender, the setting and the strategy to use instead; also when the overrides do not
            compose (the run would fail the same way, later).
    """
    from hydra.errors import HydraException
    from lightning.pytorch.strategies import StrategyRegistry
    from omegaconf.errors import OmegaConfBaseException

    import lightning_syncasync  # noqa: F401  (registers our strategy names)
    from lightning_syncasync.advise.probe import compose_config

    try:
        cfg = compose_config(overrides)
    except (HydraException, OmegaConfBaseException) as err:
        raise ValueError(
            f"contender {contender.name!r} does not compose: {err}; HINT: check its overrides "
            f"{list(contender.overrides)} and --override against the scenario's workload"
        ) from err
    strategy = OmegaConf.select(cfg, "trainer.strategy")
    why = "starts a second set of processes inside each emulated rank (gloo EADDRINUSE)"
    hint = "(the emulator starts one process per rank)"
    if isinstance(strategy, str) and strategy in StrategyRegistry:
        entry = StrategyRegistry[strategy]
        params = dict(entry["init_params"])
        start_method = params.pop("start_method", "popen")
        if start_method in SELF_LAUNCHING_START_METHODS:
            plain = _plain_strategy_name(entry["strategy"], params)
            fix = f"use {plain!r} {hint}" if plain else f"use a strategy with start_method='popen' {hint}"
            raise ValueError(
                f"contender {contender.name!r} resolves to trainer.strategy={strategy!r}, whose start_method="
                f"{start_method!r} {why}; HINT: {fix}"
            )
    elif isinstance(strategy, DictConfig) and strategy.get("start_method") in SELF_LAUNCHING_START_METHODS:
        # A strategy config group (`strategy=hier_sync_spawn`, a user's own file, `strategy.start_method=spawn`).
        target = str(strategy.get("_target_", ""))
        cls = next((e["strategy"] for e in StrategyRegistry.values() if _import_path(e["strategy"]) == target), None)
        plain = _plain_strategy_name(cls, {}) if cls is not None else None
        fix = f"use {plain!r} with strategy.start_method=popen" if plain else "set strategy.start_method=popen"
        raise ValueError(
            f"contender {contender.name!r} resolves to strategy.start_method={strategy.get('start_method')!r}, which "
            f"{why}; HINT: {fix} {hint}"
        )


def _import_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _plain_strategy_name(cls: type, params: dict[str, Any]) -> str | None:
    """The shortest registered name for ``cls`` with ``params`` whose processes are started from outside (popen)."""
    from lightning.pytorch.strategies import StrategyRegistry

    names = []
    for name, entry in StrategyRegistry.items():
        init = dict(entry["init_params"])
        if entry["strategy"] is cls and init.pop("start_method", "popen") == "popen" and init == params:
            names.append(name)
    return min(names, key=len, default=None)


# Seconds of compute timing per rank when the bench runs the advisor in a scenario (syncasync-advise's default is 5).
ADVISE_SECONDS = 6.0


class BenchRunner:
    """Runs a scenario's contenders and the ideal, interleaved, and returns one record per (contender, repeat).

    Args:
        out_dir: where runs, ``results.json``, the report and the plots go.
        quick: the scenario's short budget (minutes on a 2-core machine).
        repeats: measurements per contender; timings are reported as medians with their spread.
        seed: training seed (the same for every contender) and jitter seed.
        vary_seed: repeat ``r`` trains with ``seed + r`` (every contender sees the same seeds; the emulated
            cluster's jitter keeps ``seed``). With one seed, repeats replay one trajectory and measure timing only;
            with several they also measure how much learning (steps to target, final metric) varies with the data
            order and initialisation, which single runs of local SGD and lossy compression on the LM showed to be
            tens of steps and 1-3 points.
        netns: use network namespaces when the scenario asks for them (``False``: loopback, no link limit).
        run_timeout_s: bound on a single run.
        extra_overrides: ``syncasync-train`` overrides added to every run after the scenario's (your workload).
    """

    def __init__(
        self,
        out_dir: str | Path,
        quick: bool = False,
        repeats: int = 1,
        seed: int = 0,
        netns: bool = True,
        run_timeout_s: float = 1800.0,
        extra_overrides: list[str] | None = None,
        vary_seed: bool = False,
    ) -> None:
        if repeats < 1:
            raise ValueError(f"--repeats must be >= 1, got {repeats}")
        if vary_seed and repeats < 2:
            raise ValueError("--vary-seed needs --repeats >= 2 (repeat r trains with --seed + r); HINT: --repeats 3")
        self.out_dir = Path(out_dir)
        self.quick = quick
        self.repeats = repeats
        self.seed = seed
        self.vary_seed = vary_seed
        self.netns = netns
        self.run_timeout_s = run_timeout_s
        self.extra_overrides = list(extra_overrides or [])
        self._checked: set[tuple[str, ...]] = set()

    def check(self, scenario: Scenario, contenders: list[Contender]) -> None:
        """Refuse, before anything runs, contenders that cannot run inside the emulator (:func:`check_launcher`),
        and fault-tolerant contenders outside the node-fault scenarios (they run one job per node)."""
        from lightning_syncasync.bench.elastic import runs_fault_tolerant

        for contender in contenders:
            overrides = self._contender_overrides(scenario, contender, rep=0)
            if tuple(overrides) not in self._checked:
                check_launcher(contender, overrides)
                if not scenario.elastic and runs_fault_tolerant(overrides):
                    elastic = sorted(s.name for s in SCENARIOS.values() if s.elastic)
                    raise ValueError(
                        f"contender {contender.name!r} is a fault-tolerant strategy (one job per node through a "
                        f"torchft Lighthouse), which scenario {scenario.name!r} does not launch; HINT: run it in "
                        f"--scenario {','.join(elastic)}"
                    )
                self._checked.add(tuple(overrides))

    def run(self, scenario: Scenario, contenders: list[Contender]) -> list[dict[str, Any]]:
        self.check(scenario, contenders)
        items: list[Contender | None] = [None, *contenders]  # None: the ideal run
        records: list[dict[str, Any]] = []
        for rep in range(self.repeats):
            k = rep % len(items)
            order = items[k:] + items[:k]
            if scenario.elastic:
                # The ideal first: the node faults are placed at fractions of the budget time it measures.
                k = rep % len(contenders)
                order = [None, *contenders[k:], *contenders[:k]]
            ideal: dict[str, Any] | None = None
            rep_records = []
            for item in order:
                if item is None:
                    ideal = self._run_ideal(scenario, rep)
                elif scenario.elastic:
                    assert ideal is not None
                    rep_records.append(self._run_elastic(scenario, item, rep, ideal))
                else:
                    rep_records.append(self._run_contender(scenario, item, rep))
            assert ideal is not None
            for rec in rep_records:
                rec["ideal_samples_per_s"] = ideal["samples_per_s"]
                rec["ideal_per_rank_samples_per_s"] = ideal["per_rank"]
                rec["efficiency"] = (
                    rec["samples_per_s"] / ideal["samples_per_s"]
                    if rec["samples_per_s"] is not None and ideal["samples_per_s"]
                    else None
                )
                rec.update(bound_fields(rec["samples_per_s"], rec.get("busy_samples_per_s"), ideal["samples_per_s"]))
            records.extend(rep_records)
        return records

    def advise(self, scenario: Scenario, seconds: float = ADVISE_SECONDS) -> dict[str, Any]:
        """``syncasync-advise`` inside the scenario's emulated cluster, as a user would run it before training (its
        workload, its links, its stragglers and jitter as they are during the probe; ``--allow-async``, so that
        every contender the bench measures is a candidate): its pick, the runner-up, its confidence and its
        decision flow, for scoring against the measured ranking (``bench.publish``'s advice block)."""
        run_dir = self.out_dir / scenario.name / "advise"
        run_dir.mkdir(parents=True, exist_ok=True)
        out = run_dir / "advice.json"
        out.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "lightning_syncasync.advise", "--seconds", f"{seconds:g}", "--allow-async",
               *scenario.advise_args, "--json", str(out), "--", *scenario.overrides, *self.extra_overrides]  # fmt: skip
        log.info("[%s] syncasync-advise --seconds %g", scenario.name, seconds)
        report = self._cluster(scenario, run_dir / "logs", independent=False).run(cmd, timeout_s=600.0)
        record: dict[str, Any] = {"scenario": scenario.name, "seconds": seconds, "link_mbit": scenario.link_mbit}
        if any(report.exit_codes) or not out.exists():
            record["error"] = f"syncasync-advise failed (exit codes {report.exit_codes}); logs in {run_dir / 'logs'}"
            return record
        rec = json.loads(out.read_text())["recommendation"]
        record.update(
            pick=rec["strategy"], runner_up=rec.get("runner_up"), margin=rec.get("margin"),
            model_error=rec.get("model_error"), tie_with=rec.get("tie_with"), regime=rec.get("regime"),
            flow=rec.get("flow"), hydra=rec.get("hydra"),
            predicted={k: v.get("samples_per_s") for k, v in (rec.get("predictions") or {}).items()},
            steps_factor=rec.get("steps_factor"),
        )  # fmt: skip
        return record

    # -- one run ---------------------------------------------------------------------------------------------

    def _steps(self, scenario: Scenario) -> int:
        return scenario.quick_steps if self.quick else scenario.steps

    def train_seed(self, rep: int) -> int:
        return self.seed + rep if self.vary_seed else self.seed

    def _base_overrides(self, scenario: Scenario, rep: int) -> list[str]:
        return [
            *scenario.overrides,
            *self.extra_overrides,
            f"trainer.max_steps={self._steps(scenario)}",
            "trainer.max_epochs=-1",
            "trainer.enable_progress_bar=false",
            "trainer.enable_model_summary=false",
            "callbacks.model_checkpoint=null",
            # Lightning would add its default ModelCheckpoint, which saves at every validation here (validation runs
            # every few steps to find the target's crossing): checkpoint I/O (and hier_sync's checkpoint cut) is not
            # what the benchmark measures.
            "trainer.enable_checkpointing=false",
            f"callbacks.sync_monitor.warmup_steps={WARMUP_STEPS}",
            f"seed={self.train_seed(rep)}",
            f"optimized_metric={scenario.metric}",
        ]

    def _cluster(self, scenario: Scenario, log_dir: Path, independent: bool) -> EmulatedCluster:
        netns = self.netns and scenario.netns
        return EmulatedCluster(
            nodes=scenario.nodes,
            procs_per_node=scenario.procs_per_node,
            link_mbit=scenario.link_mbit if netns else None,
            stragglers=scenario.stragglers,
            jitter=scenario.jitter,
            schedule=scenario.schedule,
            seed=self.seed,
            netns=netns,
            independent=independent,
            link_schedule=scenario.link_schedule if netns and not independent else "",
            log_dir=log_dir,
            echo_rank0=False,
        )

    def _train_cmd(self, overrides: list[str]) -> list[str]:
        return [sys.executable, "-m", "lightning_syncasync.train", *overrides]

    def _contender_overrides(self, scenario: Scenario, contender: Contender, rep: int) -> list[str]:
        return [
            *self._base_overrides(scenario, rep),
            *contender.overrides,
            f"trainer.num_nodes={scenario.nodes}",
            f"trainer.devices={scenario.procs_per_node}",
        ]

    def _run_contender(self, scenario: Scenario, contender: Contender, rep: int) -> dict[str, Any]:
        run_dir = self.out_dir / scenario.name / contender.name / f"rep{rep}"
        overrides = [*self._contender_overrides(scenario, contender, rep), f"hydra.run.dir={run_dir}"]
        log.info("[%s] %s rep %d", scenario.name, contender.name, rep)
        start = time.monotonic()
        cluster = self._cluster(scenario, run_dir / "logs", independent=False)
        timeline = run_dir / TIMELINE_FILE
        if changing(scenario):
            timeline.unlink(missing_ok=True)
            cluster.env[ENV_TIMELINE] = str(timeline)  # global rank 0's steps: the phases' throughput and plot
        report = cluster.run(self._train_cmd(overrides), timeout_s=self.run_timeout_s)
        wall = time.monotonic() - start
        record: dict[str, Any] = {
            "scenario": scenario.name,
            "strategy": contender.name,
            "repeat": rep,
            "train_seed": self.train_seed(rep),
            "quick": self.quick,
            "target": scenario.quick_target if self.quick else scenario.target,
            "val_metric_name": scenario.metric,
            "steps": self._steps(scenario),
            "run_dir": str(run_dir),
            "emulation": {
                "cpu_mode": report.cpu_mode,
                "cores_per_rank": report.cores_per_rank,
                "netns": report.netns,
                "exit_codes": report.exit_codes,
            },  # fmt: skip
            "wall_s": wall,
            "samples_per_s": None,
            "time_to_target_s": None,
            "final_val_metric": None,
            "inter_node_bytes_per_step": None,
            "config": None,
        }
        results_file = run_dir / "results.json"
        if any(report.exit_codes) or not results_file.exists():
            record["error"] = f"run failed (exit codes {report.exit_codes}); logs in {run_dir / 'logs'}"
            log.error("[%s] %s rep %d failed: %s", scenario.name, contender.name, rep, record["error"])
            return record
        results = json.loads(results_file.read_text())
        summary = results["sync_summary"]
        history = summary.get("val_history", [])
        record.update(
            samples_per_s=summary["global_samples_per_s"],
            per_rank_samples_per_s=[r["samples_per_s"] for r in summary["ranks"]],
            busy_samples_per_s=busy_samples_per_s(summary["ranks"]),
            inter_node_bytes_per_step=summary["bytes_inter_per_step"],
            intra_node_bytes_per_step=summary["bytes_intra_per_step"],
            wait_frac=summary["wait_frac"],
            sync_point_frac=summary.get("sync_point_frac"),
            fit_wall_s=summary.get("fit_wall_s"),
            val_history=[
                {
                    "elapsed_s": h["elapsed_s"],
                    "train_s": h.get("train_s", h["elapsed_s"]),
                    "step": h["step"],
                    "value": h["metrics"].get(scenario.metric),
                }
                for h in history
            ],  # fmt: skip
            final_val_metric=history[-1]["metrics"].get(scenario.metric) if history else None,
            config=results["config"],
            # Policies' decisions (AdaptiveBatchSize rebalances), each with the step it was taken at.
            events=summary.get("events", []),
            # Memory per rank (the largest over ranks): peak RSS, peak CUDA allocation, optimizer state held.
            peak_rss_mb=summary.get("peak_rss_mb"),
            cuda_peak_mb=summary.get("cuda_peak_mb"),
            optimizer_state_mb=summary.get("optimizer_state_mb"),
        )
        record["wire"] = wire_bytes(report.net_bytes, scenario.procs_per_node, record["steps"])
        for h in record["val_history"]:
            if h["value"] is not None and scenario.reached(h["value"], self.quick):
                # Training time to the target: validation (every few steps, only to find the crossing) is left out,
                # as it costs every contender the same absolute time and would compress the ratios.
                record["time_to_target_s"] = h["train_s"]
                record["time_to_target_wall_s"] = h["elapsed_s"]
                break
        # The time-to-accuracy curve (training seconds when each level of a fixed grid was first reached): what
        # a ranking to a target chosen after the runs reads (bench.evidence), kept beside the history it comes from.
        record["tta_curve"] = tta_curve(record)
        if changing(scenario):
            record["series"] = phase_series(read_timeline(timeline), record["events"], record["steps"],
                                            boundaries(scenario), scenario.metric)  # fmt: skip
            record["link_changes"] = report.link_changes
        return record

    def _run_elastic(self, scenario: Scenario, contender: Contender, rep: int, ideal: dict[str, Any]) -> dict[str, Any]:
        """One (contender, repeat) of a node-fault scenario, one job per node (:mod:`lightning_syncasync.bench.elastic`,
        which gets what it needs from here and never imports the runner)."""
        from lightning_syncasync.bench.elastic import ElasticRun, run_elastic

        job = ElasticRun(
            contender=contender.name, rep=rep, overrides=self._contender_overrides(scenario, contender, rep),
            steps=self._steps(scenario), train_seed=self.train_seed(rep), out_dir=self.out_dir, quick=self.quick,
            netns=self.netns, run_timeout_s=self.run_timeout_s,
        )  # fmt: skip
        return run_elastic(job, scenario, ideal)

    def _run_ideal(self, scenario: Scenario, rep: int) -> dict[str, Any]:
        run_dir = self.out_dir / scenario.name / IDEAL / f"rep{rep}"
        seconds = scenario.quick_ideal_s if self.quick else scenario.ideal_s
        overrides = [
            *self._base_overrides(scenario, rep),
            "~strategy",
            "trainer.num_nodes=1",
            "trainer.devices=1",
            "trainer.limit_val_batches=0",  # throughput only: validation is not part of the limit
            # The same wall-clock window for every rank (they start together at the emulator's barrier): the slow
            # rank does fewer steps, and no rank ever trains alone on a machine the others have left.
            "trainer.max_steps=-1",
            f"trainer.max_time={{seconds: {seconds}}}",
            f"hydra.run.dir={run_dir}/rank{{rank}}",
        ]
        log.info("[%s] ideal (no communication) rep %d", scenario.name, rep)
        report = self._cluster(scenario, run_dir / "logs", independent=True).run(
            self._train_cmd(overrides), timeout_s=self.run_timeout_s
        )
        per_rank = []
        for r in range(scenario.world_size):
            path = run_dir / f"rank{r}" / "results.json"
            if report.exit_codes[r] != 0 or not path.exists():
                raise RuntimeError(f"the ideal run failed on rank {r} (exit {report.exit_codes[r]}); see {run_dir}")
            per_rank.append(json.loads(path.read_text())["sync_summary"]["global_samples_per_s"])
        return {"samples_per_s": sum(per_rank), "per_rank": per_rank}


def busy_samples_per_s(ranks: list[dict[str, float]]) -> float | None:
    """What the ranks would process with no wait at the speed they computed at: the sum over ranks of samples/s over
    the fraction of the rank's time that was not wait (``SyncMonitor``'s per-rank summary). ``None`` when a rank
    waited all the time (no compute time to divide by)."""
    total = 0.0
    for r in ranks:
        busy = 1.0 - r["wait_frac"]
        if busy <= 0.0:
            return None
        total += r["samples_per_s"] / busy
    return total


def bound_fields(samples_per_s: float | None, busy: float | None, ideal: float | None) -> dict[str, float | None]:
    """``bound_samples_per_s`` (the larger of the ideal and the contender's own no-wait throughput), the
    ``bounded_efficiency`` against it and the ideal's ``bound_error`` (``busy / ideal - 1``); see the module
    docstring."""
    if samples_per_s is None or not ideal:
        return {"bound_samples_per_s": None, "bounded_efficiency": None, "bound_error": None}
    bound = max(ideal, busy or 0.0)
    return {
        "bound_samples_per_s": bound,
        "bounded_efficiency": samples_per_s / bound,
        "bound_error": None if busy is None else busy / ideal - 1.0,
    }


def median_or_none(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def wire_bytes(net_bytes: list[dict[str, int]], procs_per_node: int, steps: int) -> dict[str, float] | None:
    """Bytes each rank sent and received per step, measured on the emulated interfaces (mean over ranks): across
    nodes (the node's link) and inside a node (its loopback), over the whole run of ``steps`` optimizer steps
    (set-up, the initial broadcast and validation included, spread over the steps). ``None`` without network
    namespaces."""
    if not net_bytes:
        return None
    ranks = len(net_bytes) * procs_per_node
    if steps <= 0 or ranks <= 0:
        return None
    per = float(steps * ranks)
    return {
        "inter_sent": sum(n["link_tx"] for n in net_bytes) / per,
        "inter_recv": sum(n["link_rx"] for n in net_bytes) / per,
        "intra_sent": sum(n["lo_tx"] for n in net_bytes) / per,
        "intra_recv": sum(n["lo_rx"] for n in net_bytes) / per,
    }

"""syncasync-bench: a seconds-long smoke run end to end, contender resolution, the report's arithmetic."""

from __future__ import annotations

import json

import pytest
from _commands import CommandFailed, run_main

from lightning_syncasync.bench.__main__ import main as bench_main
from lightning_syncasync.bench.report import merge_results, write_report
from lightning_syncasync.bench.runner import BASELINES, CONTENDER_DIR, check_launcher, resolve_contenders
from lightning_syncasync.bench.tables import summarise


@pytest.mark.timeout(300)
def test_smoke_scenario_writes_every_file_with_sane_values(tmp_path):
    # In this process (the runs are the emulator's rank processes either way): a subprocess of its own would only add
    # an interpreter importing torch and Lightning.
    run_main(bench_main, ["--scenario", "smoke", "--strategies", "ddp", "--out", str(tmp_path),
                          "--override", "model.hidden=32"])  # fmt: skip
    for name in ("results.json", "report.md", "throughput.png", "accuracy_vs_time.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    (rec,) = json.loads((tmp_path / "results.json").read_text())
    keys = ("scenario", "strategy", "samples_per_s", "ideal_samples_per_s", "efficiency", "time_to_target_s", "target",
            "final_val_metric", "val_metric_name", "inter_node_bytes_per_step", "wall_s", "config")  # fmt: skip
    for key in keys:
        assert key in rec, key
    assert (rec["scenario"], rec["strategy"], rec["val_metric_name"]) == ("smoke", "ddp", "val_acc")
    assert rec["samples_per_s"] > 0 and rec["ideal_samples_per_s"] > 0
    assert rec["efficiency"] == pytest.approx(rec["samples_per_s"] / rec["ideal_samples_per_s"])
    assert 0 < rec["efficiency"] < 1.5
    assert len(rec["ideal_per_rank_samples_per_s"]) == 2
    assert rec["inter_node_bytes_per_step"] == 0  # one node
    assert 0 < rec["final_val_metric"] <= 1 and rec["val_history"]
    assert rec["config"]["trainer"]["strategy"]["start_method"] == "popen"
    assert rec["config"]["trainer"]["max_steps"] == 10
    assert rec["config"]["model"]["hidden"] == 32  # --override reaches every run
    report = (tmp_path / "report.md").read_text()
    assert "| ddp |" in report and "no-communication limit" in report


@pytest.mark.slow  # 15 s; the advisor end to end on gloo processes runs in the default suite (test_advise.py)
@pytest.mark.timeout(300)
def test_the_advisor_runs_inside_the_scenarios_cluster_and_its_pick_is_kept(tmp_path):
    run_main(bench_main, ["--scenario", "smoke", "--strategies", "none", "--advise", "--out", str(tmp_path),
                          "--override", "model.hidden=32"])  # fmt: skip
    (advice,) = json.loads((tmp_path / "advice.json").read_text())["advice"]
    assert "error" not in advice, advice
    assert advice["scenario"] == "smoke" and advice["pick"] in advice["predicted"]
    assert advice["runner_up"] in advice["predicted"] and advice["margin"] >= 1.0 and advice["model_error"] > 0
    assert any(line.startswith("|- confidence:") for line in advice["flow"])
    assert "model.hidden=32" in advice["hydra"]  # the scenario's workload, with --override, is what was probed
    assert not (tmp_path / "results.json").exists()  # no contender ran


def test_contenders_resolve_from_files_and_baselines():
    names = [c.name for c in resolve_contenders("baselines,ddp")]
    assert names == list(BASELINES)  # duplicates dropped, order kept
    (plsgd,) = resolve_contenders("ddp_post_local_sgd")
    assert plsgd.overrides == ("strategy=ddp_post_local_sgd",)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--scenario", "nope", "--strategies", "ddp"], "unknown --scenario"),
        (["--scenario", "smoke", "--strategies", "ddp,warp_drive"], "unknown contender 'warp_drive'"),
        (["--scenario", "smoke", "--strategies", ","], "--strategies is empty"),
        (["--scenario", "smoke", "--repeats", "0"], "--repeats"),
        (["--scenario", "smoke", "--override", "model.lr"], "--override"),
        (["--scenario", "straggler", "--link-mbit", "25"], "--link-mbit needs a scenario with several nodes"),
        (["--scenario", "slow_link", "--link-mbit", "0"], "--link-mbit must be > 0"),
        (["--scenario", "slow_link", "--link-mbit", "25", "--no-netns"], "--link-mbit needs network namespaces"),
        (["--scenario", "smoke", "--vary-seed"], "--vary-seed needs --repeats >= 2"),
        (["--scenario", "smoke", "--strategies", "none"], "--strategies none runs nothing"),
    ],
)
def test_bad_input_is_rejected_before_running(tmp_path, args, message):
    with pytest.raises(CommandFailed) as failed:
        run_main(bench_main, [*args, "--out", str(tmp_path)])
    assert failed.value.code == 2
    assert message in str(failed.value)
    assert not any(tmp_path.iterdir())  # nothing ran


@pytest.mark.timeout(120)
def test_a_spawn_contender_is_refused_before_anything_runs(tmp_path):
    # The emulator starts one process per rank; a _spawn strategy would start its own again (gloo EADDRINUSE).
    args = ["--scenario", "smoke", "--strategies", "ddp,hier_sync_spawn", "--out", str(tmp_path)]
    with pytest.raises(CommandFailed) as failed:
        run_main(bench_main, args)
    message = str(failed.value)
    assert failed.value.code == 2, message
    assert "contender 'hier_sync_spawn'" in message and "trainer.strategy='hier_sync_spawn'" in message
    assert "HINT: use 'hier_sync' (the emulator starts one process per rank)" in message
    assert not (tmp_path / "smoke").exists()  # not even ddp or the ideal run started


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("overrides", "setting", "fix"),
    [
        (("~strategy", "trainer.strategy=ddp_notebook"), "trainer.strategy='ddp_notebook'", "use 'ddp'"),
        (("~strategy", "trainer.strategy=hier_sync_virtual_spawn"), "start_method='spawn'", "use 'hier_sync_virtual'"),
        (("strategy=hier_sync", "strategy.start_method=fork"), "strategy.start_method='fork'", "use 'hier_sync' with"),
        (("strategy=ddp_spawn",), "strategy.start_method='spawn'", "use 'ddp' with strategy.start_method=popen"),
        # A user's own strategy config, found through hydra.searchpath as in the report.
        (("hydra.searchpath=[file://{conf}]", "strategy=my_spawn"), "strategy.start_method='spawn'", "use 'async_ssp'"),
    ],
)
def test_contenders_that_start_their_own_processes_are_refused(tmp_path, overrides, setting, fix):
    from lightning_syncasync.bench.runner import Contender, check_launcher

    (tmp_path / "strategy").mkdir()
    (tmp_path / "strategy" / "my_spawn.yaml").write_text(
        "# @package strategy\ndefaults:\n  - async_ssp\n  - _self_\nstart_method: spawn\n"
    )
    contender = Contender("mine", tuple(o.format(conf=tmp_path) for o in overrides))
    with pytest.raises(ValueError, match="contender 'mine'") as err:
        check_launcher(contender, list(contender.overrides))
    assert setting in str(err.value) and f"HINT: {fix}" in str(err.value)
    assert "(the emulator starts one process per rank)" in str(err.value)


def test_contenders_started_from_outside_pass_the_launcher_check(tmp_path):
    from lightning_syncasync.bench.runner import BenchRunner
    from lightning_syncasync.bench.scenarios import SCENARIOS

    BenchRunner(tmp_path).check(SCENARIOS["smoke"], resolve_contenders("baselines,hier_sync,async_ssp,auto_sync"))


def test_vary_seed_gives_each_repeat_its_own_training_seed_and_the_same_to_every_contender(tmp_path):
    from lightning_syncasync.bench.runner import BenchRunner
    from lightning_syncasync.bench.scenarios import SCENARIOS

    smoke = SCENARIOS["smoke"]
    varied = BenchRunner(tmp_path, repeats=3, seed=5, vary_seed=True)
    fixed = BenchRunner(tmp_path, repeats=3, seed=5)
    assert [varied.train_seed(r) for r in range(3)] == [5, 6, 7]
    assert [fixed.train_seed(r) for r in range(3)] == [5, 5, 5]
    assert "seed=7" in varied._base_overrides(smoke, 2) and "seed=5" in fixed._base_overrides(smoke, 2)
    # The emulated cluster (jitter, stragglers) keeps --seed: only learning varies between repeats.
    assert varied._cluster(smoke, tmp_path, independent=False).seed == 5


def test_a_changed_link_rate_is_its_own_scenario():
    from lightning_syncasync.bench.scenarios import SCENARIOS, lookup

    slow = SCENARIOS["slow_link"].with_link(12.5)
    assert (slow.name, slow.link_mbit) == ("slow_link_12p5mbit", 12.5)
    assert (slow.overrides, slow.target, slow.steps) == (SCENARIOS["slow_link"].overrides, 0.34, 150)
    assert lookup(slow.name) == slow  # the report finds it again from the results folder
    assert lookup("slow_link") is SCENARIOS["slow_link"] and lookup("slow_link_fastmbit") is None


def _record(strategy: str, sps: float, ideal_ranks: list[float], ttt: float | None, **kw) -> dict:
    return {"scenario": "straggler", "strategy": strategy, "samples_per_s": sps,
            "ideal_samples_per_s": sum(ideal_ranks), "ideal_per_rank_samples_per_s": ideal_ranks,
            "efficiency": sps / sum(ideal_ranks),
            "time_to_target_s": ttt, "final_val_metric": 0.9, "inter_node_bytes_per_step": 0.0, "wait_frac": 0.1,
            "target": 0.9, "val_metric_name": "val_acc", "steps": 10, "quick": True, **kw}  # fmt: skip


def test_summary_medians_and_the_synchronous_bound():
    recs = [_record("ddp", s, [2.0, 2.0, 2.0, 1.0], t) for s, t in ((3.0, 10.0), (4.0, 12.0), (5.0, None))]
    s = summarise(recs)["straggler"]["ddp"]
    assert s["samples_per_s"] == 4.0 and s["time_to_target_s"] == 11.0 and s["reached"] == 2
    assert s["ideal_sync_efficiency"] == pytest.approx(4 * 1.0 / 7.0)  # everyone at the slowest rank's pace


def test_results_accumulate_and_a_rerun_replaces_its_records(tmp_path):
    merge_results(tmp_path, [_record("ddp", 3.0, [1.0], 1.0), _record("other", 2.0, [1.0], 2.0)])
    merged = merge_results(tmp_path, [_record("ddp", 5.0, [1.0], 1.0)])
    assert sorted((r["strategy"], r["samples_per_s"]) for r in merged) == [("ddp", 5.0), ("other", 2.0)]
    text = write_report(tmp_path, merged, "syncasync-bench test").read_text()
    assert "other reaches the target 0.50x as fast as DDP" in text


def test_report_explains_a_bounded_staleness_result_under_a_persistent_straggler():
    from lightning_syncasync.bench._answers import explain

    cfg = {"strategy": {"_target_": "lightning_syncasync.strategies.async_ssp.AsyncSSPStrategy", "staleness": 4}}
    s = {"runs": [{"config": cfg}], "efficiency": 0.7, "wait_frac": 0.25}
    line = explain("straggler", "async_ssp", s)
    assert "staleness 4" in line and "70.0% of the limit" in line and "25.0%" in line
    assert explain("jitter", "async_ssp", s) == ""  # only where persistence matters
    cfg["strategy"]["staleness"] = None
    assert "ASP" in explain("straggler", "async_asp", s)
    assert explain("straggler", "ddp", {"runs": [{"config": {"strategy": {"_target_": "DDPStrategy"}}}]}) == ""


def test_the_bound_is_the_contenders_own_no_wait_speed_where_that_beats_the_ideal(tmp_path, monkeypatch):
    from lightning_syncasync.bench.runner import BenchRunner, Contender, bound_fields, busy_samples_per_s
    from lightning_syncasync.bench.scenarios import SCENARIOS

    # Three fast ranks waiting a third of their time for the straggler: without the wait each does 3 samples/s.
    ranks = [{"samples_per_s": 2.0, "wait_frac": 1 / 3}] * 3 + [{"samples_per_s": 2.0, "wait_frac": 0.0}]
    assert busy_samples_per_s(ranks) == pytest.approx(11.0)
    assert busy_samples_per_s([{"samples_per_s": 0.0, "wait_frac": 1.0}]) is None
    # The ideal (every rank busy, so slower per step) read 10: the contender computed 10% faster than it did.
    assert bound_fields(8.0, 11.0, 10.0) == pytest.approx(
        {"bound_samples_per_s": 11.0, "bounded_efficiency": 8 / 11, "bound_error": 0.1}
    )
    # A contender that computed slower than the ideal is measured against the ideal.
    assert bound_fields(8.0, 9.0, 10.0) == pytest.approx(
        {"bound_samples_per_s": 10.0, "bounded_efficiency": 0.8, "bound_error": -0.1}
    )
    assert bound_fields(None, None, 10.0)["bounded_efficiency"] is None

    runner = BenchRunner(tmp_path)
    monkeypatch.setattr(runner, "check", lambda scenario, contenders: None)
    monkeypatch.setattr(runner, "_run_ideal", lambda scenario, rep: {"samples_per_s": 10.0, "per_rank": [2.5] * 4})
    monkeypatch.setattr(
        runner, "_run_contender", lambda scenario, c, rep: {"samples_per_s": 8.0, "busy_samples_per_s": 11.0}
    )
    (rec,) = runner.run(SCENARIOS["straggler"], [Contender("ddp", ("strategy=ddp",))])
    assert rec["efficiency"] == pytest.approx(0.8) and rec["bounded_efficiency"] == pytest.approx(8 / 11)
    assert rec["bound_error"] == pytest.approx(0.1)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "name", ["straggler_long", "jitter_long", "mid_run_straggler_long", "hetero_slow_link", "jitter_slow_link"]
)
def test_long_scenarios_compose_and_train_at_least_ten_epochs(tmp_path, name):
    from lightning_syncasync.bench.runner import BenchRunner
    from lightning_syncasync.bench.scenarios import SCENARIOS
    from lightning_syncasync.callbacks.straggler import parse_schedule

    scenario = SCENARIOS[name]
    runner = BenchRunner(tmp_path, netns=False)
    runner.check(scenario, resolve_contenders("ddp"))  # the workload's overrides compose against the schemas
    overrides = dict(o.split("=", 1) for o in scenario.overrides)
    assert overrides["data"] == "mnist5k" and overrides["trainer.check_val_every_n_epoch"] == "1"
    samples = scenario.steps * scenario.world_size * int(overrides["data.batch_size"])
    assert samples >= 10 * 4000  # 4,000 training images
    assert scenario.quick_steps < scenario.steps and scenario.quick_target <= scenario.target
    slow = {w.rank: w.factor for w in parse_schedule(scenario.schedule)}
    if name == "hetero_slow_link":
        assert (scenario.nodes, scenario.procs_per_node, scenario.link_mbit) == (2, 2, 100.0)
        assert slow == {2: 1.5, 3: 1.5}  # node 1
    elif name == "jitter_slow_link":  # jitter_long's pauses on hetero_slow_link's cluster, with equal nodes
        assert (scenario.nodes, scenario.procs_per_node, scenario.link_mbit) == (2, 2, 100.0)
        assert not slow and scenario.jitter == SCENARIOS["jitter_long"].jitter
    else:
        assert (scenario.nodes, scenario.procs_per_node) == (1, 4)


def test_help_names_the_report_subcommand_and_the_smoke_scenario(capsys):
    with pytest.raises(SystemExit):
        bench_main(["--help"])
    out = capsys.readouterr().out
    assert "syncasync-bench report --from docs/results" in out and "smoke" in out


def test_optimizer_state_ratio_reads_the_right_way_round():
    from lightning_syncasync.bench.tables import size_ratio

    assert size_ratio(4.0, 1.0) == "4.00x smaller"
    assert size_ratio(1.0, 1.5) == "1.50x larger"
    assert size_ratio(1.0, 1.004) == "the same"
    assert size_ratio(None, 1.0) == "n/a"


def test_every_contender_file_loads_composes_and_says_what_it_is():
    # A contender file is YAML a user may edit (a description with ": " in it once broke one); every one must load,
    # describe itself and compose with the app's config, before a benchmark runs it.
    names = sorted(p.stem for p in CONTENDER_DIR.glob("*.yaml"))
    contenders = resolve_contenders(",".join(names))
    assert [c.name for c in contenders] == names
    for c in contenders:
        assert c.description and c.overrides, c.name
        check_launcher(c, list(c.overrides))  # raises naming the contender when it does not compose

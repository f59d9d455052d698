"""The node-fault scenarios' arithmetic (bench/elastic.py) on hand-made timelines, and their wiring in the bench."""

from __future__ import annotations

import pytest
from _commands import CommandFailed, run_main

from lightning_syncasync.bench.__main__ import main as bench_main
from lightning_syncasync.bench.elastic import analyse, budget_time_s, fault_schedule
from lightning_syncasync.bench.scenarios import SCENARIOS


def _steps(t0, first_step, n, per_step, participants, committed=None):
    out, samples = [], 0
    for i in range(n):
        samples += per_step
        line = {"t": t0 + i, "step": first_step + i, "samples": samples, "participants": participants}
        if committed is not None:
            line["committed_steps"] = committed(i)
        out.append(line)
    return out


def test_a_restarted_job_keeps_only_what_each_restart_resumed_from():
    # Run 1: steps 1-10 (100 samples each) with 2 nodes; node 1 dies at 10.5 s. Run 2 resumes from the checkpoint of
    # step 5 alone (50 samples a step), trains steps 6-10, and is restarted when node 1 is back; run 3 resumes from
    # step 8 and trains steps 9-20 with both nodes.
    # Run 1 takes one more step (t=11) after the kill, which the restart rolls back: not a recovery.
    node0 = [{"t": 0.0, "event": "start", "step": 0}, *_steps(1, 1, 11, 100, 2)]
    node0 += [{"t": 20.0, "event": "start", "step": 5}, *_steps(21, 6, 5, 50, 1)]
    node0 += [{"t": 30.0, "event": "start", "step": 8}, *_steps(31, 9, 12, 100, 2)]
    node0 += [{"t": 35.5, "step": 13, "val": {"val_acc": 0.5}}, {"t": 42.5, "step": 20, "val": {"val_acc": 0.8}}]
    node0.sort(key=lambda x: x["t"])
    runs = [
        {"node": 0, "start": -1.0, "end": 42.5, "killed": False},
        {"node": 1, "start": -1.0, "end": 10.5, "killed": True},
        {"node": 1, "start": 25.0, "end": 42.5, "killed": False},
    ]
    out = analyse({0: node0, 1: []}, runs, [100.0, 100.0], 2, lambda v: v >= 0.7, "val_acc")
    assert out["samples_trained"] == 1100 + 250 + 1200
    assert out["samples_useful"] == 500 + 150 + 1200
    assert out["samples_lost"] == 700
    assert out["kill_to_commit_s"] == pytest.approx(21 - 10.5)  # the survivors' first step after the kill
    assert out["start_to_commit_s"] == pytest.approx(31 - 25)  # the first step with both nodes after the restart
    assert out["time_to_target_s"] == pytest.approx(42.5) and out["final_val_metric"] == 0.8
    present = 100 * 42.5 + 100 * 10.5 + 100 * 17.5  # capacity counts from the first line (t=0)
    assert out["goodput_frac"] == pytest.approx(1850 / present)
    assert out["limit_samples_per_s"] == pytest.approx(present / 42.5)
    assert out["series"]["participants"][0] == (1.0, 2)
    assert out["rate_before_join"] == pytest.approx((1100 + 250) / 25)  # until node 1's job started again
    assert out["rate_after_join"] == pytest.approx(11 * 100 / (42.5 - 31))  # after the first step with both
    # The outage, kill (10.5 s) to node 1's next start (25 s): run 1's last step and run 2's 5 steps, against
    # node 0's capacity alone.
    assert out["outage_samples_per_s"] == pytest.approx((100 + 250) / (25 - 10.5))
    assert out["outage_frac"] == pytest.approx(out["outage_samples_per_s"] / 100.0)


def test_fault_tolerant_nodes_count_what_entered_committed_rounds():
    # Node 0 commits every 2nd step; node 1 commits its first 4 steps and dies after 6 (2 steps never committed),
    # then joins again at 12 s and commits from its first step.
    node0 = [{"t": 0.0, "event": "start", "step": 0}, *_steps(1, 1, 20, 80, 2, committed=lambda i: (i + 1) // 2 * 2)]
    node1 = [{"t": 0.0, "event": "start", "step": 0}, *_steps(1, 1, 6, 80, 2, committed=lambda i: min(i + 1, 4))]
    node1 += [{"t": 12.0, "event": "start", "step": 0}, *_steps(14, 14, 7, 80, 2, committed=lambda i: i + 1)]
    for line in node0[7:13]:
        line["participants"] = 1  # rounds without node 1
    runs = [
        {"node": 0, "start": -1.0, "end": 20.5, "killed": False},
        {"node": 1, "start": -1.0, "end": 6.5, "killed": True},
        {"node": 1, "start": 11.0, "end": 20.5, "killed": False},
    ]
    out = analyse({0: node0, 1: node1}, runs, [100.0, 100.0], 2, lambda v: False, "val_acc", restarted=False)
    assert out["samples_trained"] == 80 * (20 + 6 + 7)
    assert out["samples_useful"] == 80 * (20 + 4 + 7)
    assert out["samples_lost"] == 80 * 2
    assert out["kill_to_commit_s"] == pytest.approx(8 - 6.5)  # node 0's next commit (step 8 at t=8)
    assert out["outage_frac"] == pytest.approx(80 * 5 / (11 - 6.5) / 100.0)  # node 0's steps at 7-11 s
    assert out["start_to_commit_s"] == pytest.approx(14 - 11)  # the joiner's first commit with 2 nodes
    assert out["time_to_target_s"] is None and out["final_val_metric"] is None


def test_an_exchange_that_reports_no_commits_has_no_goodput_rather_than_a_guess():
    # torchft's DiLoCo: the nodes' steps are known, what entered a committed sync is not.
    node0 = [{"t": 0.0, "event": "start", "step": 0}, *_steps(1, 1, 10, 80, 2)]
    runs = [{"node": 0, "start": -1.0, "end": 10.5, "killed": False}]
    out = analyse({0: node0}, runs, [100.0], 1, lambda v: False, "val_acc", restarted=False)
    assert out["samples_trained"] == 800 and out["samples_per_s"] == pytest.approx(800 / 10)
    assert out["samples_useful"] is None and out["goodput_frac"] is None and out["samples_lost"] is None


def test_fault_times_are_fractions_of_the_budget_at_the_measured_limit():
    sc = SCENARIOS["preemption"]
    budget = budget_time_s(sc, steps=400, ideal_samples_per_s=3200.0)
    assert budget == pytest.approx(400 * 40 * 4 / 3200)
    assert fault_schedule(sc, budget) == "kill:1@6.00,start:1@12.00"
    assert fault_schedule(SCENARIOS["scale_out"], budget) == "start:1@6.00"
    assert fault_schedule(SCENARIOS["elastic_no_faults"], budget) == ""


@pytest.mark.timeout(120)
def test_a_fault_tolerant_contender_is_refused_outside_the_node_fault_scenarios(tmp_path):
    with pytest.raises(CommandFailed) as failed:
        run_main(bench_main, ["--scenario", "slow_link", "--strategies", "hier_sync_ft", "--out", str(tmp_path)])
    assert failed.value.code == 2
    assert "preemption" in str(failed.value) and "hier_sync_ft" in str(failed.value)
